"""Primitive ops: the device-side building blocks, each runnable and testable.

put/get at warp and block level, remote ld/st with explicit semantics,
signal + wait (six comparisons, local or peer), a grid barrier, an all-rank
barrier, and a ring shift with put + signal. Peers are chosen by a ring
offset: rank r talks to rank (r + shift) % world.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import numpy as np
from pydantic import Field

from ..spec_types import SpecBase, StrictModel
from .base import Buffer, OpFamily
from .conventions import Baseline, BenchCase, BenchConventions

MAX_U64 = (1 << 64) - 1


class ShiftParams(StrictModel):
    shift: int = Field(1, ge=1, le=7, description="peer of rank r is (r + shift) % world")


class TransportParams(StrictModel):
    transport: Literal["p2p", "nvshmem"] = Field(
        "p2p", description="p2p: loads and stores to peer memory (one host); nvshmem: NVSHMEM device calls "
        "(non-blocking put/get at the op's warp or block level, put with signal, signal wait, quiet, "
        "barrier_all) on the symmetric heap, device-linked against libnvshmem_device: runs under the "
        "nvshmem backend, also across hosts")


class CopyParams(ShiftParams, TransportParams):
    pass


class NvshmemTransport:
    """Families whose spec has `params.transport`: the nvshmem choice links libnvshmem_device
    and inlines tsgen/nvshmem.cuh (templates branch on `nvshmem`)."""

    def transport(self, spec: Any) -> str:
        return spec.params.transport

    def device_libs(self, spec: Any) -> tuple[str, ...]:
        return ("nvshmem",) if spec.params.transport == "nvshmem" else ()

    def template_vars(self, spec: Any) -> dict[str, Any]:
        return {"nvshmem": spec.params.transport == "nvshmem"}


def _check_shift(spec: Any) -> list[tuple[tuple, str]]:
    bad = [w for w in spec.world_sizes if spec.params.shift % w == 0]
    if bad:
        return [
            (
                ("params", "shift"),
                f"shift {spec.params.shift} makes every rank its own peer at world size "
                f"{', '.join(map(str, bad))}",
            )
        ]
    return []


def _ring(arrays: list[np.ndarray], shift: int) -> list[np.ndarray]:
    """out[(r + shift) % W] = arrays[r]: what a push to the ring neighbour yields."""
    world = len(arrays)
    return [arrays[(d - shift) % world].copy() for d in range(world)]


# ---------------------------------------------------------------------------
# put_warp, put_block, get_warp, get_block
# ---------------------------------------------------------------------------


def _copy_spec(kind: str) -> type[SpecBase]:
    return type(
        f"{kind.title().replace('_', '')}Spec",
        (SpecBase,),
        {
            "__annotations__": {"op": Literal[kind], "params": CopyParams},
            "params": CopyParams(),
            "__doc__": f"Spec of op `{kind}`.",
        },
    )


class CopyBench(BenchConventions):
    """Bytes copied to (put) or from (get) the ring neighbour, against cudaMemcpyPeerAsync moving
    the same bytes between the same GPUs. pair: rank 0 alone (one link direction); ring: every
    rank at once. GB/s = bytes / time, per rank; the NVLink ceiling bounds it."""

    kind = "copy"
    size_unit = "bytes"
    default_sizes = "256M,1G"
    metric = "algbw_GBps"
    baselines = (Baseline("memcpy_peer", "memcpy_peer", in_process=True),)
    patterns = ("pair", "ring")
    check_up_to = 1 << 30  # random bytes are cheap to make and to compare

    def case(self, family, spec, world, size):
        return BenchCase(size, size, link_bytes=size, hbm_bytes=2 * size, bw_bytes=size)

    def checked_ranks(self, family, spec, world, pattern):
        """pair: rank 0 alone runs; a put writes its neighbour's dst, a get its own."""
        if pattern != "pair":
            return list(range(world))
        return [spec.params.shift % world if family.direction == "put" else 0]


