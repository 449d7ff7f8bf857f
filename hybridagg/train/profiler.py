"""``hybridagg profile``: measure what a model needs here, for ``hybridagg simulate``.

The measurements (:mod:`.profiling` runs them: rank 0 in a declared solo
phase, then every rank for the all-reduce), written as a
:class:`hybridagg.sim.profile.Profile`:

* compute: the model's forward and backward on a batch of zeros (training
  mode) on the device ``--device`` names (:func:`compute_device`; CUDA is
  synchronised before each reading of the clock, since kernels return
  before they finish), forward under ``--amp``'s autocast as in a run
  (:class:`~hybridagg.train.precision.Precision`), the median of ``reps``
  timed passes after a warm-up, per sample;
  each layer's share by its own floating-point operations
  (:func:`hybridagg.train.pacing.module_costs`, the pacer's rule: a layer's
  backward costs twice its forward), so the per-layer seconds are the
  measured totals apportioned by FLOPs, not timed one by one;
* buckets: the reducer's gradient buckets
  (:func:`hybridagg.reduce.buckets.assign_buckets`) and when backward fills
  each, by the pacer's rule (a module's parameters get their gradients once
  the backward shares of it and of every later module are spent);
* memory: parameter bytes, and activation bytes per sample (every module's
  output on that batch, summed, over the batch);
* a server's update: :class:`hybridagg.ps.store.ShardStore` stepping the
  run's optimizer (built by the run's factory,
  :func:`~hybridagg.train.common.make_optimizer`, and handed over as a run's
  leader hands it to its servers, :func:`hybridagg.ps.spec.server_specs`)
  over shards of several sizes on the CPU, fitted to
  ``seconds = per_update + bytes x per_byte`` (least squares);
* one core's memory-copy bandwidth (``torch`` copy of 64 MiB, best of reps);
* a worker's own work per update (:func:`measure_worker_update`): zeroing
  the gradient and checking it is finite (every step), the run's optimizer
  step over the whole model (every sync worker's after the reduction), and
  one copy of the model into a
  flat buffer (a leader's flattened push, a reply's weights copied in);
* with a data file: one validation as ``hybridagg train`` runs it on rank 0
  every ``--eval-every`` updates (:class:`~hybridagg.train.evaluate.Evaluator`
  over the file's validation split, on the profiled device; median of
  reps), which a run's wall time and its samples per second include;
* with more than one rank (``mpiexec -n N hybridagg profile``): the group
  all-reduce (:class:`hybridagg.collectives.Collectives`, the slowest rank's
  time, median over reps) at several sizes, fitted to
  ``2(n-1)(latency + bytes/(n bandwidth))``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..devices import probe_plan, resolve_device_spec
from ..sim.profile import LayerCost, MachineInfo, Profile, ServerFit, UnitCost
from .common import make_optimizer
from .config import OptimOptions
from .pacing import module_costs

__all__ = [
    "ALLREDUCE_SIZES",
    "SERVER_SIZES",
    "bucket_schedule",
    "compute_device",
    "fit_line",
    "measure_allreduce",
    "measure_compute",
    "measure_memcpy",
    "measure_server",
    "measure_validation",
    "measure_worker_update",
    "pipeline_unit_costs",
    "profile_model",
]

SERVER_SIZES = (1 << 16, 1 << 20, 1 << 22)
"""Elements of the shards a server's update is timed on (256 KiB to 16 MiB)."""

ALLREDUCE_SIZES = (1 << 18, 1 << 22, 1 << 25)
"""Bytes the group all-reduce is timed at (256 KiB to 32 MiB)."""


