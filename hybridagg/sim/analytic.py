"""The planner's cheap cost model: a :class:`~.job.SimJob`'s samples/s in closed form.

The planner scores thousands of candidate configurations; the SimGrid
simulator (about a second per job at 1,024 ranks) confirms only its final
choice. This model reads the same :class:`~.job.SimJob` the simulator runs,
so groups, servers, batches and the slowdown mean the same in both, and
follows the engine's step rule by rule (pure logic, no SimGrid):

* **A group's step** (:func:`group_step_seconds`): each member computes its
  batch (``SimJob.compute_seconds``; with ``--accumulate`` the buckets fill
  during the last pass) and reduces bucket after bucket as the reducer
  posts them: bucket ``b`` ends at ``max(ready_b, end_{b-1}) + latency +
  bytes_b / bandwidth + (2n-3) latency``, ``ready_b`` and ``end_{b-1}``
  the latest over the members (a ring moves once every member has the
  bucket), every bucket paying the ring's ``2(n-1)`` latencies; the step
  ends when the slowest member's last bucket does. With one bucket that is compute plus the closed-form ring
  ``2(n-1)(latency + bytes/(n bandwidth))`` exactly, as the simulator's
  own test checks. On a node of shared cores, compute that executes and
  the hops (memory copies, after the node's latency) share the cores: both
  stretch by ranks per core.
* **paced compute** (``--sample-ms``): the pacer's time, or the model's
  own compute (stretched on shared cores) where that is longer, then the
  share the pacer cannot hide (the first layer's backward, after the
  step's last sleep); the buckets filled at backward's end wait for it.
* **a worker's own work** (:func:`own_work_seconds`): sync, each worker's
  update of the model after the reduction; with servers, a leader's copies
  of the model (the gradient flattened, the reply's weights copied in, and
  in a group of several flattened again for the broadcast) and a member's
  copy of them into its model, added to the group's step.
* **hierarchical sync** (:func:`hierarchical_step_seconds`, sync with
  several groups): per bucket a chain reduce to each leader, the leaders'
  ring, a chain broadcast, stage after stage and bucket after bucket (the
  stages' contention on a leader's link is not modelled).
* **a slowdown schedule**: each phase's steady state (``SimJob.frozen_at``),
  walked until the run's steps or samples are done; the rate, the ideal
  and the cycles are time-averaged over that run.
* **sync**: samples of a step over the step.
* **hybrid, async**: a group's cycle is its step, the leader's exchange
  (push a shard to each server, the update, the reply; to a server it
  reaches by a flow, in the run's parts: a pipeline of those three stages,
  :func:`_push_seconds`) and the broadcast of the new weights (a pipelined
  chain). Every server serves every update
  (``server_update_s + master bytes / K x server_byte_s`` over its speed, or
  its link's time for its shard if longer), one at a time: when the groups'
  pushes come faster than the slowest server serves, every group waits the
  same ``w`` in its queue, the one that makes ``sum_g 1 / (cycle_g + w)``
  the service rate (first come, first served). With one server and tiny
  transfers this is the service-rate bound ``1 / update time`` exactly.
  When the server's link, not its update, is the bound and saturates, the
  leaders fall into a convoy (fair sharing ends their pushes together):
  see :func:`_convoy`.
  Below saturation a push waits as in a queue: the server's link shared
  fairly (processor sharing), its updates first come, first served
  (M/D/1's mean wait), the load found by a fixed point (the other groups'
  load: a push does not wait behind its own group's); a server on the
  node of a leader's shared cores copies its push in itself, part of its
  service (the leader copies the reply in). On a node of
  shared cores, the groups' core-seconds there per second (compute that
  executes, copies, server updates) may not exceed its cores: every group
  waits what keeps them within.
* **validation**: rank 0 validates every ``--eval-every`` updates
  (``SimJob.validation_s``, with servers after pulling the weights, one
  server's part after another). In sync the whole step waits for it:
  ``validation / eval_every`` more per step. Otherwise rank 0's group
  spends the share ``f = updates per second x validation / eval_every`` of
  its time validating, so its cycle is ``cycle / (1 - f)``, and the updates
  per second include that cycle (a fixed point).

* **the end of a hybrid or async run** of ``target_samples`` (dynamic
  shares, ``SimJob.claim_ahead``): when the last samples are claimed every
  group holds ``claim_ahead`` batches, the chunks its loader drew ahead
  (``windows_ahead``) and half the one it computes; the samples before then
  go at the steady rate, and the run ends when the slowest group has
  computed what it holds. (The simulator also draws each epoch apart.)

Not modelled (the simulator's business): contention between groups on a
shared link, between hierarchical stages on a leader's link, ``--overlap``,
the staleness bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .job import PULL_COPIES, SimJob
from .routes import link_between, up_link

__all__ = [
    "Estimate",
    "estimate",
    "group_step_seconds",
    "hierarchical_step_seconds",
    "link_between",
    "own_work_seconds",
    "validation_seconds",
]


@dataclass(frozen=True)
class Estimate:
    """What the analytic model predicts for a job.

    Attributes:
        samples_per_sec: Predicted samples trained per second.
        ideal_samples_per_sec: The workers' compute-only rates summed.
        group_cycle_s: Seconds per update of each group (sync: the step).
        server_wait_s: Seconds each push waits in the servers' queue.
    """

    samples_per_sec: float
    ideal_samples_per_sec: float
    group_cycle_s: tuple[float, ...]
    server_wait_s: float = 0.0


# ------------------------------------------------------------------ routes
def _server_copy(job: SimJob, node: int) -> tuple[float, float]:
    """(bandwidth, latency) of a leader-server copy on a node of shared cores
    (its calibrated ``server_link``, else its copies)."""
    n = job.nodes[node]
    link = n.get("server_link")
    if link:
        return float(link["bandwidth"]), float(link["latency"])
    return float(n["memcpy_Bps"]), float(n["intra"]["latency"])


def _share(job: SimJob, node: int, ranks_on_node: dict[int, int]) -> float:
    """How much a node of shared cores stretches what executes on it."""
    n = job.nodes[node]
    if not n["shared"]:
        return 1.0
    if job.machine:  # (namespaces of one machine: every rank shares its cores)
        return max(1.0, len(job.workers) / int(job.machine["cores"]))
    return max(1.0, ranks_on_node.get(node, 0) / int(n["cores"]))


# ------------------------------------------------------------------- steps
def _node_counts(job: SimJob) -> dict[int, int]:
    counts: dict[int, int] = {}
    for w in job.workers:
        counts[w["node"]] = counts.get(w["node"], 0) + 1
    return counts


def _hops(
    job: SimJob, ranks: list[int], pairs: list[tuple[int, int]]
) -> list[tuple[float, float, bool]]:
    """(bandwidth, latency, is a copy) of each hop ``(i, j)`` (positions in
    ``ranks``), the flows that leave (enter) a node sharing its link, and all
    the flows between nodes sharing the core switch."""
    nodes = [job.workers[r]["node"] for r in ranks]
    leaving: dict[int, int] = {}
    entering: dict[int, int] = {}
    for i, j in pairs:
        a, b = nodes[i], nodes[j]
        if a != b:
            leaving[a] = leaving.get(a, 0) + 1
            entering[b] = entering.get(b, 0) + 1
    crossing = sum(leaving.values())
    cpu = _machine_byte_seconds(job, nodes, pairs, crossing)
    out = []
    for i, j in pairs:
        a, b = nodes[i], nodes[j]
        bw, lat, copy = link_between(job, a, b)
        if a != b:
            bw /= max(leaving.get(a, 1), entering.get(b, 1))
            if job.core is not None:  # every crossing shares the core switch
                bw = min(bw, float(job.core["bandwidth"]) / crossing)
        if cpu:  # (the machine's cores: copies too, so no stretch on top)
            bw, copy = min(bw, 1.0 / cpu), False
        out.append((bw, lat, copy))
    return out


def _machine_byte_seconds(
    job: SimJob, nodes: list[int], pairs: list[tuple[int, int]], crossing: int
) -> float:
    """On one machine's namespaces, the seconds per byte of each of the
    hops ``pairs`` moving at once on its cores: a hop between namespaces
    costs a core at each end (``1/kernel_Bps`` a byte each), one inside a
    namespace a copy; each work has at most one core (0: no machine)."""
    if not job.machine:
        return 0.0
    kernel = float(job.machine["kernel_Bps"])
    copies = [float(job.nodes[nodes[i]]["memcpy_Bps"]) for i, j in pairs
              if nodes[i] == nodes[j]]  # fmt: skip
    works = 2 * crossing + len(copies)
    total = 2 * crossing / kernel + sum(1.0 / c for c in copies)
    alone = max([1.0 / kernel] * (crossing > 0) + [1.0 / c for c in copies])
    return max(alone, total / min(works, int(job.machine["cores"])) if works else 0.0)


def _compute_and_ready(
    job: SimJob, rank: int, counts: dict[int, int]
) -> tuple[float, list[float]]:
    """A rank's step compute (stretched on shared cores) and when backward
    fills each bucket (during the last of ``--accumulate``'s passes).

    Paced (``sleep_compute``): the pacer's time, or the model's own compute
    if that is longer, then the part the pacer cannot hide, which the
    buckets filled at backward's very end wait for (as the engine's)."""
    w = job.workers[rank]
    stretch = _share(job, w["node"], counts)
    compute = job.compute_seconds(rank, w["batch"])
    tail = hidden = 0.0
    if job.sleep_compute:
        executed = _on_host(job, rank, job.executed_amount(rank, w["batch"])) * stretch
        tail = executed * w["paced_tail"]
        hidden = executed - tail
    else:
        compute *= stretch
    backward = compute / max(1, job.accumulate) * (1 - job.forward_share)
    start = compute - backward
    ready = [
        max(hidden, start + backward * r) + (tail if r >= 1.0 else 0.0)
        for r, _ in job.buckets
    ]
    return max(compute, hidden) + tail, ready


def _on_host(job: SimJob, rank: int, amount: float) -> float:
    """Seconds of ``amount`` (seconds at speed 1) on ``rank``'s host, uncontended."""
    return amount / float(job.nodes[job.workers[rank]["node"]]["speed"])


