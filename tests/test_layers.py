"""The tsgen package's import graph, read from the source (no import runs): no cycle between
modules, none between layers (a subpackage such as tsgen.plan counted as one node), and no
import that runs back up from a low layer. Imports inside functions count too: a lazy import
breaks a cycle at start-up but not the dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tsgen"

# layer -> the layers it must never import (directly or inside a function)
_ABOVE_RUNTIME = {"tsgen.ops", "tsgen.spec", "tsgen.shipped", "tsgen.lowering", "tsgen.render", "tsgen.build",
                  "tsgen.harness", "tsgen.bench", "tsgen.cli", "tsgen.torch", "tsgen.plan_jobs"}
NEVER = {
    "tsgen.runtime": _ABOVE_RUNTIME,
    "tsgen.ops": {"tsgen.spec", "tsgen.shipped", "tsgen.lowering", "tsgen.render", "tsgen.build", "tsgen.harness",
                  "tsgen.bench", "tsgen.cli", "tsgen.torch", "tsgen.plan_jobs"},
    "tsgen.spec": {"tsgen.shipped", "tsgen.lowering", "tsgen.render", "tsgen.build", "tsgen.harness", "tsgen.bench",
                   "tsgen.cli", "tsgen.torch", "tsgen.plan_jobs"},
    "tsgen.harness": {"tsgen.bench", "tsgen.cli", "tsgen.torch"},
    "tsgen.torch": {"tsgen.bench", "tsgen.cli"},
}
# tsgen.plan (plans as data, their verifier and C lowering) imports nothing of tsgen outside itself
SELF_CONTAINED = ("tsgen.plan",)
# who may import these at all
ONLY_FROM = {"tsgen.cli": {"tsgen.__main__"}, "tsgen.bench": {"tsgen.cli"}}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE, lazy: bool = True) -> dict[str, set[str]]:
    """module -> the tsgen modules it imports (`from .x import name` counts as x.name where that
    is a module, else x); lazy: the imports inside functions and classes too."""
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = ast.walk(tree) if lazy else (n for top in tree.body if not isinstance(
            top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in ast.walk(top))
        found = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[: None if path.name == "__init__.py" else -1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def layer(module: str) -> str:
    """tsgen.plan.verifier -> tsgen.plan; tsgen.spec -> tsgen.spec; tsgen -> tsgen."""
    return ".".join(module.split(".")[:2])


def layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        out.setdefault(layer(m), set()).update(layer(t) for t in targets if layer(t) != layer(m))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks NEVER, SELF_CONTAINED or ONLY_FROM, as `importer -> imported`."""
    bad = []
    for m, targets in sorted(graph.items()):
        for t in sorted(targets):
            lm, lt = layer(m), layer(t)
            if lm == lt:
                continue
            if lt in NEVER.get(lm, ()) or lm in SELF_CONTAINED or (lt in ONLY_FROM and lm not in ONLY_FROM[lt]):
                bad.append(f"{m} -> {t}")
    return bad


@pytest.mark.parametrize("lazy", [False, True], ids=["module-level", "with-lazy"])
def test_no_import_cycles(lazy):
    graph = import_graph(lazy=lazy)
    assert len(graph) > 40 and "tsgen.plan.verifier" in graph
    assert cycles(graph) == [], "modules importing each other in a circle"
    assert cycles(layer_graph(graph)) == [], "layers (subpackages and top modules) importing each other in a circle"


def test_no_import_runs_back_up():
    assert upward_imports(import_graph()) == []


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    """The checks themselves: a package with plan/ importing the spec layer (lazily) shows both
    an upward import and a layer cycle."""
    pkg = tmp_path / "tsgen"
    (pkg / "plan").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "plan" / "__init__.py").write_text("")
    (pkg / "plan" / "verifier.py").write_text("def jobs():\n    from ..spec import load_spec\n")
    (pkg / "spec.py").write_text("from .plan.verifier import jobs\n")
    graph = import_graph(pkg)
    assert graph["tsgen.plan.verifier"] == {"tsgen.spec"} and graph["tsgen.spec"] == {"tsgen.plan.verifier"}
    assert cycles(graph) == [["tsgen.plan.verifier", "tsgen.spec"]]
    assert cycles(import_graph(pkg, lazy=False)) == []
    assert cycles(layer_graph(graph)) == [["tsgen.plan", "tsgen.spec"]]
    assert upward_imports(graph) == ["tsgen.plan.verifier -> tsgen.spec"]
