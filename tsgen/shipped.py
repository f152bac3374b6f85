"""The specs shipped in specs/, loaded once and selected by their families' attributes.

Tests and tools ask here for "the specs of the collective GPU sweep" or "every attention
spec" (tsgen/ops/base.py, Selection) instead of keeping lists of op or spec names, or
searching YAML text. A spec that does not load raises its SpecError here (test_spec.py
names it). Loader level: imports the ops and the spec loader, is imported by neither.
"""

from __future__ import annotations

import functools
from pathlib import Path

from .ops import get_family
from .spec import LoadedSpec, load_spec

SPECS_DIR = Path(__file__).resolve().parents[1] / "specs"
_ANY = object()


@functools.lru_cache(maxsize=None)
def _all(folder: Path) -> tuple[LoadedSpec, ...]:
    if not folder.is_dir():  # an installed package ships no specs/
        return ()
    return tuple(load_spec(p) for p in sorted(folder.glob("*.yaml")))


def shipped(op: str | None = None, category: str | None = None, gpu_sweep=_ANY, transport: str | None = None,
            multimem: bool | None = None, folder: Path = SPECS_DIR) -> list[LoadedSpec]:
    """The loaded specs of `folder` (sorted by file name) whose op is `op`, whose family has
    `category` / `gpu_sweep`, whose transport (OpFamily.transport) is `transport`, and that
    are (True) or are not (False) NVLink-multicast variants; None / not given: any."""
    out = []
    for loaded in _all(Path(folder)):
        spec = loaded.model
        family = get_family(spec.op)
        if ((op is None or spec.op == op) and (category is None or family.category == category)
                and (gpu_sweep is _ANY or family.gpu_sweep == gpu_sweep)
                and (transport is None or family.transport(spec) == transport)
                and (multimem is None or family.is_multimem(spec) == multimem)):
            out.append(loaded)
    return out


def shipped_specs(**filters) -> list[Path]:
    """The paths of `shipped(**filters)`."""
    return [loaded.path for loaded in shipped(**filters)]
