"""Spec loading: YAML file -> typed, validated model of one op kind.

Every problem is reported as ``FILE:LINE:COL: field: what is wrong``; a
problem anywhere means nothing is rendered. The YAML is composed into nodes
first so every field keeps its position, then validated by the op family's
pydantic model (strict: no silent string -> int coercion, no unknown keys).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
)

from .errors import SpecError

# ---------------------------------------------------------------------------
# Field types shared by every op kind
# ---------------------------------------------------------------------------

_C_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_C_KEYWORDS = frozenset(
    """auto break case char const continue default do double else enum extern
    float for goto if inline int long register restrict return short signed
    sizeof static struct switch typedef union unsigned void volatile while
    bool true false class namespace template typename this new delete
    operator private protected public virtual friend asm""".split()
)


def _check_c_identifier(value: str) -> str:
    if not _C_IDENT.match(value):
        raise ValueError(
            f"{value!r} is not a C identifier (letters, digits and '_', not starting with a digit)"
        )
    if value in _C_KEYWORDS:
        raise ValueError(f"{value!r} is a C/C++ keyword")
    if value.startswith("__") or len(value) > 64:
        raise ValueError(f"{value!r}: names may not start with '__' or exceed 64 characters")
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


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


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


# ---------------------------------------------------------------------------
# YAML with positions
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Pos:
    line: int
    col: int


class _Located:
    """Maps a field path (tuple of keys / indices) to its YAML position."""

    def __init__(self) -> None:
        self.value_pos: dict[tuple, Pos] = {}
        self.key_pos: dict[tuple, Pos] = {}

    def find(self, path: tuple) -> Pos:
        # The value's own position if we have it, else the key's, else the
        # nearest parent's: a missing field points at the mapping it belongs in.
        for n in range(len(path), -1, -1):
            p = tuple(path[:n])
            if n == len(path) and p in self.key_pos:
                return self.key_pos[p]
            if p in self.value_pos:
                return self.value_pos[p]
        return Pos(1, 1)


def _mark(node: yaml.Node) -> Pos:
    return Pos(node.start_mark.line + 1, node.start_mark.column + 1)


_MAP_TAG, _SEQ_TAG = "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"


def _scalar(node: yaml.Node) -> Any:
    """A scalar's value by the safe loader's rules (int, bool, float, null, str): an
    empty value is null; an unknown or unsafe tag raises ConstructorError with its mark."""
    return yaml.SafeLoader("").construct_object(node)


def _construct(node: yaml.Node, path: tuple, loc: _Located, problems: list[tuple[Pos, str, str]]):
    """Plain-Python value of a composed node, recording positions as it goes."""
    loc.value_pos[path] = _mark(node)
    if not isinstance(node, yaml.ScalarNode) and node.tag not in (_MAP_TAG, _SEQ_TAG):
        # as the safe loader would: a tag on a list or mapping is not silently dropped
        raise yaml.constructor.ConstructorError(
            None, None, f"could not determine a constructor for the tag {node.tag!r}", node.start_mark
        )
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                problems.append((_mark(key_node), _dotted(path), "keys must be plain names, not lists or mappings"))
                continue
            key = _scalar(key_node)
            child = path + (key,)
            loc.key_pos[child] = _mark(key_node)
            if key in out:
                problems.append((_mark(key_node), _dotted(child), "duplicate key"))
            out[key] = _construct(value_node, child, loc, problems)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(v, path + (i,), loc, problems) for i, v in enumerate(node.value)]
    # Scalars: let the safe constructor resolve ints, bools, floats, nulls.
    return _scalar(node)


def _dotted(path: tuple) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<spec>"


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedSpec:
    """A validated spec plus where it came from."""

    path: Path
    text: str
    model: SpecBase

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def name(self) -> str:
        return self.model.name


def _fmt(path: Path, pos: Pos, field: str, msg: str) -> str:
    return f"{path}:{pos.line}:{pos.col}: {field}: {msg}"


def _pydantic_message(err: dict) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        return "unknown key"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return msg


def load_spec(path: str | Path, display_path: str | None = None) -> LoadedSpec:
    """Read, parse and validate one spec file; raise SpecError listing every problem."""
    from .ops import get_family, family_names  # late import: ops import this module

    path = Path(path)
    shown = Path(display_path) if display_path else path
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([f"{shown}:1:1: <file>: no such file"]) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise SpecError([f"{shown}:1:1: <file>: cannot read: {e}"]) from None

    def yaml_problem(e: yaml.MarkedYAMLError, what: str) -> SpecError:
        mark = e.problem_mark or e.context_mark
        pos = Pos(mark.line + 1, mark.column + 1) if mark else Pos(1, 1)
        return SpecError([_fmt(shown, pos, "<yaml>", f"{what}: {e.problem}")])

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        raise yaml_problem(e, "YAML syntax error") from None
    if root is None or not isinstance(root, yaml.MappingNode):
        raise SpecError([_fmt(shown, Pos(1, 1), "<spec>", "a spec is a YAML mapping of fields")])

    loc = _Located()
    structural: list[tuple[Pos, str, str]] = []
    try:
        data = _construct(root, (), loc, structural)
    except yaml.MarkedYAMLError as e:  # a tag the safe loader does not construct
        raise yaml_problem(e, "YAML value not allowed") from None
    if structural:
        raise SpecError([_fmt(shown, p, f, m) for p, f, m in structural])

    op = data.get("op")
    if op is None:
        raise SpecError([_fmt(shown, loc.find(("op",)), "op", f"missing; one of: {', '.join(family_names())}")])
    try:
        family = get_family(op)
    except KeyError:
        raise SpecError(
            [_fmt(shown, loc.find(("op",)), "op", f"unknown op {op!r}; one of: {', '.join(family_names())}")]
        ) from None

    try:
        model = family.Spec.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            field_path = tuple(err["loc"])
            problems.append(_fmt(shown, loc.find(field_path), _dotted(field_path), _pydantic_message(err)))
        raise SpecError(problems) from None
    problems = [
        _fmt(shown, loc.find(field_path), _dotted(field_path), msg)
        for field_path, msg in family.check(model)
    ]
    if problems:
        raise SpecError(problems)
    return LoadedSpec(path=shown, text=text, model=model)


def spec_files(paths: list[str | Path]) -> list[Path]:
    """Expand folders into their *.yaml / *.yml files (sorted); files pass through."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.iterdir() if q.suffix in (".yaml", ".yml"))
        else:
            out.append(p)
    return out
