"""The simulator's leader-server exchange against bench/ps.py's round trips across a link.

::

    python bench/sim_exchange.py --ps ps-across.json --sitting simcheck.json \\
        --json exchange.json --md exchange.md

``--ps``: ``bench/ps.py``'s latency records (one server) measured with the
leader and the server on two hosts (``python bench/ps.py --cluster
bench/clusters/two-hosts-10g.toml --only latency --servers 1``). For each
size, three measured round trips: hybridagg's push and pull of the
gradient as transport alone (the server returns each part unapplied), the
same with the server's update, and raw mpi4py's send of the bytes, then
their return. Each is simulated by ``hybridagg simulate``'s engine on the
same link: one leader on one host and one server on another, the links of
``--cluster`` (default the emulated cluster's simulator file,
``examples/clusters/four-workers-10g.yaml``) as the profile's network fit
for that cluster calibrated them (``--profile FILE``, or ``--sitting
FILE``: the first calibrated profile of a ``bench/simcheck.py --cluster``
sitting). The server's update is the measured one (``update_us``), so only
the transfers are the model's. The exchange is simulated as the run cuts
it (in parts of ``HYBRIDAGG_PS_PART_BYTES``, 4 MiB) and, beside it, as one
message each way (``part_bytes=0``: push, update, reply in turn); the raw
anchor is one message each way without an update. Every time is the mean
of ``--steps`` exchanges. Nothing here is fitted: it checks the model of
the exchange on a microbenchmark the calibration did not use.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

CLUSTER = ROOT / "examples" / "clusters" / "four-workers-10g.yaml"

#: measured impl -> (what it is, simulated in parts, with the update)
ROWS = {
    "hybridagg-ps": ("push+pull, transport", True, False),
    "hybridagg-ps+update": ("push+pull with the update", True, True),
    "mpi4py-p2p": ("mpi4py send, then receive", False, False),
}


def link_cluster(cluster, profile):
    """``cluster``'s links as ``profile`` calibrated them, cut to one worker
    host of one rank and one server host."""
    from hybridagg.sim.job import calibrated_cluster

    cluster = calibrated_cluster(cluster, profile)
    workers = [t for t in cluster.node_types if t.devices > 0]
    servers = [t for t in cluster.node_types if t.name in cluster.servers.node_types]
    if not workers or not servers or servers[0].devices > 0:
        raise SystemExit(
            f"--cluster {cluster.name}: needs a node type of workers and a server "
            "node type without workers"
        )
    return replace(
        cluster,
        node_types=(
            replace(workers[0], count=1, devices=1),
            replace(servers[0], count=1),
        ),
        servers=replace(cluster.servers, node_types=(servers[0].name,), per_node=1),
    )


def simulate_exchange(
    nbytes: int, update_s: float, profile, cluster, *, parts: bool, steps: int
) -> float:
    """Seconds of one leader's exchange of ``nbytes`` with a server on the
    other host (the mean of ``steps``), the server's update ``update_s``."""
    from hybridagg.sim import build_job, simulate
    from hybridagg.train.config.simulation import SimulateConfig

    model = replace(
        profile,
        parameters=max(1, nbytes // 4),
        parameter_bytes=float(nbytes),
        forward_s_per_sample=1e-9,
        backward_s_per_sample=1e-9,
        server=replace(
            profile.server,
            seconds_per_update=0.0,
            seconds_per_byte=update_s / nbytes,
            lookahead_per_byte=0.0,
        ),
        grad_s=0.0,
        update_s=0.0,
        copy_s=0.0,
        validation_s=0.0,
    )
    cfg = SimulateConfig(
        mode="async", servers=1, steps=steps + 1, batch_size=1, sample_ms=1e-6,
        profile="-", cluster="-",
    )  # fmt: skip
    job = build_job(cfg, cluster, model)
    if not parts:
        job = replace(job, part_bytes=0)
    # (the run ends with the last push's first update: the group's mean
    # step is over the whole exchanges before it)
    return simulate(job).group_update_s[0]


def run(args) -> list[dict]:
    from hybridagg.sim import load_cluster, load_profile
    from hybridagg.sim.profile import profile_from_dict

    if args.sitting:
        sitting = json.loads(Path(args.sitting).read_text())
        profile = profile_from_dict(sitting["calibration"][0]["content"])
    else:
        profile = load_profile(args.profile)
    cluster = link_cluster(load_cluster(args.cluster), profile)
    if profile.network_for(cluster.name) is None:
        raise SystemExit(
            f"the profile has no network fit for cluster {cluster.name!r} "
            "(hybridagg profile --calibrate-network)"
        )
    records = json.loads(Path(args.ps).read_text())
    out = []
    for r in records:
        if r.get("impl") not in ROWS or int(r.get("servers", 1)) != 1:
            continue
        if r.get("busy"):  # (measured beside spinning processes: not simulated)
            continue
        what, parts, with_update = ROWS[r["impl"]]
        update = float(r["update_us"]) * 1e-6 if with_update else 0.0
        row = {
            "bytes": int(r["bytes"]),
            "impl": r["impl"],
            "what": what,
            "measured_s": float(r["median_us"]) * 1e-6,
            "simulated_s": simulate_exchange(
                r["bytes"], update, profile, cluster, parts=parts, steps=args.steps
            ),
        }
        if parts:
            row["one_message_s"] = simulate_exchange(
                r["bytes"], update, profile, cluster, parts=False, steps=args.steps
            )
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| bytes | round trip | measured (ms) | simulated (ms) | error "
        "| one message each way (ms) | error |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        err = r["simulated_s"] / r["measured_s"] - 1
        one = r.get("one_message_s")
        tail = (
            f"{one * 1e3:.1f} | {one / r['measured_s'] - 1:+.1%}"
            if one is not None
            else "- | -"
        )
        lines.append(
            f"| {r['bytes'] / 2**20:g} MiB | {r['what']} | {r['measured_s'] * 1e3:.1f} "
            f"| {r['simulated_s'] * 1e3:.1f} | {err:+.1%} | {tail} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ps", required=True, help="bench/ps.py's records across a link")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="a profile with the cluster's network fit")
    src.add_argument("--sitting", help="a bench/simcheck.py --cluster sitting's JSON")
    p.add_argument(
        "--cluster", default=str(CLUSTER), help="the simulator's cluster file"
    )
    p.add_argument("--steps", type=int, default=8, help="exchanges averaged")
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    rows = run(args)
    text = table(rows)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
