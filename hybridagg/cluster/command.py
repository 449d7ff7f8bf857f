"""``hybridagg cluster up|down|status|check FILE``: the emulated cluster's command line."""

from __future__ import annotations

import argparse
import sys

from . import netns, plan
from .spec import ClusterSpec, load

__all__ = ["add_parser", "run"]

_HELP = """\
An emulated cluster on this machine: each host a network namespace with its
own host name, joined to one switch by a link that the kernel shapes (tc) to
the file's bandwidth (and latency, where the kernel has netem). Needs root,
except `check`. Launch a job on it with: hybridagg-run --cluster FILE -n N -- CMD"""


def add_parser(sub) -> None:
    """Add the ``cluster`` command to ``hybridagg``'s subparsers."""
    p = sub.add_parser(
        "cluster",
        help="bring an emulated cluster (namespaces, shaped links) up or down",
        description=_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "action",
        choices=["up", "down", "status", "check"],
        help="up: build it; down: stop its processes and remove it; status: "
        "hosts, links, traffic; check: read the file only",
    )
    p.add_argument(
        "file", help="the cluster file (TOML; see README 'An emulated cluster')"
    )


def _table(spec: ClusterSpec, counts: dict[str, tuple[int, int]] | None) -> str:
    rows = [("host", "address", "ranks", "link", "sent MiB", "received MiB")]
    for h in spec.hosts:
        sent, got = counts[h.name] if counts else (None, None)
        rows.append(
            (
                h.name,
                spec.address(h),
                f"{h.ranks} ({h.servers} server)" if h.servers else str(h.ranks),
                h.link.describe(),
                "-" if sent is None else f"{sent / 2**20:.1f}",
                "-" if got is None else f"{got / 2**20:.1f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in rows
    )


def run(args: argparse.Namespace) -> int:
    """Carry out ``hybridagg cluster ACTION FILE``; 0 on success, 2 on bad input, 1 otherwise."""
    try:
        spec = load(args.file)
    except ValueError as exc:
        print(f"hybridagg cluster: {exc}", file=sys.stderr)
        return 2
    try:
        if args.action == "check":
            print(_table(spec, None))
        elif args.action == "up":
            folder = netns.up(spec)
            print(
                f"cluster {spec.name} up: switch {plan.bridge_name(spec)} at {spec.switch_address}"
            )
            print(_table(spec, None))
            print(f"state: {folder}")
        elif args.action == "down":
            stopped = netns.down(spec)
            extra = (
                f" (stopped {stopped} processes left on its hosts)" if stopped else ""
            )
            print(f"cluster {spec.name} down{extra}")
        else:
            netns.read_state(spec)
            print(_table(spec, netns.traffic(spec)))
    except netns.ClusterError as exc:
        print(f"hybridagg cluster {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0
