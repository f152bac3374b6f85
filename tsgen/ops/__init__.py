"""Registry of op families: the table of what exists.

Adding an op kind = one module here with its family (spec schema, module ABI,
reference) + one template under templates/ops/, listed in _MODULES.
"""

from __future__ import annotations

from .base import OpFamily
from . import all_to_all_v, attention, collectives, cp_attention, fused, gemm, grid_gemm, moe, primitives, ulysses

_MODULES = [primitives, collectives, all_to_all_v, gemm, fused, grid_gemm, attention, ulysses, cp_attention, moe]

_FAMILIES: dict[str, OpFamily] = {}
for _module in _MODULES:
    for _family in _module.FAMILIES:
        assert _family.kind not in _FAMILIES, f"op kind {_family.kind} defined twice"
        _FAMILIES[_family.kind] = _family


def get_family(kind: str) -> OpFamily:
    """The family of op `kind`; KeyError if there is none."""
    if not isinstance(kind, str):
        raise KeyError(kind)
    return _FAMILIES[kind]


def family_names() -> list[str]:
    return sorted(_FAMILIES)


def families() -> list[OpFamily]:
    return [_FAMILIES[k] for k in family_names()]
