"""Optional dependencies, imported where they are used and named by their extra.

hybridagg's required dependencies are what ``hybridagg train`` needs on data in
its own format. Everything else is an extra of the package (pyproject.toml's
``[project.optional-dependencies]``): scikit-learn for the bundled digits
(``digits``), matplotlib for the benchmarks' plots (``plots``), Pillow for
folders of images (``images``), tensorboard for ``--tensorboard``
(``tensorboard``). Their modules are imported inside the function that needs
them, through :func:`require`, so ``import hybridagg`` and every command that
does not use them work without them, and a missing one is a single message
that says what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["OPTIONAL", "MissingExtraError", "install_hint", "require"]

#: Top-level import name -> (the extra that installs it, its distribution name).
OPTIONAL: dict[str, tuple[str, str]] = {
    "sklearn": ("digits", "scikit-learn"),
    "matplotlib": ("plots", "matplotlib"),
    "PIL": ("images", "pillow"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "yaml": ("sim", "pyyaml"),
}


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message names its extra.

    A ``ModuleNotFoundError``, so code that catches ``ImportError`` (the
    command line's ``convert``) reports it as it reports any missing module.
    """


def install_hint(module: str) -> str:
    """``pip install 'hybridagg[EXTRA]' (or pip install DIST)`` for ``module``.

    Raises:
        ValueError: ``module`` is not one of :data:`OPTIONAL`.
    """
    top = module.partition(".")[0]
    if top not in OPTIONAL:
        raise ValueError(
            f"{module!r} is not an optional dependency of hybridagg; "
            f"known: {sorted(OPTIONAL)}"
        )
    extra, dist = OPTIONAL[top]
    return f"pip install 'hybridagg[{extra}]' (or pip install {dist})"


def require(module: str, purpose: str) -> ModuleType:
    """Import the optional ``module`` (a dotted name is fine) for ``purpose``.

    Args:
        module: What to import, e.g. ``"sklearn.datasets"``; its top-level
            package must be one of :data:`OPTIONAL`.
        purpose: What needs it, the subject of the error message, e.g.
            ``"hybridagg convert --from digits"``.

    Returns:
        The imported module.

    Raises:
        MissingExtraError: The optional package is not installed (the message
            names the extra that installs it).
        ValueError: ``module`` is not an optional dependency of hybridagg.
        ImportError: The package is installed but something it imports is
            missing or broken: that error is more useful than a hint to
            install what is already there, so it passes through.
    """
    hint = install_hint(module)
    top = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.partition(".")[0] != top:
            raise
        dist = OPTIONAL[top][1]
        raise MissingExtraError(
            f"{purpose} needs {dist}, which is not installed: {hint}", name=top
        ) from exc