class CopyFamily(NvshmemTransport, OpFamily):
    """Copy `count` bytes between ranks, split into per-warp or per-block chunks."""

    category = "primitive"
    template = "copy.cu.j2"
    count_unit = "bytes"
    bench = CopyBench()

    def __init__(self, direction: str, unit: str):
        self.direction, self.unit = direction, unit
        self.kind = f"{direction}_{unit}"
        self.Spec = _copy_spec(self.kind)
        frm, to = ("local src", "peer dst") if direction == "put" else ("peer src", "local dst")
        self.summary = (
            f"each {unit} copies its chunk of `count` bytes from {frm} to {to} "
            f"(16-byte vectors, any byte count)"
        )

    def check(self, spec):
        return _check_shift(spec)

    def buffers(self, spec):
        return (Buffer("src", "uint8", "input"), Buffer("dst", "uint8", "output"))

    def constants(self, spec):
        return {"SHIFT": spec.params.shift}

    def reference(self, spec, world, count, inputs):
        shift = spec.params.shift
        # put: rank r writes into (r+shift)'s dst; get: rank r reads (r+shift)'s src.
        return {"dst": _ring(inputs["src"], shift if self.direction == "put" else -shift)}

    def bytes_moved(self, spec, world, count):
        return count


# ---------------------------------------------------------------------------
# remote_st, remote_ld
# ---------------------------------------------------------------------------

_WIDTH_SUFFIX = {32: "u32", 64: "u64", 128: "v4"}


class RemoteParams(ShiftParams):
    semantics: str
    scope: Optional[Literal["cta", "gpu", "sys"]] = Field(
        None, description="required for relaxed/acquire/release, not allowed for weak/volatile"
    )
    width: Literal[32, 64, 128] = Field(32, description="bits per access (128 = one 16-byte vector)")


class RemoteStParams(RemoteParams):
    semantics: Literal["weak", "volatile", "relaxed", "release"] = "relaxed"


class RemoteLdParams(RemoteParams):
    semantics: Literal["weak", "volatile", "relaxed", "acquire"] = "relaxed"


class RemoteStSpec(SpecBase):
    """Spec of op `remote_st`: each element stored to the peer with st.<semantics>.<scope>."""

    op: Literal["remote_st"]
    params: RemoteStParams = RemoteStParams()


class RemoteLdSpec(SpecBase):
    """Spec of op `remote_ld`: each element loaded from the peer with ld.<semantics>.<scope>."""

    op: Literal["remote_ld"]
    params: RemoteLdParams = RemoteLdParams()