def own_work_seconds(job: SimJob, group: list[int]) -> float:
    """A group's own work per update besides compute and communication
    (stretched on shared cores): every worker's gradient zeroed and
    checked; sync, every worker's update of the model;
    with servers, the leader's copies (the gradient flattened, the reply's
    weights copied in and, in a group of several, flattened again for the
    broadcast) and then a member's copy of them into its model."""
    counts = _node_counts(job)

    def seconds(rank: int, key: str) -> float:
        stretch = _share(job, job.workers[rank]["node"], counts)
        return _on_host(job, rank, job.workers[rank][key]) * stretch

    if _pipeline(job, group) is not None:
        return 0.0  # (a pipeline's stages: not modelled)
    grads = max(seconds(r, "grad_s") for r in group)
    if job.mode == "sync" or not job.servers:
        return grads + max(seconds(r, "update_s") for r in group)
    leader = seconds(group[0], "copy_s")
    if len(group) == 1:
        return grads + 2 * leader
    return grads + 3 * leader + max(seconds(r, "copy_s") for r in group[1:])


def group_step_seconds(job: SimJob, group: list[int]) -> float:
    """Seconds of one step of ``group`` (one ring all-reduce in the group:
    sync with one group, hybrid, async): compute, each bucket's ring
    all-reduce one after another as backward fills them (see the module)."""
    spec = _pipeline(job, group)
    if spec is not None:  # the schedule's exact time (.pipelines)
        return job.pipeline_step_seconds(job.groups.index(group))
    counts = _node_counts(job)
    n = len(group)
    if n == 1:
        return _compute_and_ready(job, group[0], counts)[0]
    hops = _hops(job, group, [(i, (i + 1) % n) for i in range(n)])
    rest = (2 * n - 3) * max(lat for _, lat, _ in hops)
    per_link = 2 * (n - 1) / n * job.grad_bytes
    steps = [_compute_and_ready(job, r, counts) for r in group]
    stretch = [_share(job, job.workers[r]["node"], counts) for r in group]
    # a bucket's ring moves once every rank has it and is through the one
    # before (each phase needs its neighbour's data), then each rank's hop
    ends = [0.0] * n
    for b, (_ready, share) in enumerate(job.buckets):
        start = max(
            max(ready[b], end) for (_, ready), end in zip(steps, ends, strict=True)
        )
        ends = [
            start + lat + per_link * share / bw * (s if copy else 1.0) + rest
            for (bw, lat, copy), s in zip(hops, stretch, strict=True)
        ]
    slowest = 0.0
    for (compute, _), end, (bw, lat, copy), s in zip(
        steps, ends, hops, stretch, strict=True
    ):
        if copy:  # copies run on the cores compute uses: after it, at the least
            end = max(end, compute + len(job.buckets) * (lat + rest)
                      + per_link / bw * s)  # fmt: skip
        slowest = max(slowest, end)
    return slowest


