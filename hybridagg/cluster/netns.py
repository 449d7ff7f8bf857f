"""Bring an emulated cluster up and down with the kernel's namespaces, veth, bridge and tc.

The mechanism under :mod:`hybridagg.cluster.plan`: it runs the plan's
commands as root, writes the state folder (the description, the launch
agent, the hosts files) and removes all of it again. :func:`up` undoes what
it made when a step fails; :func:`down` stops every process left inside the
hosts' namespaces, then deletes namespaces, links and the switch, and
checks that nothing remains. Both are safe to repeat.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..runtime import envvars
from . import plan
from .spec import ClusterSpec

__all__ = [
    "ClusterError",
    "EmulatedCluster",
    "down",
    "leftovers",
    "read_state",
    "state_dir",
    "traffic",
    "up",
]

_TOOLS = ("ip", "tc", "unshare", "mount")
_COMMAND_TIMEOUT = 30.0
_STOP_GRACE = 5.0


class ClusterError(RuntimeError):
    """The cluster could not be brought up or down; the message says what and why."""


def state_dir(spec: ClusterSpec, environ: Mapping[str, str] | None = None) -> Path:
    """The state folder of a cluster: ``$HYBRIDAGG_CLUSTER_DIR/<name>``."""
    return Path(envvars.get_str("HYBRIDAGG_CLUSTER_DIR", environ)) / spec.name


def read_state(spec: ClusterSpec, environ: Mapping[str, str] | None = None) -> Path:
    """The state folder of ``spec``, checked to be up with this very description.

    Raises:
        ClusterError: The cluster is not up, or is up with another description.
    """
    folder = state_dir(spec, environ)
    try:
        recorded = json.loads((folder / plan.STATE_FILE).read_text())
    except FileNotFoundError:
        raise ClusterError(
            f"cluster {spec.name!r} is not up (no {folder / plan.STATE_FILE}): "
            f"run `hybridagg cluster up {spec.source}` first (as root)"
        ) from None
    except (OSError, ValueError) as exc:
        raise ClusterError(f"cannot read {folder / plan.STATE_FILE}: {exc}") from None
    if recorded != spec.to_dict():
        raise ClusterError(
            f"cluster {spec.name!r} is up with another description than "
            f"{spec.source}: run `hybridagg cluster down` and `up` again"
        )
    return folder


Runner = Callable[[Sequence[str]], subprocess.CompletedProcess]


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        timeout=_COMMAND_TIMEOUT,
        check=False,
    )


def _must(run: Runner, argv: Sequence[str]) -> str:
    done = run(argv)
    if done.returncode != 0:
        raise ClusterError(
            f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}"
        )
    return done.stdout


def leftovers(spec: ClusterSpec, run: Runner = _run) -> list[str]:
    """What of the cluster exists in the kernel: namespaces and links, by name."""
    found = []
    names = set(_must(run, ["ip", "netns", "list"]).split())
    found += [f"namespace {n}" for n in sorted(names) if n.startswith(spec.name + "-")]
    links = json.loads(_must(run, ["ip", "-j", "link", "show"]) or "[]")
    ours = {plan.bridge_name(spec)} | {
        plan.switch_link_name(spec, h) for h in spec.hosts
    }
    found += [f"link {li['ifname']}" for li in links if li.get("ifname") in ours]
    return found


def _check_can_start(spec: ClusterSpec, run: Runner) -> None:
    if os.geteuid() != 0:
        raise ClusterError(
            "bringing a cluster up needs root (it creates network namespaces "
            "and links and shapes them with tc)"
        )
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        raise ClusterError(
            f"{', '.join(missing)} not found: install iproute2 and util-linux"
        )
    present = leftovers(spec, run)
    if present:
        raise ClusterError(
            f"cluster {spec.name!r} seems up already ({', '.join(present)}): "
            f"run `hybridagg cluster down {spec.source}` first"
        )
    addrs = json.loads(_must(run, ["ip", "-j", "-4", "addr", "show"]) or "[]")
    for link in addrs:
        for info in link.get("addr_info", []):
            net = ipaddress.IPv4Network(
                f"{info['local']}/{info['prefixlen']}", strict=False
            )
            if net.overlaps(spec.subnet):
                raise ClusterError(
                    f"subnet {spec.subnet} of {spec.source} overlaps {net} on "
                    f"{link['ifname']}: choose another private subnet"
                )


def _check_netem(spec: ClusterSpec, run: Runner) -> None:
    """Refuse latency on a kernel without netem, before anything is made."""
    probe = f"{spec.name}-probe"
    _must(run, ["ip", "netns", "add", probe])
    try:
        done = run(
            [
                "tc",
                "-n",
                probe,
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "netem",
                "delay",
                "1ms",
            ]
        )
    finally:
        run(["ip", "netns", "delete", probe])
    if done.returncode != 0:
        raise ClusterError(
            f"{spec.source} asks for link latency, which needs the kernel's "
            "netem qdisc (CONFIG_NET_SCH_NETEM); this kernel has none "
            f"(tc: {done.stderr.strip()}). Set latency_ms = 0 to shape bandwidth only."
        )


def _write_state(spec: ClusterSpec, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / plan.HOSTS_FILE).write_text(plan.etc_hosts(spec))
    (folder / plan.HOSTFILE_FILE).write_text(plan.mpi_hostfile(spec))
    (folder / plan.RANKFILE_FILE).write_text(plan.mpi_rankfile(spec))
    agent = folder / plan.AGENT_FILE
    agent.write_text(plan.agent_script(spec, folder))
    agent.chmod(0o755)
    # written last: its presence means "up" to the launcher
    (folder / plan.STATE_FILE).write_text(json.dumps(spec.to_dict(), indent=1) + "\n")


def up(
    spec: ClusterSpec, environ: Mapping[str, str] | None = None, run: Runner = _run
) -> Path:
    """Build the cluster; on any failure remove what was built, then raise.

    Returns:
        The state folder (agent, hostfile, hosts file, description).

    Raises:
        ClusterError: Not root, tools missing, already up, subnet in use,
            latency without netem, or a command failed (named, with its error).
    """
    _check_can_start(spec, run)
    if plan.needs_netem(spec):
        _check_netem(spec, run)
    folder = state_dir(spec, environ)
    try:
        for argv in plan.up_commands(spec):
            _must(run, argv)
        _write_state(spec, folder)
    except BaseException:
        down(spec, environ, run)
        raise
    return folder


def _pids_in(namespace: str, run: Runner) -> list[int]:
    done = run(["ip", "netns", "pids", namespace])
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _stop_processes(spec: ClusterSpec, run: Runner) -> int:
    """SIGTERM then SIGKILL every process inside the hosts; returns how many."""
    namespaces = [plan.namespace_name(spec, h) for h in spec.hosts]
    pids = {p for ns in namespaces for p in _pids_in(ns, run)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + _STOP_GRACE
        while time.monotonic() < deadline:
            if not any(_pids_in(ns, run) for ns in namespaces):
                return len(pids)
            time.sleep(0.1)
    return len(pids)


def down(
    spec: ClusterSpec, environ: Mapping[str, str] | None = None, run: Runner = _run
) -> int:
    """Stop what runs on the hosts and remove namespaces, links, switch and state.

    Returns:
        How many processes were still running on the hosts.

    Raises:
        ClusterError: Something could not be removed (named).
    """
    stopped = _stop_processes(spec, run)
    for argv in plan.down_commands(spec):
        run(argv)  # "not there" is fine: down is idempotent
    remaining = leftovers(spec, run)
    if remaining:
        raise ClusterError(f"could not remove {', '.join(remaining)}")
    shutil.rmtree(state_dir(spec, environ), ignore_errors=True)
    return stopped


@dataclass
class EmulatedCluster:
    """An emulated cluster that is up; ``with`` or :meth:`free` takes it down.

    Attributes:
        spec: Its description.
        folder: Its state folder.
    """

    spec: ClusterSpec
    folder: Path
    environ: Mapping[str, str] | None = None

    @classmethod
    def start(
        cls, spec: ClusterSpec, environ: Mapping[str, str] | None = None
    ) -> EmulatedCluster:
        """Bring ``spec`` up (see :func:`up`)."""
        return cls(spec, up(spec, environ), environ)

    def free(self) -> int:
        """Take it down (see :func:`down`); returns the processes it stopped."""
        return down(self.spec, self.environ)

    def __enter__(self) -> EmulatedCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.free()


def traffic(spec: ClusterSpec, run: Runner = _run) -> dict[str, tuple[int, int]]:
    """Bytes each host has sent and received over its link, from the kernel's counters.

    Returns:
        ``{host: (sent, received)}``, read from the host side (``eth0``).
    """
    counts = {}
    for host in spec.hosts:
        ns = plan.namespace_name(spec, host)
        info = json.loads(
            _must(run, ["ip", "-n", ns, "-j", "-s", "link", "show", "dev", "eth0"])
        )
        stats = info[0]["stats64"]
        counts[host.name] = (int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
    return counts
