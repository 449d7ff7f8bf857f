"""The model zoo's names: what ``--model`` accepts besides ``package.module:factory``.

Pure data (no torch), so the training configuration checks ``--model``
without importing torch. Each name stands for a factory in
:mod:`hybridagg.train.models`, loaded the way a user's ``package.module:factory``
is, so the names are listed here once and nowhere else.
"""

from __future__ import annotations

__all__ = ["MODELS"]

MODELS: dict[str, str] = {
    "mlp": "hybridagg.train.models:mlp",
    "cnn": "hybridagg.train.models:cnn",
    "resnet": "hybridagg.train.models:resnet",
}
"""Zoo name -> the ``package.module:factory`` it stands for."""