def _bucket_chain(
    job: SimJob,
    ready: list[float],
    hop: tuple[float, float, bool],
    per_link: float,
    rest: float,
    stretch: float = 1.0,
    after: list[float] | None = None,
) -> float:
    """When a rank's last bucket is through one collective stage, one bucket
    after another: bucket ``b`` starts when filled (``ready[b]``), when its
    previous stage is done (``after[b]``) and when bucket ``b-1`` is through,
    then pays its hop's latency, its bytes and the stage's ``rest`` latencies."""
    bw, lat, copy = hop
    t = 0.0
    for b, (_ready, share) in enumerate(job.buckets):
        start = max(ready[b], t, after[b] if after else 0.0)
        t = start + lat + per_link * share / bw * (stretch if copy else 1.0) + rest
    return t


def hierarchical_step_seconds(job: SimJob) -> float:
    """Seconds of one step of hierarchical sync (``SyncOptimizer`` with
    several groups), bucket by bucket through three pipelined stages: a
    chain reduce to each group's leader, a ring all-reduce across the
    leaders, a chain broadcast in each group (see the module)."""
    counts = _node_counts(job)
    nb = len(job.buckets)
    shares = [share for _, share in job.buckets]
    to_cross: list[list[float]] = []
    for g in job.groups:
        n = len(g)
        ready = [_compute_and_ready(job, r, counts)[1] for r in g]
        if n == 1:
            to_cross.append(ready[0])
            continue
        hops = _hops(job, g, [(i, i - 1) for i in range(1, n)])
        rest = (n - 2) * max(lat for _, lat, _ in hops) if n > 2 else 0.0
        barrier, arrive, out = 0.0, [0.0] * n, []
        for b in range(nb):
            # every member's reduce actor arrives after its hop; the leader's
            # after its previous bucket's chain latencies
            times = [max(ready[0][b], arrive[0])]
            for i in range(1, n):
                bw, lat, copy = hops[i - 1]
                stretch = _share(job, job.workers[g[i]]["node"], counts) if copy else 1
                times.append(
                    max(ready[i][b], arrive[i]) + lat
                    + job.grad_bytes * shares[b] / bw * stretch
                )  # fmt: skip
            barrier = max(times)
            arrive = [barrier + rest] + [barrier] * (n - 1)
            out.append(barrier + rest)
        to_cross.append(out)
    leaders = [g[0] for g in job.groups]
    count = len(leaders)
    hops = _hops(job, leaders, [(i, (i + 1) % count) for i in range(count)])
    rest = (2 * count - 3) * max(lat for _, lat, _ in hops)
    per_link = 2 * (count - 1) / count * job.grad_bytes
    crossed, done = [], 0.0
    for b in range(nb):
        ends = []
        for i in range(count):
            bw, lat, _ = hops[i]
            start = max(to_cross[i][b], done)
            ends.append(start + lat + per_link * shares[b] / bw + rest)
        done = max(ends)
        crossed.append(done)
    step = 0.0
    for g in job.groups:
        n = len(g)
        if n == 1:
            step = max(step, crossed[-1])
            continue
        hops = _hops(job, g, [(i, i + 1) for i in range(n - 1)])
        rest = (n - 2) * max(lat for _, lat, _ in hops) if n > 2 else 0.0
        end = 0.0
        for b in range(nb):
            start = max(crossed[b], end + rest if b else 0.0)
            end = start + max(
                lat + job.grad_bytes * shares[b] / bw for bw, lat, _ in hops
            )
        step = max(step, end + rest)
    return step