def compute_device(spec: str, local_rank: int, cuda_count: int) -> tuple[str, bool]:
    """Where the compute is timed for ``--device spec``, and whether to synchronise (pure).

    The device as :func:`hybridagg.devices.resolve_device_spec` resolves it
    for a rank of a run; CUDA is synchronised before each reading of the
    clock (:func:`hybridagg.devices.probe_plan`'s rule, as the speed probe
    does).

    Raises:
        ValueError: A bad spelling, or ``cuda`` where this process sees no GPU.
    """
    device = resolve_device_spec(spec, local_rank, cuda_count)
    return device, probe_plan(device).synchronize


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` over ``points``; ``a`` and ``b`` clipped at 0.

    Raises:
        ValueError: Fewer than two distinct ``x``.
    """
    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points], dtype=float)
    if len(set(xs.tolist())) < 2:
        raise ValueError("a line needs measurements at two sizes at least")
    b, a = np.polyfit(xs, ys, 1)
    return max(float(a), 0.0), max(float(b), 0.0)


def _timed(fn, reps: int, sync=None) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after a warm-up; ``sync``
    (CUDA's) is called before each reading of the clock."""
    sync = sync or (lambda: None)
    fn()  # warm-up: allocations, lazy initialisation, CUDA's kernels loaded
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_compute(
    model: nn.Module,
    sample_shape: tuple[int, ...],
    batch: int,
    reps: int,
    *,
    device: str = "cpu",
    synchronize: bool = False,
    amp: str = "none",
) -> dict[str, Any]:
    """Forward and backward seconds per sample, layers, activation bytes.

    Args:
        model: The model (moved to ``device``).
        sample_shape: One sample's shape.
        batch: Samples per timed pass.
        reps: Timed passes (the median is kept).
        device: Where to time it (:func:`compute_device`).
        synchronize: Synchronise CUDA before each reading of the clock.
        amp: ``--amp``: forward and loss under autocast in this precision.

    Raises:
        ValueError: ``amp`` fp16 on a device other than CUDA.
    """
    from .precision import Precision

    precision = Precision.for_run(amp, torch.device(device))
    model.to(device)
    x = torch.zeros((batch, *sample_shape), device=device)

    def sync() -> None:
        if synchronize:
            torch.cuda.synchronize(device)

    model.train()
    outputs: list[int] = []

    def hook(_module, _inputs, output) -> None:
        if isinstance(output, torch.Tensor):
            outputs.append(output.numel() * output.element_size())

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with precision.autocast():
            model(x)
    finally:
        for h in handles:
            h.remove()
    activation = sum(outputs) / batch

    def forward() -> None:
        with torch.no_grad(), precision.autocast():
            model(x)

    def both() -> None:
        # the gradients stay allocated, as a run's are (views into its
        # reduction buckets), and backward accumulates into them: a fresh
        # allocation each pass would time the kernel's page faults on a
        # large model; zeroing them is grad_s's (measure_worker_update)
        with precision.autocast():
            loss = model(x).float().sum()
        loss.backward()

    t_forward = _timed(forward, reps, sync)
    t_both = _timed(both, reps, sync)
    t_backward = max(t_both - t_forward, 0.0)
    costs = module_costs(model, x[:1])
    total = sum(costs.values())
    layers = [
        LayerCost(
            name=name or type(model).__name__,
            flops=flops,
            forward_s=t_forward / batch * flops / total,
            backward_s=t_backward / batch * flops / total,
        )
        for name, flops in costs.items()
    ]
    return {
        "buckets": bucket_schedule(model, costs),
        "forward_s_per_sample": t_forward / batch,
        "backward_s_per_sample": t_backward / batch,
        "activation_bytes_per_sample": float(activation),
        "layers": tuple(layers),
    }


def bucket_schedule(
    model: nn.Module, costs: dict[str, float], bucket_bytes: int | None = None
) -> tuple[tuple[float, float], ...]:
    """(share of backward done when full, share of the gradient's bytes) per bucket.

    Modules are taken in registration order as the order forward runs them
    (backward the other way round); a parameter is ready once the backward
    shares of its module and every later one are spent.
    """
    from ..reduce.buckets import DEFAULT_BUCKET_BYTES, assign_buckets

    total = sum(costs.values())
    names = [name for name, _ in model.named_modules()]
    later: dict[str, float] = {}
    acc = 0.0
    for name in reversed(names):
        acc += costs.get(name, 0.0)
        later[name] = acc
    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), name)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params or total <= 0:
        return ()
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    out = []
    for bucket in assign_buckets(params, bucket_bytes or DEFAULT_BUCKET_BYTES):
        ready = max(later[owner[id(params[i])]] / total for i in bucket)
        nbytes = sum(params[i].numel() * params[i].element_size() for i in bucket)
        out.append((min(ready, 1.0), nbytes / grad_bytes))
    out.sort()
    return tuple(out)


def measure_worker_update(
    model: nn.Module,
    cfg: OptimOptions,
    reps: int,
    *,
    synchronize: bool = False,
) -> tuple[float, float, float]:
    """A worker's own work per update on ``model``'s device (its gradients
    filled): ``(grad_s, update_s, copy_s)``.

    ``grad_s`` is zeroing the gradient and checking it is finite, what every
    worker does each step; ``update_s`` the run's optimizer step
    (:func:`~hybridagg.train.common.make_optimizer`), what every sync
    worker does after the reduction; ``copy_s`` is one copy of the whole
    model into a flat host buffer (the run's own ``flatten_into``), what a
    leader does to push a gradient and (the other way) to load a reply's
    weights. The model's weights are restored afterwards.

    Args:
        model: The model, its gradients filled (or zeros are made).
        cfg: The run's optimizer options.
        reps: Timed repetitions of each (the median is kept).
        synchronize: Synchronise CUDA before each reading of the clock.

    Returns:
        ``(grad_s, update_s, copy_s)`` in seconds.
    """
    from ..comm import alloc
    from ..comm.finite import all_finite
    from ..ps.flat import flatten_into

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return 0.0, 0.0, 0.0
    saved = [p.detach().clone() for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    # the host buffer a leader's push is flattened into (pinned for a GPU's
    # gradients, as the parameter-server client's is)
    on_gpu = grads[0].device.type == "cuda"
    flat = alloc(sum(g.numel() for g in grads), grads[0].dtype, pinned=on_gpu)
    optimizer = make_optimizer(cfg, model)

    def sync() -> None:
        if synchronize:
            torch.cuda.synchronize(grads[0].device)

    def bookkeeping() -> None:
        for g in grads:  # (a run zeroes its reduction buckets, views of these)
            g.zero_()
        all_finite(grads)

    def copy() -> None:
        flatten_into(flat, grads, like=params)

    try:
        update_s = _timed(optimizer.step, reps, sync)
        grad_s = _timed(bookkeeping, reps, sync)
        copy_s = _timed(copy, reps, sync)
    finally:
        with torch.no_grad():
            for p, w in zip(params, saved, strict=True):
                p.copy_(w)
                p.grad = None
    return grad_s, update_s, copy_s


def measure_memcpy(reps: int, nbytes: int = 64 << 20) -> float:
    """One core's copy bandwidth in bytes per second (best of ``reps``)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dst.copy_(src)
        best = min(_timed(lambda: dst.copy_(src), 1) for _ in range(max(1, reps)))
    finally:
        torch.set_num_threads(threads)
    return nbytes / best


def measure_server(
    cfg: OptimOptions, sizes: Sequence[int], reps: int
) -> tuple[float, float, list[tuple[float, float]], float]:
    """A server's seconds per update and per byte (shards of ``sizes``
    elements), the points, and its seconds per byte of a reply's momentum
    lookahead (``--lookahead``: the weights moved along the momentum).

    Returns:
        ``(per_update, per_byte, points, lookahead_per_byte)``: the update's
        line, the (bytes, seconds) it was fitted on, and the lookahead's
        slope (``0`` for an optimizer without momentum, up to noise).

    The optimizer is the run's (:func:`~hybridagg.train.common.make_optimizer`
    over a parameter of the shard's size), handed to the
    :class:`~hybridagg.ps.store.ShardStore` as a leader hands it to its
    servers (:func:`~hybridagg.ps.spec.server_specs`).
    """
    from ..ps.compensation import Compensation
    from ..ps.spec import server_specs
    from ..ps.store import ShardStore
    from ..runtime import envvars

    part_bytes = envvars.get_int("HYBRIDAGG_PS_PART_BYTES")
    points, ahead = [], []
    for numel in sizes:
        holder = nn.ParameterList([nn.Parameter(torch.zeros(numel))])
        optimizer = make_optimizer(cfg, holder)
        (spec,) = server_specs(
            list(holder.parameters()),
            optimizer,
            holder[0].detach(),
            None,
            [(0, numel)],
            compensation=Compensation(),
            staleness_bound=None,
            max_updates=None,
            part_elems=max(1, part_bytes // 4),
        )
        store = ShardStore(spec)
        store.grad.fill_(1e-3)

        def update(store=store) -> None:
            for part in range(len(store.parts)):
                store.apply(part, [cfg.lr], 1.0)

        points.append((float(numel * 4), _timed(update, reps)))
        # --lookahead: each reply's weights moved along the momentum
        # (the store's momentum exists once it has updated)
        replies = [store.flat[a:b].clone() for a, b in store.parts]

        def lookahead(store=store, replies=replies) -> None:
            for part, out in enumerate(replies):
                store.predict(part, out, [cfg.lr], 1.0)

        ahead.append((float(numel * 4), _timed(lookahead, reps)))
    per_update, per_byte = fit_line(points)
    return per_update, per_byte, points, fit_line(ahead)[1]


def measure_validation(
    model: nn.Module,
    data: str,
    reps: int,
    *,
    loss: str = "cross-entropy",
    device: str = "cpu",
    synchronize: bool = False,
) -> tuple[float, int]:
    """Seconds of one validation of ``model`` on ``data`` and the samples it saw.

    The run's own :class:`~hybridagg.train.evaluate.Evaluator` (its batches,
    its normalisation, its split), as rank 0 runs it every ``--eval-every``
    updates; median of ``reps`` after a warm-up.
    """
    from ..data.format import inspect_split, open_file
    from .config import DataOptions
    from .evaluate import Evaluator

    evaluator = Evaluator(
        DataOptions(data=data), model, torch.device(device), loss=loss
    )
    try:
        seconds = _timed(
            lambda: evaluator.evaluate(model),
            reps,
            (lambda: torch.cuda.synchronize(device)) if synchronize else None,
        )
    finally:
        evaluator.close()
    with open_file(data) as f:
        samples = inspect_split(f, evaluator.split, path=data).length
    return seconds, int(samples)


def measure_allreduce(
    comm, sizes: Sequence[int], reps: int
) -> tuple[float, float, list[tuple[float, float]]]:
    """Fitted latency and bandwidth of the group all-reduce over ``comm`` (collective)."""
    from ..collectives import Collectives

    coll = Collectives(comm)
    n = comm.size
    points = []
    for nbytes in sizes:
        buf = torch.ones(max(1, nbytes // 4))
        times = []
        coll.allreduce(buf)  # warm-up
        for _ in range(reps):
            comm.barrier(what="profile: all-reduce timing")
            start = time.perf_counter()
            coll.allreduce(buf)
            elapsed = time.perf_counter() - start
            times.append(max(comm.allgather(elapsed, what="profile: times")))
        points.append((float(buf.numel() * 4), statistics.median(times)))
    fixed, per_byte = fit_line(points)
    if per_byte <= 0:
        # noise hid the slope (a busy machine): all of the largest size's
        # time is taken as bandwidth, none as latency
        nbytes, seconds = max(points)
        fixed, per_byte = 0.0, seconds / nbytes
    latency = fixed / (2 * (n - 1))
    bandwidth = 2 * (n - 1) / (n * per_byte)
    return latency, bandwidth, points


def profile_model(
    model: nn.Module,
    name: str,
    sample_shape: tuple[int, ...],
    batch: int,
    cfg: OptimOptions,
    *,
    reps: int = 5,
    device: str = "cpu",
    synchronize: bool = False,
    amp: str = "none",
    server_sizes: Sequence[int] = SERVER_SIZES,
    data: str | None = None,
    loss: str = "cross-entropy",
) -> Profile:
    """Measure everything but the all-reduce (see the module), in this process.

    Args:
        model: The model (moved to ``device``).
        name: Its name, for the profile.
        sample_shape: One sample's shape.
        batch: Samples per timed pass.
        cfg: The optimizer the servers run.
        reps: Timed repetitions of each measurement.
        device: Where the compute is timed (:func:`compute_device`).
        synchronize: Synchronise CUDA before each reading of the clock.
        amp: ``--amp`` of the timed forward.
        server_sizes: Elements of the shards a server's update is timed on.
        data: The data file whose validation split a run validates on
            (``None``: validation is not measured).
        loss: ``--loss`` (validation's).

    Raises:
        ValueError: ``amp`` fp16 off CUDA.
    """
    measured = measure_compute(
        model,
        sample_shape,
        batch,
        reps,
        device=device,
        synchronize=synchronize,
        amp=amp,
    )
    per_update, per_byte, server_points, ahead = measure_server(cfg, server_sizes, reps)
    memcpy = measure_memcpy(reps)
    grad_s, update_s, copy_s = measure_worker_update(
        model, cfg, reps, synchronize=synchronize
    )
    validation_s, validation_samples = (
        measure_validation(
            model, data, reps, loss=loss, device=device, synchronize=synchronize
        )
        if data is not None
        else (0.0, 0)
    )
    params = sum(p.numel() for p in model.parameters())
    units, why_no_units = pipeline_unit_costs(model, sample_shape)
    return Profile(
        model=name,
        parameters=int(params),
        sample_shape=tuple(sample_shape),
        forward_s_per_sample=measured["forward_s_per_sample"],
        backward_s_per_sample=measured["backward_s_per_sample"],
        parameter_bytes=float(
            sum(p.numel() * p.element_size() for p in model.parameters())
        ),
        activation_bytes_per_sample=measured["activation_bytes_per_sample"],
        server=ServerFit(
            per_update, per_byte, tuple(server_points), lookahead_per_byte=ahead
        ),
        machine=MachineInfo(
            cores=len(os.sched_getaffinity(0)),
            memcpy_Bps=memcpy,
            device=device,
            amp=amp,
        ),
        layers=measured["layers"],
        buckets=measured["buckets"],
        batch=batch,
        validation_s=validation_s,
        validation_samples=validation_samples,
        units=units,
        grad_s=grad_s,
        update_s=update_s,
        copy_s=copy_s,
        notes={
            **({"units": why_no_units} if why_no_units else {}),
            "layers": "measured totals apportioned by each layer's FLOPs "
            "(backward twice forward)",
            "threads": torch.get_num_threads(),
            "optimizer": cfg.optimizer,  # the servers' times depend on it
            **_device_notes(device),
        },
    )


def pipeline_unit_costs(
    model: nn.Module, sample_shape: tuple[int, ...]
) -> tuple[tuple[UnitCost, ...], str]:
    """The model's pipeline units as a pipelined group of ``hybridagg train``
    cuts it (:func:`hybridagg.train.pipelined.plan_units`: the same units,
    costs and boundary sizes), or none and why the model cannot be pipelined."""
    from .pipelined.stages import plan_units

    try:
        plan = plan_units(model, tuple(sample_shape))
    except (ValueError, TypeError) as exc:  # (not Sequential, no pipeline_layers)
        return (), f"no pipeline units: {exc}"
    sizes = [*plan.sizes, 0.0]
    return (
        tuple(
            UnitCost(cost=float(c), parameters=int(n), output_bytes=float(b))
            for c, n, b in zip(plan.flops, plan.numels, sizes, strict=True)
        ),
        "",
    )


def _device_notes(device: str) -> dict[str, str]:
    """The GPU's name for a CUDA device (what ``device`` alone does not say)."""
    if device.startswith("cuda"):
        return {"gpu": torch.cuda.get_device_name(device)}
    return {}
