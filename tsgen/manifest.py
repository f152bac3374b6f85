"""The manifest: what the runtime needs to know about one generated module, typed and versioned.

`tsgen build` writes it beside the source as NAME.json (`Manifest.to_json`); the runtime
reads a file with `Manifest.load` (users who vendor a module load it that way) and the
harness and bench hand it over in memory (tsgen.lowering). Its records are the same
classes the module ABI is made of (Arg, Buffer), so nothing is converted by string keys:
the buffers lay out a symmetric heap (`layout`), each kernel entry says how to launch it,
and `compile_mode` is the one place that decides how a source is compiled.

A manifest written by another version of the format is refused with a message that says
to rebuild it (`tsgen build`), never half read. A manifest read from a file is the runtime's
input, so nothing in it is trusted: every value is checked for its type and range as it is
read (`from_json`), and `check_source` holds it against the source it names: the same spec
digest, the same buffers (the heap the kernels address is laid out from them) as the
source's banner table, and kernel, launcher and prepare names that are the source's own
entry points.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .errors import RuntimeSetupError

# The manifest format's version: raise it whenever a field is added, removed or changes meaning.
MANIFEST_VERSION = 1

# dtype name -> (C type, numpy dtype)
DTYPES: dict[str, tuple[str, str]] = {
    "uint8": ("uint8_t", "uint8"),
    "int32": ("int32_t", "int32"),
    "uint32": ("uint32_t", "uint32"),
    "uint64": ("uint64_t", "uint64"),
    "float32": ("float", "float32"),
    "float16": ("__half", "float16"),
    "bfloat16": ("__nv_bfloat16", "bfloat16"),
}

ALIGN = 256  # every buffer starts on a 256-byte boundary of the heap


def np_dtype(name: str) -> np.dtype:
    """NumPy dtype for a manifest dtype; bfloat16 travels as its 16 bits."""
    return np.dtype("uint16" if name == "bfloat16" else name)


class ManifestError(RuntimeSetupError):
    """A manifest file this tsgen cannot read: another format version, or not a manifest."""


BUFFER_ROLES = ("input", "output", "inout", "scratch", "signal")
ARG_ROLES = ("peers", "peers_host", "rank", "calls", "count", "buffer")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_U32, _U63 = (1 << 32) - 1, (1 << 63) - 1


class _Reader:
    """Typed reads of a manifest's JSON values; ManifestError naming the field for a wrong one."""

    def __init__(self, where: str | Path):
        self.where = where

    def fail(self, path: str, problem: str) -> ManifestError:
        return ManifestError(f"{self.where}: {path}: {problem}; rebuild it from its spec with `tsgen build`")

    def get(self, d: Any, key: str, path: str, check: Callable[[Any, str], Any], default: Any = ...) -> Any:
        if not isinstance(d, dict):
            raise self.fail(path or "<manifest>", "a JSON object is expected")
        where = f"{path}.{key}" if path else key
        if key not in d:
            if default is ...:
                raise self.fail(where, "missing")
            return default
        return check(d[key], where)

    def int(self, lo: int, hi: int) -> Callable[[Any, str], int]:
        def check(v: Any, path: str) -> int:
            if type(v) is not int or not lo <= v <= hi:
                raise self.fail(path, f"{v!r} is not a whole number from {lo} to {hi}")
            return v
        return check

    def str(self, pattern: re.Pattern | None = None, choices: tuple[str, ...] | None = None):
        def check(v: Any, path: str) -> str:
            if not isinstance(v, str) or (pattern and not pattern.match(v)) or (choices and v not in choices):
                want = f"one of {', '.join(choices)}" if choices else "a C identifier" if pattern else "a string"
                raise self.fail(path, f"{v!r} is not {want}")
            return v
        return check

    def bool(self, v: Any, path: str) -> bool:
        if type(v) is not bool:
            raise self.fail(path, f"{v!r} is not true or false")
        return v

    def list(self, item: Callable[[Any, str], Any], lo: int = 0, hi: int = 1 << 16) -> Callable[[Any, str], tuple]:
        def check(v: Any, path: str) -> tuple:
            if not isinstance(v, list) or not lo <= len(v) <= hi:
                raise self.fail(path, f"a list of {lo} to {hi} entries is expected")
            return tuple(item(x, f"{path}[{i}]") for i, x in enumerate(v))
        return check


