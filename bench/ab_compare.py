"""Compare an A/B of two code versions run side by side (old and new).

Reads ``DIR/allreduce-{old,new}-N.json`` (bench/allreduce.py) and
``DIR/hetero-4x-{old,new}.json`` (bench/hetero.py) and prints markdown
tables: per size, each implementation's median over runs and the median of
the paired new/old ratios, the same normalised to each run's best MPI
anchor, and per mode the samples/s ratio seed by seed.

Usage: ``python bench/ab_compare.py DIR``
"""

import glob
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

out = sys.argv[1]
# allreduce: per (impl, bytes), each run's median; ratio new/old per repetition pair
runs = defaultdict(lambda: defaultdict(list))
for side in ("old", "new"):
    for f in sorted(glob.glob(f"{out}/allreduce-{side}-*.json")):
        for r in json.loads(Path(f).read_text()):
            runs[(r["impl"], r["bytes"])][side].append(r["median_us"])
print(
    "| impl | size | old median us, median [range] of runs | new, the same | new/old, median of paired runs |"
)
print("|---|---:|---:|---:|---:|")
for (impl, b), d in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1])):
    o, n = d["old"], d["new"]
    if not o or not n:
        continue
    ratios = [y / x for x, y in zip(o, n, strict=True)]
    print(
        f"| {impl} | {b / 2**20:g} MiB | {statistics.median(o):.0f} [{min(o):.0f}-{max(o):.0f}] | {statistics.median(n):.0f} [{min(n):.0f}-{max(n):.0f}] | {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] |"
    )
# hetero: per mode, per seed
recs = {}
for side in ("old", "new"):
    path = Path(f"{out}/hetero-4x-{side}.json")
    if path.exists():
        recs[side] = json.loads(path.read_text())
if len(recs) == 2:
    print()
    print(
        "| mode | seeds | old efficiency median | new efficiency median | new/old samples/s per seed: median [range] | seeds new faster | old time to 0.9 s | new time to 0.9 s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    by = defaultdict(dict)
    for side, rs in recs.items():
        for r in rs:
            by[(r["mode"], r["seed"])][side] = r
    for mode in ("sync", "hybrid", "async", "sync+adaptive"):
        pairs = [
            (v["old"], v["new"])
            for (m, s), v in sorted(by.items())
            if m == mode and len(v) == 2
        ]
        if not pairs:
            continue
        ratio = [n["samples_per_sec"] / o["samples_per_sec"] for o, n in pairs]
        eo = statistics.median(o["efficiency"] for o, _ in pairs)
        en = statistics.median(n["efficiency"] for _, n in pairs)
        tto = [
            o["time_to_target_s"] for o, _ in pairs if o["time_to_target_s"] is not None
        ]
        ttn = [
            n["time_to_target_s"] for _, n in pairs if n["time_to_target_s"] is not None
        ]
        faster = sum(r > 1 for r in ratio)
        print(
            f"| {mode} | {len(pairs)} | {eo:.3f} | {en:.3f} | {statistics.median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}] | {faster}/{len(pairs)} | {statistics.median(tto):.2f} | {statistics.median(ttn):.2f} |"
        )

# normalised: each run's hybridagg median over the same run's best MPI anchor
print()
print(
    "| impl | size | old: impl / best MPI anchor, median [range] | new: the same | new/old of the medians |"
)
print("|---|---:|---:|---:|---:|")
norm = defaultdict(lambda: defaultdict(list))
for side in ("old", "new"):
    for f in sorted(glob.glob(f"{out}/allreduce-{side}-*.json")):
        rs = {
            (r["impl"], r["bytes"]): r["median_us"]
            for r in json.loads(Path(f).read_text())
        }
        for (impl, b), t in rs.items():
            if impl.startswith("hybridagg"):
                anchor = min(rs[("mpi4py", b)], rs[("mpi4py-nb", b)])
                norm[(impl, b)][side].append(t / anchor)
for (impl, b), d in sorted(norm.items()):
    o, n = d["old"], d["new"]
    mo, mn = statistics.median(o), statistics.median(n)
    print(
        f"| {impl} | {b / 2**20:g} MiB | {mo:.3f} [{min(o):.3f}-{max(o):.3f}] | {mn:.3f} [{min(n):.3f}-{max(n):.3f}] | {mn / mo:.3f} |"
    )