def _broadcast_seconds(job: SimJob, group: list[int]) -> float:
    """The new weights down the group's chain (one flow per link, pipelined)."""
    n = len(group)
    if n < 2 or _pipeline(job, group) is not None:
        return 0.0  # (a pipeline's stages each take back their own part)
    worst, max_latency = 0.0, 0.0
    for i in range(n - 1):
        a, b = job.workers[group[i]]["node"], job.workers[group[i + 1]]["node"]
        bw, lat, _ = link_between(job, a, b)
        worst = max(worst, lat + job.grad_bytes / bw)
        max_latency = max(max_latency, lat)
    return worst + max(0, n - 2) * max_latency


def _server_seconds(job: SimJob) -> tuple[list[float], list[float]]:
    """Per server: its update's seconds, and its seconds of link time per
    update (its shard in over its node's link, shared by the node's servers,
    or the whole push across the core switch, if that is longer)."""
    k = len(job.servers)
    on_node: dict[int, int] = {}
    for s in job.servers:
        on_node[s["node"]] = on_node.get(s["node"], 0) + 1
    update, link = [], []
    for s in job.servers:
        node = job.nodes[s["node"]]
        seconds = job.server_update_s + job.master_bytes / k * job.server_byte_s
        update.append(seconds / float(s["speed"]))
        shard = job.grad_bytes / k
        if node["shared"]:
            bw = float(job.inter["bandwidth"]) / on_node[s["node"]]
        else:
            bw = min(
                float(node["intra"]["bandwidth"]),
                float(job.inter["bandwidth"]) / on_node[s["node"]],
            )
        seconds = shard / bw
        if job.core is not None:
            # every shard of a push crosses the core switch with the others
            # (the replies' share of it is left out)
            seconds = max(seconds, job.grad_bytes / float(job.core["bandwidth"]))
        link.append(seconds)
    return update, link


def _exchange_seconds(
    job: SimJob,
    group: list[int],
    update: list[float],
    link: list[float],
    link_busy: list[float],
    cpu_busy: list[float],
    nic_busy: float = 0.0,
) -> float:
    """The leader's push of a shard to every server, the update, the reply
    (a pipelined group: every stage's push of its part's shards, at once;
    the slowest stage's exchange).

    A server's link is shared fairly by the transfers on it (processor
    sharing: a transfer takes ``t / (1 - busy)``); its updates run one at a
    time (first come, first served: a push waits ``busy x u / (2 (1 - busy))``
    for the updates before it, M/D/1's mean), ``busy`` being the share of
    time the link or the server is in use.
    """
    # (a pipelined group's stages exchange their parts whole)
    parts = 1 if _pipeline(job, group) else job.exchange_parts()
    return max(
        _push_seconds(
            job, node, nbytes, update, link, link_busy, cpu_busy, nic_busy, parts
        )
        for node, nbytes in _senders(job, group)
    )


