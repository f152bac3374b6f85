"""Rendering: lowered spec (tsgen.lowering) -> (NAME.cu, NAME.json), byte-identical every time.

Hand-written CUDA headers under templates/include/ are pasted in verbatim
(they never pass through Jinja, so CUDA braces need no escaping); the op
templates under templates/ops/ extend templates/module.cu.j2 and fill in
one block: the op's device body.
"""

from __future__ import annotations

import re

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jinja2

from .files import atomic_write, sweep_temps, write_if_different  # noqa: F401 (re-exported)
from .manifest import entry_points
from .lowering import Lowered, banner_first_line, comment_line, lower, spec_display_path  # noqa: F401 (re-exported)
from .ops.base import ModuleAbi
from .plan.lower import emit_defines
from .spec import LoadedSpec


def templates_dir() -> Path:
    """templates/ of the source checkout this package lies in, else the copy installed as
    tsgen.templates. The checkout's own first: an editable install of another checkout maps
    tsgen.templates to that checkout's templates, which would render this one's specs."""
    checkout = Path(__file__).resolve().parents[1] / "templates"
    if (checkout / "module.cu.j2").is_file() and (checkout / "include" / "tsgen_ptx.cuh").is_file():
        return checkout
    try:
        import tsgen.templates as installed  # mapped from templates/ by pyproject.toml

        return Path(list(installed.__path__)[0])
    except ImportError:  # pragma: no cover - neither: a broken install
        return checkout


@lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    root = templates_dir()
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )

    def inline_header(name: str) -> str:
        text = emit_defines(name, (root / "include" / name).read_text(encoding="utf-8"))
        rule = "// " + "-" * 74
        return f"{rule}\n// Inlined from templates/include/{name}\n{rule}\n{text.rstrip()}\n"

    env.globals["inline_header"] = inline_header

    return env


@dataclass(frozen=True)
class Rendered:
    name: str
    source: str  # NAME.cu
    manifest: str  # NAME.json
    lowered: Lowered  # what the source was rendered from: the module ABI, the Manifest

    @property
    def abi(self) -> ModuleAbi:
        """The module ABI: buffers, kernels and constants."""
        return self.lowered.abi

    def files(self) -> dict[str, str]:
        return {f"{self.name}.cu": self.source, f"{self.name}.json": self.manifest}


def render_source(lowered: Lowered, skew: int | str | None = None) -> str:
    """NAME.cu: the lowered spec's template inputs substituted into its template. `skew`
    (tests only, never in shipped sources): every block of every rank waits a seeded, varying
    time before its call's work (templates/module.cu.j2), so on a shared GPU a missing wait
    or fence shows up as it would over NVLink; "lag" / "lag_blocks": the fixed schedules of the
    negative controls (rank 0 first, templates/ops/skew.j2). Ops with their own entry points ignore it."""
    text = environment().get_template(f"ops/{lowered.template}").render(**lowered.template_inputs, skew=skew)
    return with_contents(text, lowered.name)


_INLINED = re.compile(r"^// Inlined from templates/include/(\S+)$")


def with_contents(text: str, module: str) -> str:
    """`text` with a map inserted after its banner: the line where the inlined library begins
    (and each of its headers), where the op's own code begins (`namespace MODULE {` after the
    library) and where each extern "C" entry point is defined, as line numbers of the returned
    text. The library must come first in one self-contained C++ file; the map lets a reader go
    to the op first. Pure and deterministic."""
    lines = text.split("\n")
    at = next((i for i, line in enumerate(lines) if not line.startswith("//")), 0)
    headers = [(i - 1, m.group(1)) for i, line in enumerate(lines) if (m := _INLINED.match(line))]
    after = headers[-1][0] if headers else at
    op = next((i for i, line in enumerate(lines) if i > after and line.startswith(f"namespace {module} {{")), None)
    entries = entry_points(lines)

    def block(shift: int) -> list[str]:
        n = lambda i: i + 1 + shift  # noqa: E731 - a line number of the returned text
        out = ["// Contents (line numbers of this file):"]
        if headers:
            out.append(f"//   {n(headers[0][0])}: the hand-written library, inlined: "
                       + ", ".join(f"{name} {n(i)}" for i, name in headers))
        if op is not None:
            out.append(f"//   {n(op)}: the op's own code (namespace {module}: constants, tables, device code)")
        if entries:
            out.append("//   entry points (extern \"C\"):")
            row = "//    "
            for i, name in entries:
                item = f" {name} {n(i)},"
                if len(row) + len(item) > 110:
                    out.append(row.rstrip(","))
                    row = "//    "
                row += item
            out.append(row.rstrip(","))
        return out + ["//"]

    size = len(block(0))
    while len(block(size)) != size:  # the numbers' widths can change the wrapping
        size = len(block(size))
    return "\n".join(lines[:at] + block(size) + lines[at:])


def render(spec: LoadedSpec | Lowered, base: Path | None = None, skew: int | str | None = None) -> Rendered:
    """Render one spec (lowering it first unless it is lowered already); `base` is the folder
    spec paths in banners are relative to (lowering's). `skew`: render_source's."""
    lowered = spec if isinstance(spec, Lowered) else lower(spec, base)
    return Rendered(lowered.name, render_source(lowered, skew), lowered.manifest.to_json(), lowered)

