"""Spec loading: YAML file -> typed, validated model of one op kind; and variants of a
loaded spec (spec_variant), validated the same way.

Every problem is reported as ``FILE:LINE:COL: field: what is wrong``; a
problem anywhere means nothing is rendered. The YAML is composed into nodes
first so every field keeps its position, then validated by the op family's
pydantic model (strict: no silent string -> int coercion, no unknown keys).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .errors import SpecError
from .ops import family_names, get_family
from .spec_types import SpecBase

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


# Scalar tags a spec may use, spelled out or implied (`x: 2020-01-01` is a timestamp).
_SCALAR_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "int", "float", "str", "timestamp")}
MAX_DEPTH = 32  # lists and mappings nested in a spec (the shipped ones need 3)


def _not_allowed(problem: str, node_or_event) -> yaml.constructor.ConstructorError:
    return yaml.constructor.ConstructorError(None, None, problem, node_or_event.start_mark)


# The numbers every YAML reader agrees on (YAML 1.2's core schema): PyYAML implements YAML 1.1,
# which also reads 040 as 32 (octal), 1:04 as 64 (base 60), 1_0_ as 10 and 0b11 as 3.
_INT_12 = re.compile(r"[-+]?(?:0|[1-9][0-9]*)|0x[0-9a-fA-F]+")
_FLOAT_12 = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?")


def _number_problem(node: yaml.ScalarNode, value: Any) -> str | None:
    """Why an int or float scalar is not a number a spec may hold, or None: a form only YAML 1.1
    reads (and reads otherwise than YAML 1.2 or a person would), or a float that is not finite."""
    text = node.value
    if node.tag.endswith(":int") and not _INT_12.fullmatch(text) or (
            node.tag.endswith(":float") and ("_" in text or ":" in text)):
        form = ("base-60 (sexagesimal)" if ":" in text else "'_'-separated" if "_" in text
                else "binary" if "b" in text.lower() else "leading-zero octal")
        return (f"{text!r} is a {form} number, which only YAML 1.1 reads (as {value!r}): "
                f"write {value!r} in plain decimal")
    if isinstance(value, float) and not math.isfinite(value):
        if _FLOAT_12.fullmatch(text.strip()) is None:  # .inf, .nan
            return f"{text!r} is not a finite number"
        return f"{text!r} is too large for a float (it reads as infinity)"
    return None


def _scalar(node: yaml.Node) -> Any:
    """A scalar's value by the safe loader's rules (int, bool, float, null, str): an empty
    value is null; another tag, or a value its tag cannot read (`!!int x`, `!!bool maybe`,
    an int of 5000 digits), raises ConstructorError with its mark, and so does a number
    only YAML 1.1 reads (040, 1:04, 1_0_) or a float that is not finite (.inf, .nan, 1.0e999)."""
    if node.tag not in _SCALAR_TAGS:
        raise _not_allowed(f"could not determine a constructor for the tag {node.tag!r}", node)
    try:
        value = yaml.SafeLoader("").construct_object(node)
    except (ValueError, LookupError, AttributeError, TypeError, OverflowError):
        raise _not_allowed(f"{node.value[:40]!r} is not a valid !!{node.tag.rsplit(':', 1)[1]}", node) from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        problem = _number_problem(node, value)
        if problem:
            raise _not_allowed(problem, node)
    return value


class _SpecLoader(yaml.SafeLoader):
    """The safe loader's composer, refusing aliases (each use of an anchor is built again:
    a few hundred bytes of `&a [*b, *b, ...]` grow to gigabytes) and nesting deeper than
    MAX_DEPTH (the composer recurses); both as a ConstructorError at the offending node."""

    depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _not_allowed(f"alias *{event.anchor}: a spec writes every value out (no anchors and aliases)", event)
        if self.depth >= MAX_DEPTH:
            raise _not_allowed(f"lists and mappings nested deeper than {MAX_DEPTH} levels", event)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _construct(node: yaml.Node, path: tuple, loc: _Located, problems: list[tuple[Pos, str, str]]):
    """Plain-Python value of a composed node, recording positions as it goes."""
    loc.value_pos[path] = _mark(node)
    if not isinstance(node, yaml.ScalarNode) and node.tag not in (_MAP_TAG, _SEQ_TAG):
        # as the safe loader would: a tag on a list or mapping is not silently dropped
        raise _not_allowed(f"could not determine a constructor for the tag {node.tag!r}", node)
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
    # a variant's changes to the spec file, `key = value` (spec_variant); () for the file itself
    changes: tuple[str, ...] = ()
    # world size -> the comm plan its kernels run (OpFamily.comm_plans), built once when the
    # spec was validated; {} for families without plans. tsgen.lowering reads them from here.
    plans: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def name(self) -> str:
        return self.model.name


def _fmt(path: Path, pos: Pos, field: str, msg: str) -> str:
    return f"{path}:{pos.line}:{pos.col}: {field}: {msg}"


MAX_SPEC_BYTES = 1 << 20


def _read_text(path: Path, shown: Path) -> str:
    """The UTF-8 text of a regular file of at most MAX_SPEC_BYTES; SpecError for anything
    else (a folder, a FIFO, a device, a symlink loop, a name too long, a bad byte)."""

    def cannot(why: str, pos: Pos = Pos(1, 1)) -> SpecError:
        return SpecError([_fmt(shown, pos, "<file>", why)])

    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise cannot("no such file") from None
    except OSError as e:
        raise cannot(f"cannot read: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise cannot("cannot read: " + ("is a directory" if stat.S_ISDIR(mode) else "not a regular file"))
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_SPEC_BYTES + 1)
        except OSError as e:
            raise cannot(f"cannot read: {e.strerror or e}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise cannot(f"cannot read: larger than {MAX_SPEC_BYTES >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = data.rfind(b"\n", 0, e.start) + 1
        pos = Pos(data.count(b"\n", 0, e.start) + 1, e.start - line_start + 1)
        raise cannot(f"not UTF-8 text: byte 0x{data[e.start]:02x}", pos) from None


def _yaml_problem(e: yaml.YAMLError, text: str) -> tuple[Pos, str, str]:
    """Position, field and message of any error of the YAML loader."""
    if isinstance(e, yaml.reader.ReaderError):  # a control character (NUL, ESC, DEL, U+FFFE ...)
        line_start = text.rfind("\n", 0, e.position) + 1
        pos = Pos(text.count("\n", 0, e.position) + 1, e.position - line_start + 1)
        return pos, "<yaml>", f"YAML syntax error: character U+{e.character:04X} is not allowed"
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    pos = Pos(mark.line + 1, mark.column + 1) if mark else Pos(1, 1)
    what = "YAML value not allowed" if isinstance(e, yaml.constructor.ConstructorError) else "YAML syntax error"
    return pos, "<yaml>", f"{what}: {getattr(e, 'problem', None) or e}"


def _pydantic_message(err: dict) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        return "unknown key"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return msg


def load_spec(path: str | Path, display_path: str | None = None) -> LoadedSpec:
    """Read, parse and validate one spec file; raise SpecError listing every problem."""
    path = Path(path)
    shown = Path(display_path) if display_path else path
    text = _read_text(path, shown)
    loc = _Located()
    structural: list[tuple[Pos, str, str]] = []
    try:
        root = yaml.compose(text, Loader=_SpecLoader)
        if root is None or not isinstance(root, yaml.MappingNode):
            raise SpecError([_fmt(shown, Pos(1, 1), "<spec>", "a spec is a YAML mapping of fields")])
        data = _construct(root, (), loc, structural)
    except yaml.YAMLError as e:
        raise SpecError([_fmt(shown, *_yaml_problem(e, text))]) from None
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

    model, plans = _validate(family, data, shown, loc)
    return LoadedSpec(path=shown, text=text, model=model, plans=plans)


def _validate(family, data: dict, shown: Path, loc: _Located, after: str = "") -> tuple[SpecBase, dict[int, Any]]:
    """The family's model of `data` and its comm plans: field types, then the family's
    cross-field checks, then (the plans built, once) what only the plans show; every problem
    of the first of these that has any as a SpecError, each line ending in `after`."""
    try:
        model = family.Spec.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            field_path = tuple(err["loc"])
            problems.append(_fmt(shown, loc.find(field_path), _dotted(field_path), _pydantic_message(err)) + after)
        raise SpecError(problems) from None
    def report(found: list[tuple[tuple, str]]) -> None:
        if found:
            raise SpecError([_fmt(shown, loc.find(path), _dotted(path), msg) + after for path, msg in found])

    report(family.check(model))
    plans = family.comm_plans(model)
    report(family.check_plans(model, plans))
    return model, plans


# ---------------------------------------------------------------------------
# Variants: a spec with some fields changed (spec_variant)
# ---------------------------------------------------------------------------


def merge(base: dict, updates: dict) -> dict:
    """`base` with `updates` merged in, nested mappings key by key ({"launch": {"blocks": 64}}
    changes only launch.blocks); neither is modified."""
    out = dict(base)
    for key, value in updates.items():
        out[key] = merge(base.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def _flat(updates: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in sorted(updates.items()):
        out += _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]
    return out


def describe_variant(updates: dict) -> str:
    """`launch.blocks = 66, world_sizes = [8]`: what a variant changed, for output and results."""
    return ", ".join(f"{k} = {v}" for k, v in _flat(updates))


def spec_variant(loaded: LoadedSpec, updates: dict) -> LoadedSpec:
    """THE way to make "this spec with these changes": `loaded` with `updates` merged in
    (nested: {"launch": {"blocks": 64}}), validated exactly as load_spec validates a file
    (field types, then the family's cross-field checks; problems as SpecError, each ending in
    "(in the variant ...)"). Deterministic: the same spec and updates give the same variant.
    Its name is the spec's unless `updates` sets `name` (the dtype matrix does). Each change is
    appended to its text as a `# variant: key = value` line, so its sha256 (and the cache
    entry, manifest and banner made from it) names the variant, and recorded in `changes`,
    which the banner of a variant's source lists. No updates: `loaded` itself."""
    if not updates:
        return loaded
    family = get_family(loaded.model.op)
    data = merge(loaded.model.model_dump(), updates)
    model, plans = _validate(family, data, loaded.path, _Located(), f" (in the variant {describe_variant(updates)})")
    changes = tuple(f"{k} = {v}" for k, v in _flat(updates))
    note = "".join(f"\n# variant: {c}" for c in changes)
    return LoadedSpec(loaded.path, loaded.text + note + "\n", model, loaded.changes + changes, plans)


def spec_files(paths: list[str | Path]) -> list[Path]:
    """Expand folders into their *.yaml / *.yml files (sorted); files pass through (a path that
    cannot be looked at, a name too long or a folder without search permission, is a file
    whose read says why)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if os.path.isdir(p):  # False for any OSError; Path.is_dir raises some
            try:
                out += sorted(q for q in p.iterdir() if q.suffix in (".yaml", ".yml"))
            except OSError as e:
                raise SpecError([f"{p}:1:1: <file>: cannot read the folder: {e.strerror or e}"]) from None
        else:
            out.append(p)
    return out
