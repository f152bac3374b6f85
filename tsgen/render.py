"""Rendering: lowered spec (tsgen.lowering) -> (NAME.cu, NAME.json), byte-identical every time.

The op templates under templates/ops/ extend templates/module.cu.j2 and fill in its blocks:
the op's constants, tables, device code and entry points. The hand-written CUDA library under
templates/include/tsgen/ never passes through Jinja: a source `#include`s it (the thin form,
generated/), or has it inlined once per header (`amalgamated=True`, the one file `tsgen build
--amalgamate` writes; tsgen.headers.amalgamate). See docs/design/headers.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jinja2

from .files import atomic_write, sweep_temps, write_if_different  # noqa: F401 (re-exported)
from .manifest import entry_points
from .lowering import Lowered, banner_first_line, comment_line, lower, spec_display_path  # noqa: F401 (re-exported)
from .ops.base import ModuleAbi
from .headers import INCLUDE, INLINED, amalgamate, templates_dir  # noqa: F401 (templates_dir re-exported)
from .plan.lower import header_defines
from .spec import LoadedSpec


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

    def library_defines(name: str) -> str:
        """The `#define`s a source sets before including header `name` (tsgen.plan.lower.C_DEFINES),
        after checking the header against them."""
        defines = header_defines(name, (root / "include" / name).read_text(encoding="utf-8"))
        return "\n".join(f"#define {k} {v}" for k, v in defines.items())

    env.globals["library_defines"] = library_defines

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


def render_source(lowered: Lowered, skew: int | str | None = None, amalgamated: bool = False) -> str:
    """NAME.cu: the lowered spec's template inputs substituted into its template; it includes the
    library (tsgen/*.cuh), or with `amalgamated` has it inlined (the one-file form). `skew`
    (tests only, never in shipped sources): every block of every rank waits a seeded, varying
    time before its call's work (templates/module.cu.j2), so on a shared GPU a missing wait
    or fence shows up as it would over NVLink; "lag" / "lag_blocks": the fixed schedules of the
    negative controls (rank 0 first, templates/ops/skew.j2). Ops with their own entry points ignore it."""
    text = environment().get_template(f"ops/{lowered.template}").render(**lowered.template_inputs, skew=skew)
    return with_contents(amalgamate(text) if amalgamated else text, lowered.name)


def with_contents(text: str, module: str) -> str:
    """`text` with a map inserted after its banner: the lines that include the library (or, in
    the one-file form, where each inlined header begins), where the op's own code begins (the
    `namespace MODULE {` that templates/module.cu.j2 opens, the one followed by its
    `namespace ptx = ...` line) and where each extern "C" entry point is defined, as line numbers
    of the returned text: the map lets a reader go to the op first. Pure and deterministic."""
    lines = text.split("\n")
    at = next((i for i, line in enumerate(lines) if not line.startswith("//")), 0)
    inlined = [(i - 1, m.group(1)) for i, line in enumerate(lines) if (m := INLINED.match(line))]
    headers = inlined or [(i, m.group(1)) for i, line in enumerate(lines) if (m := INCLUDE.match(line))]
    op = next((i for i, line in enumerate(lines[:-1]) if line == f"namespace {module} {{"
               and lines[i + 1].startswith("namespace ptx = tsgen::ptx;")), None)
    entries = entry_points(lines)

    def block(shift: int) -> list[str]:
        n = lambda i: i + 1 + shift  # noqa: E731 - a line number of the returned text
        out = ["// Contents (line numbers of this file):"]
        if headers:
            out.append(f"//   {n(headers[0][0])}: the hand-written library, {'inlined' if inlined else 'included'}: "
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


def render(spec: LoadedSpec | Lowered, base: Path | None = None, skew: int | str | None = None,
           amalgamated: bool = False) -> Rendered:
    """Render one spec (lowering it first unless it is lowered already); `base` is the folder
    spec paths in banners are relative to (lowering's). `skew`, `amalgamated`: render_source's."""
    lowered = spec if isinstance(spec, Lowered) else lower(spec, base)
    return Rendered(lowered.name, render_source(lowered, skew, amalgamated), lowered.manifest.to_json(), lowered)