def _pipeline(job: SimJob, group: list[int]) -> dict | None:
    """``group``'s pipeline, if any (no search of the groups in a job
    without pipelines: these rules run per group in the fixed points)."""
    return job.pipeline_of(job.groups.index(group)) if job.pipelines else None


def _senders(job: SimJob, group: list[int]) -> list[tuple[int, float]]:
    """(node, bytes) of each rank of ``group`` that pushes to the servers:
    the leader with the whole gradient, or every stage of a pipeline with
    its part."""
    spec = _pipeline(job, group)
    if spec is None:
        return [(job.workers[group[0]]["node"], job.grad_bytes)]
    return [
        (job.workers[r]["node"], part)
        for r, part in zip(spec["ranks"], spec["parts"], strict=True)
    ]


def _push_seconds(
    job: SimJob,
    leader: int,
    nbytes: float,
    update: list[float],
    link: list[float],
    link_busy: list[float],
    cpu_busy: list[float],
    nic_busy: float,
    parts: int = 1,
) -> float:
    """One sender's exchange (see :func:`_exchange_seconds`) of ``nbytes``
    from node ``leader``; in ``parts`` to a server it reaches by a flow.

    In parts, push, update and reply are a pipeline of three stages over
    them: the first part goes through all three, then each later part adds
    the slowest stage's share, ``push + update + reply`` over ``parts`` plus
    ``(parts - 1) x`` the largest; while the push and the reply overlap they
    share the core switch, so a part's stage is at least both directions'
    bytes over the core."""
    k = len(job.servers)
    shard = nbytes / k
    worst = 0.0
    off_node = sum(1 for s in job.servers if s["node"] != leader)
    for s, seconds, on_link, lb, cb in zip(
        job.servers, update, link, link_busy, cpu_busy, strict=True
    ):
        bw, lat, copy = link_between(job, leader, s["node"])
        if copy:
            bw, lat = _server_copy(job, leader)
        if s["node"] != leader:
            bw /= max(1, off_node)  # the leader's pushes share its uplink
            transfer = max(shard / bw / (1 - nic_busy), on_link / (1 - lb))
        else:
            transfer = shard / bw
        wait = cb * seconds / (2 * (1 - cb))
        if copy or parts == 1:
            worst = max(worst, 2 * (lat + transfer) + seconds + wait)
            continue
        stage = max(transfer, seconds)
        if job.core is not None and s["node"] != leader:
            stage = max(stage, 2 * nbytes / float(job.core["bandwidth"]))
        piped = (2 * transfer + seconds + (parts - 1) * stage) / parts
        worst = max(worst, 2 * lat + piped + wait)
    return worst


BUSY_CAP = 0.95
"""The highest share of time a server or its link counts as busy below
saturation (the waits grow without bound as it nears 1)."""


def estimate(job: SimJob) -> Estimate:
    """The analytic prediction for ``job`` (see the module): with a slowdown
    schedule, each phase at its own level, time-averaged over the run."""
    starts = job.phase_starts()
    if len(starts) == 1:
        return _with_tail(job, _steady(job))
    phases = [_steady(job.frozen_at(t)) for t in starts]
    # walk the phases until the run's updates (or samples) are done
    want_updates = job.steps
    want_samples = job.target_samples
    updates = samples = elapsed = 0.0
    weighted = [0.0] * len(job.groups)
    for i, (start, phase) in enumerate(zip(starts, phases, strict=True)):
        per_second = _updates_per_sec(job, phase)
        end = starts[i + 1] if i + 1 < len(starts) else math.inf
        span = end - start
        left = []
        if want_updates is not None and per_second > 0:
            left.append((want_updates - updates) / per_second)
        if want_samples is not None and phase.samples_per_sec > 0:
            left.append((want_samples - samples) / phase.samples_per_sec)
        span = min([span, *left]) if left else span
        if not math.isfinite(span):  # no target: the last phase's level
            span = 0.0 if elapsed > 0 else 1.0
        updates += per_second * span
        samples += phase.samples_per_sec * span
        weighted = [
            w + c * span for w, c in zip(weighted, phase.group_cycle_s, strict=True)
        ]
        elapsed += span
        if left and span == min(left):
            break
    if elapsed <= 0:
        return _with_tail(job, phases[0])
    return _with_tail(
        job,
        Estimate(
            samples / elapsed,
            job.ideal_samples_per_sec(elapsed),
            tuple(w / elapsed for w in weighted),
            server_wait_s=phases[-1].server_wait_s,
        ),
    )


