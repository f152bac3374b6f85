"""Spec field types: the pydantic models and annotated types every op family's spec is
built from (SpecBase, StrictModel, WorldSizes, Dtype, ...) and the checks of a spec's name.

Op families import this module; the loader (tsgen/spec.py) imports the op families. Nothing
here imports either, so there is no import circle: types <- ops <- loader.
"""

from __future__ import annotations

import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

# ---------------------------------------------------------------------------
# Field types shared by every op kind
# ---------------------------------------------------------------------------

_C_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Every keyword of C23 and C++23 with the alternative tokens (`and`, `xor`, ...): a name is
# a namespace, kernel-name prefix and file name of one generated source.
_C_KEYWORDS = frozenset(
    """alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t
    char16_t char32_t class co_await co_return co_yield compl concept const const_cast consteval
    constexpr constinit continue decltype default delete do double dynamic_cast else enum
    explicit export extern false float for friend goto if inline int long mutable namespace new
    noexcept not not_eq nullptr operator or or_eq private protected public register
    reinterpret_cast requires restrict return short signed sizeof static static_assert
    static_cast struct switch template this thread_local throw true try typedef typeid typename
    typeof typeof_unqual union unsigned using virtual void volatile wchar_t while xor xor_eq""".split()
)
# Prefixes of whole families of declared names: tsgen's own (namespace tsgen, TSGEN_TIMEOUT_NS)
# and the CUDA headers' (cudaMalloc, cuMemAlloc, CUresult, nv_bfloat16, NVSHMEM..., PFN_cu...).
_RESERVED_PREFIX = re.compile(r"(?i:tsgen)|cuda|cu[A-Z]|CU|nv[A-Z_]|nvshmem|NV|PFN_")


def name_problem(value: str, header_names: bool = True) -> str | None:
    """Why `value` cannot be a spec's name, or None. `header_names`: also refuse what the
    headers of a generated source declare (tsgen/header_names.py, from tools/reserved_names.py)."""
    if not _C_IDENT.match(value):
        return f"{value!r} is not a C identifier (letters, digits and '_', not starting with a digit)"
    if value in _C_KEYWORDS:
        return f"{value!r} is a C/C++ keyword"
    if value.startswith("_") or len(value) > 64:
        return f"{value!r}: names may not start with '_' or exceed 64 characters"
    if value.upper() == value:
        return f"{value!r}: a name needs a lowercase letter (all capitals is the macro namespace: EOF, NULL, ...)"
    if _RESERVED_PREFIX.match(value):
        return f"{value!r}: names starting with tsgen, cuda, cu[A-Z], CU, nv[A-Z_], nvshmem, NV or PFN_ are reserved"
    if header_names:
        from .header_names import HEADER_NAMES

        if value in HEADER_NAMES:
            return f"{value!r} is already declared in a generated source (by the CUDA, C or NVSHMEM headers it includes)"
    return None


def _check_c_identifier(value: str) -> str:
    problem = name_problem(value)
    if problem:
        raise ValueError(problem)
    return value


CIdentifier = Annotated[str, AfterValidator(_check_c_identifier)]


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, int) and not isinstance(value, bool) else value


def _check_world_sizes(value: list[int]) -> list[int]:
    if len(set(value)) != len(value):
        raise ValueError(f"world sizes {value} repeat a value")
    return sorted(value)


WorldSize = Annotated[int, Field(ge=2, le=8)]
WorldSizes = Annotated[
    list[WorldSize],
    BeforeValidator(_as_list),
    Field(min_length=1, max_length=7),
    AfterValidator(_check_world_sizes),
]

Dtype = Literal["uint8", "int32", "uint32", "float32", "float16", "bfloat16"]
Scope = Literal["cta", "gpu", "sys"]


def _ints_only(tp: Any) -> bool:
    """`tp` is a Literal of whole numbers (or a union of those with None): strict mode refuses a
    bool or float for a plain int by itself, but a Literal compares by value."""
    origin = get_origin(tp)
    if origin is Literal:
        return all(type(a) is int for a in get_args(tp))
    if origin is Annotated:
        return _ints_only(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return bool(args) and all(_ints_only(a) for a in args)
    return False


def _not_whole(value: Any, tp: Any) -> Any:
    """The first bool or float in `value` where `tp` (a field's type, a list's items) takes whole
    numbers only; None when there is none."""
    if get_origin(tp) is list and isinstance(value, list):
        return next((bad for v in value if (bad := _not_whole(v, get_args(tp)[0])) is not None), None)
    return value if _ints_only(tp) and isinstance(value, (bool, float)) else None


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _whole_numbers_only(cls, value: Any, info: ValidationInfo) -> Any:
        """Strict mode refuses 2.0 and true for an int, but a Literal[64, 128] compares by value
        (2.0 == 2, True == 1): refuse them there too, for every field of every spec model."""
        bad = _not_whole(value, cls.model_fields[info.field_name].annotation)
        if bad is not None:
            raise ValueError(f"{bad!r} is a {type(bad).__name__}, not a whole number")
        return value


class Launch(StrictModel):
    """Launch shape and copy tuning; compile-time constants of the kernel."""

    blocks: int = Field(32, ge=1, le=1024, description="thread blocks per rank")
    threads: int = Field(512, ge=32, le=1024, multiple_of=32, description="threads per block")
    unroll: int = Field(4, ge=1, le=16, description="16-byte loads in flight per thread")


class Sync(StrictModel):
    """Waiting behaviour of every spin loop in the kernel."""

    timeout_ms: int = Field(
        10000,
        ge=0,
        le=3_600_000,
        description="a wait that sees no signal for this long prints who waited for what "
        "and traps; 0 turns the timeout off",
    )


class TestConfig(StrictModel):
    """Defaults for `tsgen test` (the command line can override them)."""

    count: int = Field(1_000_003, ge=1, le=1 << 31, description="elements per rank")
    iters: int = Field(100, ge=1, le=100_000, description="back-to-back calls, no reset")


class SpecBase(StrictModel):
    """Fields every spec has; op families subclass this and add `op` and `params`."""

    name: CIdentifier = Field(description="module name: file name and kernel-name prefix")
    description: str = Field("", max_length=2000, description="free text, kept in a comment")
    world_sizes: WorldSizes = Field(
        description="ranks the kernels are compiled for (one kernel per world size)"
    )
    launch: Launch = Launch()
    sync: Sync = Sync()
    test: TestConfig = TestConfig()
