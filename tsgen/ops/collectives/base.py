"""What every collective shares: the launch and params every collective takes, the plan
helpers (_spec, _entry, _final, _ring), CollectiveFamily, and the numeric helpers
(to_f64/from_f64, input values, the reductions' sum and tolerance).

The conventions every collective follows are in the package's docstring (__init__.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np
from pydantic import Field

from ...plan.ir import MAX_WAITS, CommPlan, SignalRef, Step, schedule
from ...plan.lower import (STRAIGHT_LINE_MAX_CALLS, ShareGroup, c_slice, c_tables, share_runs, straight_line_groups,
                           stream_program)
from ...spec_types import Launch, SpecBase, StrictModel
from ..base import CALLS, Buffer, ModuleAbi, OpFamily, fill, with_peers_host
from .bench import CollectiveBench
from .semantics import Semantics

CollectiveDtype = Literal["bfloat16", "float16", "float32", "int32"]


# 512 threads x 128 registers fill an SM's register file: the most straight-line code may take
STRAIGHT_LINE_MAX_THREADS = 512


class CollectiveLaunch(Launch):
    """Launch shape and copy tuning, and how the kernel runs its plan."""

    plan_code: Literal["auto", "tables"] = Field(
        "auto", description="how the kernel runs its plan (transport p2p; other transports always use the "
        f"tables): auto: a world size whose plan takes at most {STRAIGHT_LINE_MAX_CALLS} share calls as "
        "straight-line code (blocks that run the same steps share a call) runs that code, every step a "
        f"compile-time constant (with at most {STRAIGHT_LINE_MAX_THREADS} threads), and a larger plan the table "
        "interpreter; tables: always the table interpreter, "
        "which reads the next share's step from the tables after every wait")


class CollectiveParams(StrictModel):
    in_place: bool = Field(False, description="output overwrites the input buffer (NCCL's in-place layout)")
    blocks_per_peer: int = Field(8, ge=1, le=64, description="blocks that copy to (or from) each peer")
    pieces: int = Field(1, ge=1, le=16, description="pipeline depth: each transfer is cut into this many signalled pieces")
    peer_order: Literal["concurrent", "pairwise"] = Field(
        "concurrent", description="concurrent: the transfers to every peer run at once, each on its own "
        "blocks_per_peer blocks; pairwise: one peer after another (rank r sends to r+1, then r+2, ...) on the "
        "same blocks, so each GPU writes to one peer and is written by one at a time")
    transport: Literal["p2p", "copy_engine", "nvshmem"] = Field(
        "p2p", description="p2p: the kernel's threads load and store peer memory; copy_engine: copy steps are "
        "cudaMemcpyAsync over peer mappings (DMA engines, no SMs), one stream per plan lane, with small kernels for "
        "signals, waits and reductions (large messages); nvshmem: the same plan with NVSHMEM device calls (a copy "
        "to a peer is a put with signal, a copy from a peer a get; reductions local only), built with -rdc and "
        "device-linked against libnvshmem_device: the path past one host")


def _spec(kind: str, params: type) -> type[SpecBase]:
    return type(
        f"{kind.title().replace('_', '')}Spec",
        (SpecBase,),
        {
            "__annotations__": {"op": Literal[kind], "dtype": CollectiveDtype, "params": params,
                                "launch": CollectiveLaunch},
            "dtype": "bfloat16",
            "launch": CollectiveLaunch(),
            "params": params(),
            "__doc__": f"Spec of collective `{kind}`.",
        },
    )


def _entry(r: int, w: int, to: list[int] | None = None) -> Step:
    peers = [p for p in range(w) if p != r] if to is None else to
    return Step("none", signals=tuple(SignalRef(p, "entry", r) for p in peers), note="entry: signal every peer")


def _final(waits: list[tuple[str, int]], note: str) -> list[Step]:
    """Wait-only steps (at most MAX_WAITS counters each: one thread waits per counter)."""
    return [Step("none", waits=tuple(waits[i:i + MAX_WAITS]), note=note) for i in range(0, len(waits), MAX_WAITS)]


def _ring(r: int, w: int) -> list[int]:
    """Peers in rank-rotated order: r+1, r+2, ... (spreads load over links)."""
    return [(r + k) % w for k in range(1, w)]


class CollectiveFamily(OpFamily):
    """Shared machinery; subclasses build steps and the numeric reference."""

    template = "collective.cu.j2"
    category = "collective"
    gpu_sweep = "collective"
    variant_worlds = (2, 3, 4, 8)
    blocks_wait = True
    bench = CollectiveBench()  # nccl-tests conventions, NCCL baseline (bench.py)

    def __init__(self):
        self.Spec = _spec(self.kind, self.Params)

    # -- plan ---------------------------------------------------------------
    def comm_plan(self, spec: Any, w: int) -> CommPlan:
        raise NotImplementedError

    @staticmethod
    def copy_engine(spec: Any) -> bool:
        return spec.params.transport == "copy_engine"

    def _bpp(self, spec: Any) -> int:
        """Blocks per copy step: with the copy engine a step is one cudaMemcpyAsync."""
        return 1 if self.copy_engine(spec) else spec.params.blocks_per_peer

    @staticmethod
    def _peer_lane(spec: Any) -> str | None:
        """Lane of the per-peer transfers: one shared lane when they go pairwise."""
        return "peers" if spec.params.peer_order == "pairwise" else None

    def _schedule(self, spec: Any, w: int, steps: list[list[Step]], expected: dict) -> CommPlan:
        """The plan of `steps` over the kernel's blocks -- or, with the copy engine, over
        streams: one per lane or free-standing step (a stream runs its steps in order,
        as a block does, so `tsgen verify` checks either schedule the same way)."""
        buffers = {n: role for n, (role, _) in self.data_buffers(spec).items()}
        return schedule(w, None if self.copy_engine(spec) else spec.launch.blocks, steps, buffers=buffers,
                        signals=self.signal_sizes(spec, w), expected=expected)

    def transport(self, spec: Any) -> str:
        return spec.params.transport

    def launched_from_host(self, spec: Any) -> bool:
        return self.copy_engine(spec)

    def prepares(self, spec: Any) -> bool:
        return self.copy_engine(spec)  # tsgen/ce.cuh lanes

    def device_libs(self, spec: Any) -> tuple[str, ...]:
        return ("nvshmem",) if spec.params.transport == "nvshmem" else ()

    def comm_plans(self, spec: Any) -> dict[int, CommPlan]:
        """The plan of every world size of the spec; multimem variants have none (their
        template is written out, not a plan)."""
        return {} if self.is_multimem(spec) else {w: self.comm_plan(spec, w) for w in spec.world_sizes}

    def abi(self, spec: Any) -> ModuleAbi:
        return self.lower(spec, self.comm_plans(spec))[0]

    def template_vars(self, spec):
        return self.lower(spec, self.comm_plans(spec))[1]

    def lower(self, spec: Any, plans: dict[int, CommPlan]) -> tuple[ModuleAbi, dict[str, Any]]:
        straight = self.straight_line(spec, plans)
        abi = self._abi(spec, straight)
        return abi, self._template_vars(spec, plans, straight, abi)

    def _abi(self, spec: Any, straight: dict[int, list[list[ShareGroup]]]) -> ModuleAbi:
        abi = super().abi(spec)
        if self.copy_engine(spec):
            # The host launcher also needs the peer table in host memory (memcpy addresses).
            kernels = []
            for k in abi.kernels:
                kernels.append(dataclasses.replace(k, launcher_args=with_peers_host(k.args)))
            abi.kernels = tuple(kernels)
        # Straight-line code keeps every source of a reduction in flight at once, which takes
        # more registers than the interpreter; ptxas's default may cap them at what a second
        # block per SM leaves and spill. Collectives run one block per SM (at most 132).
        abi.kernels = tuple(dataclasses.replace(k, min_blocks=1) if k.world_size in straight else k
                             for k in abi.kernels)
        return abi

    def straight_line(self, spec: Any, plans: dict[int, CommPlan] | None = None) -> dict[int, list[list[ShareGroup]]]:
        """World size -> each rank's block groups, for the world sizes whose SM kernel runs its
        plan as straight-line code: launch.plan_code auto, at most STRAIGHT_LINE_MAX_CALLS share
        calls, and at most STRAIGHT_LINE_MAX_THREADS threads (with more, ptxas caps a thread at
        fewer registers than straight-line reductions keep in flight, and spills). The
        copy-engine and NVSHMEM executors, and multimem, have no such code. `plans`: the comm
        plans per world size, where the caller has them already."""
        if (self.template_for(spec) != self.template or spec.launch.plan_code != "auto"
                or spec.launch.threads > STRAIGHT_LINE_MAX_THREADS):
            return {}
        out = {}
        for w in spec.world_sizes:
            cp = plans[w] if plans is not None else self.comm_plan(spec, w)
            groups, calls = straight_line_groups(cp, hoist_opening=True)
            if calls <= STRAIGHT_LINE_MAX_CALLS:
                out[w] = groups
        return out

    def signal_sizes(self, spec: Any, w: int) -> dict[str, int]:
        raise NotImplementedError

    def buffers(self, spec):
        out = []
        for name, (role, units) in self.data_buffers(spec).items():
            # units: count-sized units per rank; "W" = one per rank of the world
            per_count, per_world = (0, 1) if units == "W" else (units, 0)
            out.append(Buffer(name, spec.dtype, role, per_count=per_count, per_world_count=per_world))
        wmax = max(spec.world_sizes)
        for name, n in self.signal_sizes(spec, wmax).items():
            out.append(Buffer(name, "uint64", "signal", per_count=0, fixed=n))
        return tuple(out)

    def data_buffers(self, spec) -> dict[str, tuple[str, int | str]]:
        raise NotImplementedError

    def check(self, spec):
        problems = []
        if spec.launch.blocks < 1:
            problems.append((("launch", "blocks"), "need at least one block"))
        if spec.launch.blocks > 132:
            problems.append((("launch", "blocks"), "collectives wait across blocks: at most 132 (one per SM)"))
        return problems + self.extra_check(spec)

    # (params field, value) that selects the NVLink-multicast variant, if the op has one
    multimem_switch: tuple[str, str] | None = None

    def extra_check(self, spec):
        problems = self._multimem_check(spec) if self.is_multimem(spec) else []
        if self.copy_engine(spec) and self.is_multimem(spec):
            problems.append((("params", "transport"), "multimem variants store through NVLink multicast, not the copy engine"))
        if self.copy_engine(spec) and getattr(spec.params, "direction", "push") == "pull":
            # measured 2026-11-21: a cudaMemcpyAsync whose source is a peer's memory blocked
            # the launching thread until it ran, so the next rank was never launched
            # (docs/design/transports.md, "Copy engine")
            problems.append((("params", "direction"), "the copy engine pushes only: a copy reading a peer's "
                             "memory blocks the host thread that launches every rank; use direction: push"))
        if spec.params.transport == "nvshmem" and self.is_multimem(spec):
            problems.append((("params", "transport"), "multimem variants store through NVLink multicast, not "
                             "NVSHMEM; use transport: p2p"))
        return problems

    def check_plans(self, spec, plans):
        """The C tables index shares with 16 bits; the copy-engine launcher has 32 streams and
        copies to one destination; the nvshmem transport puts, gets and reduces locally."""
        problems = self._nvshmem_check(spec, plans) if spec.params.transport == "nvshmem" else []
        if problems:
            return problems
        for w, cp in plans.items():
            shares = sum(len(b) for rp in cp.ranks for b in rp.blocks)
            if shares > 0xFFFF:
                problems.append((("params", "pieces"), f"the plan at world size {w} has {shares} block shares, "
                                 "more than the 65535 its tables can index: fewer pieces or blocks_per_peer"))
            if self.copy_engine(spec) and cp.nblocks > 32:
                problems.append((("params", "pieces"), f"the plan at world size {w} needs {cp.nblocks} streams, "
                                 "more than the copy-engine launcher's 32"))
            if self.copy_engine(spec) and any(st.also for rp in cp.ranks for st in rp.steps):
                problems.append((("params", "transport"), f"{spec.op} with these params stores one result to "
                                 "several ranks in one step; the copy engine copies to one destination per copy: "
                                 "use transport: p2p (or algorithm: two_shot with the copy engine)"))
                break
        return problems

    def _nvshmem_check(self, spec, plans):
        """The nvshmem transport moves remote data by put (copy into a peer, from our memory)
        and get (copy from a peer into ours); reductions and anything else run on local memory."""
        for w, cp in plans.items():
            for r, rp in enumerate(cp.ranks):
                for st in rp.steps:
                    if st.op == "reduce" and any(q != r for q, _ in (st.dst,) + tuple(st.srcs)):
                        return [(("params", "transport"), f"{spec.op} with these params reduces a peer's memory "
                                 f"(world size {w}, rank {r}: {st.note}); the nvshmem transport reduces local memory "
                                 "only (puts into inboxes, then a local sum): use a push algorithm such as "
                                 "all_reduce two_shot or reduce_scatter direct, or transport: p2p")]
                    if st.also:
                        return [(("params", "transport"), f"{spec.op} with these params stores one result to several "
                                 f"ranks in one step (world size {w}, rank {r}: {st.note}); the nvshmem transport "
                                 "puts to one peer per step: use transport: p2p")]
                    if st.op == "copy" and st.dst[0] != r and st.srcs[0][0] != r:
                        return [(("params", "transport"), f"a copy between two peers (world size {w}, rank {r}: "
                                 f"{st.note}) is neither a put nor a get: not supported by the nvshmem transport")]
        return []

    def is_multimem(self, spec) -> bool:
        return self.multimem_switch is not None and getattr(spec.params, self.multimem_switch[0]) == self.multimem_switch[1]

    def template_for(self, spec) -> str:
        if self.is_multimem(spec):
            return "multimem.cu.j2"
        if spec.params.transport == "nvshmem":
            return "nvshmem_collective.cu.j2"
        return "ce_collective.cu.j2" if self.copy_engine(spec) else self.template

    def _multimem_check(self, spec):
        problems = []
        if spec.params.in_place:
            problems.append((("params", "in_place"), "the multimem variants are out-of-place only"))
        if spec.op == "all_reduce" and spec.dtype not in ("bfloat16", "float32"):
            problems.append((("dtype",), "multimem all_reduce reduces bfloat16 or float32 (multimem.ld_reduce .v4 forms)"))
        return problems

    def _template_vars(self, spec, plans, straight, abi: ModuleAbi) -> dict[str, Any]:
        # every collective inlines tsgen/plan.cuh (vector math; the plan interpreter)
        out = {"plan_header": True, "copy_engine": self.copy_engine(spec), "nvshmem": spec.params.transport == "nvshmem"}
        if self.is_multimem(spec):
            return out
        table = (CALLS,) + tuple(self.buffers(spec))  # the order plan.buffers has
        index = {b.name: i for i, b in enumerate(table)}
        # the SM kernel (collective.cu.j2) raises each rank's opening signal in code
        hoist = self.template_for(spec) == self.template
        out |= {"comm_plans": plans, "buffer_index": index, "hoist_opening": hoist, "straight_line": straight,
                # the plans' C rows (templates/ops/plan_tables.cu.j2)
                "plan_tables": {w: c_tables(cp, index, hoist) for w, cp in plans.items()},
                "plan_share_runs": {w: share_runs(cp, hoist) for w, cp in plans.items()}}
        if self.copy_engine(spec):
            out["stream_programs"] = {w: [stream_program(cp, r) for r in range(w)] for w, cp in plans.items()}
            # world size -> rank -> copy step -> (destination, source) tsgen::slice initializers
            out["copy_slices"] = {w: [{i: (c_slice(cp, index, st.dst), c_slice(cp, index, st.srcs[0]))
                                       for i, st in enumerate(rp.steps) if st.op == "copy"} for rp in cp.ranks]
                                  for w, cp in plans.items()}
            out["launcher_params"] = ", ".join(f"{a.ctype} {a.name}" for a in abi.kernels[0].launcher_args)
        return out

    # -- what it computes: stated once, in each family's `semantics` (semantics.py) --
    semantics: Semantics

    def semantics_of(self, spec: Any) -> Semantics:
        return self.semantics

    def _expected(self, spec: Any, w: int, pieces: int) -> dict:
        """A plan's expected contributions, every count cut into `pieces` pieces."""
        return self.semantics_of(spec).plan_expected(w, pieces, spec.params.in_place)

    def make_inputs(self, spec, world, count, rng, pattern):
        out = {}
        for b in self.buffers(spec):
            if b.role in ("input", "inout"):
                out[b.name] = [_values(spec.dtype, b.elems(count, world), rng, pattern, r) for r in range(world)]
        return out

    def reference(self, spec, world, count, inputs):
        sem = self.semantics_of(spec)
        combine = (lambda parts: _sum(spec.dtype, parts)) if sem.reduces else sem.combine
        return {"dst": sem.outputs(world, count, inputs, spec.params.in_place, combine)}

    def tolerance(self, spec, world, count, inputs):
        """A reduction's rounding bound (a ring rounds its partial sums to dtype once per hop)."""
        sem = self.semantics_of(spec)
        if not sem.reduces:
            return None
        roundings = world if getattr(spec.params, "algorithm", None) == "ring" else 1
        ins = sem.inputs_of(world, count, inputs, spec.params.in_place)
        return {"dst": [sem.place(world, count, inputs, spec.params.in_place, r,
                                  _reduce_tolerance(spec.dtype, sem.parts(world, count, ins, r), roundings),
                                  zeros=True) for r in range(world)]}


