"""The import graph keeps the layer order of docs/architecture.md.

The layer table is written once, in docs/architecture.md between the
``<!-- layers -->`` markers; this test reads it. Every import counts: at
module level, inside functions, and the package root's lazy-name table.
Imports under ``if TYPE_CHECKING:`` are not executed and do not count.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hybridagg"
DOC = ROOT / "docs" / "architecture.md"


def read_layers(text: str) -> list[tuple[int, tuple[str, ...]]]:
    """``(number, module names)`` per row of the layer table."""
    match = re.search(r"<!-- layers -->(.*?)<!-- /layers -->", text, re.S)
    if match is None:
        raise ValueError("docs/architecture.md has no <!-- layers --> table")
    rows = []
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        names = tuple(re.findall(r"`([\w.]+)`", cells[2]))
        if not names:
            raise ValueError(f"layer row without modules: {line!r}")
        rows.append((int(cells[0]), names))
    return rows


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
            (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or (
                isinstance(node.test, ast.Attribute)
                and node.test.attr == "TYPE_CHECKING"
            )
        ):
            for inner in node.body:
                skip.update(id(n) for n in ast.walk(inner))
    return skip


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The hybridagg modules ``path`` imports (resolved to the deepest known name)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("hybridagg"):
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("hybridagg"))
    if name == "hybridagg":
        # the lazy table: names resolved through importlib on first use
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets
            ):
                found.update(
                    v.value
                    for v in node.value.values
                    if isinstance(v, ast.Constant) and isinstance(v.value, str)
                )
    return {f for f in found if f != name}


def build_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {m: imports_of(p, modules) for m, p in paths.items()}


def row_of(module: str, rows) -> tuple[int, int]:
    """``(row index, layer number)`` of the longest matching module prefix."""
    best = None
    for index, (number, names) in enumerate(rows):
        for name in names:
            matches = module == name or module.startswith(name + ".")
            if matches and (best is None or len(name) > best[0]):
                best = (len(name), index, number)
    if best is None:
        raise LookupError(module)
    return best[1], best[2]


def violations(graph: dict[str, set[str]], rows) -> list[str]:
    bad = []
    for source, targets in sorted(graph.items()):
        s_row, s_num = row_of(source, rows)
        for target in sorted(targets):
            t_row, t_num = row_of(target, rows)
            if t_num > s_num:
                bad.append(f"{source} (layer {s_num}) imports {target} (layer {t_num})")
            elif t_num == s_num and t_row != s_row:
                bad.append(
                    f"{source} imports {target}, a different row of layer {s_num}"
                )
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    rows = read_layers(DOC.read_text())
    missing = []
    for module in build_graph():
        try:
            row_of(module, rows)
        except LookupError:
            missing.append(module)
    assert missing == [], f"modules without a row in docs/architecture.md: {missing}"


def test_no_import_runs_up_the_layer_order():
    rows = read_layers(DOC.read_text())
    assert violations(build_graph(), rows) == []


def test_no_import_cycle():
    assert cycles(build_graph()) == []


def test_the_checks_catch_what_they_are_for():
    """The checks fail on a made-up graph that breaks each rule."""
    rows = [(0, ("p.low",)), (1, ("p.mid", "p.mid2")), (1, ("p.side",)), (2, ("p",))]
    graph = {
        "p.low.a": {"p.mid.b"},  # upward
        "p.mid.b": {"p.side.c", "p.mid2.x"},  # sideways to another row; same row ok
        "p.side.c": {"p.low.a"},
        "p.mid2.x": set(),
        "p": {"p.low.a", "p.mid.b"},  # the root may import everything
    }
    assert violations(graph, rows) == [
        "p.low.a (layer 0) imports p.mid.b (layer 1)",
        "p.mid.b imports p.side.c, a different row of layer 1",
    ]
    assert cycles(graph) == [["p.low.a", "p.mid.b", "p.side.c"]]
    with pytest.raises(LookupError):
        row_of("q.other", rows)


def test_the_table_parser_reads_the_rows():
    text = "x\n<!-- layers -->\n| # | l | m | k |\n|---|---|---|---|\n| 0 | a | `p.a`, `p.b` | - |\n| 3 | c | `p.c` | - |\n<!-- /layers -->\n"
    assert read_layers(text) == [(0, ("p.a", "p.b")), (3, ("p.c",))]
    with pytest.raises(ValueError, match="no <!-- layers --> table"):
        read_layers("no table")


def test_imports_inside_functions_and_the_lazy_table_count(tmp_path):
    pkg = tmp_path / "hybridagg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('_LAZY = {"x": "hybridagg.sub.mod"}\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..other import T\n"
        "def f():\n    from ..other import g\n"
    )
    (pkg / "other.py").write_text("")
    names = {"hybridagg", "hybridagg.sub", "hybridagg.sub.mod", "hybridagg.other"}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert imports_of(pkg / "sub" / "mod.py", names) == {"hybridagg.other"}
        assert imports_of(pkg / "__init__.py", names) == {"hybridagg.sub.mod"}
    finally:
        ROOT = saved