def _with_tail(job: SimJob, est: Estimate) -> Estimate:
    """The end of a hybrid or async run of ``target_samples`` (see the
    module): once the pool of samples is claimed, every group still holds
    ``claim_ahead`` batches, its ``windows_ahead`` chunks drawn ahead and
    half the one it computes, and the run ends when the slowest has
    computed them (the epochs' boundaries, where a slow worker's draws are
    fewer, are the simulator's)."""
    if (
        job.mode == "sync"
        or not job.target_samples
        or not job.claim_ahead
        or est.samples_per_sec <= 0
    ):
        return est
    batch = sum(w["batch"] for w in job.workers) / len(job.workers)
    windows = job.windows_ahead * (job.chunk_samples or batch) / batch
    left = job.claim_ahead + windows + 0.5  # steps each group has to go
    held = left * sum(w["batch"] for w in job.workers)
    claimed = max(0.0, job.target_samples - held) / est.samples_per_sec
    end = claimed + left * max(est.group_cycle_s)
    end = max(end, job.target_samples / est.samples_per_sec)
    return Estimate(
        job.target_samples / end,
        est.ideal_samples_per_sec,
        est.group_cycle_s,
        server_wait_s=est.server_wait_s,
    )


def _updates_per_sec(job: SimJob, phase: Estimate) -> float:
    """Updates per second at ``phase``'s level (sync: steps; else versions)."""
    if job.mode == "sync" or not job.servers:
        return 1.0 / max(phase.group_cycle_s)
    return sum(1.0 / c for c in phase.group_cycle_s)


def validation_seconds(job: SimJob) -> float:
    """One of rank 0's validations: the pull of the weights (with servers,
    each server's part after another, then rank 0's copies of the model
    around it: :data:`~.job.PULL_COPIES`) and the evaluation
    itself (stretched on shared cores); the pull's wait in the servers'
    queue is :func:`_with_validation`'s."""
    mine = job.workers[0]["node"]
    stretch = _share(job, mine, _node_counts(job))
    seconds = job.validation_s * stretch
    if job.validation_pull and job.servers:
        copy = _on_host(job, 0, job.workers[0]["copy_s"])
        # rank 0's copies around the pull, and each server's of its part
        # to reply from (one after another, as the parts arrive)
        seconds += (PULL_COPIES * stretch + 1) * copy
        part = job.master_bytes / len(job.servers)
        for server in job.servers:
            if server["node"] == mine and job.nodes[mine]["shared"]:
                bw, lat = _server_copy(job, mine)
            else:
                bw, lat, _ = link_between(job, server["node"], mine)
            seconds += lat + part / bw
    return seconds


def _with_validation(job: SimJob, trained: Estimate) -> Estimate:
    """``trained`` (the steady state without validation) with rank 0's
    validations every ``eval_every`` updates (see the module)."""
    if not job.eval_every or job.validation_s <= 0:
        return trained
    each = validation_seconds(job)
    if job.validation_pull and job.servers:
        each += trained.server_wait_s  # the pull queues as a push does
    each /= job.eval_every  # per update
    samples = [sum(job.workers[r]["batch"] for r in g) for g in job.groups]
    cycles = trained.group_cycle_s
    if job.mode == "sync" or not job.servers:
        step = max(cycles) + each  # every group waits for rank 0
        total = trained.samples_per_sec * max(cycles)  # samples of a step
        return Estimate(
            total / step,
            trained.ideal_samples_per_sec,
            tuple(step for _ in cycles),
            trained.server_wait_s,
        )
    mine = next(i for i, g in enumerate(job.groups) if 0 in g)
    slowed = list(cycles)
    for _ in range(100):  # f grows with the updates per second it lowers
        per_second = sum(1.0 / c for c in slowed)
        share = min(0.95, per_second * each)
        new = cycles[mine] / (1.0 - share)
        if abs(new - slowed[mine]) <= 1e-12 * new:
            break
        slowed[mine] = new
    rate = sum(s / c for s, c in zip(samples, slowed, strict=True))
    return Estimate(
        rate, trained.ideal_samples_per_sec, tuple(slowed), trained.server_wait_s
    )


def _steady(job: SimJob) -> Estimate:
    """The prediction at one slowdown level held throughout, validations included."""
    return _with_validation(job, _steady_training(job))