# ---------------------------------------------------------------------------
# Numeric helpers (bfloat16 travels as uint16 bits)
# ---------------------------------------------------------------------------


def to_f64(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def from_f64(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        u = x.astype(np.float32).view(np.uint32)
        return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    if dtype == "int32":
        return x.astype(np.int64).astype(np.int32)
    return x.astype(np.dtype(dtype))


EPS = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-23, "int32": 0.0}


def _values(dtype: str, n: int, rng: np.random.Generator, pattern: bool, rank: int) -> np.ndarray:
    if pattern:
        return fill(dtype, n, rng, True, rank)
    if dtype == "int32":
        return rng.integers(-1000, 1000, size=n, dtype=np.int32)
    return from_f64(rng.standard_normal(n), dtype)


def _itemsize(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


def _reduce_tolerance(dtype: str, parts: list[np.ndarray], roundings: int = 1) -> np.ndarray:
    """|error| allowed for a sum of `parts` (fp32 accumulation; `roundings` roundings to dtype:
    1 when the sum is rounded once, one per hop when a ring carries rounded partial sums)."""
    if dtype == "int32":
        return np.zeros(parts[0].shape)
    mag = sum(np.abs(to_f64(p, dtype)) for p in parts)
    return (1 + roundings) * EPS[dtype] * mag + 2 * EPS["float32"] * len(parts) * mag + 1e-30


def _sum(dtype: str, parts: list[np.ndarray]) -> np.ndarray:
    total = sum(to_f64(p, dtype) for p in parts)
    return from_f64(total, dtype)
