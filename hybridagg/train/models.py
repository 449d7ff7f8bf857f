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

import torch
from torch import nn

from .zoo import MODELS

__all__ = ["MODELS", "build_model", "check_fits", "image_shape", "resolve_device"]


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


def build_model(
    name: str, sample_shape: tuple[int, ...], num_classes: int
) -> nn.Module:
    """A zoo model by name, or ``package.module:factory`` for the user's own.

    A zoo name is loaded as the factory it stands for
    (:data:`hybridagg.train.zoo.MODELS`).

    A factory is called with ``sample_shape=`` and ``num_classes=`` when it
    accepts them, else with no arguments, and must return a ``torch.nn.Module``.

    Raises:
        ValueError: Unknown name, a module or factory that cannot be found, or
            a factory that returns something else.
    """
    module_name, colon, attr = MODELS.get(name, name).partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(
            f"unknown model {name!r}: choose one of {sorted(MODELS)} or give "
            "package.module:factory"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"model factory {name!r} cannot be loaded: {exc}") from None
    params = inspect.signature(factory).parameters
    kwargs = {}
    if "sample_shape" in params:
        kwargs["sample_shape"] = tuple(sample_shape)
    if "num_classes" in params:
        kwargs["num_classes"] = int(num_classes)
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model factory {name!r} returned {type(model).__name__}, not a Module"
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
) -> None:
    """Check, with one sample of zeros, that ``model`` takes the data and covers its classes.

    Run once at set-up so that a model that does not fit is one clear error
    before the first step, not a traceback inside it. The forward runs in
    eval mode without gradients (BatchNorm's statistics stay untouched);
    one sample costs a small fraction of a step.

    Raises:
        ValueError: The model fails on a sample of this shape, or gives
            fewer outputs than the data has classes; names both shapes.
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
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or len(out) != 1:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"model {name!r} does not fit the data: for a batch of 1 sample of "
            f"shape {tuple(sample_shape)} it returns {got}, not logits of shape "
            f"(1, {num_classes})"
        )
    if out.shape[1] < num_classes:
        raise ValueError(
            f"model {name!r} does not fit the data: it outputs {out.shape[1]} "
            f"values per sample, but the data has {num_classes} classes "
            f"(samples of shape {tuple(sample_shape)})"
        )
