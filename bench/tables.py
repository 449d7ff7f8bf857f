"""Markdown tables for bench/RESULTS.md from the benchmarks' ``--json`` files.

``python bench/tables.py allreduce FILE.json [MORE.json ...]`` or
``python bench/tables.py ps FILE.json`` (several files: their records together).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def human(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return f"{n} B"


def allreduce(recs: list[dict]) -> str:
    by = {(r["impl"], r["bytes"]): r for r in recs}
    impls = [
        i
        for i in (
            "hybridagg",
            "hybridagg-flat",
            "mpi4py",
            "mpi4py-nb",
            "gloo",
            "horovod",
        )
        if any(k[0] == i for k in by)
    ]
    out = [
        "| size | "
        + " | ".join(impls)
        + " | hybridagg / best MPI | hybridagg / gloo |",
        "|---|" + "---:|" * (len(impls) + 2),
    ]
    for b in sorted({r["bytes"] for r in recs}):
        cells = [
            f"{by[(i, b)]['median_us']:.0f} / {by[(i, b)]['busbw_GBps']:.2f}"
            for i in impls
        ]
        h = by[("hybridagg", b)]["busbw_GBps"]
        m = max(by[("mpi4py", b)]["busbw_GBps"], by[("mpi4py-nb", b)]["busbw_GBps"])
        g = by[("gloo", b)]["busbw_GBps"]
        out.append(
            f"| {human(b)} | " + " | ".join(cells) + f" | {h / m:.2f} | {h / g:.2f} |"
        )
    return "\n".join(out)


def ps(recs: list[dict]) -> str:
    lat = [r for r in recs if "bytes" in r]
    by = {(r["impl"], r["servers"], r["bytes"]): r for r in lat}
    out = [
        "| servers | size | hybridagg-ps (transport) | mpi4py-p2p | ps / p2p | "
        "hybridagg-ps+update | update_us |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for k in sorted({r["servers"] for r in lat}):
        for b in sorted({r["bytes"] for r in lat}):
            a, r = by[("hybridagg-ps", k, b)], by[("mpi4py-p2p", k, b)]
            u = by[("hybridagg-ps+update", k, b)]
            out.append(
                f"| {k} | {human(b)} | {a['median_us']:.0f} / {a['algbw_GBps']:.2f} | "
                f"{r['median_us']:.0f} / {r['algbw_GBps']:.2f} | "
                f"{a['algbw_GBps'] / r['algbw_GBps']:.2f} | "
                f"{u['median_us']:.0f} / {u['algbw_GBps']:.2f} | {a['update_us']:.0f} |"
            )
    cap = [r for r in recs if "leaders" in r]
    if cap:
        out += ["", "| leaders | servers | updates/s |", "|---:|---:|---:|"]
        out += [
            f"| {r['leaders']} | {r['servers']} | {r['updates_per_sec']:.0f} |"
            for r in cap
        ]
    return "\n".join(out)


if __name__ == "__main__":
    kind, paths = sys.argv[1], sys.argv[2:]
    records = [r for p in paths for r in json.loads(Path(p).read_text())]
    print({"allreduce": allreduce, "ps": ps}[kind](records))
