"""moe: mixture-of-experts expert-parallel dispatch and combine: normal mode (bf16 or fp8 rows) and low-latency mode.

E experts are placed in contiguous runs of L = E / W per rank (rank d holds experts
[d L, (d + 1) L)). From `topk_idx` [tokens, topk] (expert ids; -1, or any id outside
[0, E), means none) a token's destination ranks are the ranks of its experts; it is sent
once to each, however many of its experts live there.

dispatch: every rank receives its rows contiguously in `recv_x`, grouped by source rank
(rank 0's rows first), in source token order inside one source; with each row, per top-k
slot, the local expert id on the receiving rank (-1 where that slot's expert lives
elsewhere) and its weight (0 there), and the handle (source rank, source token).
`recv_counts`: rows received, flags (1: more rows than the receive capacity arrived and
those past it were dropped; 2: some of this rank's rows were dropped by a destination),
rows per source rank, (token, expert) pairs per local expert. The receive capacity is
fixed in the spec (worst case: every token of every rank, W x capacity), so a call needs no
host synchronization and can be captured in a CUDA graph.

combine: each rank hands back its processed rows `y` (row r = received row r); every source
token gets the sum of its rows over its destination ranks, fp32 accumulation in rank order,
one rounding to bf16, in the original order. With `weighted: true` the row from rank d is
scaled by the sum of the token's top-k weights of the experts on d (exact MoE weighting when
each rank returns its experts' unweighted output averaged the same way, e.g. one expert per
rank); unweighted, the experts' weights travel with the rows and the ranks apply them.

`count` (the run-time argument) is this rank's tokens, at most params.capacity; the
`tsgen test` call is dispatch then combine of the received rows as they are (identity expert).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
from pydantic import Field

from ..runtime.placement import fit_blocks
from ..spec_types import SpecBase, StrictModel
from .base import Buffer, OpFamily
from .conventions import Baseline, BenchCase, BenchConventions
from .collectives import from_f64, to_f64
from .collectives.base import _values


class MoeBench(BenchConventions):
    """A timed call is the pair launcher (dispatch, then combine of the received rows; fp8: with
    the rows dequantized between), every rank with `size` tokens routed at random (the family's
    make_inputs). Bytes: what the bottleneck rank (the one sending most) moves to other ranks per
    call, dispatch plus combine, counting every byte the kernels store into peers (rows, fp8
    scales, per-row metadata and handles; `traffic`), DeepEP's "bottleneck bandwidth" over the
    link; the guard's link bytes are the least any rank sends. Baseline: PyTorch's
    all_to_all_single-based dispatch / combine (counts exchange, permute, all-to-all, unpermute
    with index_add), one process per GPU (tsgen/bench/moe_torch.py); DeepEP's dispatch, combine
    and pair where its wheel is installed, beside the measured peer-copy ceiling
    (tsgen/bench/moe_deepep.py). Beside the pair, tsgen's dispatch alone and combine alone, each with
    its own bytes and SM count ("tsgen_phases", in this process: tsgen/bench/moe_phases.py)."""

    kind = "latency"
    size_unit = "count"
    metric = "time_us"
    baselines = (Baseline("tsgen_phases", "moe_phases", in_process=True), Baseline("torch_moe", "moe_a2a"),
                 Baseline("deepep", "deepep"))

    def group_shape(self, spec):
        """The baseline moves what the routing and row shape say: a variant of another shape (or
        mode, or payload) is timed against its own baseline."""
        p = spec.params
        return f"/e{p.experts}/h{p.hidden}/k{p.topk}/{p.mode}/{p.payload}{'/weighted' if p.weighted else ''}"

    def case(self, family, spec, world, size):
        sent = traffic(spec, world, self.bench_inputs(family, spec, world, size, np.random.default_rng(12345)))
        total = [d + c for d, c in zip(sent["dispatch"], sent["combine"])]
        return BenchCase(size, size, link_bytes=float(min(total)), bw_bytes=float(max(total)),
                         note="bytes: the bottleneck rank's dispatch + combine bytes to other ranks")


class MoeParams(StrictModel):
    experts: int = Field(64, ge=1, le=1024, description="experts in all (E); each rank holds E / world of them")
    hidden: int = Field(1024, ge=8, le=65536, description="channels per token (bf16: a multiple of 8)")
    topk: int = Field(8, ge=1, le=16, description="experts per token")
    capacity: int = Field(512, ge=1, le=65536, description="tokens per rank at most (the run-time count)")
    recv_capacity: int | None = Field(None, ge=1, le=1 << 22,
                                      description="rows one rank can receive (default: max world x capacity, "
                                      "the worst case); more is reported, never written")
    weighted: bool = Field(False, description="combine scales rank d's row by the token's weights of experts on d")
    mode: Literal["normal", "low_latency"] = Field("normal", description="normal | low_latency (decode)")
    slot_tokens: int | None = Field(None, ge=1, le=65536,
                                    description="low_latency: rows per (local expert, source rank) slot (default: "
                                    "capacity, the worst case)")
    payload: Literal["bf16", "fp8"] = Field("bf16", description="dispatch payload")
    combine_blocks: int | None = Field(None, ge=1, le=132,
                                       description="normal mode: combine's grid (default: launch.blocks, dispatch's); "
                                       "one block per SM, like dispatch's")
    combine_chunk_rows: int = Field(2, ge=1, le=64,
                                    description="normal mode: rows of a receive buffer per combine chunk, the unit "
                                    "its rows go home in and are signalled by (a token's sum waits for the chunks "
                                    "holding its rows)")
    combine_order: Literal["rows", "peers"] = Field(
        "rows", description="normal mode: the order combine's senders push a receive buffer's chunks home in: rows "
        "(row order; the rows are grouped by source rank, so every rank pushes to one peer at a time, the same one: "
        "incast at world > 2) | peers (the peers' chunks interleaved: every rank pushes to every peer at once)")
    combine_senders: int | None = Field(
        None, ge=1, le=32, description="normal mode: warps of each combine block that push rows home before they "
        "sum (default: half the block's warps); fewer senders, each with more bytes in flight "
        "(combine_send_unroll), finish each chunk sooner, so the chunks land in smaller waves and the sums "
        "trail the link closer")
    combine_send_unroll: int | None = Field(
        None, ge=1, le=16, description="normal mode: 16-byte vectors per lane that a combine sender loads before "
        "it stores them to the peer (default: launch.unroll)")
    fp8_send_unroll: int | None = Field(
        None, ge=1, le=8, description="fp8 payload: dispatch's send with a pass's scales gathered, one lane per "
        "128-channel group (one division pair a lane a pass, one contiguous scale store per destination, the "
        "destinations' row addresses once per row), each lane loading this many 16-channel chunks before it "
        "quantizes (at most 8: a lane per group of a pass); default: the shipped send (launch.unroll chunks, every "
        "lane dividing for each of its chunks, a 16-byte scale store per group); the same bytes and scales")


class MoeSpec(SpecBase):
    """Spec of op `moe` (dispatch + combine)."""

    op: Literal["moe"]
    dtype: Literal["bfloat16"] = "bfloat16"
    params: MoeParams = MoeParams()


def recv_rows(spec) -> int:
    """Normal mode: rows one rank can receive."""
    p = spec.params
    return p.recv_capacity if p.recv_capacity is not None else max(spec.world_sizes) * p.capacity


def combine_blocks(spec) -> int:
    """Normal mode: combine's grid (params.combine_blocks, else dispatch's launch.blocks)."""
    p = spec.params
    return p.combine_blocks if p.combine_blocks is not None else spec.launch.blocks


def combine_chunks(spec) -> int:
    """Normal mode: chunks of params.combine_chunk_rows rows in one rank's receive buffer, the units its
    rows go home in and are signalled by (chunk_sig); a token's sum waits for the chunks that hold its
    rows (tsgen/moe.cuh)."""
    return -(-recv_rows(spec) // spec.params.combine_chunk_rows)


def combine_sender_constants(spec) -> dict:
    """Normal mode: combine's sender warps per block and their copy's unroll (params.combine_senders,
    params.combine_send_unroll) as the module's SENDERS and SEND_UNROLL, or {} where neither is set: the
    kernel then keeps half the block's warps as senders and launch.unroll (tsgen/moe.cuh), and the
    rendered source has neither constant (the shipped sources stay as they were)."""
    p = spec.params
    if p.combine_senders is None and p.combine_send_unroll is None:
        return {}
    warps = spec.launch.threads // 32
    return {"SENDERS": p.combine_senders if p.combine_senders is not None else (warps // 2 if warps > 1 else 1),
            "SEND_UNROLL": p.combine_send_unroll if p.combine_send_unroll is not None else spec.launch.unroll}


def fp8_send_constants(spec) -> dict:
    """FP8 payload: dispatch's send with a pass's scales gathered (params.fp8_send_unroll) as the module's
    FP8_UNROLL, or {} where it is not set: the kernel then keeps the shipped send (push_row_fp8,
    tsgen/moe.cuh), and the rendered source has no such constant (the shipped sources stay as they were)."""
    u = spec.params.fp8_send_unroll
    return {} if u is None else {"FP8_UNROLL": u}


def phase_sms(spec, phase: str) -> int:
    """SMs (one block each) the dispatch or combine kernel runs on."""
    return combine_blocks(spec) if phase == "combine" and not low_latency(spec) else spec.launch.blocks


def slot_rows(spec) -> int:
    """Low-latency mode: rows per (local expert, source rank) slot."""
    p = spec.params
    return p.slot_tokens if p.slot_tokens is not None else p.capacity


STATIC_SMEM_LIMIT = 48 * 1024  # bytes of __shared__ arrays a block may declare statically


def dispatch_static_smem(spec, world: int) -> int:
    """Bytes of the dispatch kernel's __shared__ arrays (tsgen/moe.cuh) at one world size: normal
    mode s_total..s_run and s_from [W] x 6, s_ecount [E], s_warp [warps][W], s_pos [threads][W], s_mask
    [threads]; low-latency s_warp [warps], s_run, s_pair [threads * topk]. 4 bytes each."""
    p, threads = spec.params, spec.launch.threads
    warps = threads // 32
    if low_latency(spec):
        return 4 * (warps + 1 + threads * p.topk)
    return 4 * (6 * world + p.experts + warps * world + threads * world + threads)


def low_latency(spec) -> bool:
    return spec.params.mode == "low_latency"


class MoeFamily(OpFamily):
    kind = "moe"
    summary = ("MoE expert-parallel dispatch (tokens to the ranks of their top-k experts) and combine (rows back "
               "to their tokens, summed in fp32): normal mode (bf16 or fp8 dispatch) and low-latency mode")
    Spec = MoeSpec
    category = "moe"
    template = "moe.cu.j2"
    count_unit = "tokens"
    blocks_wait = True
    host_launch = True  # a call is two kernels (dispatch, combine) through NAME_wW_launch
    bench = MoeBench()

    def check(self, spec):
        p, problems = spec.params, []
        for w in spec.world_sizes:
            if p.experts % w:
                problems.append((("params", "experts"), f"{p.experts} experts do not divide over world size {w} "
                                 "(each rank holds experts / world of them)"))
                break
        if p.hidden % 8:
            problems.append((("params", "hidden"), f"{p.hidden} is not a multiple of 8 (rows move as 16-byte "
                             "vectors of 8 bf16)"))
        if p.payload == "fp8" and p.hidden % 128:
            problems.append((("params", "hidden"), f"{p.hidden} is not a multiple of 128: the fp8 payload has one "
                             "scale per 128 channels"))
        if p.topk > p.experts:
            problems.append((("params", "topk"), f"{p.topk} experts per token, but there are {p.experts}"))
        if low_latency(spec):
            need = p.experts * slot_rows(spec)
            if p.recv_capacity is not None and p.recv_capacity < need:
                problems.append((("params", "recv_capacity"), f"{p.recv_capacity} rows is too small for the "
                                 f"low-latency slots: {p.experts} (local expert, source rank) slots of "
                                 f"{slot_rows(spec)} rows (params.slot_tokens) need {need}"))
            if not p.weighted:
                problems.append((("params", "weighted"), "low_latency combine always applies the top-k weights "
                                 "(one row per (token, expert)): set weighted: true"))
        elif p.slot_tokens is not None:
            problems.append((("params", "slot_tokens"), "only the low_latency mode has slots"))
        if low_latency(spec) and p.combine_order != "rows":
            problems.append((("params", "combine_order"), "only the normal mode's combine pushes chunks of a receive "
                             "buffer; low_latency's goes by (local expert, source rank) slot"))
        if low_latency(spec) and (p.combine_senders is not None or p.combine_send_unroll is not None):
            problems.append((("params", "combine_senders" if p.combine_senders is not None else "combine_send_unroll"),
                             "only the normal mode's combine has sender warps; low_latency's pushes with every warp"))
        if p.fp8_send_unroll is not None and p.payload != "fp8":
            problems.append((("params", "fp8_send_unroll"), "only the fp8 payload quantizes in dispatch's send; "
                             f"payload {p.payload} copies its rows as they are"))
        if p.combine_senders is not None and p.combine_senders > spec.launch.threads // 32:
            problems.append((("params", "combine_senders"), f"{p.combine_senders} sender warps, but a block of "
                             f"{spec.launch.threads} threads has {spec.launch.threads // 32}"))
        if low_latency(spec) and p.combine_blocks is not None:
            problems.append((("params", "combine_blocks"), "only the normal mode's combine has a grid of its own; "
                             "low_latency's runs on launch.blocks"))
        if p.payload == "fp8" and low_latency(spec):
            problems.append((("params", "payload"), "fp8 is built for the normal mode only; use bf16 with "
                             "low_latency"))
        if spec.test.count > p.capacity:
            problems.append((("test", "count"), f"{spec.test.count} tokens per rank, more than params.capacity "
                             f"{p.capacity}"))
        if spec.launch.blocks > 132:
            problems.append((("launch", "blocks"), "its blocks wait on peers: at most 132 (one per SM)"))
        for w in spec.world_sizes:
            need = dispatch_static_smem(spec, w)
            if need > STATIC_SMEM_LIMIT:
                problems.append((("launch", "threads"), f"{spec.launch.threads} threads need {need} bytes of static "
                                 f"shared memory in dispatch at world size {w} (at most {STATIC_SMEM_LIMIT}): "
                                 "use fewer threads" + (" or a smaller topk" if low_latency(spec) else "")))
                break
        return problems

    def shared_fit(self, spec, colocated, sms):
        """Both grids (dispatch's launch.blocks, combine's params.combine_blocks) resident at once."""
        blocks = fit_blocks(spec.launch.blocks, colocated, sms)
        out = {"launch": {"blocks": blocks}} if blocks != spec.launch.blocks else {}
        if spec.params.combine_blocks is not None:
            comb = fit_blocks(spec.params.combine_blocks, colocated, sms)
            if comb != spec.params.combine_blocks:
                out["params"] = {"combine_blocks": comb}
        return out

    def abi(self, spec):
        """One kernel entry per world size; its grid in the manifest is the larger of dispatch's and
        combine's (the runtime's residency checks read it: every block of both must be resident)."""
        abi = super().abi(spec)
        grid = max(spec.launch.blocks, combine_blocks(spec))
        abi.kernels = tuple(dataclasses.replace(k, grid=grid) for k in abi.kernels)
        return abi

    def summary_of(self, spec):
        if low_latency(spec):
            return ("MoE expert-parallel dispatch and combine, low-latency mode: rows straight into "
                    "per-(local expert, source rank) slots, one kernel per direction, weighted combine, bf16")
        payload = ("fp8 dispatch (e4m3, a scale per token per 128 channels), bf16 combine"
                   if spec.params.payload == "fp8" else "bf16")
        return ("MoE expert-parallel dispatch (rows grouped by source rank, source order kept, with local "
                f"expert ids, weights and handles) and combine (fp32 sums in token order), normal mode, {payload}")

    def buffers(self, spec):
        p, wmax, recv = spec.params, max(spec.world_sizes), recv_rows(spec)
        ends = (  # both modes: the tokens, their routing and the combined result, the counts
            Buffer("x", "bfloat16", "input", per_count=p.hidden),
            Buffer("topk_idx", "int32", "input", per_count=p.topk),
            Buffer("topk_weights", "float32", "input", per_count=p.topk),
            Buffer("out", "bfloat16", "output", per_count=p.hidden),
            Buffer("recv_counts", "int32", "output", per_count=0, fixed=2 + wmax + p.experts),
        )
        if low_latency(spec):
            rows = 2 * p.experts * slot_rows(spec)  # two halves (call parity) of L x W = E slots
            return (
                *ends,
                Buffer("recv_x", "bfloat16", "scratch", per_count=0, fixed=rows * p.hidden),
                Buffer("recv_src", "int32", "scratch", per_count=0, fixed=rows),
                Buffer("comb", "bfloat16", "scratch", per_count=0, fixed=p.capacity * p.topk * p.hidden),
                Buffer("lsig", "uint64", "signal", per_count=0, fixed=p.experts),
                Buffer("csig", "uint64", "signal", per_count=0, fixed=wmax),
                Buffer("combine_calls", "uint64", "signal", per_count=0, fixed=2),
            )
        if p.payload == "fp8":  # e4m3 rows, their scales, and bf16 rows for the identity expert
            payload = (Buffer("recv_q", "uint8", "scratch", per_count=0, fixed=recv * p.hidden),
                       Buffer("recv_scale", "float32", "scratch", per_count=0, fixed=recv * (p.hidden // 128)),
                       Buffer("recv_bf16", "bfloat16", "scratch", per_count=0, fixed=recv * p.hidden))
        else:
            payload = (Buffer("recv_x", "bfloat16", "scratch", per_count=0, fixed=recv * p.hidden),)
        return (
            *ends,
            *payload,
            Buffer("recv_idx", "int32", "scratch", per_count=0, fixed=recv * p.topk),
            Buffer("recv_w", "float32", "scratch", per_count=0, fixed=recv * p.topk),
            Buffer("handle", "int32", "scratch", per_count=0, fixed=recv * 2),
            # token t's row on rank d ([t][d], -1: not sent there, or dropped past the capacity): combine
            # reads a rank's own rows in y and waits for the chunks of its peers' rows (tsgen/moe.cuh)
            Buffer("sent_row", "int32", "scratch", per_count=0, fixed=p.capacity * wmax),
            Buffer("comb", "bfloat16", "scratch", per_count=0, fixed=p.capacity * wmax * p.hidden),
            Buffer("cnt", "int32", "scratch", per_count=0, fixed=wmax * wmax + wmax * p.experts),
            # counts rows arrived [wmax], data arrivals [wmax], then the last dispatch's token count
            # (combine refuses more: tsgen/moe.cuh, SIG_TOKENS)
            Buffer("sig", "uint64", "signal", per_count=0, fixed=2 * wmax + 1),
            Buffer("chunk_sig", "uint64", "signal", per_count=0, fixed=wmax * combine_chunks(spec)),
            Buffer("combine_calls", "uint64", "signal", per_count=0, fixed=2),
        )

    def constants(self, spec):
        p = spec.params
        return {"WMAX": max(spec.world_sizes), "EXPERTS": p.experts, "TOPK": p.topk, "HIDDEN": p.hidden,
                "CAP": p.capacity, "RECV": recv_rows(spec), "WEIGHTED": int(p.weighted), "SLOT": slot_rows(spec),
                "FP8": int(p.payload == "fp8"), "COMBINE_BLOCKS": combine_blocks(spec),
                "CHUNK": p.combine_chunk_rows, "PEER_ORDER": int(p.combine_order == "peers"),
                **combine_sender_constants(spec), **fp8_send_constants(spec)}

    def template_vars(self, spec):
        # the buffers tsgen::moe::Buffers holds, in its order
        held = [b for b in self.buffers(spec) if b.name != "combine_calls"]
        return {"buffer_params": ", ".join(f"{b.ctype}* {b.name}" for b in held),
                "buffer_names": ", ".join(b.name for b in held), "ll": low_latency(spec),
                "blocks": spec.launch.blocks, "combine_blocks": combine_blocks(spec),
                "fp8": spec.params.payload == "fp8", "own_senders": bool(combine_sender_constants(spec)),
                "fp8_gathered": bool(fp8_send_constants(spec))}

    # -- as torch ops (tsgen.torch) -----------------------------------------
    def torch_entries(self, constants, world, buffers):
        """The module as tsgen.torch ops (tsgen/torch/signature.py): its dispatch and combine host
        launchers (`<kernel>_dispatch_launch`, `<kernel>_combine_launch`) as two ops on one heap, called
        in turn (dispatch, combine, dispatch, ...: the kernels' protocol, tsgen/moe.cuh). A dict:
        entries: entry -> {tensor: (dims, count dim, how)}, how "in" (copied into its buffer), "out"
        (copied out of it), "shape" (checked only: combine's topk_idx, whose buffer keeps the
        dispatch's) or "arg:<dtype>" (passed by pointer after the buffers: combine's y, read in place);
        order: the entries' cyclic call order; adjoint: whether dispatch and combine are each other's
        adjoint (unweighted combine only: weighted scales rows by routing weights); max_count: the
        most tokens per rank (the launchers refuse more) and the spec field that sets it. Or a string: why
        the module is not a torch op (fp8 payload, low-latency mode)."""
        c = constants
        if c["FP8"]:
            return "the fp8 payload quantizes the rows (not differentiable, and combine reads dequantized rows); use bf16"
        if "recv_src" in buffers:
            return "the low-latency mode's rows sit in per-(expert, source) slots; use the normal mode"
        tokens, hidden, topk, recv = ("tokens", 1), ("hidden", c["HIDDEN"]), ("topk", c["TOPK"]), ("recv", c["RECV"])
        routing = (tokens, topk)
        dispatch = {"x": ((tokens, hidden), 0, "in"), "topk_idx": (routing, 0, "in"),
                    "topk_weights": (routing, 0, "in"),
                    "recv_x": ((recv, hidden), None, "out"), "recv_idx": ((recv, topk), None, "out"),
                    "recv_w": ((recv, topk), None, "out"),
                    "recv_counts": ((("2 + WMAX + experts", 2 + c["WMAX"] + c["EXPERTS"]),), None, "out")}
        combine = {"y": ((recv, hidden), None, "arg:bfloat16"), "topk_idx": (routing, 0, "shape"),
                   "out": ((tokens, hidden), 0, "out")}
        return {"entries": {"dispatch": dispatch, "combine": combine}, "order": ("dispatch", "combine"),
                "adjoint": not c["WEIGHTED"], "max_count": (c["CAP"], "params.capacity")}

    # -- reference ----------------------------------------------------------
    def make_inputs(self, spec, world, count, rng, pattern):
        p = spec.params
        idx = [routing("random", world, p.experts, p.topk, count, rng, r) for r in range(world)]
        return {"x": [_values("bfloat16", count * p.hidden, rng, pattern, r) for r in range(world)],
                "topk_idx": idx,
                "topk_weights": [rng.random(count * p.topk, dtype=np.float32) for _ in range(world)]}

    def reference(self, spec, world, count, inputs):
        return self.once_per_inputs(inputs, (spec, world, count), lambda: self._reference(spec, world, count, inputs))

    def _reference(self, spec, world, count, inputs):
        p = spec.params
        if low_latency(spec):
            disp = ll_dispatch_reference(inputs, world, p.experts, p.topk, p.hidden, slot_rows(spec))
            outs = ll_combine_reference(inputs, [d["recv_x"] for d in disp], world, p.experts, p.topk, p.hidden,
                                        slot_rows(spec))
            return {"out": outs, "recv_counts": [ll_counts_array(d, max(spec.world_sizes), p.experts) for d in disp]}
        disp = dispatch_reference(inputs, world, p.experts, p.topk, p.hidden, recv_rows(spec))
        rows = [d["recv_x"] if p.payload == "bf16" else fp8_dequantize(*fp8_quantize(d["recv_x"], p.hidden))
                for d in disp]
        outs = combine_reference(inputs, rows, world, p.experts, p.topk, p.hidden, p.weighted)
        wmax = max(spec.world_sizes)
        return {"out": outs, "recv_counts": [counts_array(d, wmax, p.experts) for d in disp]}

    def tolerance(self, spec, world, count, inputs):
        """recv_counts exact; out within one bf16 unit of the reference (out_tolerance)."""
        ref = self.reference(spec, world, count, inputs)
        tol_out = [out_tolerance(o) for o in ref["out"]]
        return {"out": tol_out, "recv_counts": [np.zeros(c.size) for c in ref["recv_counts"]]}

    def bytes_moved(self, spec, world, count):
        """Bytes the bottleneck rank sends to other ranks per call (dispatch + combine) with the
        bench's routing (MoeBench.case)."""
        return int(self.bench.case(self, spec, world, count).bw_bytes)


def out_tolerance(ref_bits: np.ndarray) -> np.ndarray:
    """How far combine's bf16 `out` may be from the reference's (bits, uint16): one bf16 unit in
    the last place. The kernel sums in fp32 in its own order, the reference in float64, and each
    rounds once to bf16; where the exact sum lies near the midpoint of two bf16 values the two
    sums round to neighbours, one unit apart: up to 2^-7 of the value (measured on one H100:
    8.0 against 8.0625 in the low-latency and weighted combines), more than the 2^-8 of half a unit."""
    return 2.0**-7 * np.abs(to_f64(ref_bits, "bfloat16")) + 1e-30


# ---------------------------------------------------------------------------
# NumPy references (shared with the tests)
# ---------------------------------------------------------------------------

ROUTINGS = ("random", "skewed", "one_rank_idle", "no_expert", "same_rank", "pattern")


def routing(case: str, world: int, experts: int, topk: int, tokens: int, rng: np.random.Generator,
            rank: int) -> np.ndarray:
    """topk_idx [tokens * topk] (int32) of one rank for a routing case:
    random: distinct random experts, one slot in ten -1; skewed: every token to expert 0
    (the other slots -1); one_rank_idle: random experts, none on the last rank; no_expert: all
    -1 on even tokens, random on odd; same_rank: every slot an expert of one rank (several experts
    of a token on one rank); pattern: expert (t + k) mod E."""
    local = experts // world
    idx = np.full((tokens, topk), -1, dtype=np.int64)
    for t in range(tokens):
        if case == "random":
            idx[t] = rng.permutation(experts)[:topk]
            idx[t, rng.random(topk) < 0.1] = -1
        elif case == "skewed":
            idx[t, 0] = 0
        elif case == "one_rank_idle":
            pool = experts - local
            n = min(topk, pool)
            idx[t, :n] = rng.permutation(pool)[:n]
        elif case == "no_expert":
            if t % 2:
                idx[t] = rng.permutation(experts)[:topk]
        elif case == "same_rank":
            d = int(rng.integers(world))
            n = min(topk, local)
            idx[t, :n] = d * local + rng.permutation(local)[:n]
        elif case == "pattern":
            idx[t] = (t + np.arange(topk)) % experts
        else:
            raise ValueError(f"routing case {case!r}: one of {ROUTINGS}")
    return idx.astype(np.int32).reshape(-1)


def layout(topk_idx: np.ndarray, world: int, experts: int, topk: int) -> dict[str, np.ndarray]:
    """One rank's routing layout: mask [tokens, world] (token goes to rank d), per_rank [world]
    tokens to each rank, per_expert [experts] (token, expert) pairs, pos [tokens, world] (the
    token's place among this rank's tokens to d, -1 where it does not go)."""
    idx = topk_idx.reshape(-1, topk).astype(np.int64)
    valid = (idx >= 0) & (idx < experts)
    ranks = np.where(valid, idx // (experts // world), -1)
    mask = np.zeros((idx.shape[0], world), dtype=bool)
    for k in range(topk):
        rows = np.flatnonzero(ranks[:, k] >= 0)
        mask[rows, ranks[rows, k]] = True
    pos = np.where(mask, np.cumsum(mask, axis=0) - 1, -1)
    per_expert = np.bincount(idx[valid], minlength=experts)
    return {"mask": mask, "per_rank": mask.sum(axis=0), "per_expert": per_expert, "pos": pos}


def dispatch_reference(inputs: dict, world: int, experts: int, topk: int, hidden: int, recv: int) -> list[dict]:
    """What every rank receives: rows (recv_x [rows, hidden] bf16 bits), recv_idx, recv_w,
    handle [rows, 2] (all the rows, also past the capacity `recv`), per-source and per-local-expert
    counts and the flags."""
    local = experts // world
    lays = [layout(inputs["topk_idx"][s], world, experts, topk) for s in range(world)]
    out = []
    for d in range(world):
        xs, ids, ws, hs = [], [], [], []
        for s in range(world):
            sel = np.flatnonzero(lays[s]["mask"][:, d])
            idx = inputs["topk_idx"][s].reshape(-1, topk)[sel].astype(np.int64)
            here = (idx >= d * local) & (idx < (d + 1) * local)
            xs.append(inputs["x"][s].reshape(-1, hidden)[sel])
            ids.append(np.where(here, idx - d * local, -1).astype(np.int32))
            ws.append(np.where(here, inputs["topk_weights"][s].reshape(-1, topk)[sel], 0).astype(np.float32))
            hs.append(np.stack([np.full(sel.size, s), sel], axis=1).astype(np.int32))
        per_source = np.array([lay["per_rank"][d] for lay in lays])
        # rank d as a sender: rows it sent past a destination's capacity
        dropped = any(lays[d]["per_rank"][dd] and sum(lays[j]["per_rank"][dd] for j in range(d + 1)) > recv
                      for dd in range(world))
        received = int(per_source.sum())
        out.append({
            "recv_x": np.concatenate(xs), "recv_idx": np.concatenate(ids), "recv_w": np.concatenate(ws),
            "handle": np.concatenate(hs), "per_source": per_source,
            "per_expert": sum(lay["per_expert"][d * local:(d + 1) * local] for lay in lays),
            "flags": (1 if received > recv else 0) | (2 if dropped else 0),
        })
    return out


def counts_array(received: dict, wmax: int, experts: int) -> np.ndarray:
    """recv_counts as the kernel writes it."""
    out = np.zeros(2 + wmax + experts, dtype=np.int32)
    out[0] = received["per_source"].sum()
    out[1] = received["flags"]
    out[2:2 + received["per_source"].size] = received["per_source"]
    out[2 + wmax:2 + wmax + received["per_expert"].size] = received["per_expert"]
    return out


def combine_reference(inputs: dict, ys: list[np.ndarray], world: int, experts: int, topk: int, hidden: int,
                      weighted: bool) -> list[np.ndarray]:
    """Every source's out [tokens * hidden] (bf16 bits): the fp32 sum in rank order of the rows
    its destination ranks hand back (`ys[d]`, bf16 bits, in dispatch's order), each scaled by the
    token's weights of the experts on that rank when `weighted`."""
    local = experts // world
    lays = [layout(inputs["topk_idx"][s], world, experts, topk) for s in range(world)]
    starts = np.zeros((world, world), dtype=np.int64)  # starts[s, d]: s's first row on d
    for d in range(world):
        starts[1:, d] = np.cumsum([lays[s]["per_rank"][d] for s in range(world - 1)])
    out = []
    for s in range(world):
        lay = lays[s]
        tokens = lay["mask"].shape[0]
        idx = inputs["topk_idx"][s].reshape(-1, topk).astype(np.int64)
        w = inputs["topk_weights"][s].reshape(-1, topk)
        acc = np.zeros((tokens, hidden), dtype=np.float32)
        for d in range(world):
            sel = np.flatnonzero(lay["mask"][:, d])
            rows = to_f64(ys[d].reshape(-1, hidden)[starts[s, d] + lay["pos"][sel, d]], "bfloat16").astype(np.float32)
            if weighted:
                here = (idx[sel] >= d * local) & (idx[sel] < (d + 1) * local)
                scale = np.where(here, w[sel], np.float32(0)).sum(axis=1, dtype=np.float32)
                rows = rows * scale[:, None]
            acc[sel] = acc[sel] + rows
        out.append(from_f64(acc.reshape(-1), "bfloat16"))
    return out


def ll_dispatch_reference(inputs: dict, world: int, experts: int, topk: int, hidden: int, slot: int) -> list[dict]:
    """Low-latency mode: what every rank d receives, slot by slot. recv_x [E, slot, hidden] and recv_src
    [E, slot] (token * 32 + k) for the slot of (local expert l, source s) at index l * world + s,
    rows past a slot's count left 0 (the kernel leaves them alone); counts [E] (all the pairs, also
    past the slot); flags."""
    local = experts // world
    out = []
    for d in range(world):
        rx = np.zeros((experts, slot, hidden), dtype=np.uint16)
        rs = np.zeros((experts, slot), dtype=np.int32)
        counts = np.zeros(experts, dtype=np.int64)
        for l in range(local):
            for s in range(world):
                idx = inputs["topk_idx"][s].reshape(-1, topk)
                t, k = np.nonzero(idx == d * local + l)  # row-major: token order, then k
                i = l * world + s
                counts[i] = t.size
                n = min(t.size, slot)
                rx[i, :n] = inputs["x"][s].reshape(-1, hidden)[t[:n]]
                rs[i, :n] = t[:n] * 32 + k[:n]
        out.append({"recv_x": rx, "recv_src": rs, "counts": counts, "flags": int((counts > slot).any())})
    return out


def ll_counts_array(received: dict, wmax: int, experts: int) -> np.ndarray:
    """recv_counts of the low-latency mode as the kernel writes it."""
    out = np.zeros(2 + wmax + experts, dtype=np.int32)
    out[0] = received["counts"].sum()
    out[1] = received["flags"]
    out[2 + wmax:] = received["counts"]
    return out


def ll_combine_reference(inputs: dict, ys: list[np.ndarray], world: int, experts: int, topk: int, hidden: int,
                         slot: int) -> list[np.ndarray]:
    """Low-latency combine: out[t] = sum over valid k (in k order, fp32) of topk_weights[t][k] times
    the row rank e // L hands back for (t, k) (`ys[d]` laid out as recv_x: [E, slot, hidden])."""
    local = experts // world
    out = []
    for s in range(world):
        idx = inputs["topk_idx"][s].reshape(-1, topk).astype(np.int64)
        w = inputs["topk_weights"][s].reshape(-1, topk)
        acc = np.zeros((idx.shape[0], hidden), dtype=np.float32)
        seen = {}  # (d, slot index) -> next row
        for t in range(idx.shape[0]):
            for k in range(topk):
                e = idx[t, k]
                if not 0 <= e < experts:
                    continue
                d, i = e // local, (e % local) * world + s
                r = seen.get((d, i), 0)
                seen[(d, i)] = r + 1
                row = to_f64(ys[d].reshape(experts, slot, hidden)[i, r], "bfloat16").astype(np.float32)
                acc[t] = acc[t] + row * w[t, k]
        out.append(from_f64(acc.reshape(-1), "bfloat16"))
    return out


def row_bytes(spec) -> dict[str, int]:
    """Bytes one row moves over the link: dispatch (payload + what travels with it), combine, and
    the least any design must move (the bf16 row each way; fp8: its bytes and scales)."""
    p = spec.params
    payload = p.hidden + 4 * (p.hidden // 128) if p.payload == "fp8" else 2 * p.hidden
    extra = 4 if low_latency(spec) else 8 * p.topk + 8  # LL: the handle; normal: ids, weights, handle
    return {"dispatch": payload + extra, "combine": 2 * p.hidden, "min_dispatch": payload, "min_combine": 2 * p.hidden}


def traffic(spec, world: int, inputs: dict) -> dict[str, list[int]]:
    """Per rank, the bytes its dispatch and its combine store into other ranks for these inputs:
    normal mode one row per (token, destination rank), low-latency one per (token, expert) pair;
    `min_*`: one payload row per (token, destination rank), nothing else."""
    p, rb = spec.params, row_bytes(spec)
    local = p.experts // world
    out = {"dispatch": [], "combine": [], "min_dispatch": [], "min_combine": []}
    lays = [layout(inputs["topk_idx"][r], world, p.experts, p.topk) for r in range(world)]
    for r in range(world):
        remote_rows = int(np.delete(lays[r]["per_rank"], r).sum())  # (token, other rank) pairs of r
        idx = inputs["topk_idx"][r].reshape(-1, p.topk).astype(np.int64)
        valid = (idx >= 0) & (idx < p.experts)
        remote_pairs = int((valid & (idx // local != r)).sum())
        back_rows = sum(int(lays[s]["per_rank"][r]) for s in range(world) if s != r)  # rows r returns
        back_pairs = 0
        for s in range(world):
            if s != r:
                i = inputs["topk_idx"][s].reshape(-1, p.topk).astype(np.int64)
                back_pairs += int(((i >= 0) & (i < p.experts) & (i // local == r)).sum())
        if low_latency(spec):
            out["dispatch"].append(remote_pairs * rb["dispatch"])
            out["combine"].append(back_pairs * rb["combine"])
        else:
            out["dispatch"].append(remote_rows * rb["dispatch"])
            out["combine"].append(back_rows * rb["combine"])
        out["min_dispatch"].append(remote_rows * rb["min_dispatch"])
        out["min_combine"].append(back_rows * rb["min_combine"])
    return out


E4M3_MAX = 448.0


def e4m3_encode(v: np.ndarray) -> np.ndarray:
    """float32 -> e4m3 bytes (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities),
    rounding to nearest even and saturating at 448 as PTX cvt.rn.satfinite.e4m3x2.f32 does (an infinity to
    448, NaN to 0x7F with its sign). On the float32 bits: from 2^-6 up, the mantissa rounded to 3 bits (ties
    to even) gives the code's exponent and mantissa fields; below it, the subnormal steps of 2^-9 (np.rint:
    ties to even). Integer work only: the fp8 reference encodes millions of channels a call."""
    v = np.asarray(v, dtype=np.float32)
    a = np.abs(v)
    bits = a.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFFF) + ((bits >> 20) & 1))) & np.uint32(0xFFF00000)
    rounded = np.minimum(rounded, np.float32(E4M3_MAX).view(np.uint32))  # as floats: the order of their bits
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)  # float32 exponent bias 127, e4m3's 7
    with np.errstate(over="ignore", invalid="ignore"):
        subnormal = np.rint(a * np.float32(2.0**9))
        code = np.where(a < np.float32(2.0**-6), subnormal, normal).astype(np.uint8)
    code[np.isnan(a)] = 0x7F
    return (np.signbit(v).astype(np.uint8) << 7) | code


def _e4m3_values() -> np.ndarray:
    """The value of every e4m3 code, by its fields (0x7F and 0xFF, NaN in e4m3, decode as 480)."""
    b = np.arange(256, dtype=np.uint8)
    field, mant = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    mag = np.where(field > 0, (1 + mant / 8) * 2.0 ** (field.astype(np.float64) - 7), mant * 2.0**-9)
    return np.where(b >> 7, -mag, mag)


_E4M3_VALUES = _e4m3_values()


def e4m3_decode(b: np.ndarray) -> np.ndarray:
    """e4m3 bytes -> float64 values (a table lookup)."""
    return _E4M3_VALUES[np.asarray(b, dtype=np.uint8)]


def fp8_quantize(rows_bf16: np.ndarray, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """bf16 rows (bits) -> (e4m3 bytes [rows, hidden], fp32 scales [rows, hidden / 128]) as dispatch
    computes them: amax per 128 channels (at least 1e-4), scale = amax / 448, q = e4m3(x * (448 / amax))."""
    x = to_f64(rows_bf16.reshape(-1), "bfloat16").astype(np.float32).reshape(-1, hidden // 128, 128)
    amax = np.maximum(np.abs(x).max(axis=2, initial=0), np.float32(1e-4)).astype(np.float32)
    scale = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    inv = (np.float32(E4M3_MAX) / amax).astype(np.float32)
    q = e4m3_encode((x * inv[:, :, None]).astype(np.float32))
    return q.reshape(-1, hidden), scale.reshape(x.shape[0], hidden // 128)


def fp8_dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """e4m3 bytes and scales -> bf16 bits: (q * scale) in fp32, rounded to bf16 (dequantize's arithmetic)."""
    rows, hidden = q.shape
    f = (e4m3_decode(q).astype(np.float32).reshape(rows, hidden // 128, 128) * scale[:, :, None]).astype(np.float32)
    return from_f64(f.reshape(-1), "bfloat16")


def fp8_error_bound(rows_bf16: np.ndarray, hidden: int) -> np.ndarray:
    """|dequantized - x| allowed per element: half a step of e4m3 at x (2^-4 relative for normal
    values, 2^-10 x scale absolute for the subnormal ones), plus a bf16 rounding of the result."""
    x = to_f64(rows_bf16.reshape(-1), "bfloat16").reshape(-1, hidden // 128, 128)
    amax = np.maximum(np.abs(x).max(axis=2, initial=0), 1e-4)
    scale = amax / E4M3_MAX
    bound = np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * scale[:, :, None]) * (1 + 2.0**-8) + 2.0**-8 * np.abs(x)
    return bound.reshape(-1)


FAMILIES: list[OpFamily] = [MoeFamily()]
