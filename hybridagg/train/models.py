"""The model zoo of ``hybridagg train``, and loading a user's own model.

Every builder takes the data's ``sample_shape`` and ``num_classes`` (from the
HDF5 file's attributes) and returns a ``torch.nn.Module`` mapping a batch of
samples to class logits. Samples stored flat (``(64,)`` for the 8x8 digits)
are reshaped to a square one-channel image for the convolutional models.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys

import torch
from torch import nn

from .zoo import MODELS

__all__ = [
    "MODELS",
    "build_model",
    "check_fits",
    "factory_arguments",
    "image_shape",
    "resolve_device",
]


def image_shape(sample_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``(C, H, W)`` for a convolutional model.

    Raises:
        ValueError: The samples are neither images nor a square number of values.
    """
    if len(sample_shape) == 3:
        return tuple(sample_shape)  # type: ignore[return-value]
    if len(sample_shape) == 2:
        return (1, *sample_shape)  # type: ignore[return-value]
    n = math.prod(sample_shape)
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(
            f"a convolutional model needs image samples (C, H, W); samples of "
            f"shape {tuple(sample_shape)} are not a square image"
        )
    return (1, side, side)


def mlp(
    sample_shape: tuple[int, ...], num_classes: int, hidden: int = 128
) -> nn.Module:
    """Two hidden layers of ReLU units."""
    n = math.prod(sample_shape)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(n, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden // 2),
        nn.ReLU(),
        nn.Linear(hidden // 2, num_classes),
    )


def cnn(sample_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Two 3x3 convolutions, pooling, and two linear layers."""
    c, h, w = image_shape(sample_shape)
    return nn.Sequential(
        nn.Unflatten(1, (c, h, w)) if len(sample_shape) != 3 else nn.Identity(),
        nn.Conv2d(c, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2) if min(h, w) >= 8 else nn.Identity(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(32 * 16, 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


def resnet(sample_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A small ResNet: a stem and three stages of one basic block (16/32/64 channels)."""
    c, h, w = image_shape(sample_shape)
    return nn.Sequential(
        nn.Unflatten(1, (c, h, w)) if len(sample_shape) != 3 else nn.Identity(),
        nn.Conv2d(c, 16, 3, 1, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        _Block(16, 16, 1),
        _Block(16, 32, 2),
        _Block(32, 64, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, num_classes),
    )


def _import_factory(name: str, spec: str):
    """The callable ``spec`` (``package.module:factory``) names, found from the current folder too.

    ``mpiexec -n 4 hybridagg train`` starts the console script, whose
    ``sys.path`` holds the script's folder, not the current one (``python
    -m`` and ``python script.py`` add it; an entry point does not), so a
    ``mymodel.py`` beside the user was not found without ``PYTHONPATH``. The
    current folder is appended, not prepended: an installed package of the
    same name (a ``torch.py`` left in the folder) still wins. It stays on the
    path, so the module's own imports of its neighbours work too.

    Raises:
        ValueError: The module or the attribute cannot be found or loaded.
    """
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(
            f"unknown model {name!r}: choose one of {sorted(MODELS)} or give "
            "package.module:factory"
        )
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"model factory {name!r} cannot be loaded: {exc} (searched the "
            f"current folder {cwd} and the Python path)"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(
            f"model factory {name!r} cannot be loaded: module {module_name!r} "
            f"({getattr(module, '__file__', '?')}) has no {attr!r}"
        ) from None


def factory_arguments(
    name: str, factory, sample_shape: tuple[int, ...], num_classes: int
) -> dict:
    """The keyword arguments ``factory`` is called with (see :func:`build_model`).

    Raises:
        TypeError: ``factory`` is not callable, or it requires a parameter
            other than ``sample_shape`` and ``num_classes``.
    """
    if not callable(factory):
        raise TypeError(
            f"model factory {name!r} is a {type(factory).__name__}, not a callable"
        )
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # (a builtin without a signature)
        params = {}
    offered = {"sample_shape": tuple(sample_shape), "num_classes": int(num_classes)}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return offered
    unknown = [
        p.name
        for p in params.values()
        if p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name not in offered
    ]
    positional_only = [
        p.name
        for p in params.values()
        if p.kind is p.POSITIONAL_ONLY and p.name in offered
    ]
    if unknown or positional_only:
        bad = unknown or positional_only
        raise TypeError(
            f"model factory {name!r} has the signature "
            f"{name.partition(':')[2] or name}{inspect.signature(factory)}; "
            f"hybridagg calls it as factory(sample_shape=..., num_classes=...), "
            f"passing only the keywords it accepts, and cannot fill "
            f"{', '.join(repr(b) for b in bad)}"
            + (" (positional-only)" if not unknown else "")
            + ": give those parameters defaults, or wrap the factory"
        )
    return {k: v for k, v in offered.items() if k in params}


def build_model(
    name: str, sample_shape: tuple[int, ...], num_classes: int
) -> nn.Module:
    """A zoo model by name, or ``package.module:factory`` for the user's own.

    A zoo name is loaded as the factory it stands for
    (:data:`hybridagg.train.zoo.MODELS`). A user's module is imported from
    the Python path, then from the current folder (``--model mymodel:build``
    finds ``./mymodel.py`` without ``PYTHONPATH``).

    The factory's signature::

        def build(sample_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module

    It is called with keywords, and only with those it declares (either,
    both, or neither; ``**kwargs`` takes both): ``sample_shape`` is one
    sample's shape as stored (``(64,)`` for flat digits, ``(3, 32, 32)`` for
    images), ``num_classes`` the number of classes, or with float targets
    (``--loss mse``) the number of values per target (1 for a scalar). The
    module maps a batch ``(B, *sample_shape)`` to ``(B, num_classes)``
    outputs (logits, or predictions). It is built on the CPU with the run's
    seed set (every worker builds the same initial weights, and rank 0's are
    broadcast anyway), then moved to ``--device``.

    Raises:
        ValueError: Unknown name, or a module or factory that cannot be found.
        TypeError: The factory is not callable, requires a parameter other
            than ``sample_shape`` and ``num_classes``, or returns something
            that is not a ``torch.nn.Module``.
    """
    factory = _import_factory(name, MODELS.get(name, name))
    kwargs = factory_arguments(name, factory, sample_shape, num_classes)
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model factory {name!r} returned {type(model).__name__}, not a "
            "torch.nn.Module"
        )
    return model


def resolve_device(text: str, rank: int) -> torch.device:
    """The ``--device`` as a ``torch.device`` this rank can use.

    Raises:
        ValueError: Not a device torch knows, not ``cpu`` or ``cuda``, or
            ``cuda`` where CUDA is not available (or has no such index).
    """
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(
            f"--device {text!r} is not a device: use cpu, cuda or cuda:N"
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {text!r}: hybridagg trains on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {text}: CUDA is not available on rank {rank} (torch "
                f"{torch.__version__}, built for CUDA {torch.version.cuda}); "
                "use --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"--device {text}: rank {rank} sees {count} CUDA device(s)"
            )
    return device


def _expected_input(model: nn.Module) -> str:
    """What the model's first layer takes, in words (``""``: not known)."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            return f"inputs of {m.in_features} features"
        if isinstance(m, nn.modules.conv._ConvNd):
            return f"inputs of {m.in_channels} channels"
    return ""


def check_fits(
    model: nn.Module,
    sample_shape: tuple[int, ...],
    num_classes: int,
    name: str,
    device: torch.device,
    loss: str = "cross-entropy",
) -> None:
    """Check, with one sample of zeros, that ``model`` takes the data and gives its outputs.

    Run once at set-up so that a model that does not fit is one clear error
    before the first step, not a traceback inside it. The forward runs in
    eval mode without gradients (BatchNorm's statistics stay untouched);
    one sample costs a small fraction of a step.

    Args:
        model: The model.
        sample_shape: One sample's shape.
        num_classes: Classes, or with ``loss="mse"`` values per target.
        name: The ``--model`` (for messages).
        device: Where the model is.
        loss: ``"cross-entropy"``: at least ``num_classes`` logits;
            ``"mse"``: exactly ``num_classes`` values.

    Raises:
        ValueError: The model fails on a sample of this shape, or gives
            the wrong number of outputs; names both shapes.
    """
    sample = torch.zeros((1, *sample_shape), device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(sample)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        expects = _expected_input(model)
        expects = f" (it expects {expects})" if expects else ""
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ValueError(
            f"model {name!r} does not fit the data: it cannot take samples of "
            f"shape {tuple(sample_shape)}{expects}: {type(exc).__name__}: {reason}"
        ) from None
    finally:
        model.train(was_training)
    what = "outputs" if loss == "mse" else "logits"
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or len(out) != 1:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"model {name!r} does not fit the data: for a batch of 1 sample of "
            f"shape {tuple(sample_shape)} it returns {got}, not {what} of shape "
            f"(1, {num_classes})"
        )
    if loss == "mse" and out.shape[1] != num_classes:
        raise ValueError(
            f"model {name!r} does not fit the data: it outputs {out.shape[1]} "
            f"values per sample, but the targets have {num_classes} "
            f"(samples of shape {tuple(sample_shape)}, --loss mse)"
        )
    if out.shape[1] < num_classes:
        raise ValueError(
            f"model {name!r} does not fit the data: it outputs {out.shape[1]} "
            f"values per sample, but the data has {num_classes} classes "
            f"(samples of shape {tuple(sample_shape)})"
        )