@dataclass(frozen=True)
class Arg:
    """One argument of a kernel or host launcher; `role` says what the runtime passes."""

    name: str
    ctype: str
    role: str  # peers | peers_host | rank | calls | count | buffer


@dataclass(frozen=True)
class Buffer:
    """A symmetric buffer: same size and offset on every rank.

    Elements per rank = (per_count + per_world_count * world) * count + fixed.
    `role` tells the harness
    what to do with it: fill `input`s with data, poison `output`s before each
    call and compare them after, leave `scratch` alone, and zero `signal`s
    once at allocation (or fill them with `init` bytes) and never again.
    """

    name: str
    dtype: str
    role: str  # input | output | inout | scratch | signal
    per_count: int = 1
    fixed: int = 0
    init: int = 0  # byte value signals start at
    per_world_count: int = 0

    def elems(self, count: int, world: int = 1) -> int:
        return (self.per_count + self.per_world_count * world) * count + self.fixed

    @property
    def ctype(self) -> str:
        return DTYPES[self.dtype][0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "role": self.role,
            "elems": {"per_count": self.per_count, "per_world_count": self.per_world_count, "fixed": self.fixed},
            "init_byte": self.init,
        }

    @classmethod
    def read(cls, d: Any, path: str, r: _Reader) -> "Buffer":
        elems = lambda key, hi: r.get(r.get(d, "elems", path, lambda v, p: v), key, f"{path}.elems",  # noqa: E731
                                      r.int(0, hi))
        return cls(r.get(d, "name", path, r.str(_IDENT)), r.get(d, "dtype", path, r.str(choices=tuple(DTYPES))),
                   r.get(d, "role", path, r.str(choices=BUFFER_ROLES)), per_count=elems("per_count", _U32),
                   fixed=elems("fixed", _U63), init=r.get(d, "init_byte", path, r.int(0, 255)),
                   per_world_count=elems("per_world_count", _U32))


@dataclass(frozen=True)
class KernelEntry:
    """How the runtime launches the module at one world size: the kernel (grid, block,
    dynamic shared memory, arguments) or its host launcher (`launcher_args`, then a stream)."""

    name: str
    launcher: str
    world_size: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple[Arg, ...]
    launcher_args: tuple[Arg, ...]
    # `extern "C" cudaError_t NAME(int rank, int device)` of a host-launch module that makes what
    # a rank's calls need (side streams, events, kernel attributes) on `device`; "" when it has
    # none. Called for every rank before any rank's first call: the launcher would otherwise make
    # them at its first call, and on a GPU shared by ranks that creation can wait for the peers'
    # kernels already spinning there (docs/lab/shared_gpu.md, 2026-11-26).
    prepare: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = {
            "name": self.name,
            "launcher": self.launcher,
            "world_size": self.world_size,
            "grid": list(self.grid),
            "block": list(self.block),
            "shared_bytes": self.shared_bytes,
            "args": [asdict(a) for a in self.args],
            "launcher_args": [asdict(a) for a in self.launcher_args],
        }
        if self.prepare:
            d["prepare"] = self.prepare
        return d

    @classmethod
    def read(cls, d: Any, path: str, r: _Reader) -> "KernelEntry":
        def arg(a: Any, p: str) -> Arg:
            return Arg(r.get(a, "name", p, r.str(_IDENT)), r.get(a, "ctype", p, r.str()),
                       r.get(a, "role", p, r.str(choices=ARG_ROLES)))

        def dims(his: tuple[int, int, int], lo: int) -> Callable[[Any, str], tuple]:
            def check(v: Any, p: str) -> tuple:
                t = r.list(lambda x, q: x, 3, 3)(v, p)
                return tuple(r.int(lo, hi)(x, f"{p}[{i}]") for i, (x, hi) in enumerate(zip(t, his)))
            return check

        block = r.get(d, "block", path, dims((1024, 1024, 64), 1))
        if block[0] * block[1] * block[2] > 1024:
            raise r.fail(f"{path}.block", f"{list(block)}: more than 1024 threads")
        return cls(r.get(d, "name", path, r.str(_IDENT)), r.get(d, "launcher", path, r.str(_IDENT)),
                   r.get(d, "world_size", path, r.int(1, 1024)),
                   r.get(d, "grid", path, dims(((1 << 31) - 1, 65535, 65535), 0)), block,
                   r.get(d, "shared_bytes", path, r.int(0, 1 << 20)), r.get(d, "args", path, r.list(arg)),
                   r.get(d, "launcher_args", path, r.list(arg)), r.get(d, "prepare", path, r.str(_IDENT), ""))


