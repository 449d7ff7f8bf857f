"""Emulated compute where it happens: forward, then backward layer by layer.

The step's emulated time (:meth:`hybridagg.train.emulation.Pacer.target`)
is spent inside the step, not after it. Each module that computes gets its
share of the step: its own floating-point operations ``F`` (counted once by
``torch.utils.flop_counter`` on one sample) over the model's, a third in the
forward pass (``F``) and two thirds in the backward pass (``2F``: the
gradients with respect to inputs and to weights). A module's forward share
is slept right after its forward; its backward share when the gradient of
its output arrives, before its own backward runs, so its parameters'
gradients (and the reducer's buckets that wait on them) become ready when
the emulated hardware would have produced them, in backward order.

Sleeps are deadlines, not durations: after the module that brings the
emulated schedule to a fraction ``s`` of the step, the rank sleeps until
``start + s x target``. Real compute in between counts toward the schedule,
so a step lasts ``max(target, real compute)`` however the real cost is
spread. Without ``--sample-ms`` (a factor stretching the real compute) each
stretch of real compute between two hooks is stretched where it ran.

While it sleeps, the rank calls ``progress`` (the optimizer's: test the
collectives in flight, post those whose gradients are ready), as a
communication thread or an offloading NIC would on real hardware: a
collective posted during backward moves while the later layers "compute".
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .emulation import Pacer

__all__ = ["LayerPacer", "module_costs"]

_BACKWARD_TIMES_FORWARD = 2.0
_PROGRESS_SLICE = 0.001  # seconds between progress calls while sleeping


def module_costs(model: nn.Module, sample: torch.Tensor) -> dict[str, float]:
    """Floating-point operations each module does itself on one sample (its
    own, not its children's), by the module's name in ``named_modules()``.

    Modules that do no counted operation (activations, normalisation and
    other element-wise work, which ``flop_counter`` does not count) are left
    out.

    Args:
        model: The model.
        sample: One sample, batch dimension included (``(1, ...)``).
    """
    root = type(model).__name__
    training = model.training
    model.eval()  # batch statistics of one sample are not defined
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(sample)
    finally:
        model.train(training)
    totals = {
        (name[len(root) + 1 :] if name != root else ""): float(sum(ops.values()))
        for name, ops in counter.get_flop_counts().items()
        if name == root or name.startswith(root + ".")
    }

    def inner(name: str, module: nn.Module) -> float:
        # what the nearest counted descendants did: a container that is
        # never called (ModuleList, ModuleDict) has no total of its own, and
        # its children's work belongs to them, not to the module above it
        done = 0.0
        for child, sub in module.named_children():
            path = f"{name}.{child}" if name else child
            done += totals[path] if path in totals else inner(path, sub)
        return done

    own = {}
    for name, module in model.named_modules():
        if name not in totals:
            continue
        flops = totals[name] - inner(name, module)
        if flops > 0:
            own[name] = flops
    return own


class LayerPacer:
    """Spends a step's emulated time inside forward and backward (see the module).

    Use: :meth:`begin` before the forward pass, :meth:`end` after the
    backward pass; :meth:`free` removes the hooks.

    Args:
        model: The model (hooks go on the modules named in ``costs``).
        pacer: The rank's emulated speed.
        costs: :func:`module_costs` of the model.
        progress: Called while sleeping (``None``: plain sleeps).
        clock: Seconds (``time.perf_counter``); tests pass a fake.
        sleep: Sleeps seconds (``time.sleep``); tests pass a fake.
    """

    def __init__(
        self,
        model: nn.Module,
        pacer: Pacer,
        costs: dict[str, float],
        progress: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.pacer, self.progress = pacer, progress
        self.clock, self._sleep = clock, sleep
        total = sum(costs.values()) * (1 + _BACKWARD_TIMES_FORWARD)
        self.shares = {n: c / total for n, c in costs.items()} if total > 0 else {}
        self._handles = []
        modules = dict(model.named_modules())
        for name in self.shares:
            self._handles.append(
                modules[name].register_forward_hook(self._forward_hook(name))
            )
        self._active = False
        self.start = self.target = self.done = self.slept = self.mark = 0.0

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        pacer: Pacer,
        sample: torch.Tensor,
        progress: Callable[[], object] | None = None,
    ) -> LayerPacer:
        """The pacer of ``model``: its costs counted on ``sample`` (one sample,
        batch dimension included) when ``pacer`` emulates anything; else no
        hooks at all, so an unemulated run pays nothing per module."""
        costs = module_costs(model, sample) if pacer.emulating else {}
        return cls(model, pacer, costs, progress=progress)

    # --- one step ------------------------------------------------------------
    def begin(self, samples: int) -> None:
        """A step of ``samples`` samples starts now (0: nothing to emulate)."""
        self._active = samples > 0
        self.samples = samples
        self.start = self.mark = self.clock()
        self.done = self.slept = 0.0
        self.factor = self.pacer.factor()
        # a base time per sample fixes the step's length up front; a bare
        # factor stretches what runs, as it runs
        self.target = (
            self.pacer.target(samples, 0.0) if self.pacer.sample_ms > 0 else None
        )

    def end(self) -> tuple[float, float]:
        """The step's compute is over: sleep what is left of it.

        Returns:
            ``(compute_s, slept_s)``: the real compute (wall time less the
            sleeps) and the time slept.
        """
        if self._active:
            self._advance(0.0, final=True)
        self._active = False
        wall = self.clock() - self.start
        return wall - self.slept, self.slept

    def free(self) -> None:
        """Remove the hooks from the model."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # --- hooks ---------------------------------------------------------------
    def _forward_hook(self, name: str):
        share = self.shares[name]

        def hook(module, inputs, output):
            if not self._active:
                return output
            self._advance(share)
            tensors = output if isinstance(output, tuple) else (output,)
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(
                        self._backward_hook(share * _BACKWARD_TIMES_FORWARD)
                    )
                    break  # one hook per module output is enough to place it
            return output

        return hook

    def _backward_hook(self, share: float):
        def hook(grad):
            if self._active:
                self._advance(share)

        return hook

    def _advance(self, share: float, final: bool = False) -> None:
        """The emulated schedule moved on by ``share`` of the step (``final``:
        to its end): sleep to it."""
        now = self.clock()
        if self.target is not None:
            # a module run twice in one pass may overshoot: the step never
            # emulates more than its target
            self.done = 1.0 if final else min(1.0, self.done + share)
            wait = self.start + self.done * self.target - now
        else:
            # stretch the real compute since the last hook by the factor
            wait = (now - self.mark) * (self.factor - 1.0)
        if wait > 0:
            self._wait(wait)
        self.mark = self.clock()

    def _wait(self, seconds: float) -> None:
        t0 = self.clock()
        if self.progress is None:
            self._sleep(seconds)
        else:
            deadline = t0 + seconds
            while True:
                self.progress()
                left = deadline - self.clock()
                if left <= 0:
                    break
                self._sleep(min(left, _PROGRESS_SLICE))
        self.slept += self.clock() - t0
