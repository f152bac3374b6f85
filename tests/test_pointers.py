"""What the project tells a newcomer points at what exists: every file or folder of the checkout
named in the README, the manual (docs/*.md), the example's README, the suites and the strings of tsgen/ (its error
hints and descriptions) exists, and every install hint installs from the checkout (`pip install
".[extra]"` with an extra pyproject.toml declares; the package itself is not on the index)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT

# the folders of the checkout a path is named from
TOP = ("tsgen", "tools", "specs", "suites", "examples", "docs", "templates", "tests", "schema", "generated",
       "results", ".ci")
PATH = re.compile(r"[\w./{}<>*$-]+")
PLACEHOLDER = re.compile(r"(^|/)(NAME|OP|SUITE)(\.|/|$)|[{}<>*$]")  # generated/NAME.cu, results/<op>/...
# named in a section of the README that is not this test's to edit: (path, why it is still there)
KNOWN_STALE: dict[str, str] = {}
# tsgen's CUDA headers are named as they are included, "tsgen/ptx.cuh": below templates/include/
INCLUDE_NAME = re.compile(r"tsgen/\w+\.cuh")


def _strings(path: Path):
    """(line, text) of every string literal of a Python file: its messages, hints and docstrings."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def texts():
    """(where, text) of everything this test reads."""
    for name in ("README.md", "examples/vendor/README.md"):
        yield name, (ROOT / name).read_text()
    for p in sorted((ROOT / "docs").glob("*.md")):  # the manual the README leads to (not the lab logs)
        yield f"docs/{p.name}", p.read_text()
    for p in sorted((ROOT / "suites").glob("*.yaml")):
        yield f"suites/{p.name}", p.read_text()
    for p in sorted((ROOT / "tsgen").rglob("*.py")):
        for line, text in _strings(p):
            yield f"{p.relative_to(ROOT)}:{line}", text


def named_paths(text: str):
    """(path, the text before it) for each file (a name with an extension) or folder (a name
    ending in /) of the checkout that `text` names; placeholders and patterns are left out."""
    for m in PATH.finditer(text):
        path = m.group().removeprefix("./").rstrip(".")
        top, _, rest = path.partition("/")
        if top not in TOP or not rest or PLACEHOLDER.search(path):
            continue
        if re.search(r"\.\w+$", path.rsplit("/", 1)[-1]) or (path.endswith("/") and top != "tsgen"):
            yield path, text[max(0, m.start() - 200):m.start()]


def test_named_paths_exist():
    missing = []
    for where, text in texts():
        for path, before in named_paths(text):
            retired = "retired" in before.rsplit(". ", 1)[-1]  # "the retired tools/gpu_gemm.py": history
            where_it_is = ROOT / "templates" / "include" / path if INCLUDE_NAME.fullmatch(path) else ROOT / path
            if not where_it_is.exists() and not retired and path not in KNOWN_STALE:
                missing.append(f"{where}: {path}")
    assert missing == []


def test_the_scan_sees_paths():
    """What makes test_named_paths_exist able to fail."""
    found = {p for _, t in texts() for p, _ in named_paths(t)}
    assert {"tools/gpu_shared.sh", "examples/vendor/main.cu", "docs/design/", "specs/allgather.yaml"} <= found
    assert not {p for p, _ in named_paths("generated/NAME.cu results/<op>/x.md tools/gpu_run{2..8}.sh tsgen/abort")}


def _pyproject() -> tuple[str, set[str]]:
    """The project's name and its extras (read as text: tomllib is Python 3.11's)."""
    text = (ROOT / "pyproject.toml").read_text()
    name = re.search(r'^name = "([^"]+)"', text, re.M)[1]
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return name, set(re.findall(r"^([\w-]+) = \[", section, re.M))


def install_hints():
    """(where, what) of every `pip install WHAT` and every `.[extra]` named."""
    for where, text in texts():
        for m in re.finditer(r"pip install ([^`\n#&;)]*)", text):
            for arg in m.group(1).split():
                if not arg.startswith("-"):
                    yield where, arg.strip("'\"")
        for m in re.finditer(r"""["']?\.\[[a-zA-Z][\w,-]*\]["']?""", text):  # not a regex's .[0-9]
            yield where, m.group().strip("'\"")


def test_install_hints_install_from_the_checkout():
    project, extras = _pyproject()
    bad = []
    for where, what in install_hints():
        if m := re.fullmatch(r"\.(?:\[([\w,-]+)\])?", what):
            bad += [f"{where}: {what}: no extra {e!r} in pyproject.toml" for e in (m[1] or "").split(",")
                    if e and e not in extras]
        elif re.split(r"[\[<>=!~ ]", what)[0].lower() in (project, "tsgen"):
            bad.append(f"{where}: {what}: {project} is not on the package index; from the checkout it is "
                       f'`pip install ".[...]"`')
    assert bad == []


@pytest.mark.parametrize("hint,problem", [
    ("pip install 'tsgen-cuda[cuda13]'", "is not on the package index"),
    ('pip install ".[cuda14]"', "no extra 'cuda14'"),
])
def test_a_bad_install_hint_is_caught(monkeypatch, hint, problem):
    monkeypatch.setattr(sys.modules[__name__], "texts", lambda: iter([("x", hint)]))
    with pytest.raises(AssertionError, match=re.escape(problem)):
        test_install_hints_install_from_the_checkout()


def test_the_readme_is_a_door():
    """The README stays a door (issue 32): at most 300 lines, leading to each part of the manual."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for name in ("guide", "running", "testing", "benchmarks", "guarantees", "vendoring", "torch"):
        assert f"(docs/{name}.md)" in text, name


def test_families_md_indexes_every_family():
    """docs/design/families.md is the index of the op families: every op kind is in exactly one row
    of its table, and that row names the family's module, template and bench conventions."""
    import inspect

    from tsgen.ops import families

    text = (ROOT / "docs" / "design" / "families.md").read_text()
    rows = [ln for ln in text.split("## The index", 1)[1].split("\n## ", 1)[0].splitlines() if ln.startswith("| `")]
    for f in families():
        mine = [r for r in rows if f"`{f.kind}`" in r.split("|")[1]]
        assert len(mine) == 1, f"{f.kind}: {len(mine)} rows"
        module = Path(inspect.getsourcefile(type(f))).relative_to(ROOT).as_posix()
        named = module if "/collectives/" not in module else "tsgen/ops/collectives/<op>.py"
        for piece in (named, type(f).__name__, f"templates/ops/{f.template}", type(f.bench).__name__):
            assert piece in mine[0], f"{f.kind}: its row does not name {piece}"
