"""Which kernel a server's optimizer steps with.

A server's time per update is one optimizer step over its whole shard, and
torch's default on CPU is a loop over the parameters in several passes over
memory (for SGD with momentum: the decay, the momentum buffer, then the
weights). Where the user's optimizer class has a fused kernel, one pass over
memory does all of it; the servers use it unless the user chose a kernel
(``fused=False``, or any ``foreach`` setting), since the choice changes only
speed and rounding, not the update's arithmetic. Figures: bench/RESULTS.md.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["KERNEL_KEYS", "build_optimizer", "one_pass_settings"]

#: The settings that choose a kernel, not the update: they are not state, so
#: a checkpoint's values are replaced by the ones the server chose.
KERNEL_KEYS = ("fused", "foreach")


def one_pass_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with ``fused=True`` where the user left the kernel open.

    Pure. A class with a fused kernel lists ``fused`` in its ``defaults``
    (``None`` when not chosen); ``differentiable`` optimizers have none.

    Args:
        settings: An optimizer's ``defaults`` or one parameter group's
            settings (without ``params``).

    Returns:
        A new dict; ``settings`` itself is not changed.
    """
    out = dict(settings)
    if (
        "fused" in out
        and out["fused"] is None
        and out.get("foreach") is None
        and not out.get("differentiable", False)
    ):
        out["fused"] = True
    return out


def build_optimizer(
    cls: type[torch.optim.Optimizer], groups: list[dict], defaults: dict[str, Any]
) -> torch.optim.Optimizer:
    """The user's optimizer ``cls`` over ``groups``, fused where it may be.

    Args:
        cls: The user's optimizer class.
        groups: Parameter groups (each with ``params``).
        defaults: The user's optimizer's ``defaults``.

    Returns:
        The optimizer with the fused kernel where :func:`one_pass_settings`
        asks for it and torch accepts it for these parameters, else as the
        user configured it.
    """
    fast = [
        {
            **one_pass_settings({k: v for k, v in g.items() if k != "params"}),
            "params": g["params"],
        }
        for g in groups
    ]
    # keep the keywords cls takes: torch 2.13's AdamW lists
    # decoupled_weight_decay in its defaults (inherited from Adam) but its
    # constructor refuses it (the groups keep every setting)
    defaults = _accepted(cls, defaults)
    try:
        return cls(fast, **one_pass_settings(defaults))
    except (RuntimeError, TypeError, ValueError):
        # torch refuses fused for some dtypes and devices (and a user's
        # subclass may not take the keyword): the user's own settings then
        return cls(groups, **defaults)


def _accepted(cls: type, settings: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``settings`` that ``cls``'s constructor takes as keywords."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # no signature to read: pass them all
        return dict(settings)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(settings)
    return {k: v for k, v in settings.items() if k in params}
