"""Pipelined groups against data parallelism on emulated heterogeneous groups (issue 22).

One command plans and runs every configuration side by side (it starts the
MPI job itself)::

    python bench/pipeline.py --json pipeline.json

Per setting (``--settings``; each a cluster file of the planner, whose node
types give every rank its speed, memory and price, and a ``--groups``-style
list of each group's ranks in stage order):

* ``pairs``: bench/clusters/pipeline-pairs.yaml, groups ``0+2,1+3``: each
  group one fast rank and one four times slower;
* ``mixed``: bench/clusters/pipeline-mixed.yaml, groups ``0+1,4+2+3``: two
  fast ranks; and a small-memory, a half-speed and a quarter-speed rank.

The model's profile is a real model's (``--profile-model``: GPT-2 small's
width and depth, 768 wide, 12 blocks, by default): each pipeline layer's
share of the floating-point operations (``hybridagg.train.pacing
.module_costs``), its parameter bytes and the bytes of its output. A rank's
compute is emulated from it (``--sample-ms`` per sample for the whole model
on a speed-1 rank, scaled by the rank's speed: each stage sleeps its
layers' share at its rank's speed after each micro-batch's forward and
after its backward), and so are the links
(the cluster file's inter-node link, slept by the receiver of every
activation, gradient and all-reduce as if the profiled model's bytes had
crossed it). The tensors that really move are those of a narrow stand-in
with the same layers (``--standin-width``), so that four to five ranks on
two cores stay within their emulated time.

Configurations (``config`` in the records):

* ``dp``: every rank a group of its own holding the whole model, equal
  shares of the global batch, the gradient summed across all ranks;
* ``dp-adaptive``: the same, each rank's share proportional to its
  throughput measured in the warm-up (OmniLearn's rule);
* ``even``: the groups as given, each cut into stages of equal compute,
  equal shares;
* ``auto``: each group cut by the communication-aware dynamic program
  (``hybridagg.pipeline.best_partition``), shares by Ling et al.'s linear
  solve of the groups' batch times (``hybridagg.control.affine_shares``),
  solved again from the times measured in the warm-up;
* ``best-static``: brute force over every group's cut points and every
  split of the global batch, by the batch-time model
  (``hybridagg.pipeline.batch_time``);
* ``ctl-V<V>``: the drift-plus-penalty controller
  (``hybridagg.control.CostController``) at ``--cost-budget`` per hour,
  choosing each slot of ``--slot-steps`` steps among ``auto`` and the
  configurations with a group's slowest rank parked (layers move between
  ranks when the choice changes); its cost is measured: each slot's
  active ranks' prices times the slot's measured seconds.

A configuration whose ranks cannot hold their part of the model (weights,
gradients and momentum of the profiled model's bytes, plus the activations
in flight) in their node type's ``memory`` is reported as not fitting and
not run. Reported per configuration: the measured batch time (the slowest
rank's, per step, after ``--warmup`` steps), samples per second, cost per
hour, the model's predicted batch time; per setting the analytic
steady-state cut of ``auto`` against ``even`` (layers infinitely divisible,
links free, no bubble) and the goals of the issue.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = {
    "pairs": ("bench/clusters/pipeline-pairs.yaml", "0+2,1+3"),
    "pairs-10g": ("bench/clusters/pipeline-pairs-10g.yaml", "0+2,1+3"),
    "mixed": ("bench/clusters/pipeline-mixed.yaml", "0+1,4+2+3"),
}
STATIC = ("dp", "dp-adaptive", "even", "auto", "best-static")
_MOMENTUM = 0.0  # plain SGD: no optimizer state moves with a layer


# ----------------------------------------------------------------- planning
@dataclass(frozen=True)
class ModelProfile:
    """The profiled model, per pipeline layer, per sample."""

    layer_seconds: list[float]  # on a speed-1 rank, summing to --sample-ms
    param_bytes: list[int]
    activation_bytes: list[int]  # of each layer's output (the last: logits)
    standin_activation_bytes: list[int]


def _gpt2(width: int, layers: int, heads: int):
    from hybridagg.train.architectures import GPT2

    return GPT2((64,), 10, n_embd=width, n_head=heads, n_layer=layers)


def _layer_outputs(model) -> list[int]:
    import torch

    from hybridagg.pipeline import model_layers

    h = torch.zeros(1, 64)
    out = []
    with torch.no_grad():
        for layer in model_layers(model):
            h = layer(h)
            out.append(h.numel() * h.element_size())
    return out


def profile_model(args) -> ModelProfile:
    """Per-layer flops, parameter and activation bytes of the profiled model."""
    import torch

    from hybridagg.pipeline import layer_costs, model_layers
    from hybridagg.train.pacing import module_costs

    torch.manual_seed(0)
    big = _gpt2(args.profile_width, args.layers, args.profile_heads)
    if args.profile:
        # a profile's measured seconds per module (hybridagg profile of the
        # same architecture, --model gpt2 at these dimensions)
        from hybridagg.sim.profile import load_profile

        costs = {
            c.name: c.forward_s + c.backward_s
            for c in load_profile(args.profile).layers
        }
    else:
        costs = module_costs(big, torch.zeros(1, 64))
    flops = layer_costs(big, costs)
    layers = model_layers(big)
    total = sum(flops)
    seconds = [args.sample_ms / 1000.0 * f / total for f in flops]
    params = [sum(p.numel() * 4 for p in layer.parameters()) for layer in layers]
    standin = _gpt2(args.standin_width, args.layers, 2)
    return ModelProfile(seconds, params, _layer_outputs(big), _layer_outputs(standin))


@dataclass(frozen=True)
class Rank:
    node: int
    type: str
    speed: float
    memory: float | None
    price: float


def cluster_ranks(path: str):
    """Each rank's node, speed, memory and price, in the planner's rank order."""
    from hybridagg.sim.cluster import load_cluster

    spec = load_cluster(ROOT / path)
    ranks, node = [], 0
    for t in spec.node_types:
        for _ in range(t.count):
            for _ in range(t.devices):
                ranks.append(Rank(node, t.name, t.speed, t.memory, t.price_per_hour))
            node += 1
    return spec, ranks


def parse_groups(text: str, n: int) -> list[list[int]]:
    groups = [[int(r) for r in g.split("+")] for g in text.split(",")]
    flat = [r for g in groups for r in g]
    if sorted(flat) != list(range(n)):
        raise SystemExit(f"--groups {text!r} must name each of the {n} ranks once")
    return groups


def sum_seconds(
    groups, bounds, param_bytes, link, latency_s: float
) -> dict[int, float]:
    """Each holder's emulated seconds of the gradient sum across groups.

    Per segment of layers (:func:`hybridagg.pipeline.segments`), a ring over
    its holders: ``2(g-1)`` messages of ``bytes/g`` over the slowest link
    among them (``link(a, b)``, a :class:`~hybridagg.pipeline.Link`).
    """
    from hybridagg.pipeline import holders, segments

    g = len(groups)
    per_rank: dict[int, float] = {}
    if g < 2:
        return per_rank
    for seg in segments(bounds):
        nbytes = sum(param_bytes[seg[0] : seg[1]])
        owners = holders(groups, bounds, seg)
        bw = min(link(a, b).bandwidth_Bps for a, b in itertools.pairwise(owners))
        t = 2 * (g - 1) * (latency_s + nbytes / g / bw)
        for r in owners:
            per_rank[r] = per_rank.get(r, 0.0) + t
    return per_rank


class Planner:
    """Cuts, shares and predicted times of one setting (pure, no MPI)."""

    def __init__(self, args, prof: ModelProfile, spec, ranks: list[Rank]) -> None:
        from hybridagg.pipeline import Link

        self.args, self.prof, self.ranks = args, prof, ranks
        self.L = len(prof.layer_seconds)
        self.inter = Link(spec.inter_node.latency, spec.inter_node.bandwidth)
        self.intra = Link(spec.intra_node.latency, spec.intra_node.bandwidth)

    def link(self, a: int, b: int):
        return self.intra if self.ranks[a].node == self.ranks[b].node else self.inter

    def group_time(self, group: list[int], bounds, samples: int) -> float:
        """Predicted seconds of one group's batch of ``samples``."""
        from hybridagg.pipeline import batch_time, micro_sizes, timing_inputs

        if samples == 0:
            return 0.0
        links = [self.link(a, b) for a, b in itertools.pairwise(group)]
        f, b, c = timing_inputs(
            bounds,
            self.prof.layer_seconds,
            [self.ranks[r].speed for r in group],
            self.prof.activation_bytes[:-1],
            links if links else self.inter,
        )
        return batch_time(f, b, c, micro_sizes(samples, self.args.micro))

    def reduce_time(self, groups, bounds) -> float:
        """Predicted seconds of the gradient sum across groups (the slowest rank's)."""
        per_rank = sum_seconds(
            groups, bounds, self.prof.param_bytes, self.link, self.inter.latency_s
        )
        return max(per_rank.values(), default=0.0)

    def fits(self, group: list[int], bounds, samples: int) -> bool:
        """Whether every rank of the group holds its stage (:meth:`layer_bytes`)."""
        from hybridagg.pipeline import micro_sizes

        micro = (micro_sizes(samples, self.args.micro) or [0])[0]
        need = self.layer_bytes(len(group), micro)
        for k, r in enumerate(group):
            mem = self.ranks[r].memory
            if mem is not None and sum(need[bounds[k] : bounds[k + 1]]) > mem:
                return False
        return True

    def most_samples(self, group: list[int], bounds) -> int:
        """The largest share of the global batch whose micro-batches fit."""
        fitting = [
            b for b in range(1, self.args.batch + 1) if self.fits(group, bounds, b)
        ]
        return max(fitting, default=0)

    def layer_bytes(self, stages: int, micro: int) -> list[float]:
        """What a layer needs on its rank: weights and gradients, and its
        output for the micro-batches in flight (at most ``stages`` in 1F1B)."""
        state = 3 if _MOMENTUM else 2
        return [
            p * state + a * micro * stages
            for p, a in zip(
                self.prof.param_bytes, self.prof.activation_bytes, strict=True
            )
        ]

    def affine(self, group, bounds, total: int) -> tuple[float, float]:
        """The group's batch time as ``a b + c``, fitted on the model at two sizes."""
        lo, hi = max(1, total // 4), total
        t1, t2 = self.group_time(group, bounds, lo), self.group_time(group, bounds, hi)
        a = (t2 - t1) / (hi - lo)
        return a, max(0.0, t1 - a * lo)

    def auto(self, groups) -> tuple[list, list[int]]:
        from hybridagg.control.shares import affine_shares
        from hybridagg.pipeline import best_partition

        B, M = self.args.batch, self.args.micro
        bounds = []
        for group in groups:
            links = [self.link(a, b) for a, b in itertools.pairwise(group)]
            micro = max(1, B // len(groups) // M)
            p = best_partition(
                self.prof.layer_seconds,
                [self.ranks[r].speed for r in group],
                self.prof.activation_bytes[:-1],
                links if links else self.inter,
                micro_batch=micro,
                layer_bytes=self.layer_bytes(len(group), micro),
                memory=[self.ranks[r].memory for r in group],
            )
            bounds.append(list(p.bounds))
        coef = [self.affine(g, b, B) for g, b in zip(groups, bounds, strict=True)]
        # no group gets more samples than its ranks hold the micro-batches of
        high = [self.most_samples(g, b) for g, b in zip(groups, bounds, strict=True)]
        shares = affine_shares([a for a, _ in coef], [c for _, c in coef], B, high=high)
        return bounds, shares

    def even(self, groups) -> tuple[list, list[int]]:
        from hybridagg.pipeline import even_partition

        B = self.args.batch
        bounds = [list(even_partition(self.prof.layer_seconds, len(g))) for g in groups]
        base, extra = divmod(B, len(groups))
        return bounds, [base + (1 if i < extra else 0) for i in range(len(groups))]

    def best_static(self, groups) -> tuple[list, list[int]]:
        """Every group's every cut and every split of the batch, by the model
        (pipelines and the gradient sum across groups), among cuts that fit."""
        B = self.args.batch
        tables = []
        for group in groups:
            cuts = [
                (0, *c, self.L)
                for c in itertools.combinations(range(1, self.L), len(group) - 1)
            ]
            cuts = [c for c in cuts if self.fits(group, c, 1)]
            tables.append(
                [
                    (
                        c,
                        [
                            self.group_time(group, c, b)
                            if self.fits(group, c, b)
                            else math.inf
                            for b in range(B + 1)
                        ],
                    )
                    for c in cuts
                ]
            )
        best = (math.inf, None, None)
        for combo in itertools.product(*tables):
            bounds = [list(c) for c, _ in combo]
            # the smallest largest group time over splits (min-max knapsack)
            split = {0: (0.0, [])}
            for _, times in combo:
                nxt = {}
                for used, (t, picks) in split.items():
                    for b in range(1, B - used + 1):
                        cand = (max(t, times[b]), [*picks, b])
                        if used + b not in nxt or cand[0] < nxt[used + b][0]:
                            nxt[used + b] = cand
                split = nxt
            t, shares = split[B]
            t += self.reduce_time(groups, bounds)
            if t < best[0]:
                best = (t, bounds, shares)
        if best[1] is None:
            raise ValueError("no static configuration fits the ranks' memory")
        return best[1], best[2]

    def predict(self, groups, bounds, shares) -> float:
        t = max(
            self.group_time(g, b, s)
            for g, b, s in zip(groups, bounds, shares, strict=True)
        )
        return t + self.reduce_time(groups, bounds)

    def cost(self, groups) -> float:
        return sum(self.ranks[r].price for g in groups for r in g)


def plan_setting(args, name: str, prof: ModelProfile) -> dict:
    """Every configuration of one setting, with its predicted batch time."""
    from hybridagg.batching import proportional_batches
    from hybridagg.pipeline import continuous_bottleneck

    path, spec_groups = SETTINGS[name]
    spec, ranks = cluster_ranks(path)
    groups = parse_groups(spec_groups, len(ranks))
    pl = Planner(args, prof, spec, ranks)
    B, L = args.batch, pl.L
    runs, skipped = [], {}

    def candidate(label, gs, bounds, shares, adapt=None):
        fits = all(pl.fits(g, b, s) for g, b, s in zip(gs, bounds, shares, strict=True))
        return {
            "name": label,
            "groups": gs,
            "bounds": bounds,
            "shares": shares,
            "adapt": adapt,
            "fits": fits,
            "predicted_batch_time_s": pl.predict(gs, bounds, shares),
            "cost_per_hour": pl.cost(gs),
            "intercepts": [
                pl.affine(g, b, B)[1] for g, b in zip(gs, bounds, strict=True)
            ],
        }

    singles = [[r] for r in range(len(ranks))]
    base, extra = divmod(B, len(ranks))
    even_dp = [base + (1 if i < extra else 0) for i in range(len(ranks))]
    speeds = [r.speed for r in ranks]
    configs = {
        "dp": candidate("dp", singles, [[0, L]] * len(ranks), even_dp),
        "dp-adaptive": candidate(
            "dp-adaptive",
            singles,
            [[0, L]] * len(ranks),
            proportional_batches(speeds, B),
            adapt="proportional",
        ),
        "even": candidate("even", groups, *pl.even(groups)),
        "auto": candidate("auto", groups, *pl.auto(groups), adapt="affine"),
    }
    try:
        configs["best-static"] = candidate(
            "best-static", groups, *pl.best_static(groups)
        )
    except ValueError as exc:
        skipped["best-static"] = str(exc)
    for label in STATIC:
        if label not in configs:
            continue
        c = configs[label]
        if c["fits"]:
            runs.append({"config": label, "candidates": [c]})
        else:
            skipped[label] = "does not fit a rank's memory"
    # the controller's choices: auto, and each group's slowest rank parked
    parkable = [g for g in groups if len(g) > 1]
    choices = []
    for mask in itertools.product([False, True], repeat=len(parkable)):
        gs = []
        for g in groups:
            if g in parkable and mask[parkable.index(g)]:
                slowest = min(g, key=lambda r: (ranks[r].speed, -r))
                g = [r for r in g if r != slowest]
            gs.append(g)
        label = (
            "auto"
            if not any(mask)
            else "park "
            + ",".join(
                str(min(g, key=lambda r: (ranks[r].speed, -r)))
                for g, m in zip(parkable, mask, strict=True)
                if m
            )
        )
        try:
            c = candidate(label, gs, *pl.auto(gs), adapt=None)
        except ValueError:  # no cut of the remaining ranks fits their memory
            continue
        if c["fits"]:
            choices.append(c)
    for v in args.V:
        runs.append(
            {
                "config": f"ctl-V{v:g}",
                "candidates": choices,
                "controller": {"V": v, "budget_per_hour": args.cost_budget},
            }
        )
    even_cfg, auto_cfg = configs["even"], configs["auto"]
    # the analytic steady state: divisible layers, free links, no bubble;
    # a rank holds at most its memory's worth of the model's work
    total = sum(prof.layer_seconds)
    micro = max(1, B // len(groups) // args.micro)

    def capacity(group):
        need = (
            sum(pl.layer_bytes(len(group), micro)) / total
        )  # bytes per second of work
        return [
            None if ranks[r].memory is None else ranks[r].memory / need for r in group
        ]

    t_even = [total / len(g) / min(ranks[r].speed for r in g) for g in groups]
    t_auto = [
        continuous_bottleneck(total, [ranks[r].speed for r in g], capacity(g))
        for g in groups
    ]
    even_time = max((B / len(groups)) * t for t in t_even)
    auto_time = B / sum(1 / t for t in t_auto)
    return {
        "setting": name,
        "cluster": path,
        "groups": groups,
        "ranks": [r.__dict__ for r in ranks],
        "runs": runs,
        "skipped": skipped,
        "analytic_cut": 1 - auto_time / even_time,
        "analytic_cut_per_group": [
            1 - a / e for a, e in zip(t_auto, t_even, strict=True)
        ],
        "analytic_cut_no_memory": 1
        - (B / sum(sum(ranks[r].speed for r in g) / total for g in groups)) / even_time,
        "predicted": {k: v["predicted_batch_time_s"] for k, v in configs.items()},
        "choices": [
            (c["name"], c["predicted_batch_time_s"], c["cost_per_hour"])
            for c in choices
        ],
        "even_auto_predicted_cut": 1
        - auto_cfg["predicted_batch_time_s"] / even_cfg["predicted_batch_time_s"],
    }


# ----------------------------------------------------------------- the job
class _ScaledLink:
    """An emulated link carrying the profiled model's bytes for the stand-in's."""

    def __init__(self, link, scale: float) -> None:
        self.link, self.scale = link, scale

    def seconds(self, nbytes: float) -> float:
        return self.link.seconds(nbytes * self.scale)


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class Job:
    """One setting's runs on this rank (inside mpiexec)."""

    def __init__(self, world, setting: dict, args: dict) -> None:
        import torch

        from hybridagg.pipeline import Link, model_layers

        self.world, self.setting, self.args = world, setting, args
        self.prof = ModelProfile(**args["profile"])
        torch.manual_seed(0)
        self.model = _gpt2(args["standin_width"], args["layers"], 2)
        self.layers = model_layers(self.model)
        self.ranks = [Rank(**r) for r in setting["ranks"]]
        c = args["links"]
        self.inter = Link(*c["inter"])
        self.intra = Link(*c["intra"])
        g = torch.Generator().manual_seed(1)
        self.X = torch.randn(args["batch"], 64, generator=g)
        self.Y = torch.randint(0, 10, (args["batch"],), generator=g)
        self.last: dict | None = None  # the placement the previous run left

    def _link(self, a: int, b: int):
        return self.intra if self.ranks[a].node == self.ranks[b].node else self.inter

    def _place(self, cand: dict) -> dict[int, list[int]]:
        """Which world rank holds each layer, per group."""
        out = {}
        for gi, (group, bounds) in enumerate(
            zip(cand["groups"], cand["bounds"], strict=True)
        ):
            out[gi] = [
                group[k]
                for k in range(len(group))
                for _ in range(bounds[k], bounds[k + 1])
            ]
        return out

    def resync(self) -> None:
        """Give every rank the current weights of every layer (untimed, between
        runs): a run leaves each layer trained only on its holders, and the
        next run's placement starts from a whole model on every rank."""
        if self.last is None:
            return  # every rank built the same initial weights
        holder = self._place(self.last)[0]  # the first group holds every layer
        for layer, root in enumerate(holder):
            for p in self.layers[layer].parameters():
                self.world.Bcast(p.data, root, what="weights between runs")
        self.last = None

    def move(self, old: dict | None, new: dict) -> float:
        """Send the layers whose holder changes within a run (``old`` None:
        the first placement, on ranks that all hold the whole model)."""
        if old is None:
            return 0.0
        t0 = time.perf_counter()
        a, b = self._place(old), self._place(new)
        reqs, keep, link_s = [], [], 0.0
        for gi in b:
            for layer, (src, dst) in enumerate(zip(a[gi], b[gi], strict=True)):
                if src == dst:
                    continue
                for j, p in enumerate(self.layers[layer].parameters()):
                    tag = 1000 + layer * 64 + j
                    if self.world.rank == src:
                        buf = p.data.contiguous()
                        keep.append(buf)
                        reqs.append(self.world.Isend(buf, dst, tag))
                    elif self.world.rank == dst:
                        reqs.append(self.world.Irecv(p.data, src, tag))
                if self.world.rank == dst:
                    link_s += self._link(src, dst).seconds(self.prof.param_bytes[layer])
        if reqs:
            self.world.wait(reqs, "moving layers between ranks")
        _sleep(link_s)
        return time.perf_counter() - t0

    def build(self, cand: dict):
        """The group communicator, stage and reducer of this rank for ``cand``."""
        import torch

        from hybridagg.pipeline import (
            CrossGroupReducer,
            PipelineStage,
            StagePace,
            split_layers,
        )
        from hybridagg.pipeline.partition import FORWARD_SHARE

        me = self.world.rank
        gi = next((i for i, g in enumerate(cand["groups"]) if me in g), None)
        k = cand["groups"][gi].index(me) if gi is not None else 0
        group = self.world.split(gi, k, name=f"group {gi}")
        reducer = CrossGroupReducer(
            self.world, cand["groups"], cand["bounds"], self.layers
        )
        if gi is None:
            return None
        ranks, bounds = cand["groups"][gi], cand["bounds"][gi]
        module = split_layers(self.layers, bounds)[k]
        lo, hi = bounds[k], bounds[k + 1]
        per = sum(self.prof.layer_seconds[lo:hi]) / self.ranks[me].speed
        pace = StagePace(per * FORWARD_SHARE, per * (1 - FORWARD_SHARE))

        def link(i: int):
            if not 0 <= i < len(ranks) or i == k:
                return None
            lay = min(bounds[k + 1], bounds[i + 1]) - 1  # the boundary's layer
            scale = (
                self.prof.activation_bytes[lay]
                / self.prof.standin_activation_bytes[lay]
            )
            return _ScaledLink(self._link(me, ranks[i]), scale)

        stage = PipelineStage(
            module,
            group,
            sample=self.X[:1] if k == 0 else None,
            loss=torch.nn.functional.cross_entropy,
            pace=pace,
            links=(link(k - 1), link(k + 1)),
        )
        # the all-reduce's emulated time: this rank's segments over the link
        reduce_s = sum_seconds(
            cand["groups"],
            cand["bounds"],
            self.prof.param_bytes,
            self._link,
            self.inter.latency_s,
        ).get(me, 0.0)
        return {
            "group": group,
            "stage": stage,
            "reducer": reducer,
            "module": module,
            "gi": gi,
            "k": k,
            "reduce_s": reduce_s,
        }

    def step(self, parts, shares: list[int]) -> tuple[float, float]:
        """One global batch; returns (this rank's step seconds, group batch seconds)."""
        import torch

        t0 = time.perf_counter()
        if parts is None:
            return 0.0, 0.0
        gi, B = parts["gi"], sum(shares)
        lo = sum(shares[:gi])
        mine = shares[gi]
        parts["module"].zero_grad()
        batch = (
            (self.X[lo : lo + mine], self.Y[lo : lo + mine])
            if parts["k"] == 0
            else None
        )
        _, _, times = parts["stage"].step(batch, self.args["micro"])
        t_group = times.wall_s
        parts["reducer"].allreduce(mine / B)
        _sleep(parts["reduce_s"])
        with torch.no_grad():
            for p in parts["module"].parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.args["lr"])
        return time.perf_counter() - t0, t_group

    def free(self, parts) -> None:
        if parts is not None:
            parts["group"].free()

    def run_static(self, run: dict) -> dict:
        """Warm-up, re-solve the shares where the config adapts, time."""
        import numpy as np

        cand = dict(run["candidates"][0])
        self.resync()
        self.move(None, cand)
        parts = self.build(cand)
        shares = list(cand["shares"])
        warm = []
        for _ in range(self.args["warmup"]):
            warm.append(self.step(parts, shares))
        if cand["adapt"]:
            shares = self._resolve(cand, parts, shares, warm)
        walls, pipes = [], []
        for _ in range(self.args["steps"]):
            wall, pipe = self.step(parts, shares)
            walls.append(wall)
            pipes.append(pipe)
        w = np.array([sum(walls), sum(pipes)], dtype=np.float64)
        self.world.Allreduce(w, op=_max())
        if parts is not None:
            parts["reducer"].free()
        self.free(parts)
        self.last = cand
        steps = self.args["steps"]
        return {
            "config": run["config"],
            "batch_time_s": float(w[0]) / steps,
            "pipeline_time_s": float(w[1]) / steps,
            "samples_per_sec": sum(shares) * steps / float(w[0]),
            "cost_per_hour": cand["cost_per_hour"],
            "predicted_batch_time_s": cand["predicted_batch_time_s"],
            "bounds": cand["bounds"],
            "shares": shares,
            "initial_shares": cand["shares"],
            "groups": cand["groups"],
        }

    def _resolve(self, cand, parts, shares, warm) -> list[int]:
        """The shares again, from the group batch times measured in the warm-up."""
        from hybridagg.batching import proportional_batches
        from hybridagg.control.shares import affine_shares

        gi = -1 if parts is None else parts["gi"]
        first = parts is not None and parts["k"] == 0
        mean = sum(t for _, t in warm[1:]) / max(1, len(warm) - 1)
        got = self.world.allgather((gi, first, mean), what="warm-up times")
        seconds = [0.0] * len(cand["groups"])
        for g, is_first, t in got:
            if is_first:
                seconds[g] = t
        B = sum(shares)
        if cand["adapt"] == "proportional":
            rates = [b / t for b, t in zip(shares, seconds, strict=True)]
            return proportional_batches(rates, B)
        slopes = [
            max(1e-9, (t - c) / b)
            for t, c, b in zip(seconds, cand["intercepts"], shares, strict=True)
        ]
        return affine_shares(slopes, cand["intercepts"], B)

    def run_controller(self, run: dict) -> dict:
        """Slots of ``slot_steps`` steps; rank 0's controller picks each slot."""
        import numpy as np

        from hybridagg.control.cost import Candidate, CostController

        ctl_args = run["controller"]
        cands = run["candidates"]
        ctl = CostController(
            budget_per_hour=ctl_args["budget_per_hour"], V=ctl_args["V"]
        )
        options = [
            Candidate(c["name"], c["predicted_batch_time_s"], c["cost_per_hour"], i)
            for i, c in enumerate(cands)
        ]
        self.resync()
        current, parts, trace = None, None, []
        total_s = spent = samples = 0.0
        for _slot in range(self.args["slots"]):
            pick = np.array([ctl.choose(options).config if self.world.rank == 0 else 0])
            self.world.Bcast(pick, 0, what="the controller's choice")
            choice = cands[int(pick[0])]
            t0 = time.perf_counter()
            if current is not choice:
                if parts is not None:
                    parts["reducer"].free()
                    self.free(parts)
                moved = self.move(current, choice)
                parts = self.build(choice)
                current = choice
            else:
                moved = 0.0
            for _ in range(self.args["slot_steps"]):
                self.step(parts, choice["shares"])
            w = np.array([time.perf_counter() - t0], dtype=np.float64)
            self.world.Allreduce(w, op=_max())
            seconds = float(w[0])
            ctl.observe(options[int(pick[0])], seconds)
            total_s += seconds
            spent += choice["cost_per_hour"] * seconds / 3600
            samples += sum(choice["shares"]) * self.args["slot_steps"]
            trace.append(
                {
                    "choice": choice["name"],
                    "seconds": seconds,
                    "moved_s": moved,
                    "queue": ctl.queue,
                }
            )
        if parts is not None:
            parts["reducer"].free()
            self.free(parts)
        self.last = current
        steps = self.args["slots"] * self.args["slot_steps"]
        return {
            "config": run["config"],
            "V": ctl_args["V"],
            "budget_per_hour": ctl_args["budget_per_hour"],
            "batch_time_s": total_s / steps,
            "samples_per_sec": samples / total_s,
            "cost_per_hour": spent / (total_s / 3600),
            "slots": trace,
        }


def _max():
    from mpi4py import MPI

    return MPI.MAX


def inner(args) -> None:
    """Run every configuration of the settings in the plan file (in mpiexec)."""
    from hybridagg.comm import Comm

    plan = json.loads(Path(args.plan).read_text())
    world = Comm(name="pipeline-bench")
    out = []
    for setting in plan["settings"]:
        if world.size != len(setting["ranks"]):
            continue
        job = Job(world, setting, plan["args"])
        for run in setting["runs"]:
            rec = (
                job.run_controller(run) if "controller" in run else job.run_static(run)
            )
            rec["setting"] = setting["setting"]
            out.append(rec)
            world.barrier(what="between configurations")
    if world.rank == 0:
        Path(args.out).write_text(json.dumps(out, indent=1))
    world.free()


# ----------------------------------------------------------------- driver
def table(setting: dict, recs: list[dict]) -> str:
    by = {r["config"]: r for r in recs}
    even = by.get("even")
    lines = [
        f"### {setting['setting']}: groups {setting['groups']}",
        "",
        "| config | batch time (s) | samples/s | cost ($/h) | predicted (s) | cut vs even |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in recs:
        pred = r.get("predicted_batch_time_s")
        cut = 1 - r["batch_time_s"] / even["batch_time_s"] if even else float("nan")
        lines.append(
            f"| {r['config']} | {r['batch_time_s']:.3f} | {r['samples_per_sec']:.1f} | "
            f"{r['cost_per_hour']:.2f} | {'' if pred is None else f'{pred:.3f}'} | "
            f"{cut:+.1%} |"
        )
    for label, why in setting["skipped"].items():
        lines.append(f"| {label} | {why} | | | | |")
    return "\n".join(lines)


def goals(setting: dict, recs: list[dict], budget: float) -> list[str]:
    by = {r["config"]: r for r in recs}
    out = []
    analytic = setting["analytic_cut"]
    if "even" in by and "auto" in by:
        cut = 1 - by["auto"]["batch_time_s"] / by["even"]["batch_time_s"]
        out.append(
            f"auto's cut against even {cut:.1%}: {cut / analytic:.2f} of the analytic "
            f"{analytic:.1%} (goal >= 0.90)"
        )
    if "best-static" in by and "auto" in by:
        ratio = by["auto"]["batch_time_s"] / by["best-static"]["batch_time_s"]
        out.append(f"auto / best-static batch time {ratio:.3f} (goal <= 1.10)")
    if "dp-adaptive" in by and "auto" in by:
        ratio = by["dp-adaptive"]["batch_time_s"] / by["auto"]["batch_time_s"]
        out.append(f"dp-adaptive / auto batch time {ratio:.3f} (> 1: auto faster)")
    elif "auto" in by and "dp-adaptive" in setting["skipped"]:
        out.append("dp-adaptive: " + setting["skipped"]["dp-adaptive"] + "; auto runs")
    if "even" in by and "auto" in by and "pipeline_time_s" in by["auto"]:
        pipe = 1 - by["auto"]["pipeline_time_s"] / by["even"]["pipeline_time_s"]
        out.append(
            f"the pipelines alone (the slowest group's batch, without the sum across "
            f"groups): auto's cut {pipe:.1%}, {pipe / analytic:.2f} of the analytic"
        )
    for r in recs:
        if "V" in r:
            ok = "met" if r["cost_per_hour"] <= budget else "NOT met"
            elapsed = sum(s["seconds"] for s in r["slots"])
            bound = budget + 3600 * r["slots"][-1]["queue"] / elapsed
            parked = sum(s["choice"] != "auto" for s in r["slots"])
            out.append(
                f"{r['config']}: {r['cost_per_hour']:.2f} $/h against a budget of "
                f"{budget:.2f} ({ok}; drift-plus-penalty bound budget + 3600 Q/T = "
                f"{bound:.2f}), batch time {r['batch_time_s']:.3f} s, "
                f"{parked} of {len(r['slots'])} slots with a rank parked"
            )
    return out


SUMMARY = (
    "setting",
    "groups",
    "skipped",
    "analytic_cut",
    "analytic_cut_per_group",
    "analytic_cut_no_memory",
    "even_auto_predicted_cut",
)
"""Each setting's fields that every one of its records carries."""


def report(recs: list[dict]) -> str:
    """One setting's table and goals, from its records."""
    setting = {k: recs[0][k] for k in SUMMARY}
    budget = recs[0]["budget_per_hour"]
    block = [table(setting, recs), ""]
    block += [f"- {g}" for g in goals(setting, recs, budget)]
    block.append(
        f"- predicted cut of auto against even {setting['even_auto_predicted_cut']:.1%}"
        f"; analytic per group {[f'{c:.0%}' for c in setting['analytic_cut_per_group']]}"
        f"; analytic without memory limits {setting['analytic_cut_no_memory']:.1%}"
    )
    return "\n".join(block)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--settings", default="pairs,pairs-10g,mixed", help="comma-separated"
    )
    p.add_argument("--batch", type=int, default=256, help="global batch (samples)")
    p.add_argument(
        "--micro", type=int, default=16, help="micro-batches per group batch"
    )
    p.add_argument(
        "--sample-ms",
        type=float,
        default=8.0,
        help="emulated fwd+bwd ms per sample of the whole model, speed 1",
    )
    p.add_argument("--layers", type=int, default=24, help="decoder blocks")
    p.add_argument("--profile-width", type=int, default=768)
    p.add_argument("--profile-heads", type=int, default=12)
    p.add_argument("--standin-width", type=int, default=32)
    p.add_argument(
        "--profile",
        help="a hybridagg profile of the same decoder: each layer's share of "
        "the measured seconds instead of its share of the floating-point "
        "operations (--sample-ms still sets the whole model's time)",
    )
    p.add_argument("--steps", type=int, default=12, help="timed steps per config")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument(
        "--V",
        type=float,
        nargs="*",
        default=[0.001, 0.01, 0.1],
        help="the controller's weights of batch time against the cost queue "
        "(each slot it minimises V x seconds + Q x $/h, Q in $): larger "
        "V is faster and needs longer to settle on the budget; none: no "
        "controller run",
    )
    p.add_argument(
        "--cost-budget",
        type=float,
        default=12.0,
        help="the controller's budget per hour (the clusters' $ units)",
    )
    p.add_argument("--slots", type=int, default=30, help="controller slots")
    p.add_argument("--slot-steps", type=int, default=2, help="steps per slot")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument(
        "--from-json", help="print the tables of an earlier --json, run nothing"
    )
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, low in (("batch", 2), ("micro", 1), ("steps", 1), ("warmup", 2),
                      ("slots", 1), ("slot_steps", 1), ("layers", 1)):  # fmt: skip
        if getattr(args, name) < low:
            # the affine fit needs two batch sizes, the re-solve a timed warm-up
            # step after the first
            p.error(f"--{name.replace('_', '-')} must be >= {low}")
    if args.inner:
        inner(args)
        return 0
    if args.from_json:
        recs = json.loads(Path(args.from_json).read_text())
        names = list(dict.fromkeys(r["setting"] for r in recs))
        text = [report([r for r in recs if r["setting"] == n]) for n in names]
        print("\n\n".join(text))
        if args.md:
            Path(args.md).write_text("\n\n".join(text) + "\n")
        return 0
    from hybridagg.runtime import runner

    names = [s for s in args.settings.split(",") if s]
    for n in names:
        if n not in SETTINGS:
            raise SystemExit(
                f"unknown setting {n!r}; choose from {', '.join(SETTINGS)}"
            )
    prof = profile_model(args)
    text, records = [], []
    for name in names:
        setting = plan_setting(args, name, prof)
        spec, _ = cluster_ranks(SETTINGS[name][0])
        shared = {
            "profile": prof.__dict__,
            "standin_width": args.standin_width,
            "layers": args.layers,
            "batch": args.batch,
            "micro": args.micro,
            "steps": args.steps,
            "warmup": args.warmup,
            "lr": args.lr,
            "slots": args.slots,
            "slot_steps": args.slot_steps,
            "links": {
                "inter": [spec.inter_node.latency, spec.inter_node.bandwidth],
                "intra": [spec.intra_node.latency, spec.intra_node.bandwidth],
            },
        }
        with tempfile.TemporaryDirectory() as tmp:
            plan = Path(tmp, "plan.json")
            out = Path(tmp, "out.json")
            plan.write_text(json.dumps({"settings": [setting], "args": shared}))
            cmd = [
                sys.executable,
                str(HERE),
                "--inner",
                "--plan",
                str(plan),
                "--out",
                str(out),
            ]
            launch = runner.mpiexec_argv(len(setting["ranks"]), cmd)
            result = runner.run_job(
                launch, timeout=args.timeout, env=runner.mpiexec_env()
            )
            if result.returncode != 0 or not out.exists():
                print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"pipeline: setting {name} failed")
            recs = json.loads(out.read_text())
        info = {k: setting[k] for k in SUMMARY}
        for r in recs:
            r.update(info)
            r["budget_per_hour"] = args.cost_budget
        records += recs
        text.append(report(recs))
        print(text[-1] + "\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    if args.md:
        Path(args.md).write_text("\n\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
