"""The planner's REINFORCE policy against its exact searcher, on three fixed spaces.

::

    python bench/planner.py            # a table
    python bench/planner.py --json     # the records as JSON on stdout

Spaces (each the cost model's default space; the analytic model scores
every configuration, no simulation):

* ``two-generation-1024, 38 KB model``: the 1,024-GPU cluster with a
  model of the digits headline's size (a server's update 0.1 ms),
  ``--objective throughput``;
* ``three-speeds-priced``: ``examples/clusters/three-speeds-priced.yaml``
  (10 GPUs of two speeds, CPU nodes for servers), ``--objective cost
  --min-samples-per-sec 1500``;
* ``two-generation-1024``: ``examples/clusters/two-generation-1024.yaml``,
  ``--objective cost --min-samples-per-sec 150000``;
* ``emulated-8-three-speeds``: this machine's emulation, ``-n 8
  --slowdown 2-4:2,5-7:4 --sample-ms 2``, ``--objective throughput``.

``--simulate``: the planner's choice against exhaustive simulation: on three
small spaces (all of ``three-speeds-priced``'s nodes, ``four-workers-10g``,
the 8-worker emulation with either profile; throughput), every configuration is simulated with
SimGrid (20 updates per group) and the simulated samples/s of the
planner's choice (over the second half of the updates, as ``hybridagg
plan`` ranks them) is set beside the best simulated one (the issue's goal:
within 5%). The planner's choice is ``hybridagg plan``'s: the fastest
simulated of the exact searcher's choice and the configurations predicted
within ``CONFIRM_BAND`` of it (``search_choice``: the exact searcher's
alone).

The profile is a synthetic ResNet-50-sized one (25 M parameters, 100 MB of
float32 gradient, 3 ms of compute per sample on the reference device, a
server's update 4 ms + 0.2 ns/B, copies at 5 GB/s): the same as the
simulator's tests, so the figures do not depend on this machine; give
``--profile FILE`` for a measured one. The gap is the policy's cost over the
exact one's, less one (cost objective), or one less the policy's samples/s
over the exact one's (throughput), per seed; wall times beside.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridagg.sim import load_cluster, load_profile  # noqa: E402
from hybridagg.sim.job import machine_cluster  # noqa: E402
from hybridagg.sim.planner import (  # noqa: E402
    CONFIRM_BAND,
    compare_searchers,
    confirm,
    contenders,
)
from hybridagg.sim.profile import MachineInfo, Profile, ServerFit  # noqa: E402
from hybridagg.sim.search import Objective, exact_search  # noqa: E402
from hybridagg.sim.space import CostModel, Space  # noqa: E402

SYNTHETIC = Profile(
    model="synthetic-resnet50-size",
    parameters=25_000_000,
    sample_shape=(3,),
    forward_s_per_sample=0.001,
    backward_s_per_sample=0.002,
    parameter_bytes=1e8,
    activation_bytes_per_sample=0.0,
    server=ServerFit(seconds_per_update=0.004, seconds_per_byte=2e-10),
    machine=MachineInfo(cores=2, memcpy_Bps=5e9),
)


SMALL_MODEL = Profile(
    **{
        **SYNTHETIC.__dict__,
        "model": "synthetic-38KB",
        "parameters": 9610,
        "parameter_bytes": 38440.0,
        "server": ServerFit(seconds_per_update=1e-4, seconds_per_byte=2e-10),
    }
)
"""The digits headline's size (38 KB of gradient), a server's update 0.1 ms."""


def spaces(profile: Profile) -> list[tuple[str, CostModel, Objective]]:
    """The fixed spaces (see the module)."""
    clusters = ROOT / "examples" / "clusters"
    return [
        (
            "two-generation-1024, 38 KB model",
            CostModel(load_cluster(clusters / "two-generation-1024.yaml"), SMALL_MODEL),
            Objective("throughput"),
        ),
        (
            "three-speeds-priced",
            CostModel(load_cluster(clusters / "three-speeds-priced.yaml"), profile),
            Objective("cost", 1500.0),
        ),
        (
            "two-generation-1024",
            CostModel(load_cluster(clusters / "two-generation-1024.yaml"), profile),
            Objective("cost", 150000.0),
        ),
        (
            "emulated-8-three-speeds",
            CostModel(
                machine_cluster(profile, 8, 0),
                profile,
                workers=8,
                slowdown="2-4:2,5-7:4",
                sample_ms=2.0,
            ),
            Objective("throughput"),
        ),
    ]


def run(profile: Profile, seeds: int, rounds: int) -> list[dict]:
    """One record per space: :func:`hybridagg.sim.planner.compare_searchers`'s."""
    return [
        {
            "space": name,
            **compare_searchers(
                model, model.default_space(), objective, seeds=seeds, rounds=rounds
            ),
        }
        for name, model, objective in spaces(profile)
    ]