def _steady_training(job: SimJob) -> Estimate:
    """The prediction at one slowdown level held throughout (no validation)."""
    ideal = job.ideal_samples_per_sec()
    samples = [sum(job.workers[r]["batch"] for r in g) for g in job.groups]
    if job.hierarchical:
        step = hierarchical_step_seconds(job) + max(
            own_work_seconds(job, g) for g in job.groups
        )
        total = sum(samples)
        return Estimate(total / step, ideal, tuple(step for _ in job.groups))
    steps = [group_step_seconds(job, g) + own_work_seconds(job, g) for g in job.groups]
    if job.mode == "sync" or not job.servers:
        rate = sum(s / t for s, t in zip(samples, steps, strict=True) if t > 0)
        return Estimate(rate, ideal, tuple(steps))
    update, link = _server_seconds(job)
    rest = [
        step + _broadcast_seconds(job, g)
        for g, step in zip(job.groups, steps, strict=True)
    ]
    idle = [0.0] * len(job.servers)

    # each leader's pushes leave its node by the node's link: the seconds
    # they hold it per update (0 when every server is on the leader's node)
    leader_node = [job.workers[g[0]]["node"] for g in job.groups]
    # (a pipelined group's leader sends its own part only)
    sent = [_senders(job, g)[0][1] for g in job.groups]
    nic = [
        nbytes
        * sum(1 for s in job.servers if s["node"] != n)
        / len(job.servers)
        / up_link(job, n)[0]
        for n, nbytes in zip(leader_node, sent, strict=True)
    ]

    # a server copies its reply itself to a leader on its node of shared
    # cores before it serves the next push: that copy is part of its service
    busy = [
        u + _server_copy_seconds(job, s)
        for s, u in zip(job.servers, update, strict=True)
    ]

    def cycles_at(
        link_busy: list[float], cpu_busy: list[float], per_group: list[float]
    ) -> list[float]:
        out = []
        for i, (g, r) in enumerate(zip(job.groups, rest, strict=True)):
            others = sum(  # the other leaders' pushes on this node's link
                nic[j] * per_group[j]
                for j in range(len(job.groups))
                if j != i and leader_node[j] == leader_node[i]
            )
            # (a push waits behind the other groups' pushes, not its own)
            own = per_group[i]
            links = [
                max(0.0, b - lk * own) for b, lk in zip(link_busy, link, strict=True)
            ]
            cpus = [max(0.0, b - u * own) for b, u in zip(cpu_busy, busy, strict=True)]
            out.append(
                r
                + _exchange_seconds(
                    job, g, update, link, links, cpus, min(BUSY_CAP, others)
                )
            )
        return out

    cycles = cycles_at(idle, idle, [0.0] * len(job.groups))
    service = max(max(u, lk) for u, lk in zip(busy, link, strict=True))
    if sum(1.0 / c for c in cycles) < 1.0 / service:
        # below saturation: the queues' waits, to a fixed point (waits lengthen
        # the cycles, which lowers the load: damped iteration converges)
        for _ in range(200):
            per_second = sum(1.0 / c for c in cycles)
            link_busy = [min(BUSY_CAP, lk * per_second) for lk in link]
            cpu_busy = [min(BUSY_CAP, u * per_second) for u in busy]
            new = cycles_at(link_busy, cpu_busy, [1.0 / c for c in cycles])
            done = max(abs(a - b) / b for a, b in zip(new, cycles, strict=True))
            cycles = [(a + b) / 2 for a, b in zip(new, cycles, strict=True)]
            if done < 1e-9:
                break
    wait = _queue_wait(cycles, service)
    wait = max(wait, _cores_wait(job, cycles, update))
    final = [c + wait for c in cycles]
    link_bound = max(link)
    if link_bound > max(busy) and sum(1.0 / c for c in cycles) > 1.0 / link_bound:
        final = [
            max(f, c) for f, c in zip(final, _convoy(cycles, link_bound), strict=True)
        ]
    rate = sum(s / c for s, c in zip(samples, final, strict=True))
    mean_wait = sum(f - c for f, c in zip(final, cycles, strict=True)) / len(cycles)
    return Estimate(rate, ideal, tuple(final), server_wait_s=mean_wait)


def _convoy(cycles: list[float], link: float) -> list[float]:
    """The groups' cycles when a server's link is saturated and is the
    server's bound (``link`` seconds of it per update, more than an update).

    The link is shared fairly, so concurrent pushes end together and the
    leaders fall into a convoy: a round is the link carrying every group's
    push back to back, then idle while the server updates, the replies
    travel and the leaders compute, until the quickest leader pushes again
    (its cycle less its push). A group slower than the round pushes once
    per its own cycle: ``P = link x sum_g min(1, P / c_g) + min_g(c_g - link)``.
    """
    gap = max(0.0, min(c - link for c in cycles))
    period = link * len(cycles) + gap
    for _ in range(100):  # decreasing to its fixed point
        new = link * sum(min(1.0, period / c) for c in cycles) + gap
        if abs(new - period) <= 1e-12 * period:
            break
        period = new
    return [max(c, period) for c in cycles]


def _server_copy_seconds(job: SimJob, server: dict) -> float:
    """A server's mean seconds copying in the pushes of leaders on its own
    node of shared cores, per update (groups equally weighted): the
    receiver of a large message on shared memory copies it (a leader
    copies its reply in the same way, on its own time)."""
    node = job.nodes[server["node"]]
    if not node["shared"]:
        return 0.0
    local = sum(1 for g in job.groups if job.workers[g[0]]["node"] == server["node"])
    shard = job.grad_bytes / len(job.servers)
    bw, lat = _server_copy(job, server["node"])
    return local / len(job.groups) * (lat + shard / bw)


