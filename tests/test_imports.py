"""No import circles inside tsgen/: the graph of which tsgen module imports which, read
from the sources (module-level imports and the imports inside functions alike: an import
moved into a function to break a circle still counts), has no cycle; and every module
imports on its own in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tsgen"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _own(name: str) -> str | None:
    """The tsgen module `name` is, or the nearest package holding it."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _with_packages(name: str) -> list[str]:
    """Importing a.b.c runs a/__init__, a/b/__init__ and then a/b/c."""
    parts = name.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in MODULES]


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        is_package = path.name == "__init__.py"
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node)
                # `from . import x` / `from .ops import base` import submodules too
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                own = _own(target)
                if own:
                    out.update(_with_packages(own))
        out.discard(module)
        # a package's own parents are imported before it: not an edge of its own making
        graph[module] = {m for m in out if not module.startswith(m + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_sees_the_layers():
    graph = import_graph()
    assert "tsgen.spec_types" in graph["tsgen.ops.base"]
    assert "tsgen.ops" in graph["tsgen.spec"]
    assert not {m for m in graph["tsgen.spec_types"] if m.startswith(("tsgen.ops", "tsgen.spec."))}


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("first", ["tsgen.spec_types", "tsgen.ops.base", "tsgen.ops.collectives",
                                   "tsgen.spec", "tsgen.render", "tsgen.build", "tsgen.cli"])
def test_each_layer_imports_first_in_a_fresh_interpreter(first):
    """Importing a module first, before anything else of tsgen, works: a circle broken only
    by the order modules happen to be imported in would fail for one of these."""
    subprocess.run([sys.executable, "-c", f"import {first}"], check=True, cwd=ROOT)
