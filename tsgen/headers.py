"""The hand-written CUDA library, templates/include/tsgen/*.cuh (docs/design/headers.md).

A generated source includes it (`#include "tsgen/ptx.cuh"`, ...) and every compile passes
its folder with `include_flags()`; `amalgamate` writes the one-file form a user vendors,
each header inlined once, the headers it includes before it. Pure, deterministic.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

# An include of the library, in any spelling the preprocessor takes as one (`#include "tsgen/X.cuh"`,
# indented, `# include`, a comment after it): a spelling this missed would leave the header out of
# the compile cache's key (library_digest) and out of the one-file form (amalgamate).
INCLUDE = re.compile(r'^\s*#\s*include\s*"(tsgen/\w+\.cuh)"\s*(?://.*|/\*.*\*/\s*)?$')
# The line the one-file form opens each inlined header with (render.with_contents maps them).
INLINED = re.compile(r"^// Inlined from templates/include/(\S+)$")


def templates_dir() -> Path:
    """templates/ of the source checkout this package lies in, else the copy installed as
    tsgen.templates. The checkout's own first: an editable install of another checkout maps
    tsgen.templates to that checkout's templates, which would render this one's specs."""
    checkout = Path(__file__).resolve().parents[1] / "templates"
    if (checkout / "module.cu.j2").is_file() and (checkout / "include" / "tsgen" / "ptx.cuh").is_file():
        return checkout
    try:
        import tsgen.templates as installed  # mapped from templates/ by pyproject.toml

        return Path(list(installed.__path__)[0])
    except ImportError:  # pragma: no cover - neither: a broken install
        return checkout


def include_dir() -> Path:
    """The folder `#include "tsgen/..."` resolves against (nvcc -I)."""
    return templates_dir() / "include"


def include_flags() -> list[str]:
    """nvcc's flags for a generated source: the library's include path."""
    return [f"-I{include_dir()}"]


def header_names(root: Path | None = None) -> list[str]:
    """Every header of the library, as an include names it ("tsgen/ptx.cuh"), sorted."""
    root = root or include_dir()
    return sorted(p.relative_to(root).as_posix() for p in (root / "tsgen").glob("*.cuh"))


def includes(text: str) -> list[str]:
    """The library headers `text` includes, in order."""
    return [m.group(1) for line in text.split("\n") if (m := INCLUDE.match(line))]


def closure(text: str, root: Path | None = None) -> list[str]:
    """The library headers `text` includes, directly or through each other, each once, in the
    order `amalgamate` inlines them (a header after those it includes)."""
    root = root or include_dir()
    out: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        path = root / name
        if path.is_file():  # a missing one is nvcc's error to report
            for dep in includes(path.read_text(encoding="utf-8")):
                visit(dep)
            out.append(name)

    for name in includes(text):
        visit(name)
    return out


def library_digest(text: str, root: Path | None = None) -> bytes:
    """sha256 (hex) of the names and contents of the library headers `text` includes (closure):
    what the compile cache keys on besides the source, so a header change recompiles exactly
    the sources that include it."""
    root = root or include_dir()
    h = hashlib.sha256()
    for name in closure(text, root):
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    return h.hexdigest().encode()


def amalgamate(text: str, root: Path | None = None) -> str:
    """`text` (a generated source) with each `#include "tsgen/NAME.cuh"` replaced by the header,
    the library headers it includes inlined before it (depth first, in include order), each
    header once: the first include inlines it, any later one becomes a comment, as its include
    guard would make it. ValueError for a header that is missing or includes itself back."""
    root = root or include_dir()
    done: set[str] = set()
    opened: list[str] = []
    rule = "// " + "-" * 74

    def inline(name: str) -> list[str]:
        if name in opened:
            raise ValueError(f"templates/include/{name}: includes itself back ({' -> '.join(opened + [name])})")
        if name in done:
            return []
        path = root / name
        if not path.is_file():
            raise ValueError(f"#include \"{name}\": no such header in {root}")
        opened.append(name)
        lines = path.read_text(encoding="utf-8").rstrip("\n").split("\n")
        before = [line for dep in includes("\n".join(lines)) for line in inline(dep)]
        opened.pop()
        done.add(name)
        body = [f"// {line} -- inlined above" if INCLUDE.match(line) else line for line in lines]
        return before + [rule, f"// Inlined from templates/include/{name}", rule, *body, ""]

    out: list[str] = []
    for line in text.split("\n"):
        m = INCLUDE.match(line)
        if m is None:
            out.append(line)
        elif m.group(1) in done:
            out.append(f"// {line} -- inlined above")
        else:
            out += inline(m.group(1))
    return "\n".join(out)
