"""The model zoo's names: what ``--model`` accepts besides ``package.module:factory``.

Pure data (no torch), so the training configuration checks ``--model``
without importing torch. Each name stands for a factory in
:mod:`hybridagg.train.models` (small models) or
:mod:`hybridagg.train.architectures` (models of real size and their shape
twins, which only time computation and communication), loaded the way a
user's ``package.module:factory`` is, so the names are listed here once and
nowhere else.
"""

from __future__ import annotations

__all__ = ["MODELS"]

MODELS: dict[str, str] = {
    "mlp": "hybridagg.train.models:mlp",
    "cnn": "hybridagg.train.models:cnn",
    "resnet": "hybridagg.train.models:resnet",
    "resnet18": "hybridagg.train.architectures:resnet18",
    "resnet50": "hybridagg.train.architectures:resnet50",
    "gpt2": "hybridagg.train.architectures:gpt2",
    "resnet18-twin": "hybridagg.train.architectures:resnet18_twin",
    "resnet50-twin": "hybridagg.train.architectures:resnet50_twin",
    "gpt2-twin": "hybridagg.train.architectures:gpt2_twin",
}
"""Zoo name -> the ``package.module:factory`` it stands for."""