@dataclass(frozen=True)
class Slot:
    """A buffer's place in one rank's symmetric heap for one count."""

    name: str
    dtype: str
    role: str
    offset: int
    elems: int
    init_byte: int

    @property
    def nbytes(self) -> int:
        return self.elems * np_dtype(self.dtype).itemsize


# A generated source's banner table of buffers (templates/module.cu.j2), one line each:
#   //   NAME     CTYPE          ROLE   FORMULA[  (starts as bytes 0xNN)]
_TABLE_ROW = re.compile(r"//   (?P<name>\w+) +(?P<ctype>\w+) +(?P<role>\w+) *(?P<formula>.*?)"
                        r"(?:  \(starts as bytes 0x(?P<init>[0-9A-F]{2})\))?\Z")
_FORMULA = re.compile(r"(?:(?:(?P<pc>\d+) \+ )?(?:(?P<pw>\d+) \* )?(?P<world>world \* count)"
                      r"|(?:(?P<pc1>\d+) \* )?(?P<count>count))?(?:(?(world) \+ |(?(count) \+ |))(?P<fixed>\d+))?\Z")


def buffer_table(lines: list[str]) -> list[tuple] | None:
    """The buffers a generated source's banner lists, as (name, dtype, role, per_count,
    per_world_count, fixed, init_byte); None when it has no table. Pure."""
    try:
        start = lines.index("// Buffers (elements per rank):") + 1
    except ValueError:
        return None
    ctypes = {c: name for name, (c, _) in DTYPES.items()}
    out = []
    for line in lines[start:]:
        if not line.startswith("//   "):
            break
        row = _TABLE_ROW.match(line)
        f = _FORMULA.match(row["formula"]) if row else None
        if not f or row["ctype"] not in ctypes:
            return out + [("<unreadable row>", line)]
        if f["world"]:
            pc, pw = int(f["pc"] or 0), int(f["pw"] or 1)
        else:
            pc, pw = (int(f["pc1"] or 1) if f["count"] else 0), 0
        out.append((row["name"], ctypes[row["ctype"]], row["role"], pc, pw, int(f["fixed"] or 0),
                    int(row["init"] or "0", 16)))
    return out


_ENTRY = re.compile(r'^extern "C" [^(]*?(\w+)\(')
_ATTRIBUTES = re.compile(r"__\w+__\([^)]*\)\s*")  # __launch_bounds__(...), __cluster_dims__(...)


def entry_points(lines: list[str]) -> list[tuple[int, str]]:
    """(line index, name) of every extern "C" function a source defines or declares; a
    declaration may break after its attributes, the name then on the next line. Pure."""
    return [(i, m.group(1)) for i, line in enumerate(lines) if line.startswith('extern "C"')
            and (m := _ENTRY.match(_ATTRIBUTES.sub("", " ".join(lines[i:i + 2]))))]


