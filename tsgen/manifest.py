"""The manifest: what the runtime needs to know about one generated module, typed and versioned.

`tsgen build` writes it beside the source as NAME.json (`Manifest.to_json`); the runtime
reads a file with `Manifest.load` (users who vendor a module load it that way) and the
harness and bench hand it over in memory (tsgen.lowering). Its records are the same
classes the module ABI is made of (Arg, Buffer), so nothing is converted by string keys:
the buffers lay out a symmetric heap (`layout`), each kernel entry says how to launch it,
and `compile_mode` is the one place that decides how a source is compiled.

A manifest written by another version of the format is refused with a message that says
to rebuild it (`tsgen build`), never half read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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
    def from_dict(cls, d: dict[str, Any]) -> "Buffer":
        e = d["elems"]
        return cls(d["name"], d["dtype"], d["role"], per_count=e["per_count"], fixed=e["fixed"],
                   init=d["init_byte"], per_world_count=e["per_world_count"])


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
    def from_dict(cls, d: dict[str, Any]) -> "KernelEntry":
        return cls(d["name"], d["launcher"], d["world_size"], tuple(d["grid"]), tuple(d["block"]),
                   d["shared_bytes"], tuple(Arg(**a) for a in d["args"]),
                   tuple(Arg(**a) for a in d["launcher_args"]), d.get("prepare", ""))


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
        try:
            return cls(
                tsgen_version=data["tsgen_version"], name=data["name"], op=data["op"], spec=data["spec"],
                spec_sha256=data["spec_sha256"], source=data["source"], world_sizes=tuple(data["world_sizes"]),
                count_unit=data["count_unit"], timeout_ms=data["timeout_ms"], blocks_wait=data["blocks_wait"],
                host_launch=data["host_launch"], multimem=data["multimem"], constants=dict(data["constants"]),
                buffers=tuple(Buffer.from_dict(b) for b in data["buffers"]),
                kernels=tuple(KernelEntry.from_dict(k) for k in data["kernels"]),
                device_libs=tuple(data.get("device_libs", ())), version=version,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where}: a manifest version {version} with a missing or malformed field "
                                f"({type(e).__name__}: {e}); rebuild it with `tsgen build`") from None

    @classmethod
    def load(cls, path: str | Path) -> "Manifest":
        """Read NAME.json; ManifestError naming the file when it cannot be read or used."""
        path = Path(path)
        try:
            text = path.read_bytes()
        except OSError as e:
            raise ManifestError(f"cannot read the manifest {path}: {e.strerror or e}") from None
        return cls.from_json(text, path)
