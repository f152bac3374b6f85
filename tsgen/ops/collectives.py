"""Collectives as plans: allgather, reduce_scatter, all_to_all, all_reduce, broadcast.

Each family builds, for every world size, a CommPlan (tsgen/plan/ir.py): the
steps every rank takes, the signals between them, and the contributions
every output slice must end up with. The template renders the plan as
tables that one interpreter kernel executes (templates/include/
tsgen_plan.cuh) -- a small plan also as straight-line code making the same
share calls --, and `tsgen verify` executes the same plan on the CPU.

Conventions (as NCCL's): `count` is elements per rank of the smaller side:
allgather takes count and returns world x count; reduce_scatter takes
world x count and returns count; all_to_all moves world x count each way,
count to each peer; all_reduce and broadcast take and return count.
Every call begins with an entry signal to every peer ("I am in call e: my
inputs are ready and my outputs from call e-1 have been consumed"), and no
rank writes into a peer or reads a peer's memory before that peer's entry.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Literal

import numpy as np
from pydantic import Field

from ..plan.ir import MAX_WAITS, CommPlan, SignalRef, Slice, Step, schedule
from ..plan.lower import STRAIGHT_LINE_MAX_CALLS, ShareGroup, straight_line_groups, stream_program
from ..spec_types import Launch, SpecBase, StrictModel
from .base import CALLS, Arg, Buffer, ModuleAbi, OpFamily, fill
from .collectives_bench import AllReduceBench, CollectiveBench

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


class AllgatherParams(CollectiveParams):
    direction: Literal["push", "pull", "ring", "multimem"] = Field(
        "push", description="push: write into peers; pull: read from peers; ring: pass chunks around the "
        "ring r -> r+1 in `pieces` signalled pieces, forwarding each piece as it lands (every GPU writes to "
        "one peer only); multimem: one NVLink-multicast store per element (compiled only: the runtime "
        "refuses it unless explicitly enabled)")


class AllReduceParams(CollectiveParams):
    algorithm: Literal["one_shot", "two_shot", "two_shot_pull", "ring", "multimem"] = Field(
        "two_shot", description="one_shot: every rank reads every peer's input and reduces all of it; "
        "ring: ring reduce-scatter then ring allgather, r -> r+1 only, in signalled pieces; "
        "two_shot: reduce-scatter by push into inboxes, then allgather by push (large sizes); "
        "two_shot_pull: each rank reads and reduces its part from every peer, then pushes it (small sizes); "
        "multimem: two-shot with multimem.ld_reduce + multimem.st and a multimem.red barrier (compiled only: "
        "the runtime refuses it unless explicitly enabled)")


class ReduceScatterParams(CollectiveParams):
    algorithm: Literal["direct", "ring"] = Field(
        "direct", description="direct: push each peer's chunk into its inbox, every rank reduces its own; "
        "ring: partial sums travel r -> r+1, each rank adds its part and forwards (one outgoing peer per "
        "GPU; a rounding to dtype per hop)")


class BroadcastParams(CollectiveParams):
    root: int = Field(0, ge=0, le=7, description="rank whose input every rank receives")
    algorithm: Literal["push", "scatter_allgather", "ring"] = Field(
        "push", description="push: the root writes the whole message into every peer (small sizes); "
        "scatter_allgather: the root writes part j into rank j, then every rank writes its part into "
        "every other non-root rank (the root sends each byte once); ring: a chain root -> root+1 -> ... "
        "in signalled pieces, each forwarded as it lands (large sizes)")


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
    blocks_wait = True
    reduces = False
    bench = CollectiveBench()  # nccl-tests conventions, NCCL baseline (collectives_bench.py)

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

    def launched_from_host(self, spec: Any) -> bool:
        return self.copy_engine(spec)

    def device_libs(self, spec: Any) -> tuple[str, ...]:
        return ("nvshmem",) if spec.params.transport == "nvshmem" else ()

    def abi(self, spec: Any) -> ModuleAbi:
        abi = super().abi(spec)
        if self.copy_engine(spec):
            # The host launcher also needs the peer table in host memory (memcpy addresses).
            kernels = []
            for k in abi.kernels:
                args = k.args[:1] + (Arg("peers_host", "char* const*", "peers_host"),) + k.args[1:]
                kernels.append(dataclasses.replace(k, launcher_args=args))
            abi.kernels = tuple(kernels)
        # Straight-line code keeps every source of a reduction in flight at once, which takes
        # more registers than the interpreter; ptxas's default may cap them at what a second
        # block per SM leaves and spill. Collectives run one block per SM (at most 132).
        straight = self.straight_line(spec)
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
        if spec.params.transport == "nvshmem":
            problems += self._nvshmem_check(spec)
        if problems or self.is_multimem(spec):
            return problems
        for w in spec.world_sizes:  # the C tables index shares with 16 bits; streams are finite
            cp = self.comm_plan(spec, w)
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

    def _nvshmem_check(self, spec):
        """The nvshmem transport moves remote data by put (copy into a peer, from our memory)
        and get (copy from a peer into ours); reductions and anything else run on local memory."""
        if self.is_multimem(spec):
            return [(("params", "transport"), "multimem variants store through NVLink multicast, not NVSHMEM; "
                     "use transport: p2p")]
        for w in spec.world_sizes:
            for r, rp in enumerate(self.comm_plan(spec, w).ranks):
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

    def template_vars(self, spec):
        # every collective inlines tsgen_plan.cuh (vector math; the plan interpreter)
        out = {"plan_header": True, "copy_engine": self.copy_engine(spec), "nvshmem": spec.params.transport == "nvshmem"}
        if self.is_multimem(spec):
            return out
        plans = {w: self.comm_plan(spec, w) for w in spec.world_sizes}
        table = (CALLS,) + tuple(self.buffers(spec))  # the order plan.buffers has
        out |= {"comm_plans": plans, "buffer_index": {b.name: i for i, b in enumerate(table)}}
        # the SM kernel (collective.cu.j2) raises each rank's opening signal in code
        out |= {"hoist_opening": self.template_for(spec) == self.template, "straight_line": self.straight_line(spec, plans)}
        if self.copy_engine(spec):
            out["stream_programs"] = {w: [stream_program(cp, r) for r in range(w)] for w, cp in plans.items()}
            out["launcher_params"] = ", ".join(f"{a.ctype} {a.name}" for a in self.abi(spec).kernels[0].launcher_args)
        return out

    # -- reference ----------------------------------------------------------
    def make_inputs(self, spec, world, count, rng, pattern):
        out = {}
        for b in self.buffers(spec):
            if b.role in ("input", "inout"):
                out[b.name] = [_values(spec.dtype, b.elems(count, world), rng, pattern, r) for r in range(world)]
        return out


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


# ---------------------------------------------------------------------------
# allgather
# ---------------------------------------------------------------------------


class AllgatherFamily(CollectiveFamily):
    kind = "allgather"
    Params = AllgatherParams
    summary = "every rank ends with all ranks' inputs, rank j's at offset j*count (push or pull)"
    multimem_switch = ("direction", "multimem")

    def summary_of(self, spec):
        how = {"push": "each rank writes its input into every peer", "pull": "each rank reads every peer's input",
               "ring": "chunks pass around the ring r -> r+1 in pieces",
               "multimem": "one NVLink-multicast store per element"}[spec.params.direction]
        return f"every rank ends with all ranks' inputs, rank j's at offset j*count ({spec.params.direction}: {how})"

    def data_buffers(self, spec):
        if spec.params.in_place:
            return {"dst": ("inout", "W")}
        return {"src": ("input", 1), "dst": ("output", "W")}

    def signal_sizes(self, spec, w):
        if self.is_multimem(spec):
            return {"barrier": 1}
        if spec.params.direction == "ring":
            return {"entry": w, "arrive": w * spec.params.pieces}
        return {"entry": w, ("arrive" if spec.params.direction == "push" else "done"): w}

    def _ring_plan(self, spec, w):
        """Rank r sends chunk r, then forwards chunks r-1, r-2, ... to r+1, piece by piece,
        each as soon as it has landed; chunk r+1 arrives last and goes no further."""
        p = spec.params
        P, bpp = p.pieces, self._bpp(spec)
        steps = []
        for r in range(w):
            left, right = (r - 1) % w, (r + 1) % w
            own = (lambda i: Slice("dst", r, i, P)) if p.in_place else (lambda i: Slice("src", 0, i, P))
            s = [_entry(r, w, to=[left])]  # only our left neighbour writes into us
            for hop in range(w - 1):
                c = (r - hop) % w
                for i in range(P):
                    waits = (("entry", right),) + ((("arrive", c * P + i),) if hop else ())
                    s.append(Step("copy", dst=(right, Slice("dst", c, i, P)),
                                  srcs=((r, own(i) if hop == 0 else Slice("dst", c, i, P)),), waits=waits,
                                  signals=(SignalRef(right, "arrive", c * P + i),), blocks=bpp, lane="ring",
                                  note=f"chunk {c} piece {i} to rank {right}"))
            if not p.in_place:
                s += [Step("copy", dst=(r, Slice("dst", r, i, P)), srcs=((r, own(i)),), blocks=bpp, lane="local",
                           note=f"local copy, piece {i}") for i in range(P)]
            s += _final([("arrive", c * P + i) for c in range(w) if c != r for i in range(P)],
                        "wait for every chunk")
            steps.append(s)
        origin = "dst" if p.in_place else "src"
        expected = {(q, Slice("dst", j, i, P)): Counter({(j, origin, j if p.in_place else 0, i): 1})
                    for q in range(w) for j in range(w) for i in range(P) if not (p.in_place and q == j)}
        return self._schedule(spec, w, steps, expected)

    def comm_plan(self, spec, w):
        p = spec.params
        if self.is_multimem(spec):
            raise ValueError("multimem variants are not plans: they have no CPU verification")
        if p.direction == "ring":
            return self._ring_plan(spec, w)
        bpp = self._bpp(spec)
        steps = []
        for r in range(w):
            src = (r, Slice("dst", r)) if p.in_place else (r, Slice("src", 0))
            s = [_entry(r, w)]
            lane = self._peer_lane(spec)
            for q in _ring(r, w):
                if p.direction == "push":
                    s.append(Step("copy", dst=(q, Slice("dst", r)), srcs=(src,), waits=(("entry", q),),
                                  signals=(SignalRef(q, "arrive", r),), blocks=bpp, lane=lane,
                                  note=f"put to rank {q}"))
                else:
                    qsrc = (q, Slice("dst", q)) if p.in_place else (q, Slice("src", 0))
                    s.append(Step("copy", dst=(r, Slice("dst", q)), srcs=(qsrc,), waits=(("entry", q),),
                                  signals=(SignalRef(q, "done", r),), blocks=bpp, lane=lane,
                                  note=f"get from rank {q}"))
            if not p.in_place:
                s.append(Step("copy", dst=(r, Slice("dst", r)), srcs=(src,), blocks=bpp, note="local copy"))
            name = "arrive" if p.direction == "push" else "done"
            s += (_final([(name, q) for q in range(w) if q != r],
                            "wait for every peer's data" if p.direction == "push" else "wait until every peer has read our input"))
            steps.append(s)
        origin = "dst" if p.in_place else "src"
        expected = {(q, Slice("dst", j)): Counter({(j, origin, j if p.in_place else 0, 0): 1})
                    for q in range(w) for j in range(w) if not (p.in_place and q == j)}
        return self._schedule(spec, w, steps, expected)

    def reference(self, spec, world, count, inputs):
        if spec.params.in_place:
            mine = [inputs["dst"][r][r * count:(r + 1) * count] for r in range(world)]
        else:
            mine = inputs["src"]
        full = np.concatenate([m[:count] for m in mine])
        return {"dst": [full.copy() for _ in range(world)]}

    def bytes_moved(self, spec, world, count):
        return count * np.dtype("uint16" if spec.dtype == "bfloat16" else spec.dtype).itemsize * world


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


# ---------------------------------------------------------------------------
# reduce_scatter: push each peer's chunk into its inbox, reduce locally
# ---------------------------------------------------------------------------


class ReduceScatterFamily(CollectiveFamily):
    kind = "reduce_scatter"
    Params = ReduceScatterParams
    summary = ("rank r ends with the sum over ranks of chunk r (push chunks into peers' inboxes, "
               "pipelined in pieces, reduce locally in fp32)")

    def summary_of(self, spec):
        if spec.params.algorithm == "ring":
            return ("rank r ends with the sum over ranks of chunk r (ring: partial sums travel r -> r+1, each "
                    "rank adds its part and forwards)")
        return self.summary

    def data_buffers(self, spec):
        if spec.params.in_place:
            return {"dst": ("inout", "W"), "inbox": ("scratch", "W")}
        return {"src": ("input", "W"), "dst": ("output", 1), "inbox": ("scratch", "W")}

    def signal_sizes(self, spec, w):
        return {"entry": w, "arrive": w * spec.params.pieces}

    def comm_plan(self, spec, w):
        if spec.params.algorithm == "ring":
            return self._ring(spec, w)
        p = spec.params
        P, bpp = p.pieces, self._bpp(spec)
        src_buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            s = [_entry(r, w)]
            for q in _ring(r, w):  # one lane per peer (or one for all, pairwise): pieces go out in order
                for i in range(P):
                    s.append(Step("copy", dst=(q, Slice("inbox", r, i, P)), srcs=((r, Slice(src_buf, q, i, P)),),
                                  waits=(("entry", q),), signals=(SignalRef(q, "arrive", r * P + i),),
                                  blocks=bpp, lane=self._peer_lane(spec) or f"to{q}",
                                  note=f"piece {i} of chunk {q} to rank {q}'s inbox"))
            for i in range(P):  # the reduce lane follows the pieces as they arrive
                dst = (r, Slice("dst", r, i, P)) if p.in_place else (r, Slice("dst", 0, i, P))
                srcs = ((r, Slice(src_buf, r, i, P)),) + tuple((r, Slice("inbox", q, i, P)) for q in range(w) if q != r)
                s.append(Step("reduce", dst=dst, srcs=srcs,
                              waits=tuple(("arrive", q * P + i) for q in range(w) if q != r),
                              blocks=bpp, lane="reduce", note=f"reduce piece {i}"))
            steps.append(s)
        expected = {}
        for r in range(w):
            for i in range(P):
                sl = Slice("dst", r, i, P) if p.in_place else Slice("dst", 0, i, P)
                expected[(r, sl)] = Counter({(q, src_buf, r, i): 1 for q in range(w)})
        return self._schedule(spec, w, steps, expected)

    def _ring(self, spec, w):
        """Chunk c starts at rank c+1 and ends at rank c: at hop h rank r adds its part of
        chunk r-h-1 to the partial sum that arrived in its inbox and writes the result
        into rank r+1's inbox; the last hop's sum is the output."""
        p = spec.params
        P, bpp = p.pieces, self._bpp(spec)
        src_buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            right = (r + 1) % w
            s = [_entry(r, w, to=[(r - 1) % w])]  # only our left neighbour writes into us
            for hop in range(w - 1):
                c = (r - hop - 1) % w
                for i in range(P):
                    mine = (r, Slice(src_buf, c, i, P))
                    dst = (right, Slice("inbox", c, i, P))
                    if hop == 0:
                        step = Step("copy", dst=dst, srcs=(mine,), waits=(("entry", right),),
                                    note=f"chunk {c} piece {i}: our part to rank {right}")
                    else:
                        step = Step("reduce", dst=dst, srcs=((r, Slice("inbox", c, i, P)), mine),
                                    waits=(("arrive", c * P + i), ("entry", right)),
                                    note=f"chunk {c} piece {i}: partial sum + our part to rank {right}")
                    s.append(dataclasses.replace(step, signals=(SignalRef(right, "arrive", c * P + i),),
                                                 blocks=bpp, lane="ring"))
            for i in range(P):
                dst = (r, Slice("dst", r, i, P)) if p.in_place else (r, Slice("dst", 0, i, P))
                s.append(Step("reduce", dst=dst, srcs=((r, Slice("inbox", r, i, P)), (r, Slice(src_buf, r, i, P))),
                              waits=(("arrive", r * P + i),), blocks=bpp, lane="final",
                              note=f"our chunk, piece {i}: last partial sum + our part"))
            steps.append(s)
        expected = {}
        for r in range(w):
            for i in range(P):
                sl = Slice("dst", r, i, P) if p.in_place else Slice("dst", 0, i, P)
                expected[(r, sl)] = Counter({(q, src_buf, r, i): 1 for q in range(w)})
        return self._schedule(spec, w, steps, expected)

    def _parts(self, spec, world, count, inputs, r):
        src = inputs["dst" if spec.params.in_place else "src"]
        return [src[q][r * count:(r + 1) * count] for q in range(world)]

    def reference(self, spec, world, count, inputs):
        out = []
        for r in range(world):
            total = _sum(spec.dtype, self._parts(spec, world, count, inputs, r))
            if spec.params.in_place:
                full = inputs["dst"][r].copy()
                full[r * count:(r + 1) * count] = total
                total = full
            out.append(total)
        return {"dst": out}

    def tolerance(self, spec, world, count, inputs):
        out = []
        for r in range(world):
            tol = _reduce_tolerance(spec.dtype, self._parts(spec, world, count, inputs, r),
                                    roundings=world if spec.params.algorithm == "ring" else 1)
            if spec.params.in_place:
                full = np.zeros(world * count)
                full[r * count:(r + 1) * count] = tol
                tol = full
            out.append(tol)
        return {"dst": out}


# ---------------------------------------------------------------------------
# all_to_all
# ---------------------------------------------------------------------------


class AllToAllFamily(CollectiveFamily):
    kind = "all_to_all"
    Params = CollectiveParams
    summary = "chunk q of rank r's input lands as chunk r of rank q's output (push)"

    def data_buffers(self, spec):
        if spec.params.in_place:
            return {"dst": ("inout", "W"), "inbox": ("scratch", "W")}
        return {"src": ("input", "W"), "dst": ("output", "W")}

    def signal_sizes(self, spec, w):
        return {"entry": w, "arrive": w} | ({"sent": w} if spec.params.in_place else {})

    def comm_plan(self, spec, w):
        p = spec.params
        bpp = self._bpp(spec)
        steps = []
        for r in range(w):
            s = [_entry(r, w)]
            for q in _ring(r, w):
                if p.in_place:
                    # into q's inbox; our own chunk q is overwritten only after it has been sent
                    s.append(Step("copy", dst=(q, Slice("inbox", r)), srcs=((r, Slice("dst", q)),),
                                  waits=(("entry", q),),
                                  signals=(SignalRef(q, "arrive", r), SignalRef(r, "sent", q)),
                                  blocks=bpp, note=f"chunk {q} to rank {q}'s inbox"))
                else:
                    s.append(Step("copy", dst=(q, Slice("dst", r)), srcs=((r, Slice("src", q)),),
                                  waits=(("entry", q),), signals=(SignalRef(q, "arrive", r),),
                                  blocks=bpp, lane=self._peer_lane(spec), note=f"chunk {q} to rank {q}"))
            if p.in_place:
                for q in _ring(r, w):
                    s.append(Step("copy", dst=(r, Slice("dst", q)), srcs=((r, Slice("inbox", q)),),
                                  waits=(("arrive", q), ("sent", q)), blocks=bpp,
                                  note=f"rank {q}'s chunk from the inbox"))
            else:
                s.append(Step("copy", dst=(r, Slice("dst", r)), srcs=((r, Slice("src", r)),), blocks=bpp,
                              note="own chunk"))
                s += (_final([("arrive", q) for q in range(w) if q != r], "wait for every peer's chunk"))
            steps.append(s)
        origin = "dst" if p.in_place else "src"
        expected = {(q, Slice("dst", j)): Counter({(j, origin, q, 0): 1}) for q in range(w) for j in range(w)
                    if not (p.in_place and q == j)}
        return self._schedule(spec, w, steps, expected)

    def reference(self, spec, world, count, inputs):
        src = inputs["dst" if spec.params.in_place else "src"]
        return {"dst": [np.concatenate([src[j][q * count:(q + 1) * count] for j in range(world)])
                        for q in range(world)]}


# ---------------------------------------------------------------------------
# all_reduce
# ---------------------------------------------------------------------------


class AllReduceFamily(CollectiveFamily):
    kind = "all_reduce"
    Params = AllReduceParams
    bench = AllReduceBench()  # + PyTorch SymmetricMemory's one- and two-shot all-reduce
    summary = "every rank ends with the sum of all ranks' inputs (one_shot pull, or two_shot push RS + push AG)"
    multimem_switch = ("algorithm", "multimem")

    def summary_of(self, spec):
        how = {"one_shot": "every rank reads and reduces every peer's input",
               "two_shot": "reduce-scatter by push into inboxes, then allgather by push",
               "two_shot_pull": "each rank reads and reduces its part from every peer, then pushes it",
               "ring": "ring reduce-scatter then ring allgather, r -> r+1 in pieces",
               "multimem": "two-shot with multimem.ld_reduce + multimem.st"}[spec.params.algorithm]
        return f"every rank ends with the sum of all ranks' inputs ({spec.params.algorithm}: {how})"

    def data_buffers(self, spec):
        if spec.params.algorithm == "ring":  # the inbox holds one partial sum per part
            io = {"dst": ("inout", 1)} if spec.params.in_place else {"src": ("input", 1), "dst": ("output", 1)}
            return io | {"inbox": ("scratch", 1)}
        two = spec.params.algorithm == "two_shot"
        if spec.params.algorithm in ("two_shot_pull", "multimem"):
            return {"dst": ("inout", 1)} if spec.params.in_place else {"src": ("input", 1), "dst": ("output", 1)}
        if spec.params.in_place:
            return {"dst": ("inout", 1)} | ({"inbox": ("scratch", "W")} if two else {"scratch": ("scratch", 1)})
        return {"src": ("input", 1), "dst": ("output", 1)} | ({"inbox": ("scratch", "W")} if two else {})

    def signal_sizes(self, spec, w):
        P = spec.params.pieces
        if spec.params.algorithm == "one_shot":
            return {"entry": w, "done": w} | ({"reduced": 1} if spec.params.in_place else {})
        if spec.params.algorithm == "two_shot_pull":
            return {"entry": w, "gathered": w * P}
        if spec.params.algorithm == "ring":
            return {"entry": w, "arrive": w * P, "gathered": w * P}
        if spec.params.algorithm == "multimem":
            return {"barrier": 1}
        return {"entry": w, "arrive": w * P, "reduced": P, "gathered": w * P}

    def comm_plan(self, spec, w):
        return {"one_shot": self._one_shot, "two_shot": self._two_shot, "two_shot_pull": self._two_shot_pull,
                "ring": self._ring}[spec.params.algorithm](spec, w)

    def _ring(self, spec, w):
        """Ring reduce-scatter of the w parts (part c ends reduced at rank c), then a ring
        allgather of the reduced parts; every GPU writes only into rank r+1."""
        p = spec.params
        P, bpp = p.pieces, self._bpp(spec)
        n = w * P  # part c, piece i = piece c*P + i of the count
        buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            right = (r + 1) % w
            s = [_entry(r, w, to=[(r - 1) % w])]  # only our left neighbour writes into us
            for hop in range(w - 1):  # reduce-scatter: partial sums of part r-hop-1 go right
                c = (r - hop - 1) % w
                for i in range(P):
                    k = c * P + i
                    mine, dst = (r, Slice(buf, 0, k, n)), (right, Slice("inbox", 0, k, n))
                    if hop == 0:
                        step = Step("copy", dst=dst, srcs=(mine,), waits=(("entry", right),),
                                    note=f"part {c} piece {i}: our input to rank {right}")
                    else:
                        step = Step("reduce", dst=dst, srcs=((r, Slice("inbox", 0, k, n)), mine),
                                    waits=(("arrive", k), ("entry", right)),
                                    note=f"part {c} piece {i}: partial sum + our input to rank {right}")
                    s.append(dataclasses.replace(step, signals=(SignalRef(right, "arrive", k),),
                                                 blocks=bpp, lane="rs"))
            # One lane: each block reduces its share of a piece of our part, then sends that
            # same share on (it wrote it itself, so no signal is needed in between).
            for i in range(P):
                k = r * P + i
                s.append(Step("reduce", dst=(r, Slice("dst", 0, k, n)),
                              srcs=((r, Slice("inbox", 0, k, n)), (r, Slice(buf, 0, k, n))),
                              waits=(("arrive", k),), blocks=bpp, lane="ag",
                              note=f"our part, piece {i}: last partial sum + our input"))
            for hop in range(w - 1):  # allgather: reduced part r-hop goes right
                c = (r - hop) % w
                for i in range(P):
                    k = c * P + i
                    waits = (("entry", right),) + ((("gathered", k),) if hop else ())
                    s.append(Step("copy", dst=(right, Slice("dst", 0, k, n)), srcs=((r, Slice("dst", 0, k, n)),),
                                  waits=waits, signals=(SignalRef(right, "gathered", k),), blocks=bpp, lane="ag",
                                  note=f"reduced part {c} piece {i} to rank {right}"))
            s += _final([("gathered", c * P + i) for c in range(w) if c != r for i in range(P)],
                        "wait for every reduced part")
            steps.append(s)
        expected = {(r, Slice("dst", 0, k, n)): Counter({(q, buf, 0, k): 1 for q in range(w)})
                    for r in range(w) for k in range(n)}
        return self._schedule(spec, w, steps, expected)

    def _two_shot_pull(self, spec, w):
        """Entry; reduce our part straight from every rank's input (peer reads), storing
        the sums into every rank's output at once. A peer's `gathered` signal also says it
        has finished reading our input (it read before it stored), so waiting for all of
        them is the exit barrier too."""
        p = spec.params
        P, nb = p.pieces, self._bpp(spec)
        n = w * P
        buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            s = [_entry(r, w)]
            for i in range(P):
                # Each block reduces its share of our part and stores the sums to every rank
                # at once (dst and `also`): nothing is re-read to be pushed. Every peer's
                # signal is raised after the stores (one round of release fences).
                mine = r * P + i
                s.append(Step("reduce", dst=(r, Slice("dst", 0, mine, n)),
                              also=tuple((q, Slice("dst", 0, mine, n)) for q in _ring(r, w)),
                              srcs=tuple((q, Slice(buf, 0, mine, n)) for q in [r] + _ring(r, w)),
                              waits=tuple(("entry", q) for q in range(w) if q != r),
                              signals=tuple(SignalRef(q, "gathered", mine) for q in _ring(r, w)),
                              blocks=nb, lane="part", note=f"reduce our part, piece {i}, reading every rank; "
                              "the sums to every rank"))
            s += _final([("gathered", q * P + i) for q in range(w) if q != r for i in range(P)],
                        "wait for every peer's reduced parts (and their reads of our input)")
            steps.append(s)
        expected = {(r, Slice("dst", 0, k, n)): Counter({(q, buf, 0, k): 1 for q in range(w)})
                    for r in range(w) for k in range(n)}
        return self._schedule(spec, w, steps, expected)

    def _one_shot(self, spec, w):
        p = spec.params
        nb = self._bpp(spec)
        buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            s = [_entry(r, w)]
            srcs = tuple((q, Slice(buf, 0)) for q in [r] + _ring(r, w))
            done = tuple(SignalRef(q, "done", r) for q in range(w) if q != r)
            if p.in_place:  # our result may overwrite our input only once every peer has read it
                s.append(Step("reduce", dst=(r, Slice("scratch", 0)), srcs=srcs,
                              waits=tuple(("entry", q) for q in range(w) if q != r),
                              signals=done + (SignalRef(r, "reduced", 0),), blocks=nb, note="sum every rank's input"))
                s.append(Step("copy", dst=(r, Slice("dst", 0)), srcs=((r, Slice("scratch", 0)),),
                              waits=tuple(("done", q) for q in range(w) if q != r) + (("reduced", 0),),
                              blocks=nb, note="result over our input"))
            else:
                s.append(Step("reduce", dst=(r, Slice("dst", 0)), srcs=srcs,
                              waits=tuple(("entry", q) for q in range(w) if q != r),
                              signals=done, blocks=nb, note="sum every rank's input"))
                s += (_final([("done", q) for q in range(w) if q != r], "wait until every peer has read our input"))
            steps.append(s)
        expected = {(r, Slice("dst", 0)): Counter({(q, buf, 0, 0): 1 for q in range(w)}) for r in range(w)}
        return self._schedule(spec, w, steps, expected)

    def _two_shot(self, spec, w):
        p = spec.params
        P, bpp = p.pieces, self._bpp(spec)
        n = w * P  # the count is cut into w parts of P pieces: part q (pieces q*P..) is reduced by rank q
        buf = "dst" if p.in_place else "src"
        nb = bpp
        steps = []
        for r in range(w):
            s = [_entry(r, w)]
            for q in _ring(r, w):  # reduce-scatter: push part q to rank q's inbox, piece by piece
                for i in range(P):
                    s.append(Step("copy", dst=(q, Slice("inbox", r, q * P + i, n)),
                                  srcs=((r, Slice(buf, 0, q * P + i, n)),), waits=(("entry", q),),
                                  signals=(SignalRef(q, "arrive", r * P + i),), blocks=nb, lane=f"rs{q}",
                                  note=f"part {q} piece {i} to rank {q}"))
            for i in range(P):
                mine = r * P + i
                srcs = ((r, Slice(buf, 0, mine, n)),) + tuple((r, Slice("inbox", q, mine, n)) for q in range(w) if q != r)
                s.append(Step("reduce", dst=(r, Slice("dst", 0, mine, n)), srcs=srcs,
                              waits=tuple(("arrive", q * P + i) for q in range(w) if q != r),
                              signals=(SignalRef(r, "reduced", i),), blocks=nb, lane="reduce",
                              note=f"reduce our part, piece {i}"))
            for q in _ring(r, w):  # allgather: push each reduced piece to every peer
                for i in range(P):
                    mine = r * P + i
                    s.append(Step("copy", dst=(q, Slice("dst", 0, mine, n)), srcs=((r, Slice("dst", 0, mine, n)),),
                                  waits=(("reduced", i), ("entry", q)), signals=(SignalRef(q, "gathered", r * P + i),),
                                  blocks=nb, lane=f"ag{q}", note=f"reduced piece {i} to rank {q}"))
            s += (_final([("gathered", q * P + i) for q in range(w) if q != r for i in range(P)],
                            "wait for every peer's reduced parts"))
            steps.append(s)
        expected = {(r, Slice("dst", 0, k, n)): Counter({(q, buf, 0, k): 1 for q in range(w)})
                    for r in range(w) for k in range(n)}
        return self._schedule(spec, w, steps, expected)

    def reference(self, spec, world, count, inputs):
        parts = inputs["dst" if spec.params.in_place else "src"]
        total = _sum(spec.dtype, parts)
        return {"dst": [total.copy() for _ in range(world)]}

    def tolerance(self, spec, world, count, inputs):
        parts = inputs["dst" if spec.params.in_place else "src"]
        tol = _reduce_tolerance(spec.dtype, parts, roundings=world if spec.params.algorithm == "ring" else 1)
        return {"dst": [tol for _ in range(world)]}


# ---------------------------------------------------------------------------
# broadcast
# ---------------------------------------------------------------------------


class BroadcastFamily(CollectiveFamily):
    kind = "broadcast"
    Params = BroadcastParams
    summary = "every rank ends with the root's input (the root pushes to every peer)"

    def summary_of(self, spec):
        how = {"push": "the root pushes to every peer",
               "scatter_allgather": "the root writes part j into rank j, then every rank writes its part into "
                                    "the other non-root ranks",
               "ring": "a chain root -> root+1 -> ... in signalled pieces"}[spec.params.algorithm]
        return f"every rank ends with the root's input ({spec.params.algorithm}: {how})"

    def extra_check(self, spec):
        bad = [w for w in spec.world_sizes if spec.params.root >= w]
        if bad:
            return [(("params", "root"), f"root {spec.params.root} is not a rank at world size {bad[0]}")]
        return []

    def data_buffers(self, spec):
        if spec.params.in_place:
            return {"dst": ("inout", 1)}
        return {"src": ("input", 1), "dst": ("output", 1)}

    def signal_sizes(self, spec, w):
        if spec.params.algorithm == "scatter_allgather":
            return {"entry": w, "scattered": 1, "gathered": w}
        if spec.params.algorithm == "ring":
            return {"entry": w, "arrive": spec.params.pieces}
        return {"entry": w, "arrive": 1}

    def comm_plan(self, spec, w):
        if spec.params.algorithm == "scatter_allgather":
            return self._scatter_allgather(spec, w)
        if spec.params.algorithm == "ring":
            return self._chain(spec, w)
        p = spec.params
        root, bpp = p.root, self._bpp(spec)
        buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            if r != root:
                steps.append([_entry(r, w, to=[root])] + _final([("arrive", 0)], "wait for the root's data"))
                continue
            s = []
            for q in _ring(r, w):
                s.append(Step("copy", dst=(q, Slice("dst", 0)), srcs=((r, Slice(buf, 0)),), waits=(("entry", q),),
                              signals=(SignalRef(q, "arrive", 0),), blocks=bpp, note=f"put to rank {q}"))
            if not p.in_place:
                s.append(Step("copy", dst=(r, Slice("dst", 0)), srcs=((r, Slice("src", 0)),), blocks=bpp,
                              note="local copy"))
            steps.append(s)
        expected = {(q, Slice("dst", 0)): Counter({(root, buf, 0, 0): 1}) for q in range(w)
                    if not (p.in_place and q == root)}
        return self._schedule(spec, w, steps, expected)

    def _chain(self, spec, w):
        """root -> root+1 -> ... -> root-1, piece by piece, each forwarded as it lands."""
        p = spec.params
        root, P, bpp = p.root, p.pieces, self._bpp(spec)
        buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            right, last = (r + 1) % w, (root - 1) % w
            s = [] if r == root else [_entry(r, w, to=[(r - 1) % w])]  # our left neighbour writes into us
            if r != last:
                for i in range(P):
                    src = (r, Slice(buf if r == root else "dst", 0, i, P))
                    waits = (("entry", right),) + (() if r == root else (("arrive", i),))
                    s.append(Step("copy", dst=(right, Slice("dst", 0, i, P)), srcs=(src,), waits=waits,
                                  signals=(SignalRef(right, "arrive", i),), blocks=bpp, lane="chain",
                                  note=f"piece {i} to rank {right}"))
            else:
                s += _final([("arrive", i) for i in range(P)], "wait for every piece")
            if r == root and not p.in_place:
                s += [Step("copy", dst=(r, Slice("dst", 0, i, P)), srcs=((r, Slice("src", 0, i, P)),), blocks=bpp,
                           lane="local", note=f"local copy, piece {i}") for i in range(P)]
            steps.append(s)
        expected = {(q, Slice("dst", 0, i, P)): Counter({(root, buf, 0, i): 1}) for q in range(w) for i in range(P)
                    if not (p.in_place and q == root)}
        return self._schedule(spec, w, steps, expected)

    def _scatter_allgather(self, spec, w):
        """The message is cut into w - 1 parts, one per non-root rank: part k travels
        root -> its owner -> every other non-root rank, so the root sends each byte once."""
        p = spec.params
        root, bpp = p.root, self._bpp(spec)
        buf = "dst" if p.in_place else "src"
        others = [q for q in range(w) if q != root]
        n = len(others)
        part = {q: k for k, q in enumerate(others)}  # rank -> the part it owns
        steps = []
        for r in range(w):
            if r == root:  # nobody writes into the root, so it signals no entry
                s = [Step("copy", dst=(q, Slice("dst", 0, part[q], n)), srcs=((r, Slice(buf, 0, part[q], n)),),
                          waits=(("entry", q),), signals=(SignalRef(q, "scattered", 0),), blocks=bpp,
                          note=f"part {part[q]} to its owner, rank {q}") for q in _ring(r, w)]
                if not p.in_place:
                    s += [Step("copy", dst=(r, Slice("dst", 0, k, n)), srcs=((r, Slice("src", 0, k, n)),),
                               blocks=bpp, lane="local", note=f"local copy of part {k}") for k in range(n)]
            else:
                s = [_entry(r, w)]
                mine = Slice("dst", 0, part[r], n)
                for q in _ring(r, w):  # allgather among the non-root ranks: our part to each
                    if q != root:
                        s.append(Step("copy", dst=(q, mine), srcs=((r, mine),),
                                      waits=(("scattered", 0), ("entry", q)),
                                      signals=(SignalRef(q, "gathered", r),), blocks=bpp,
                                      note=f"our part {part[r]} to rank {q}"))
                waits = [("scattered", 0)] + [("gathered", q) for q in others if q != r]
                s += _final(waits, "wait for our part from the root and every other part from its owner")
            steps.append(s)
        expected = {(q, Slice("dst", 0, k, n)): Counter({(root, buf, 0, k): 1}) for q in range(w) for k in range(n)
                    if not (p.in_place and q == root)}
        return self._schedule(spec, w, steps, expected)

    def reference(self, spec, world, count, inputs):
        src = inputs["dst" if spec.params.in_place else "src"]
        return {"dst": [src[spec.params.root].copy() for _ in range(world)]}


FAMILIES: list[OpFamily] = [AllgatherFamily(), ReduceScatterFamily(), AllToAllFamily(), AllReduceFamily(),
                            BroadcastFamily()]