def simulated_spaces(profile: Profile) -> list[tuple[str, CostModel, Space]]:
    """Small spaces for exhaustive simulation (see the module)."""
    clusters = ROOT / "examples" / "clusters"
    three = CostModel(load_cluster(clusters / "three-speeds-priced.yaml"), profile)
    four = CostModel(load_cluster(clusters / "four-workers-10g.yaml"), profile)
    emulated = CostModel(
        machine_cluster(profile, 8, 0),
        profile,
        workers=8,
        slowdown="2-4:2,5-7:4",
        sample_ms=2.0,
    )
    small = CostModel(
        machine_cluster(SMALL_MODEL, 8, 0),
        SMALL_MODEL,
        workers=8,
        slowdown="2-4:2,5-7:4",
        sample_ms=2.0,
    )
    return [
        ("three-speeds-priced (all nodes)", three,
         replace(three.default_space(), nodes=((2,), (3,)))),
        ("four-workers-10g", four, four.default_space()),
        ("emulated-8-three-speeds", emulated, emulated.default_space()),
        ("emulated-8-three-speeds, 38 KB model", small,
         small.default_space()),
    ]  # fmt: skip


def exhaustive(profile: Profile) -> list[dict]:
    """The planner's choice against every configuration simulated."""
    records = []
    for name, model, space in simulated_spaces(profile):
        chosen = exact_search(model, space, Objective("throughput"))
        assert chosen.best is not None and chosen.score is not None
        simulated: dict = {}
        start = time.perf_counter()
        for c in (c for n in space.node_choices() for c in space.candidates_on(n)):
            if model.score(c) is None:
                continue
            simulated[c] = confirm(model, c, timeout=600)["steady_samples_per_sec"]
        best = max(simulated, key=simulated.get)
        errors = [
            abs(model.score(c).samples_per_sec / v - 1) for c, v in simulated.items()
        ]
        # hybridagg plan's choice: the fastest simulated of the search's
        # choice and the configurations predicted within the band of it
        pool = contenders(model, space, chosen.best, chosen.score, CONFIRM_BAND)
        planned = max(
            (c for c, _ in pool),
            key=lambda c: (simulated[c], -model.score(c).cost_per_hour),
        )
        records.append(
            {
                "space": name,
                "configurations": len(simulated),
                "search_choice": chosen.best.describe(),
                "search_simulated": simulated[chosen.best],
                "confirmed": len(pool),
                "planner_choice": planned.describe(),
                "planner_predicted": model.score(planned).samples_per_sec,
                "planner_simulated": simulated[planned],
                "best_simulated_choice": best.describe(),
                "best_simulated": simulated[best],
                "shortfall": 1 - simulated[planned] / simulated[best],
                "analytic_error_median": statistics.median(errors),
                "analytic_error_max": max(errors),
                "wall_s": time.perf_counter() - start,
            }
        )
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON records")
    parser.add_argument("--profile", help="a profile file (default: synthetic)")
    parser.add_argument("--seeds", type=int, default=5, help="policy seeds per space")
    parser.add_argument("--rounds", type=int, default=150, help="policy updates")
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="the planner's choice against exhaustive simulation (SimGrid)",
    )
    args = parser.parse_args(argv)
    profile = load_profile(args.profile) if args.profile else SYNTHETIC
    if args.simulate:
        records = exhaustive(profile)
        if args.json:
            print(json.dumps(records, indent=1))
            return 0
        for r in records:
            print(
                f"{r['space']}: {r['configurations']} simulated; planner "
                f"{r['planner_choice']} {r['planner_simulated']:.1f} samples/s "
                f"(predicted {r['planner_predicted']:.1f}); best simulated "
                f"{r['best_simulated_choice']} {r['best_simulated']:.1f}; "
                f"shortfall {r['shortfall']:.2%}; analytic error median "
                f"{r['analytic_error_median']:.1%}, max {r['analytic_error_max']:.1%}"
            )
        return 0
    records = run(profile, args.seeds, args.rounds)
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    print(
        f"{'space':<26} {'objective':<10} {'configs':>8} {'exact':>12} "
        f"{'exact s':>8} {'rl gap med':>10} {'rl gap max':>10} {'rl s':>6}"
    )
    for r in records:
        figure = (
            r["exact"]["cost_per_hour"]
            if r["objective"] == "cost"
            else r["exact"]["samples_per_sec"]
        )
        rl_s = statistics.median(x["wall_s"] for x in r["rl"])
        print(
            f"{r['space']:<26} {r['objective']:<10} {r['configurations']:>8} "
            f"{figure:>12.1f} {r['exact']['wall_s']:>8.2f} "
            f"{r['median_gap']:>10.2%} {r['max_gap']:>10.2%} {rl_s:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
