"""One rank's stage of a pipelined group, run over MPI point-to-point.

The ranks of a pipelined group hold consecutive stages of one model replica,
in rank order on the group's communicator. Stage 0 takes the batch; it cuts
it into micro-batches (sizes as ``torch.tensor_split``, so a batch that does
not divide evenly is served); each micro-batch's activation goes forward to
the next stage, and the gradient of that activation comes back, in the order
of :func:`~hybridagg.pipeline.schedule.schedule`. The last stage computes the
loss of each micro-batch weighted by its share of the batch, so the
micro-batches' gradients sum to the batch's mean gradient, as one pass over
the whole batch gives (up to rounding).

Sends are posted and not waited for (a stage goes on computing while its
output travels); a receive is posted when an action needs its input and
completed through the communicator's polled wait, so a stage waiting for a
slower neighbour sleeps instead of spinning a core, and a neighbour that
never sends ends in a timeout naming the stage and the micro-batch, not a
hang. Messages between two neighbours never overtake each other (MPI's
ordering on one communicator and tag), which is why each kind of message has
one tag.

Per batch, stage 0 broadcasts the batch's size and micro-batch count, and
sends the labels to the last stage. Per-sample activation shapes and dtypes
are agreed once, at construction, by passing one sample's worth through
the stages.

Emulated compute (:class:`StagePace`): a stage may stretch each forward and
backward to an emulated per-sample time, sleeping (not spinning) until the
deadline while testing its sends in flight. Emulated links (``links``): a
message from a neighbour over a link slower than this machine's memory
costs the receiver the link's time once it has arrived (the transfer starts
when both ends are ready and occupies the receiver: the cost model of
:mod:`.partition` and :mod:`.timing`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from ..comm import Comm
from .schedule import SCHEDULES, schedule
from .timing import micro_sizes

__all__ = [
    "PipelineStage",
    "StagePace",
    "StepTimes",
    "layer_costs",
    "model_layers",
    "split_layers",
]

_ACTIVATION, _GRADIENT, _LABELS = 31, 32, 33  # tags: one per kind of message
_PROGRESS_SLICE = 0.001  # seconds between tests of the sends while pacing


def model_layers(model: nn.Module) -> list[nn.Module]:
    """The model as a sequence of layers that pipeline stages can cut.

    An ``nn.Sequential`` is its children; any other model must say how it
    is cut, with a ``pipeline_layers()`` method returning modules that share
    its parameters and, applied in order, compute its forward.

    Raises:
        TypeError: The model is neither.
    """
    if isinstance(model, nn.Sequential):
        return list(model.children())
    layers = getattr(model, "pipeline_layers", None)
    if callable(layers):
        return list(layers())
    raise TypeError(
        f"a pipelined group needs an nn.Sequential model or one with a "
        f"pipeline_layers() method; {type(model).__name__} has neither"
    )


def layer_costs(model: nn.Module, costs: Mapping[str, float]) -> list[float]:
    """Per-module costs summed per pipeline layer (:func:`model_layers`).

    Args:
        model: The model.
        costs: A cost (seconds, floating-point operations) per module name
            of ``model.named_modules()``: a profile's per-layer seconds
            (:class:`hybridagg.sim.profile.LayerCost`) or
            :func:`hybridagg.train.pacing.module_costs`.

    Raises:
        ValueError: A named module is not in the model, or lies in no
            pipeline layer.
    """
    layers = model_layers(model)
    owner = {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}
    modules = dict(model.named_modules())
    out = [0.0] * len(layers)
    for name, cost in costs.items():
        if name not in modules:
            raise ValueError(
                f"layer costs name {name!r}, which the model does not have"
            )
        if id(modules[name]) not in owner:
            raise ValueError(
                f"module {name!r} lies in none of the model's pipeline layers"
            )
        out[owner[id(modules[name])]] += float(cost)
    return out


def split_layers(
    layers: Sequence[nn.Module], bounds: Sequence[int]
) -> list[nn.Sequential]:
    """Cut ``layers`` at ``bounds`` (``S + 1`` cut points) into ``S`` stages.

    Raises:
        ValueError: The bounds do not start at 0, end at ``len(layers)`` and
            increase strictly (every stage holds a layer).
    """
    b = list(bounds)
    if (
        len(b) < 2
        or b[0] != 0
        or b[-1] != len(layers)
        or any(x >= y for x, y in pairwise(b))
    ):
        raise ValueError(
            f"stage bounds must increase strictly from 0 to {len(layers)} "
            f"(the model's layers), got {b}"
        )
    return [nn.Sequential(*layers[i:j]) for i, j in pairwise(b)]


@dataclass(frozen=True)
class StagePace:
    """Emulated compute of one stage on its rank: seconds per sample.

    A forward of ``m`` samples lasts at least ``m x forward_s`` and a
    backward ``m x backward_s``; real compute counts toward it.
    """

    forward_s: float
    backward_s: float

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise TypeError(f"StagePace.{name} must be a number, got {v!r}")
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"StagePace.{name} must be finite and >= 0, got {v!r}")


@dataclass
class StepTimes:
    """Where one batch's time went on one stage, in seconds."""

    compute_s: float = 0.0
    """real forward and backward"""
    pace_s: float = 0.0
    """slept to the emulated compute"""
    wait_s: float = 0.0
    """waiting for a neighbour's activation, gradient or the labels"""
    link_s: float = 0.0
    """slept to emulated links"""
    wall_s: float = 0.0
    """the whole batch on this stage"""