class RemoteAccessFamily(OpFamily):
    category = "primitive"
    template = "remote_access.cu.j2"

    def __init__(self, kind: str):
        self.kind = kind
        self.is_store = kind == "remote_st"
        self.Spec = RemoteStSpec if self.is_store else RemoteLdSpec
        self.summary = (
            "element-wise st.<semantics>.<scope> of local src into the peer's dst"
            if self.is_store
            else "element-wise ld.<semantics>.<scope> of the peer's src into local dst"
        )

    def check(self, spec):
        p = spec.params
        problems = _check_shift(spec)
        if p.semantics in ("weak", "volatile") and p.scope is not None:
            problems.append(
                (("params", "scope"), f"{p.semantics} accesses take no scope; remove `scope`")
            )
        if p.semantics not in ("weak", "volatile") and p.scope is None:
            problems.append(
                (("params", "scope"), f"{p.semantics} accesses need a scope: cta, gpu or sys")
            )
        return problems

    def helper(self, spec) -> str:
        """Name of the tsgen/ptx.cuh helper the kernel calls per element."""
        p = spec.params
        scope = f"_{p.scope}" if p.scope else ""
        return f"{'st' if self.is_store else 'ld'}_{p.semantics}{scope}_global_{_WIDTH_SUFFIX[p.width]}"

    def _elem(self, spec) -> tuple[str, int]:
        w = spec.params.width
        return ("uint64", 1) if w == 64 else ("uint32", w // 32)

    def buffers(self, spec):
        dtype, per = self._elem(spec)
        return (Buffer("src", dtype, "input", per_count=per), Buffer("dst", dtype, "output", per_count=per))

    def constants(self, spec):
        return {"SHIFT": spec.params.shift}

    def reference(self, spec, world, count, inputs):
        shift = spec.params.shift
        return {"dst": _ring(inputs["src"], shift if self.is_store else -shift)}

    def bytes_moved(self, spec, world, count):
        return count * spec.params.width // 8


# ---------------------------------------------------------------------------
# signal_wait
# ---------------------------------------------------------------------------


class SignalWaitParams(ShiftParams):
    compare: Literal["eq", "ne", "ge", "gt", "le", "lt"] = "ge"
    where: Literal["local", "peer"] = Field(
        "peer", description="peer: a rank signals its ring neighbour; local: block 0 signals blocks 1.. of its own grid"
    )


class SignalWaitSpec(SpecBase):
    """Spec of op `signal_wait`: message passing through a payload and one signal."""

    op: Literal["signal_wait"]
    params: SignalWaitParams = SignalWaitParams()


# For each comparison: (signal value raised at call `epoch`, value waited for).
# Signals only move one way, so le / lt count down from all-ones.
SIGNAL_VALUES = {
    "eq": ("epoch", "epoch"),
    "ne": ("epoch", "epoch - 1"),
    "ge": ("epoch", "epoch"),
    "gt": ("epoch", "epoch - 1"),
    "le": ("~0ull - epoch", "~0ull - epoch"),
    "lt": ("~0ull - epoch", "~0ull - epoch + 1"),
}


class SignalWaitFamily(OpFamily):
    category = "primitive"
    kind = "signal_wait"
    Spec = SignalWaitSpec
    template = "signal_wait.cu.j2"
    blocks_wait = True
    summary = (
        "block 0 writes a payload and raises a signal (st.release); the other blocks wait "
        "with wait_<compare> (acquire) and copy the payload out"
    )

    def check(self, spec):
        problems = _check_shift(spec) if spec.params.where == "peer" else []
        if spec.launch.blocks < 2:
            problems.append((("launch", "blocks"), "signal_wait needs >= 2 blocks (one producer, consumers)"))
        return problems

    def buffers(self, spec):
        init = 0xFF if spec.params.compare in ("le", "lt") else 0
        return (
            Buffer("src", "uint32", "input"),
            Buffer("inbox", "uint32", "scratch"),
            Buffer("dst", "uint32", "output"),
            Buffer("signal", "uint64", "signal", per_count=0, fixed=1, init=init),
        )

    def constants(self, spec):
        return {"SHIFT": spec.params.shift if spec.params.where == "peer" else 0}

    def template_vars(self, spec):
        raise_value, expect_value = SIGNAL_VALUES[spec.params.compare]
        return {"raise_value": raise_value, "expect_value": expect_value}

    def reference(self, spec, world, count, inputs):
        if spec.params.where == "local":
            return {"dst": [a.copy() for a in inputs["src"]]}
        return {"dst": _ring(inputs["src"], spec.params.shift)}


# ---------------------------------------------------------------------------
# barrier_blocks, barrier_all, simple_shift
# ---------------------------------------------------------------------------


class StaggerParams(StrictModel):
    stagger_ns: int = Field(
        20000, ge=0, le=10_000_000,
        description="writers start staggered by up to this many ns (by block or rank) so that a "
        "barrier that does not hold shows up as wrong data; 0 = no stagger",
    )


class BarrierBlocksSpec(SpecBase):
    """Spec of op `barrier_blocks`: a barrier over all blocks of one grid."""

    op: Literal["barrier_blocks"]
    params: StaggerParams = StaggerParams()


class BarrierAllParams(ShiftParams, StaggerParams, TransportParams):
    pass


class BarrierBlocksFamily(OpFamily):
    category = "primitive"
    kind = "barrier_blocks"
    Spec = BarrierBlocksSpec
    template = "barrier_blocks.cu.j2"
    blocks_wait = True
    summary = (
        "every block stages its chunk, all blocks meet at a grid barrier, then each block "
        "copies out the chunk another block staged"
    )

    def buffers(self, spec):
        return (
            Buffer("src", "uint32", "input"),
            Buffer("stage", "uint32", "scratch"),
            Buffer("dst", "uint32", "output"),
            Buffer("counter", "uint64", "signal", per_count=0, fixed=1),
        )

    def constants(self, spec):
        return {"STAGGER_NS": spec.params.stagger_ns}

    def reference(self, spec, world, count, inputs):
        return {"dst": [a.copy() for a in inputs["src"]]}


class BarrierAllSpec(SpecBase):
    """Spec of op `barrier_all`: a barrier over all ranks (and all their blocks)."""

    op: Literal["barrier_all"]
    params: BarrierAllParams = BarrierAllParams()


class BarrierAllFamily(NvshmemTransport, OpFamily):
    category = "primitive"
    kind = "barrier_all"
    Spec = BarrierAllSpec
    template = "barrier_all.cu.j2"
    blocks_wait = True
    summary = (
        "every rank stages its data, all ranks meet at a barrier, then each rank reads the "
        "data its ring neighbour staged"
    )

    def check(self, spec):
        return _check_shift(spec)

    def buffers(self, spec):
        return (
            Buffer("src", "uint32", "input"),
            Buffer("stage", "uint32", "scratch"),
            Buffer("dst", "uint32", "output"),
            Buffer("counter", "uint64", "signal", per_count=0, fixed=1),
            Buffer("flags", "uint64", "signal", per_count=0, fixed=8),
        )

    def constants(self, spec):
        return {"SHIFT": spec.params.shift, "STAGGER_NS": spec.params.stagger_ns}

    def reference(self, spec, world, count, inputs):
        return {"dst": _ring(inputs["src"], -spec.params.shift)}


class SimpleShiftParams(ShiftParams, TransportParams):
    pass


class SimpleShiftSpec(SpecBase):
    """Spec of op `simple_shift`: ring shift by put + signal."""

    op: Literal["simple_shift"]
    dtype: Literal["uint8", "int32", "uint32", "float32", "float16", "bfloat16"] = "float32"
    params: SimpleShiftParams = SimpleShiftParams()


class SimpleShiftFamily(NvshmemTransport, OpFamily):
    category = "primitive"
    kind = "simple_shift"
    Spec = SimpleShiftSpec
    template = "simple_shift.cu.j2"
    blocks_wait = True
    summary = (
        "each rank puts its buffer into its ring neighbour's inbox and signals it; the "
        "neighbour waits for every block's signal and copies the inbox out"
    )

    def check(self, spec):
        return _check_shift(spec)

    def buffers(self, spec):
        return (
            Buffer("src", spec.dtype, "input"),
            Buffer("inbox", spec.dtype, "scratch"),
            Buffer("dst", spec.dtype, "output"),
            Buffer("ready", "uint64", "signal", per_count=0, fixed=1),
            Buffer("slot_free", "uint64", "signal", per_count=0, fixed=1),
        )

    def constants(self, spec):
        return {"SHIFT": spec.params.shift}

    def reference(self, spec, world, count, inputs):
        return {"dst": _ring(inputs["src"], spec.params.shift)}

    def bytes_moved(self, spec, world, count):
        return count * np.dtype("uint16" if spec.dtype == "bfloat16" else spec.dtype).itemsize


FAMILIES: list[OpFamily] = [
    CopyFamily("put", "warp"),
    CopyFamily("put", "block"),
    CopyFamily("get", "warp"),
    CopyFamily("get", "block"),
    RemoteAccessFamily("remote_st"),
    RemoteAccessFamily("remote_ld"),
    SignalWaitFamily(),
    BarrierBlocksFamily(),
    BarrierAllFamily(),
    SimpleShiftFamily(),
]
