"""Packaging: one version, extras that match the code, optional packages that
are imported only where they are used, and a missing one named by its extra."""

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import hybridagg
from hybridagg.runtime.extras import OPTIONAL, MissingExtraError, require

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]

# Put in front of a child's code: every import of these top-level packages
# fails as it does when they are not installed.
BLOCKER = """\
import sys


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Blocker())
"""


def run_python(code: str, *, blocked=(), timeout=120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    prelude = f"BLOCKED = {set(blocked)!r}\n" + BLOCKER if blocked else ""
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}


def extras_of(extra: str) -> set[str]:
    """Every distribution ``extra`` installs, through ``hybridagg[...]`` too."""
    names = set()
    for req in EXTRAS[extra]:
        inner = re.fullmatch(r"hybridagg\[([a-z,]+)\]", req)
        if inner:
            for e in inner.group(1).split(","):
                names |= extras_of(e)
        else:
            names |= requirement_names([req])
    return names


def test_installed_version_is_the_package_version():
    """pyproject reads the version from hybridagg/version.py; what pip
    installed, ``hybridagg.__version__`` and ``hybridagg --version`` agree."""
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "hybridagg.version.__version__"
    }
    assert importlib.metadata.version("hybridagg") == hybridagg.__version__
    got = run_python("from hybridagg.cli import main; main(['--version'])")
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == f"hybridagg {hybridagg.__version__}"


def test_optional_packages_are_extras_not_requirements():
    required = requirement_names(PYPROJECT["project"]["dependencies"])
    for top, (extra, dist) in OPTIONAL.items():
        assert dist in extras_of(extra), (top, extra)
        assert dist not in required, f"{dist} is optional ({extra}), not required"
    # `all` is every optional feature; the suite tests every one of them.
    assert {d for _, d in OPTIONAL.values()} <= extras_of("all")
    assert extras_of("all") | {"pytest", "pytest-timeout"} <= extras_of("test")


def test_every_extra_named_in_a_message_exists():
    """A hint such as ``pip install 'hybridagg[images]'`` names a real extra."""
    named = set()
    for folder in ("hybridagg", "bench", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            named |= set(re.findall(r"hybridagg\[([a-z,]+)\]", path.read_text()))
    named = {e for group in named for e in group.split(",")}
    assert {"digits", "images", "tensorboard", "mpi"} <= named
    assert named <= set(EXTRAS), named - set(EXTRAS)


def module_level_imports(tree: ast.Module):
    """Import nodes that run when the module is imported (not in a function)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
        todo.extend(ast.iter_child_nodes(node))


def test_optional_packages_are_imported_inside_functions():
    found = []
    for folder in ("hybridagg", "bench", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for name in module_level_imports(tree):
                if name.partition(".")[0] in OPTIONAL:
                    found.append(f"{path.relative_to(ROOT)}: import {name}")
    assert found == []


def test_commands_do_not_import_optional_packages():
    code = (
        f"OPTIONAL = {sorted(OPTIONAL)!r}\n"
        + """
import contextlib, io, sys
import hybridagg, hybridagg.data, hybridagg.train, hybridagg.torch
from hybridagg.cli import main
for argv in (["train", "--help"], ["convert", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
print(sorted(m for m in sys.modules if m.partition(".")[0] in OPTIONAL))
"""
    )
    got = run_python(code)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("blocked", "code", "extra"),
    [
        (
            "sklearn",
            "from hybridagg.cli import main; "
            "sys.exit(main(['convert', '--from', 'digits', '--out', 'OUT']))",
            "digits",
        ),
        (
            "PIL",
            "from hybridagg.cli import main; "
            "sys.exit(main(['convert', '--from', 'folder', 'bench', '--out', 'OUT']))",
            "images",
        ),
        (
            "matplotlib",
            "import runpy; sys.argv = ['hetero.py', '--png', 'OUT']; "
            "runpy.run_path('bench/hetero.py', run_name='__main__')",
            "plots",
        ),
    ],
    ids=["digits", "images", "plots"],
)
def test_missing_extra_is_named(tmp_path, blocked, code, extra):
    """Without the package: one message naming the extra, and nothing written
    (bench/hetero.py says it before its runs, not after them)."""
    out = tmp_path / "out"
    got = run_python(code.replace("OUT", str(out)), blocked=[blocked], timeout=60)
    assert got.returncode != 0
    assert f"pip install 'hybridagg[{extra}]'" in got.stderr, got.stderr
    assert not out.exists()


def test_a_broken_optional_package_is_not_called_missing():
    """scikit-learn installed but a module it imports missing: that module's
    error passes through, not a hint to install scikit-learn again."""
    got = run_python(
        "from hybridagg.runtime.extras import require\n"
        "try:\n"
        "    require('sklearn.datasets', 'this test')\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(type(exc).__name__, exc.name)\n",
        blocked=["scipy"],
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["ModuleNotFoundError", "scipy"]


def test_require():
    assert require("sklearn.datasets", "this test").load_digits
    with pytest.raises(ValueError, match="not an optional dependency"):
        require("numpy", "this test")
    assert issubclass(MissingExtraError, ModuleNotFoundError)
