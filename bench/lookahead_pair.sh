#!/bin/bash
# Async over two equal workers (the fast pair of bench/hetero.py, no slow
# ones), with and without the servers' momentum lookahead, seeds 0-5.
# Writes one JSON list per setting: bench/results/lookahead-pair-{on,off}.json
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
for setting in on off; do
    extra=()
    if [ "$setting" = off ]; then extra=(--no-lookahead); fi
    tmp=$(mktemp -d)
    for seed in 0 1 2 3 4 5; do
        "$py" -m hybridagg.cli run -n 3 -- "$py" -m hybridagg.cli train \
            --data runs/digits.h5 --epochs 4 --lr 0.05 --batch-size 32 \
            --slowdown 0-1:1 --sample-ms 1 --target-accuracy 0.9 --eval-every 5 \
            --mode async --servers 1 --seed "$seed" --no-progress "${extra[@]}" \
            --summary "$tmp/$seed.json" >/dev/null
    done
    "$py" - "$tmp" "bench/results/lookahead-pair-$setting.json" <<'PY'
import json, pathlib, statistics, sys
runs = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))]
pathlib.Path(sys.argv[2]).write_text(json.dumps(runs, indent=1))
t = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
n = [r["time_to_target_s"] * r["samples_per_sec"] for r in runs if r["time_to_target_s"] is not None]
print(sys.argv[2], f"{len(t)}/{len(runs)} reached 0.9; time median",
      round(statistics.median(t), 2) if t else None, [round(x, 2) for x in t],
      "samples median", round(statistics.median(n)) if n else None, [round(x) for x in n])
PY
    rm -rf "$tmp"
done