MACHINE = -1
""":func:`_core_work`'s key for the machine whose namespaces the nodes are."""


def _core_work(job: SimJob, update: list[float]) -> dict[int, list[float]]:
    """Per node of shared cores: each group's core-seconds there per update
    (compute that executes, ring and broadcast hops as copies, the leader's
    pushes and replies to servers on the node as copies, the servers' updates).
    On one machine's namespaces (``job.machine``) the nodes' work is the
    machine's (key :data:`MACHINE`), with the kernel's at both ends of each
    message between nodes: ring and broadcast hops, pushes and replies."""
    work = _node_work(job, update)
    if not job.machine:
        return work
    kernel = 2.0 / float(job.machine["kernel_Bps"])  # core-seconds per byte
    k = len(job.servers)
    pooled = [sum(per[i] for per in work.values()) for i in range(len(job.groups))]
    for index, g in enumerate(job.groups):
        size = len(g)
        if job.pipeline_of(index) is None and size > 1:
            for i, r in enumerate(g):
                if job.workers[r]["node"] == job.workers[g[(i + 1) % size]]["node"]:
                    continue
                pooled[index] += kernel * 2 * (size - 1) / size * job.grad_bytes
                pooled[index] += kernel * job.grad_bytes if i < size - 1 else 0.0
        for node, nbytes in _senders(job, g):
            away = sum(1 for s in job.servers if s["node"] != node)
            pooled[index] += kernel * 2 * nbytes / k * away  # push and reply
    return {MACHINE: pooled}


def _node_work(job: SimJob, update: list[float]) -> dict[int, list[float]]:
    """:func:`_core_work` node by node (no kernel work)."""
    work: dict[int, list[float]] = {}
    k = len(job.servers)
    for n, node in enumerate(job.nodes):
        if not node["shared"]:
            continue
        copy = float(node["memcpy_Bps"])
        per_group = []
        for index, g in enumerate(job.groups):
            size = len(g)
            seconds = 0.0
            spec = job.pipeline_of(index)
            for i, r in enumerate(g):
                if job.workers[r]["node"] != n:
                    continue
                if spec is not None:  # a stage: its share; no ring, no broadcast
                    if not job.sleep_compute:
                        seconds += spec["shares"][i] * job.compute_seconds(
                            r, job.workers[g[0]]["batch"]
                        )
                    continue
                # the model's own compute (paced or not) and the copies
                seconds += _on_host(
                    job, r, job.executed_amount(r, job.workers[r]["batch"])
                )
                copies = (2 + (size > 1)) if i == 0 else 1
                seconds += copies * _on_host(job, r, job.workers[r]["copy_s"])
                seconds += _on_host(job, r, job.workers[r]["grad_s"])
                nxt = job.workers[g[(i + 1) % size]]["node"]
                if size > 1 and nxt == n:  # ring hop and broadcast hop, copied
                    seconds += 2 * (size - 1) / size * job.grad_bytes / copy
                    seconds += job.grad_bytes / copy if i < size - 1 else 0.0
            senders = _senders(job, g)
            for s, u in zip(job.servers, update, strict=True):
                if s["node"] == n:
                    seconds += u
                    for node, nbytes in senders:
                        if node == n:  # push and reply of the shard, copied
                            seconds += 2 * nbytes / k / _server_copy(job, n)[0]
            per_group.append(seconds)
        work[n] = per_group
    return work


def _cores_wait(job: SimJob, cycles: list[float], update: list[float]) -> float:
    """The wait that keeps each node of shared cores within its cores: the
    groups' core-seconds per second there at most ``cores`` (0 if they fit)."""
    worst = 0.0
    for n, per_group in _core_work(job, update).items():
        cores = float(job.machine["cores"] if n == MACHINE else job.nodes[n]["cores"])
        if sum(w / c for w, c in zip(per_group, cycles, strict=True)) <= cores:
            continue
        low, high = 0.0, sum(per_group) / cores
        for _ in range(100):  # bisection: the demand falls as the wait grows
            mid = (low + high) / 2
            if (
                sum(w / (c + mid) for w, c in zip(per_group, cycles, strict=True))
                > cores
            ):
                low = mid
            else:
                high = mid
            if high - low <= 1e-12 * max(1.0, high):
                break
        worst = max(worst, high)
    return worst


def _queue_wait(cycles: list[float], service: float) -> float:
    """The wait ``w >= 0`` with ``sum 1/(c + w) = 1/service`` (0 below saturation)."""
    if service <= 0 or sum(1.0 / c for c in cycles) <= 1.0 / service:
        return 0.0
    low, high = 0.0, len(cycles) * service
    for _ in range(100):  # bisection: the sum falls as w grows
        mid = (low + high) / 2
        if sum(1.0 / (c + mid) for c in cycles) > 1.0 / service:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * max(1.0, high):
            break
    return high if math.isfinite(high) else 0.0
