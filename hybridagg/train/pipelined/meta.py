"""``--pipeline-init meta``: no rank ever holds the whole model.

The model is built on PyTorch's meta device: its structure, shapes and
floating-point operations are known, and nothing is allocated. The cut is
computed from that (:func:`~.stages.plan_units` works on meta tensors).
Each rank then materialises only the units of its own stage
(``to_empty``) and initialises each unit from the run's seed and the
unit's index. So every rank that holds a unit, in any group, holds the same
weights for it, whichever cut its group took.

Initialisation of a unit: a layer with an ``init_weights()`` method is
initialised by it (``gpt2``'s layers apply GPT-2's rules). Otherwise every
submodule that holds parameters of its own must have ``reset_parameters()``
(every ``torch.nn`` layer with parameters has one). The weights follow the
same distributions as a whole build from the seed, but not the same values:
a whole build draws them in construction order, over the whole model.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["check_meta_model", "materialize_unit", "unit_seed"]


def unit_seed(seed: int, index: int) -> int:
    """The seed unit ``index`` is initialised from (one stream per unit)."""
    return (seed * 1_000_003 + index) % (1 << 63)


def _initialisers(layer: nn.Module) -> list[nn.Module]:
    """The modules whose ``reset_parameters`` cover ``layer``'s parameters.

    Raises:
        ValueError: A module holds parameters of its own without it.
    """
    found = []
    for name, module in layer.named_modules():
        own = list(module.parameters(recurse=False))
        if not own:
            continue
        if not callable(getattr(module, "reset_parameters", None)):
            where = name or type(layer).__name__
            raise ValueError(
                f"--pipeline-init meta cannot initialise {where} "
                f"({type(module).__name__}): it holds parameters but has no "
                "reset_parameters(); give the pipeline layer an init_weights() "
                "method, or use --pipeline-init seed"
            )
        found.append(module)
    return found


def check_meta_model(model: nn.Module, layers: list[nn.Module]) -> None:
    """Refuse what a meta build cannot initialise, before anything is cut.

    Raises:
        ValueError: The model holds buffers (their values would be lost on
            the meta device), or a layer cannot be initialised.
    """
    buffers = [n for n, _ in model.named_buffers()]
    if buffers:
        raise ValueError(
            "--pipeline-init meta needs a model without buffers (a meta "
            f"build loses their values); this one has {buffers[:3]}"
        )
    for layer in layers:
        if not callable(getattr(layer, "init_weights", None)):
            _initialisers(layer)


def materialize_unit(unit: nn.Sequential, seed: int, index: int) -> None:
    """Give ``unit`` (on the meta device) CPU memory and its weights, in place.

    Args:
        unit: The unit's layers.
        seed: The run's seed.
        index: The unit's index in the model.
    """
    unit.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(unit_seed(seed, index))
        with torch.no_grad():
            for layer in unit:
                init = getattr(layer, "init_weights", None)
                if callable(init):
                    init()
                else:
                    for module in _initialisers(layer):
                        module.reset_parameters()
