"""Registry of op families: the table of what exists.

Adding an op kind = one module here with its family (spec schema, module ABI,
reference, and what it is: `category`, `gpu_sweep`, ... on the family, tsgen/ops/base.py)
+ one template under templates/ops/, listed in _MODULES. Everything else selects ops
through `families(category=..., gpu_sweep=...)` here, or shipped specs through
tsgen.shipped.shipped_specs, never through lists of op kinds of its own.
"""

from __future__ import annotations

from .base import CATEGORIES, GPU_SWEEPS, OpFamily
from . import all_to_all_v, attention, attention_backward, collectives, cp_attention, fused, gemm, grid_gemm, moe, primitives, ulysses

_MODULES = [primitives, collectives, all_to_all_v, gemm, fused, grid_gemm, attention, attention_backward, ulysses, cp_attention, moe]

_FAMILIES: dict[str, OpFamily] = {}
for _module in _MODULES:
    for _family in _module.FAMILIES:
        assert _family.kind not in _FAMILIES, f"op kind {_family.kind} defined twice"
        assert getattr(_family, "category", None) in CATEGORIES, \
            f"op kind {_family.kind}: category {getattr(_family, 'category', None)!r} is not one of {CATEGORIES}"
        assert _family.gpu_sweep in GPU_SWEEPS, f"op kind {_family.kind}: gpu_sweep {_family.gpu_sweep!r}"
        _FAMILIES[_family.kind] = _family


def get_family(kind: str) -> OpFamily:
    """The family of op `kind`; KeyError if there is none."""
    if not isinstance(kind, str):
        raise KeyError(kind)
    return _FAMILIES[kind]


def family_names() -> list[str]:
    return sorted(_FAMILIES)


_ANY = object()


def families(category: str | None = None, gpu_sweep=_ANY) -> list[OpFamily]:
    """The families, sorted by kind; with `category` (one of base.CATEGORIES) or `gpu_sweep`
    (one of base.GPU_SWEEPS, None included) given, those that declare it."""
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"category {category!r}: one of {', '.join(CATEGORIES)}")
    if gpu_sweep is not _ANY and gpu_sweep not in GPU_SWEEPS:
        raise ValueError(f"gpu_sweep {gpu_sweep!r}: one of {', '.join(map(str, GPU_SWEEPS))}")
    return [f for f in (_FAMILIES[k] for k in family_names())
            if (category is None or f.category == category) and (gpu_sweep is _ANY or f.gpu_sweep == gpu_sweep)]