@dataclass(frozen=True)
class _Boundary:
    """What crosses a stage boundary per sample: shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def differentiable(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


class PipelineStage:
    """Runs one rank's stage of a pipelined group (see the module).

    Construction is collective over ``comm``: the stages agree on the
    shapes of what crosses each boundary.

    Args:
        module: This rank's layers.
        comm: The group's communicator; its rank ``k`` holds stage ``k``.
        sample: Stage 0 only (``None`` elsewhere): one input, with its batch
            dimension (``(1, ...)``), for the shapes.
        loss: The last stage's loss, ``loss(output, labels)`` (a mean over
            the micro-batch).
        schedule: ``"1f1b"`` or ``"gpipe"``.
        pace: Emulated compute of this stage on this rank (``None``: none).
        links: Emulated links to the previous and the next stage (``None``:
            this machine's own), each with a ``seconds(nbytes)`` method
            (:class:`~hybridagg.pipeline.partition.Link`).
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Comm,
        *,
        sample: torch.Tensor | None = None,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        schedule: str = "1f1b",
        pace: StagePace | None = None,
        links: tuple[object | None, object | None] = (None, None),
    ) -> None:
        self.module, self.comm = module, comm
        self.links = links
        self.stage, self.stages = comm.rank, comm.size
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.loss = loss
        self.schedule_name = schedule
        self.pace = pace
        self._sends: list = []
        self._held: list = []  # buffers of the sends in flight
        self._broken: str | None = None  # why a step failed half-way
        # every stage's arguments are checked before any message, and the
        # first bad one is the same error on every stage (never a stage
        # left waiting for a neighbour that gave up)
        err = self._check_arguments(sample, loss, schedule, pace)
        names = comm.allgather(schedule, what="the stages' schedules")
        if err is None and len(set(names)) > 1:
            err = ValueError(
                f"the stages of a group must share a schedule, got {names}"
            )
        comm.check(err, what="the pipeline stage's arguments")
        self.input, self.output = self._agree_shapes(sample)

    def _check_arguments(self, sample, loss, schedule, pace) -> Exception | None:
        if self.first != (sample is not None):
            return ValueError(
                "PipelineStage: stage 0, and only stage 0, takes a sample "
                f"(stage {self.stage} of {self.stages} got "
                f"{'one' if sample is not None else 'none'})"
            )
        if self.first and not isinstance(sample, torch.Tensor):
            return TypeError(f"PipelineStage: sample must be a tensor, got {sample!r}")
        if self.last and loss is None:
            return ValueError("PipelineStage: the last stage needs a loss")
        if schedule not in SCHEDULES:
            return ValueError(
                f"unknown pipeline schedule {schedule!r}; choose from {', '.join(SCHEDULES)}"
            )
        if pace is not None and not isinstance(pace, StagePace):
            return TypeError(f"PipelineStage: pace must be a StagePace, got {pace!r}")
        return None

    # --- set-up ---------------------------------------------------------------
    def _agree_shapes(self, sample: torch.Tensor | None) -> tuple[_Boundary, _Boundary]:
        """Pass one sample's shapes through the stages, stage by stage.

        A stage whose layers fail on their input (a cut that does not
        match, a layer that returns no tensor) passes ``None`` on instead of
        its output's shape, and every stage then raises its error.
        """
        comm, k = self.comm, self.stage
        if self.first:
            inp = _Boundary(tuple(sample.shape[1:]), sample.dtype)
        else:
            inp = comm.recv(k - 1, _ACTIVATION, what=f"stage {k}'s input shape")
        output, err = None, None
        if inp is not None:
            try:
                output = self._probe(inp, sample)
            except (RuntimeError, TypeError, ValueError) as exc:
                err = exc
        if not self.last:
            req, keep = comm.isend(output, k + 1, _ACTIVATION)
            comm.wait(req, f"stage {k}'s output shape")
            del keep
        comm.check(err, what="the stages' shapes")
        return inp, output

    def _probe(self, inp: _Boundary, sample: torch.Tensor | None) -> _Boundary:
        """The shape of what this stage's layers make of one input."""
        probe = sample if self.first else torch.zeros((1, *inp.shape), dtype=inp.dtype)
        training = self.module.training
        self.module.eval()  # one sample: no batch statistics, no dropout
        try:
            with torch.no_grad():
                out = self.module(probe)
        finally:
            self.module.train(training)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"pipeline stage {self.stage}'s layers return {type(out).__name__}; "
                "a stage must return one tensor"
            )
        return _Boundary(tuple(out.shape[1:]), out.dtype)

    # --- one batch ------------------------------------------------------------
    def step(
        self,
        batch: tuple[torch.Tensor, torch.Tensor] | None,
        micro_batches: int,
        *,
        keep_outputs: bool = False,
    ) -> tuple[float | None, torch.Tensor | None, StepTimes]:
        """One batch's forward and backward through the pipeline.

        The parameters' ``.grad`` accumulate the batch's mean gradient (call
        ``zero_grad`` before). Collective over the group.

        Args:
            batch: Stage 0: ``(inputs, labels)`` (``None`` elsewhere). An
                empty batch is a step with nothing to do on every stage.
            micro_batches: Micro-batches to cut the batch into (stage 0's
                value is used; at most one per sample).
            keep_outputs: The last stage returns the model's outputs.

        Returns:
            ``(loss, outputs, times)``: the batch's mean loss on the last
            stage (``None`` elsewhere or for an empty batch), the outputs
            (last stage with ``keep_outputs``), and this stage's times.
        """
        t0 = time.perf_counter()
        times = StepTimes()
        sizes = self._header("step", batch, micro_batches, labels=True)
        if not sizes:
            times.wall_s = time.perf_counter() - t0
            return None, None, times
        with self._guard():
            loss, kept = self._step(batch, sizes, times, keep_outputs)
        times.wall_s = time.perf_counter() - t0
        return loss, kept, times

    def _step(self, batch, sizes: list[int], times: StepTimes, keep_outputs: bool):
        """The body of :meth:`step` once every stage took the call."""
        comm, k = self.comm, self.stage
        x, y = batch if self.first else (None, None)
        n = sum(sizes)
        labels = None
        if self.first:
            xs = list(x.split(sizes))
            if self.last:
                labels = y
            else:
                ylab = y.contiguous()
                self._post(
                    comm.isend(
                        (tuple(ylab.shape), ylab.dtype), self.stages - 1, _LABELS
                    )
                )
                self._sends.append(comm.Isend(ylab, self.stages - 1, _LABELS))
                self._keep_send(ylab)
        if self.last and not self.first:
            t = time.perf_counter()
            shape, dtype = comm.recv(0, _LABELS, what="the batch's labels")
            labels = torch.empty(shape, dtype=dtype)
            comm.wait(comm.Irecv(labels, 0, _LABELS), "the batch's labels")
            times.wait_s += time.perf_counter() - t
        ys = list(labels.split(sizes)) if self.last else None
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        kept: list[torch.Tensor] = []
        total = 0.0
        for action in schedule(self.schedule_name, k, self.stages, len(sizes)):
            i, size = action.micro, sizes[action.micro]
            if action.kind == "F":
                xin = xs[i] if self.first else self._receive_activation(i, size, times)
                c0 = time.perf_counter()
                out = self.module(xin)
                if self.last:
                    part = self.loss(out, ys[i]) * (size / n)
                    total += float(part.detach())
                    if keep_outputs:
                        kept.append(out.detach())
                    outputs[i] = part
                else:
                    send = out.detach().contiguous()
                    self._sends.append(comm.Isend(send, k + 1, _ACTIVATION))
                    outputs[i] = out
                    self._keep_send(send)
                self._spend(c0, size, forward=True, times=times)
                inputs[i] = xin
            else:
                grad = None if self.last else self._receive_gradient(i, size, times)
                c0 = time.perf_counter()
                out = outputs.pop(i)
                if self.last:
                    out.backward()  # the micro-batch's weighted loss
                elif grad is not None and out.requires_grad:
                    out.backward(grad)
                # (an output without a gradient, as integer ids, ends the
                # backward here: the layers before it get none)
                xin = inputs.pop(i)
                if not self.first and self.input.differentiable:
                    g = xin.grad if xin.grad is not None else torch.zeros_like(xin)
                    g = g.contiguous()
                    self._sends.append(comm.Isend(g, k - 1, _GRADIENT))
                    self._keep_send(g)
                self._spend(c0, size, forward=False, times=times)
        self._finish_sends(times)
        return (total if self.last else None), (torch.cat(kept) if kept else None)

    def infer(
        self, inputs: torch.Tensor | None, micro_batches: int
    ) -> torch.Tensor | None:
        """The model's outputs on ``inputs``, forward only (validation).

        Collective over the group; the module is put in ``eval`` mode for
        the pass and back after it.

        Args:
            inputs: Stage 0: the samples (``None`` elsewhere).
            micro_batches: As :meth:`step`.

        Returns:
            The outputs on the last stage (``None`` elsewhere).
        """
        sizes = self._header("infer", inputs, micro_batches, labels=False)
        xs = list(inputs.split(sizes)) if self.first else None
        training = self.module.training
        self.module.eval()
        outs, times = [], StepTimes()
        with self._guard():
            try:
                with torch.no_grad():
                    for i, size in enumerate(sizes):
                        if self.first:
                            x = xs[i]
                        else:
                            x = self._receive_activation(i, size, times)
                        out = self.module(x)
                        if self.last:
                            outs.append(out)
                        else:
                            send = out.contiguous()
                            self._keep_send(send)
                            self._sends.append(
                                self.comm.Isend(send, self.stage + 1, _ACTIVATION)
                            )
            finally:
                self.module.train(training)
            self._finish_sends(times)
        return torch.cat(outs) if self.last and outs else None

    # --- pieces -----------------------------------------------------------------
    def _header(self, method: str, given, micro_batches, *, labels: bool) -> list[int]:
        """Every stage's checks of a call, then stage 0's batch: the sizes.

        One all-reduce of ``[samples, micro-batches, refused]``: stage 0
        gives the batch, every stage its verdict on its own arguments, so a
        call refused anywhere is the same error on every stage (through
        ``Comm.check``), never a stage left waiting.
        """
        if self._broken is not None:
            # a verdict like the others: a stage that failed alone must not
            # leave its neighbours waiting in the header
            err: Exception | None = RuntimeError(
                f"pipeline stage {self.stage} cannot run: an earlier call failed "
                f"half-way ({self._broken}); build the stages again"
            )
        else:
            err = self._check_call(method, given, micro_batches, labels)
        header = np.zeros(3, dtype=np.int64)
        if err is None and self.first:
            x = given[0] if labels else given
            header[:2] = (len(x), micro_batches)
        header[2] = err is not None
        self.comm.Allreduce(header, MPI.MAX, what="the pipeline's batch header")
        if header[2]:
            self.comm.check(err, what=f"the pipeline's {method}")
        return micro_sizes(int(header[0]), int(header[1]))

    def _check_call(
        self, method: str, given, micro_batches, labels: bool
    ) -> Exception | None:
        """This stage's verdict on a call's arguments (``None``: fine)."""
        what = "the batch (inputs, labels)" if labels else "the inputs"
        if self.first != (given is not None):
            return ValueError(
                f"PipelineStage.{method}: stage 0, and only stage 0, takes {what} "
                f"(stage {self.stage} got {'none' if given is None else 'some'})"
            )
        if not self.first:
            return None  # stage 0's micro-batch count is the one used
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int):
            return TypeError(f"micro_batches must be an int, got {micro_batches!r}")
        if micro_batches < 1:
            return ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if labels:
            if not isinstance(given, tuple | list) or len(given) != 2:
                return TypeError(
                    f"PipelineStage.{method} takes the batch as (inputs, labels), "
                    f"got {type(given).__name__}"
                )
            x, y = given
        else:
            x, y = given, None
        for name, t in (("inputs", x), ("labels", y) if labels else ("inputs", x)):
            if not isinstance(t, torch.Tensor):
                return TypeError(f"the batch's {name} must be a tensor, got {t!r}")
        if tuple(x.shape[1:]) != self.input.shape or x.dtype != self.input.dtype:
            return ValueError(
                f"pipeline batch of {tuple(x.shape[1:])} {x.dtype} samples; the "
                f"stages were set up for {self.input.shape} {self.input.dtype}"
            )
        if labels and len(y) != len(x):
            return ValueError(f"pipeline batch of {len(x)} inputs and {len(y)} labels")
        return None

    @contextlib.contextmanager
    def _guard(self):
        """A call that fails half-way leaves messages in flight that would
        pair with the next call's: the stage refuses any later call."""
        try:
            yield
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise

    def _post(self, posted: tuple) -> None:
        req, keep = posted
        self._sends.append(req)
        self._keep_send(keep)

    def _keep_send(self, buf) -> None:
        # a posted send's buffer must outlive the send
        self._held.append(buf)

    def _receive_activation(self, i: int, size: int, times: StepTimes) -> torch.Tensor:
        buf = torch.empty((size, *self.input.shape), dtype=self.input.dtype)
        t = time.perf_counter()
        self.comm.wait(
            self.comm.Irecv(buf, self.stage - 1, _ACTIVATION),
            f"stage {self.stage}'s input of micro-batch {i} from stage {self.stage - 1}",
        )
        times.wait_s += time.perf_counter() - t
        self._link(self.links[0], buf, times)
        if self.input.differentiable:
            buf.requires_grad_(True)
        return buf

    def _receive_gradient(
        self, i: int, size: int, times: StepTimes
    ) -> torch.Tensor | None:
        if not self.output.differentiable:
            return None
        buf = torch.empty((size, *self.output.shape), dtype=self.output.dtype)
        t = time.perf_counter()
        self.comm.wait(
            self.comm.Irecv(buf, self.stage + 1, _GRADIENT),
            f"stage {self.stage}'s output gradient of micro-batch {i} "
            f"from stage {self.stage + 1}",
        )
        times.wait_s += time.perf_counter() - t
        self._link(self.links[1], buf, times)
        return buf

    def _link(self, link, buf: torch.Tensor, times: StepTimes) -> None:
        """Sleep the emulated link's time of a message that has arrived."""
        if link is not None:
            t = time.perf_counter()
            self._sleep_until(t + link.seconds(buf.numel() * buf.element_size()))
            times.link_s += time.perf_counter() - t

    def _sleep_until(self, deadline: float) -> None:
        now = time.perf_counter()
        while now < deadline:
            time.sleep(min(_PROGRESS_SLICE, deadline - now))
            if self._sends:
                MPI.Request.Testall(self._sends)  # moves sends in flight
            now = time.perf_counter()

    def _spend(self, c0: float, size: int, *, forward: bool, times: StepTimes) -> None:
        """Account real compute since ``c0`` and sleep to the emulated time."""
        now = time.perf_counter()
        times.compute_s += now - c0
        if self.pace is None:
            return
        per = self.pace.forward_s if forward else self.pace.backward_s
        self._sleep_until(c0 + per * size)
        times.pace_s += time.perf_counter() - now

    def _finish_sends(self, times: StepTimes) -> None:
        if self._sends:
            t = time.perf_counter()
            self.comm.wait(self._sends, f"stage {self.stage}'s sends")
            times.wait_s += time.perf_counter() - t
        self._sends, self._held = [], []