def layout(buffers: tuple[Buffer, ...] | list[Buffer], count: int, world: int = 1) -> tuple[list[Slot], int]:
    """Offsets of every buffer in the symmetric heap, and the heap size; RuntimeSetupError for
    a negative count or a heap past the 64-bit address space."""
    if count < 0:
        raise RuntimeSetupError(f"count {count}: the number of elements per rank cannot be negative")
    slots, offset = [], 0
    for b in buffers:
        slot = Slot(b.name, b.dtype, b.role, offset, b.elems(count, world), b.init)
        slots.append(slot)
        offset += -(-max(slot.nbytes, 1) // ALIGN) * ALIGN
    if offset >= 1 << 64:
        raise RuntimeSetupError(f"allocating a {offset}-byte symmetric heap per rank (count {count}): "
                                "larger than the 64-bit address space")
    return slots, max(offset, ALIGN)


@dataclass(frozen=True)
class Manifest:
    """One generated module as the runtime sees it (NAME.json)."""

    tsgen_version: str
    name: str
    op: str
    spec: str  # the spec's path as the banner gives it
    spec_sha256: str
    source: str  # NAME.cu, beside the manifest
    world_sizes: tuple[int, ...]
    count_unit: str
    timeout_ms: int
    blocks_wait: bool
    # the runtime calls <kernel>_launch from a shared library (see OpFamily.host_launch)
    host_launch: bool
    # NVLink multicast: compiled only; the runtime refuses it unless explicitly enabled
    multimem: bool
    constants: dict[str, int]
    buffers: tuple[Buffer, ...]
    kernels: tuple[KernelEntry, ...]
    device_libs: tuple[str, ...] = ()  # written only when not empty
    version: int = field(default=MANIFEST_VERSION)

    # -- what the runtime asks --------------------------------------------------
    def layout(self, count: int, world: int = 1) -> tuple[list[Slot], int]:
        """Every buffer's place in one rank's heap for `count`, and the heap's size."""
        return layout(self.buffers, count, world)

    def kernel(self, world: int) -> KernelEntry:
        """The entry for world size `world`; RuntimeSetupError naming the spec if there is none."""
        for k in self.kernels:
            if k.world_size == world:
                return k
        raise RuntimeSetupError(f"{self.name}: compiled for world sizes {list(self.world_sizes)}, not {world}; "
                                f"add {world} to world_sizes in {self.spec}")

    @property
    def compile_mode(self) -> tuple[str, tuple[str, ...]]:
        """THE decision how the source is compiled and loaded: ("shared", ()) for a shared
        library with the host launchers (host_launch), else ("cubin", the device libraries
        it is device-linked against)."""
        return ("shared", ()) if self.host_launch else ("cubin", self.device_libs)

    # -- the file ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "manifest_version": self.version,
            "tsgen_version": self.tsgen_version,
            "name": self.name,
            "op": self.op,
            "spec": self.spec,
            "spec_sha256": self.spec_sha256,
            "source": self.source,
            "world_sizes": list(self.world_sizes),
            "count_unit": self.count_unit,
            "timeout_ms": self.timeout_ms,
            "blocks_wait": self.blocks_wait,
            "host_launch": self.host_launch,
            "multimem": self.multimem,
            **({"device_libs": list(self.device_libs)} if self.device_libs else {}),
            "constants": dict(self.constants),
            "buffers": [b.to_dict() for b in self.buffers],
            "kernels": [k.to_dict() for k in self.kernels],
        }

    def to_json(self) -> str:
        """NAME.json's text: deterministic (key order fixed, two-space indent, final newline)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str | Path = "<manifest>") -> "Manifest":
        """The manifest in `text` (from `where`, named in errors); ManifestError for another
        format version (or none: written before manifests had one) or anything not a manifest."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ManifestError(f"{where}: not a tsgen manifest (not JSON: {e})") from None
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: not a tsgen manifest (a JSON object is expected)")
        version = data.get("manifest_version")
        if version != MANIFEST_VERSION:
            made = f" (written by tsgen {data['tsgen_version']})" if isinstance(data.get("tsgen_version"), str) else ""
            what = "has no manifest_version" if version is None else f"is manifest version {version!r}"
            raise ManifestError(f"{where}: {what}{made}; this tsgen reads version {MANIFEST_VERSION}: "
                                "rebuild it from its spec with `tsgen build`")
        r = _Reader(where)
        text_of = r.str()

        def constants(v: Any, p: str) -> dict[str, int]:
            if not isinstance(v, dict):
                raise r.fail(p, "a JSON object is expected")
            return {r.str(_IDENT)(k, p): r.int(-(1 << 63), _U63)(x, f"{p}.{k}") for k, x in v.items()}

        manifest = cls(
            tsgen_version=r.get(data, "tsgen_version", "", text_of), name=r.get(data, "name", "", r.str(_IDENT)),
            op=r.get(data, "op", "", text_of), spec=r.get(data, "spec", "", text_of),
            spec_sha256=r.get(data, "spec_sha256", "", r.str(re.compile(r"[0-9a-f]{64}\Z"))),
            source=r.get(data, "source", "", r.str(re.compile(r"[^/\\\0]+\.cu\Z"))),
            world_sizes=r.get(data, "world_sizes", "", r.list(r.int(1, 1024), 1)),
            count_unit=r.get(data, "count_unit", "", text_of), timeout_ms=r.get(data, "timeout_ms", "", r.int(0, _U32)),
            blocks_wait=r.get(data, "blocks_wait", "", r.bool), host_launch=r.get(data, "host_launch", "", r.bool),
            multimem=r.get(data, "multimem", "", r.bool), constants=r.get(data, "constants", "", constants),
            buffers=r.get(data, "buffers", "", r.list(lambda b, p: Buffer.read(b, p, r))),
            kernels=r.get(data, "kernels", "", r.list(lambda k, p: KernelEntry.read(k, p, r), 1)),
            device_libs=r.get(data, "device_libs", "", r.list(r.str(_IDENT)), ()), version=version,
        )
        manifest._check_consistent(r)
        return manifest

    def _check_consistent(self, r: _Reader) -> None:
        """What no single field shows: unique names, a kernel per world size, arguments that name buffers."""
        names = [b.name for b in self.buffers]
        if len(set(names)) != len(names):
            raise r.fail("buffers", f"buffer names repeat: {names}")
        for what in ("name", "launcher"):
            kernel_names = [getattr(k, what) for k in self.kernels]
            if len(set(kernel_names)) != len(kernel_names):
                raise r.fail("kernels", f"kernel {what}s repeat: {kernel_names}")
        worlds = [k.world_size for k in self.kernels]
        if sorted(worlds) != sorted(set(self.world_sizes)) or len(set(worlds)) != len(worlds):
            raise r.fail("kernels", f"one kernel per world size {list(self.world_sizes)} is expected, "
                                    f"found world sizes {worlds}")
        for i, k in enumerate(self.kernels):
            for what, args in (("args", k.args), ("launcher_args", k.launcher_args)):
                for a in args:
                    if a.role == "buffer" and a.name not in names or a.role == "calls" and "calls" not in names:
                        raise r.fail(f"kernels[{i}].{what}", f"argument {a.name!r} names no buffer of the manifest")

    def check_source(self, text: str, where: str | Path) -> None:
        """ManifestError unless this manifest describes the source `text` (read from `where`): the
        spec digest of its banner, the buffers of its banner table (so the heap laid out from the
        manifest is the heap the kernels address), and the names the runtime resolves (the host
        launchers and prepares of a host-launch module, else the kernels) among its extern "C"
        entry points (so a name never resolves to another library's
        function, `exit` say)."""
        def differ(what: str) -> ManifestError:
            return ManifestError(f"{where} is not the source this manifest describes: {what}; a manifest and its "
                                 "source come from one `tsgen build` of one spec")

        lines = text.split("\n", 400)[:400]
        if len(lines) < 2 or lines[1] != f"// spec sha256 {self.spec_sha256}":
            raise differ(f"its banner does not name spec sha256 {self.spec_sha256}")
        table = buffer_table(lines)
        if table is None:
            raise differ("it has no buffer table in its banner")
        mine = [(b.name, b.dtype, b.role, b.per_count, b.per_world_count, b.fixed, b.init) for b in self.buffers]
        if table != mine:
            theirs = dict((t[0], t) for t in table)
            name = next((m[0] for m in mine if theirs.get(m[0]) != m), None) or next(t[0] for t in table)
            raise differ(f"buffer {name!r} is {theirs.get(name)} in the source and "
                         f"{next((m for m in mine if m[0] == name), None)} in the manifest "
                         "(name, dtype, role, per count, per world x count, fixed, init byte)")
        entries = {name for _, name in entry_points(text.split("\n"))}
        for k in self.kernels:  # the names the runtime resolves: host launchers and prepares, or kernels
            for name in ((k.launcher, k.prepare) if self.host_launch else (k.name,)):
                if name and name not in entries:
                    raise differ(f"{name!r} (world size {k.world_size}) is not one of its extern \"C\" entry points")

    @classmethod
    def load(cls, path: str | Path) -> "Manifest":
        """Read NAME.json; ManifestError naming the file when it cannot be read or used."""
        path = Path(path)
        try:
            text = path.read_bytes()
        except OSError as e:
            raise ManifestError(f"cannot read the manifest {path}: {e.strerror or e}") from None
        return cls.from_json(text, path)
