"""Load SimGrid's Python extension, and only it.

SimGrid has no wheel on PyPI; Debian's ``python3-simgrid`` (3.32, ``make
simgrid``) installs one shared object,
``/usr/lib/python3/dist-packages/simgrid.cpython-311-x86_64-linux-gnu.so``,
which imports fine into the project's virtual environment. Putting Debian's
whole ``dist-packages`` on ``sys.path`` would shadow the venv's own packages
(numpy, torch), so the extension is loaded from its file by
:mod:`importlib` and nothing is added to the path.
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

from ..runtime import envvars

__all__ = ["SimGridMissing", "find_extension", "load"]

_DEBIAN_DIR = "/usr/lib/python3/dist-packages"
INSTALL_HINT = (
    "install it with `make simgrid` (as root: apt-get install python3-simgrid)"
)


class SimGridMissing(ImportError):
    """SimGrid's Python extension cannot be found or loaded."""


def find_extension() -> str:
    """The path of the extension: ``HYBRIDAGG_SIMGRID``, else Debian's for this Python.

    Raises:
        SimGridMissing: None is there, naming where it looked and how to install it.
    """
    given = envvars.get_str("HYBRIDAGG_SIMGRID")
    if given:
        if not os.path.isfile(given):
            raise SimGridMissing(f"HYBRIDAGG_SIMGRID={given} is not a file")
        return given
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    found = sorted(glob.glob(os.path.join(_DEBIAN_DIR, "simgrid*.so")))
    for suffix in suffixes:
        for path in found:
            if path.endswith(suffix):
                return path
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    extra = (
        f" (found {', '.join(os.path.basename(p) for p in found)}, built for "
        f"another Python than {version})"
        if found
        else ""
    )
    raise SimGridMissing(
        f"SimGrid's Python extension for Python {version} is not in "
        f"{_DEBIAN_DIR}{extra}; {INSTALL_HINT}, or set HYBRIDAGG_SIMGRID to "
        "its path"
    )


def load() -> ModuleType:
    """The ``simgrid`` module (loaded once per process).

    Raises:
        SimGridMissing: Not installed, or not loadable in this Python.
    """
    module = sys.modules.get("simgrid")
    if module is not None:
        return module
    path = find_extension()
    spec = importlib.util.spec_from_file_location("simgrid", path)
    if spec is None or spec.loader is None:
        raise SimGridMissing(f"{path} is not a Python extension; {INSTALL_HINT}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise SimGridMissing(f"cannot load {path}: {exc}; {INSTALL_HINT}") from exc
    sys.modules["simgrid"] = module
    return module
