"""cp_attention: context-parallel flash attention with an overlapped K / V all-gather.

Rank r holds Q, K and V of `count` = S / P positions of each of params.batch sequences
(P ranks, S the whole sequence) and computes O and LSE of its own queries against every
key of the sequence:

  layout contiguous  rank r holds positions [r S/P, (r + 1) S/P)
  layout zigzag      rank r holds chunks r and 2P - 1 - r of 2P chunks of S / 2P positions
                     (its first count / 2 rows, then the other count / 2): causal work is
                     the same on every rank; count must be even

Tensors in the user's layout (params.tensors): bshd = q, o [batch, count, heads, head_dim],
k, v [batch, count, kv_heads, head_dim]; bhsd = [batch, heads, count, head_dim]; lse fp32
[batch, heads, count]. The result equals attention over the whole sequence (the rows of all
ranks in position order), restricted to this rank's rows (see `reference`).

One call (the host launcher, templates/ops/cp_attention.cu.j2 over
templates/include/tsgen/cp.cuh and tsgen/attention.cuh):
  * an entry kernel advances the call counter (the epoch) and tells every peer that this
    rank's previous call no longer reads its gathered buffers (FREE);
  * the gather writes this rank's K and V rows into every rank's symmetric k_full / v_full
    (its own included), each chunk raising sig[READY + c] = epoch at its receiver:
    gather copy_engine: cudaMemcpy2DAsync on a side stream, a one-block signal kernel after
    each receiver's copies (no SM taken from attention but those); gather sm: a push kernel
    of params.gather_blocks CTAs on a side stream (the variant that runs where ranks share a
    GPU: copies between ranks of one GPU stalled there, docs/lab/shared_gpu.md);
  * meanwhile the attention kernel (the `attention` op's, with its per-KV-chunk waits)
    reads k_full / v_full: its producer waits for sig[READY + c] >= epoch before the first
    block of chunk c. Causal: k_full is in position order (chunk c = positions
    [c kv_chunk, (c + 1) kv_chunk)) and the queries carry their positions (the zig-zag
    pair too), so the kernel starts on the diagonal, this rank's own chunk. Not causal:
    positions do not matter, and the shards are stored rotated (slot j holds rank
    r + 1 + j's rows) so the last slot, walked first, is this rank's own;
  * the attention grid is persistent and leaves SMs to the gather (a plain grid of waiting
    CTAs could take every SM from the kernels that raise what they wait for).
Nothing is reset between calls: signals count epochs.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ..errors import RuntimeSetupError
from ..runtime.placement import fit_blocks
from ..spec_types import SpecBase, StrictModel, WorldSizes
from .attention import (AttentionFamily, AttentionTile, RescaleAt, RescaleSkip, RowMaxChains, SoftmaxScale,
                        attention_reference, check_query_rows, flops, from_bshd, o_tolerance, scale_of, scale_vars,
                        shape_constants, shape_key, smem_bytes, to_bshd, worst_row_error)
from .base import Buffer, OpFamily, copy_engine_refusal, launcher_vars, one_kernel_abi
from .collectives import from_f64, to_f64
from .conventions import Baseline, BenchCase, BenchConventions

MAX_WORLD = 8  # tsgen::cp::MAX_WORLD
SIGNALS = 4 * MAX_WORLD + 1  # tsgen::cp::SIGNALS: FREE[8], READY[16] (one per KV chunk), ARRIVED[8], WORK
OWN_COPY_THREADS = 256  # params.own_copy_first: threads a CTA of the own-copy kernel (2 CTAs an SM)
ENTRY_SMS = 1  # gather sm: the SM the launcher's one-block entry kernel needs beside the push and the attention
TRACE_WORDS = 7  # u64 words per trace record (tsgen/attention.cuh TRACE_WORDS)
STAMP_WORDS = 8 * 24  # the call timeline's stamps before the trace (tsgen/cp.cuh STAMP_WORDS; tsgen/ops/cp_timeline.py)


def trace_words(records: int) -> int:
    """sig words after the signals for `records` trace records: the call timeline's stamps
    (STAMP_WORDS), then a count, a spare word, the records."""
    return STAMP_WORDS + 2 + TRACE_WORDS * records if records else 0


def trace_table(words) -> dict:
    """The trace after sig's signals and stamps (the count, a spare word, the records) -> {"count":
    records the kernel made (more than were kept if the room ran out), "records": [{"index", "sm",
    "cta", "tile", "start", "end", "waited", "first_ready", "last_ready", "cycles"} ...] (ns,
    globaltimer) by start}; "index" is the record's place in the kernel's count (call k of several
    back-to-back ones since the count was reset made records k x tiles .. (k + 1) x tiles - 1),
    first_ready / last_ready when the wait for the tile's first / last KV chunk returned (0: none
    ran), cycles the SM's clock count over the tile (cycles / (end - start) ns: its clock in GHz)."""
    w = np.asarray(words, dtype=np.uint64)
    count = int(w[0])
    kept = min(count, (len(w) - 2) // TRACE_WORDS)
    out = []
    for i, r in enumerate(w[2:2 + TRACE_WORDS * kept].reshape(kept, TRACE_WORDS)):
        head = int(r[0])
        out.append({"index": i, "sm": head >> 48, "cta": (head >> 32) & 0xFFFF, "tile": head & 0xFFFFFFFF,
                    "start": int(r[1]), "end": int(r[2]), "waited": int(r[3]), "first_ready": int(r[4]),
                    "last_ready": int(r[5]), "cycles": int(r[6])})
    return {"count": count, "records": sorted(out, key=lambda x: x["start"])}


def trace_summary(table: dict, tiles: int) -> dict:
    """What a trace (`trace_table`) says of one call, in the terms of tsgen/ops/cp_schedule.py:
    whether every tile ran exactly once, the span (first start to last end, us), the CTAs' busy
    time over CTAs x span ("efficiency", the model's), each CTA's busy time (max / mean / min,
    us), the tail (the first CTA to finish to the last, us) and the chunk waits (us per CTA);
    tiles per CTA (max / min), each CTA's mean tile time (max / median / min, us: how unequal the
    SMs are on equal tiles) and the chunk wait of each CTA's first tile (max / mean, us: the
    start's wait for its own chunk, and any stall on the first peer chunk); of each CTA's first tile
    (median over CTAs, us): its duration, when its first and last chunk waits returned after its
    start (not causal at W 2: its own chunk, then the peer's), and its summed wait (the producer's
    time inside its wait_chunks calls, one per KV block: about 35 us a tile of it is the producer's
    own work overlapped with the consumers', the 2026-11-27 traces' later tiles, whose chunks had long
    been there; a sum of intervals inside the tile, so never more than the tile's duration); the median
    tile after each CTA's first, and the median SM clock of those tiles (GHz, %clock over globaltimer)."""
    recs = table["records"]
    if table["count"] != len(recs) or not recs:
        return {"complete": False, "records": len(recs), "count": table["count"]}
    t0, t1 = min(r["start"] for r in recs), max(r["end"] for r in recs)
    busy, last, waited, ntiles, first, first_rec, later, clocks = {}, {}, {}, {}, {}, {}, [], []
    for r in recs:  # by start: a CTA's first record is its first tile
        c = r["cta"]
        busy[c] = busy.get(c, 0) + r["end"] - r["start"]
        last[c] = max(last.get(c, 0), r["end"])
        waited[c] = waited.get(c, 0) + r["waited"]
        ntiles[c] = ntiles.get(c, 0) + 1
        if c in first_rec:
            later.append(r["end"] - r["start"])
            if r.get("cycles") and r["end"] > r["start"]:
                clocks.append(r["cycles"] / (r["end"] - r["start"]))
        first.setdefault(c, r["waited"])
        first_rec.setdefault(c, r)
    span = t1 - t0
    us = 1e-3
    per_tile = sorted(busy[c] / ntiles[c] for c in busy)  # each CTA's mean tile time: the SMs' spread
    return {"complete": True, "records": len(recs), "tiles_once": sorted(r["tile"] for r in recs) == list(range(tiles)),
            "ctas": len(busy), "span_us": span * us,
            "efficiency": sum(busy.values()) / (len(busy) * span) if span else 1.0,
            "busy_us": {"max": max(busy.values()) * us, "mean": sum(busy.values()) / len(busy) * us,
                        "min": min(busy.values()) * us},
            "tail_us": (t1 - min(last.values())) * us, "waited_us_per_cta": sum(waited.values()) / len(busy) * us,
            "tiles_per_cta": {"max": max(ntiles.values()), "min": min(ntiles.values())},
            "tile_us": {"max": per_tile[-1] * us, "median": per_tile[len(per_tile) // 2] * us, "min": per_tile[0] * us},
            "first_wait_us": {"max": max(first.values()) * us, "mean": sum(first.values()) / len(first) * us},
            "first_tile_us": first_tile(list(first_rec.values())),
            "later_tile_us": _median(later) * us if later else None,
            "sm_clock_ghz": _median(clocks) if clocks else None}


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0


def first_tile(firsts: list[dict]) -> dict:
    """Each CTA's first tile (its trace records), medians over the CTAs in us: "duration" (end - start),
    "waited" (the summed chunk waits), "first_ready" / "last_ready" (when the wait for its first / last
    KV chunk returned, after the tile's start; None where no record has one), and "kernel_start" (the
    first CTA's start, ns: the kernel's start on this GPU's globaltimer)."""
    us = 1e-3

    def after(key):
        xs = [r[key] - r["start"] for r in firsts if r.get(key)]
        return _median(xs) * us if xs else None

    return {"ctas": len(firsts), "duration": _median([r["end"] - r["start"] for r in firsts]) * us,
            "waited": _median([r["waited"] for r in firsts]) * us, "first_ready": after("first_ready"),
            "last_ready": after("last_ready"), "kernel_start": min(r["start"] for r in firsts) if firsts else None}


CE_RESERVE_SMS = 2  # gather copy_engine: SMs the attention leaves to the one-block signal kernels


class CpAttentionParams(StrictModel):
    head_dim: Literal[64, 128] = Field(128, description="Q, K, V and O columns per head")
    heads: int = Field(32, ge=1, le=1024, description="query heads")
    kv_heads: int = Field(8, ge=1, le=1024, description="K and V heads; divides heads (grouped-query attention)")
    batch: int = Field(1, ge=1, le=1 << 20, description="sequences per call (compile-time)")
    causal: bool = Field(False, description="a query sees only keys at positions <= its own")
    softmax_scale: SoftmaxScale | None = Field(None, description="scale of Q K^T; default 1 / sqrt(head_dim)")
    layout: Literal["contiguous", "zigzag"] = Field(
        "contiguous", description="which positions a rank holds: contiguous = [r S/P, (r+1) S/P); zigzag = chunks "
        "r and 2P-1-r of S/2P positions (causal work balanced; count must be even)")
    tensors: Literal["bshd", "bhsd"] = Field(
        "bshd", description="bshd: [batch, seq, heads, head_dim]; bhsd: [batch, heads, seq, head_dim]")
    gather: Literal["copy_engine", "sm"] = Field(
        "copy_engine", description="copy_engine: the K / V all-gather is cudaMemcpy2DAsync on a side stream (no SMs "
        "but the signal kernels'); sm: a push kernel of gather_blocks CTAs (runs on a GPU shared by ranks)")
    gather_blocks: int = Field(8, ge=1, le=64, description="gather sm: CTAs of the push kernel (the attention "
                               "grid leaves as many SMs free for it)")
    tile: AttentionTile = AttentionTile()
    stages: int = Field(2, ge=1, le=8, description="K and V blocks in flight (each its own ring)")
    pingpong: bool = Field(True, description="the two consumer warpgroups take turns issuing their GEMMs")
    epilogue_overlap: bool = Field(
        False, description="stage O in shared memory of its own (one more Q tile's bytes) and release Q after a "
        "tile's last S = Q K^T, so that the next tile of the same CTA (every CTA walks tiles) loads its Q and first K "
        "blocks during this tile's last P V and epilogue (attention's params.epilogue_overlap, the same kernel code)")
    row_max_chains: RowMaxChains = None
    rescale_at: RescaleAt = None
    rescale_skip: RescaleSkip = False
    tile_counter: bool = Field(
        False, description="not causal: hand the equal tiles out from the rank's atomic tile counter (sig's WORK slot, "
        "the causal kernel's dynamic schedule; head-major order kept) instead of the static stride (CTA c takes c, "
        "c + grid, ...), so that a CTA on a slower SM takes fewer tiles (issue 33, docs/design/cp_attention.md: "
        "\"Where the not-causal time goes\"); causal always uses the counter. Off: the shipped static stride")
    local_kv: bool = Field(
        False, description="the attention kernel reads this rank's own K and V rows in place (two more tensor maps "
        "over k and v) instead of from k_full / v_full, so the gather copies only to the peers and no call waits for a "
        "copy of rows it already has (issue 33, docs/design/cp_attention.md: \"Outside the tiles\"); not causal the own "
        "shard is the last slot, causal its chunk (zig-zag: its two chunks) in position order. A call whose own rows "
        "would start or end inside a KV block of tile.n rows gathers them as without it. Off: every row gathered, "
        "the own first")
    own_copy_first: bool = Field(
        False, description="gather copy_engine, where the own rows are not read in place (local_kv off, or a count "
        "own_in_place refuses): copy them into k_full / v_full by the SMs on the call's stream before the attention "
        "kernel (predicted 20-40 / 40-60 us at 16K / 32K), and signal them there, instead of on the copy engine under the "
        "kernel, which every CTA's first tile waited for; the kernel then reads every row through k_full's map (issue "
        "33, docs/design/cp_attention.md: \"The two maps\": read from k_full alone the kernel ran at the ideal's rate, "
        "3-4 % faster than with its own rows in place). Off: the own rows go with the peers' on the copy engine")
    copy_1d: bool = Field(
        False, description="gather copy_engine: copy a piece that is one contiguous run (lines == 1: bshd with "
        "batch 1, the suites' shape) with cudaMemcpyAsync instead of cudaMemcpy2DAsync (the path cudaMemcpyPeer's 397 GB/s was "
        "measured on), to tell whether the 2-D path is what makes a call's copies slow (issue 33, "
        "docs/design/cp_attention.md: \"Outside the tiles\"); other pieces stay 2-D. Off: every piece 2-D")
    attention_only_entry: bool = Field(
        False, description="test-only: also export <kernel>_attention_only_launch (the launcher's arguments), which "
        "enqueues the attention kernel alone at the rank's current epoch: no entry exchange, copies or signals. After "
        "a full call of the same count its chunks are all signalled, so the kernel runs over the gathered K and V "
        "without a wait or a peer, as a single-GPU kernel would (before any full call, or at another count, it "
        "waits for chunks nobody signals, or reads what an earlier call gathered); not with trace (the host "
        "timeline would count its calls as the device's). Issue 33, docs/design/cp_attention.md: \"The clock beside "
        "the rate\"; tools/cp_clock_probe.py --solo. Off: no such entry")
    skip_wait: bool = Field(
        False, description="test-only negative control: the attention kernel does not wait for the first remote "
        "KV chunk it reads (a correct run must then fail under rank skew); never in a shipped spec")
    trace: int = Field(
        0, ge=0, le=1 << 20, description="test-only: room for this many per-tile records of the attention "
        "kernel's timeline (tsgen/attention.cuh's trace, compiled in only then; tools/attention_trace.py "
        "draws it), after the signals in sig; 0: no trace code")


class CpAttentionLaunch(StrictModel):
    blocks: int = Field(0, ge=0, le=1 << 20,
                        description="attention CTAs (persistent, each walking tiles blockIdx.x, + N, ...); 0: every "
                        "SM but those the gather needs (gather_blocks, or 2 for the copy engine's signal kernels)")
    threads: Literal[384] = Field(384, description="one producer + two consumer warpgroups")


class CpAttentionSpec(SpecBase):
    """Spec of op `cp_attention`: context-parallel attention, K and V all-gathered per chunk."""

    op: Literal["cp_attention"]
    world_sizes: WorldSizes
    dtype: Literal["bfloat16", "float16"] = Field("bfloat16", description="Q, K, V and O element type")
    params: CpAttentionParams = CpAttentionParams()
    launch: CpAttentionLaunch = CpAttentionLaunch()


# ---------------------------------------------------------------------------
# Positions and chunks (the same arithmetic as tsgen::cp::Geometry)
# ---------------------------------------------------------------------------


def positions(layout: str, world: int, count: int, rank: int) -> np.ndarray:
    """Global positions of rank's `count` local rows."""
    r = np.arange(count, dtype=np.int64)
    if layout == "contiguous":
        return rank * count + r
    half = count // 2
    return np.where(r < half, rank * half + r, (2 * world - 1 - rank) * half + (r - half))


def segments(layout: str, causal: bool, world: int, count: int, source: int, dest: int) -> list[tuple]:
    """(source row, rows, gathered row, chunk) of each piece of `source`'s K / V in `dest`'s
    k_full / v_full. Causal: position order (zig-zag: two chunks of count / 2); not causal:
    whole shards rotated so that dest's own shard is the last slot."""
    if not causal:
        slot = (source - dest - 1) % world
        return [(0, count, slot * count, slot)]
    if layout == "contiguous":
        return [(0, count, source * count, source)]
    half = count // 2
    second = 2 * world - 1 - source
    return [(0, half, source * half, source), (half, half, second * half, second)]


def kv_chunk(layout: str, causal: bool, count: int) -> int:
    return count // 2 if causal and layout == "zigzag" else count


def own_in_place(layout: str, causal: bool, world: int, count: int, rank: int, tile_n: int) -> bool:
    """params.local_kv: whether rank's call reads its own rows in place (tsgen/cp.cuh own_in_place): each of
    its own segments in the gathered order (not causal: the last slot; causal: its chunk or its two zig-zag
    chunks) starts on a KV block boundary and ends on one or at the end; any other call gathers them like a
    peer's."""
    kv_len = world * count
    return all(dst % tile_n == 0 and ((dst + n) % tile_n == 0 or dst + n == kv_len)
               for _, n, dst, _ in segments(layout, causal, world, count, rank, rank))


def first_remote_chunk(layout: str, causal: bool, world: int, count: int, rank: int) -> int:
    """The first KV chunk held by another rank that rank's attention producer reads (its first
    tile: the one with the last positions, walked from its last visible block down): the wait
    `skip_wait` removes. -1 when there is none (rank 0, causal contiguous)."""
    if not causal:
        return world - 2
    owner = {seg[3]: s for s in range(world) for seg in segments(layout, True, world, count, s, rank)}
    top = rank if layout == "contiguous" else 2 * world - 1 - rank
    return next((c for c in range(top, -1, -1) if owner[c] != rank), -1)


class CpAttentionBench(BenchConventions):
    """Size = S, the whole sequence (count = S / world per rank). FLOPs per GPU from the family
    (`flops`), NVLink bytes its K and V rows to every peer. Baselines, one process per GPU
    (tsgen/bench/attention_baselines.py cp_worker): PyTorch all_gather_into_tensor of K and V, then
    SDPA of the local queries over the whole sequence (a position mask where causal: the naive
    one); causal zig-zag also zig-zag SDPA per chunk (diagonal causal, earlier chunks whole)
    merged by LSE, as ring-flash-attention and USP do. Timed eagerly (side streams), checked on
    sampled query rows of sequence 0 of every rank."""

    kind = "fused"
    size_unit = "rows"
    default_sizes = "8192,16384,32768"
    metric = "TFLOPs"
    baselines = (Baseline("torch_sdpa_cp", "cp_sdpa"),)
    graphs = False
    check = "rows"

    def case(self, family, spec, world, size):
        count = size // world
        if size % world or (spec.params.layout == "zigzag" and count % 2):
            raise RuntimeSetupError(f"{spec.name}: S = {size} positions do not split over {world} ranks"
                                    f"{' into two zig-zag chunks each' if spec.params.layout == 'zigzag' else ''}")
        return BenchCase(size, count, flops=family.flops(spec, world, count),
                         link_bytes=family.bytes_moved(spec, world, count))

    def group_shape(self, spec):
        return shape_key(spec.params)

    def check_rows(self, family, spec, world, count, fetch):
        """O at rows of sequence 0 of each rank spread over its rows (`check_query_rows`; the
        sequence's last positions are rank 0's last rows zig-zag, rank W - 1's contiguous)
        against float32 attention of those queries over every rank's K and V at their positions:
        the worst row's relative error (`worst_row_error`)."""
        p = spec.params

        def tensor(name, r, heads):
            x = to_f64(fetch(name, r, 0, p.batch * count * heads * p.head_dim), spec.dtype).astype(np.float32)
            return to_bshd(x, p.batch, count, heads, p.head_dim, p.tensors)[:1]

        pos = [positions(p.layout, world, count, r) for r in range(world)]
        k = np.zeros((1, world * count, p.kv_heads, p.head_dim), np.float32)
        v = np.zeros_like(k)
        for r in range(world):
            k[:, pos[r]], v[:, pos[r]] = tensor("k", r, p.kv_heads), tensor("v", r, p.kv_heads)
        worst = 0.0
        rows = check_query_rows(count)
        for r in range(world):
            ref, _ = attention_reference(tensor("q", r, p.heads)[:, rows], k, v, scale_of(spec), p.causal,
                                         q_pos=pos[r][rows])
            worst = max(worst, worst_row_error(tensor("o", r, p.heads)[:, rows], ref))
        return worst


class CpAttentionFamily(OpFamily):
    kind = "cp_attention"
    Spec = CpAttentionSpec
    template = "cp_attention.cu.j2"
    category = "sequence"
    gpu_sweep = None  # tests/test_cp_attention_gpu.py (few heads: its reference is attention over the whole sequence)
    count_unit = "rows"  # S / P positions per rank
    host_launch = True
    side_streams = True  # tsgen/fused.cuh lanes
    bench = CpAttentionBench()
    summary = ("context-parallel attention: K and V all-gathered chunk by chunk into symmetric buffers (copy engine "
               "or SM push, a signal per chunk) while the flash-attention kernel waits per chunk; contiguous or "
               "zig-zag positions, causal, GQA; O and LSE of the local queries")

    def summary_of(self, spec):
        p = spec.params
        return (f"context-parallel attention ({p.layout}, {'causal' if p.causal else 'not causal'}): K and V "
                f"all-gathered chunk by chunk ({'copy engine on a side stream' if p.gather == 'copy_engine' else 'SM push kernel on a side stream'}), "
                "a signal per chunk, while the flash-attention kernel waits per chunk; O and LSE of the local queries")

    @staticmethod
    def copy_engine(spec) -> bool:
        """Refused on a shared GPU (tsgen.harness.shared_gpu_variant)."""
        return spec.params.gather == "copy_engine"

    def check(self, spec):
        p = spec.params
        problems = AttentionFamily().check(spec)
        if max(spec.world_sizes) > MAX_WORLD:
            problems.append((("world_sizes",), f"at most {MAX_WORLD} ranks (the signals of tsgen/cp.cuh)"))
        if min(spec.world_sizes) < 2:
            problems.append((("world_sizes",), "context parallelism needs at least 2 ranks (one GPU: op attention)"))
        if p.layout == "zigzag" and spec.test.count % 2:
            problems.append((("test", "count"),
                             f"{spec.test.count} rows per rank: zigzag splits them into two chunks, so the count "
                             "must be even"))
        if p.copy_1d and p.gather != "copy_engine":
            problems.append((("params", "copy_1d"), "the SM push has no copy-engine copies: copy_1d needs gather: "
                             "copy_engine"))
        if p.own_copy_first and p.gather != "copy_engine":
            problems.append((("params", "own_copy_first"), "the SM push copies the own rows itself: own_copy_first "
                             "needs gather: copy_engine"))
        elif p.own_copy_first and p.trace:
            problems.append((("params", "own_copy_first"), "own_copy_first with trace: the call timeline reads the "
                             "first signal kernel as the copy stream's own copy, which this one is not"))
        if p.attention_only_entry and p.trace:
            problems.append((("params", "attention_only_entry"), "attention_only_entry with trace: the host timeline "
                             "would count the entry's calls, which advance no epoch; trace the full calls only"))
        if p.tile_counter and p.causal:
            problems.append((("params", "tile_counter"), "causal tiles are always handed out from the counter "
                             "(longest first): tile_counter is the not-causal option"))
        if p.skip_wait and p.gather != "sm":
            problems.append((("params", "skip_wait"), "the negative control runs on a shared GPU: needs gather: sm"))
        return problems

    def shared_refusal(self, spec):
        if spec.params.gather != "copy_engine":
            return None
        return copy_engine_refusal("the gather: sm variant (specs/cp_attention_zigzag_causal_sm.yaml)")

    def shared_fit(self, spec, colocated, sms):
        """Each rank's share of the GPU: the push kernel's CTAs (at most a quarter of the share),
        one SM for the launcher's one-block entry kernel, and the persistent attention grid in
        the rest. An attention CTA takes a whole SM (its registers), so nothing else runs beside
        it: without the entry kernel's SM, every SM held spinning kernels of the ranks that had
        started while a peer's entry kernel waited for one (measured: W 4, rank 0's push waited
        3 s for sig.free[1])."""
        if colocated == 1:
            return {}
        p = spec.params
        room = sms // colocated  # (gather: copy_engine is refused: shared_refusal)
        gather = min(p.gather_blocks, max(1, room // 4))
        blocks = fit_blocks(spec.launch.blocks or room, colocated, sms, reserve=gather + ENTRY_SMS)
        updates = {"launch": {"blocks": blocks}} if blocks != spec.launch.blocks else {}
        if gather != p.gather_blocks:
            updates["params"] = {"gather_blocks": gather}
        return updates

    def buffers(self, spec):
        p = spec.params
        kv = p.batch * p.kv_heads * p.head_dim
        return (
            Buffer("q", spec.dtype, "input", per_count=p.batch * p.heads * p.head_dim),
            Buffer("k", spec.dtype, "input", per_count=kv),
            Buffer("v", spec.dtype, "input", per_count=kv),
            Buffer("o", spec.dtype, "output", per_count=p.batch * p.heads * p.head_dim),
            Buffer("lse", "float32", "output", per_count=p.batch * p.heads),
            Buffer("k_full", spec.dtype, "scratch", per_count=0, per_world_count=kv),  # the whole sequence's K
            Buffer("v_full", spec.dtype, "scratch", per_count=0, per_world_count=kv),
            Buffer("sig", "uint64", "signal", per_count=0, fixed=SIGNALS + trace_words(p.trace)),
        )

    def constants(self, spec):
        p = spec.params
        return {
            **shape_constants(p),
            "TILE_M": p.tile.m,
            "TILE_N": p.tile.n,
            "STAGES": p.stages,
            "CAUSAL": int(p.causal),
            "PINGPONG": int(p.pingpong),
            "KV_WAITS": 1,
            "BHSD": int(p.tensors == "bhsd"),
            "ZIGZAG": int(p.layout == "zigzag"),
            "SM_GATHER": int(p.gather == "sm"),
            "GATHER_BLOCKS": p.gather_blocks,
            "RESERVE_SMS": p.gather_blocks if p.gather == "sm" else CE_RESERVE_SMS,
            "SKIP_WAIT": int(p.skip_wait),
            **({"EPILOGUE_OVERLAP": 1} if p.epilogue_overlap else {}),  # only where set: shipped sources unchanged
            **({"TILE_COUNTER": 1} if p.tile_counter else {}),  # only where set: shipped sources unchanged
            **({"LOCAL_KV": 1} if p.local_kv else {}),  # only where set: shipped sources unchanged
            **({"COPY_1D": 1} if p.copy_1d else {}),  # only where set: shipped sources unchanged
            **({"ROW_MAX_CHAINS": p.row_max_chains} if p.row_max_chains else {}),  # only where set
            **({"RESCALE_AT": p.rescale_at} if p.rescale_at is not None else {}),  # only where set
            **({"RESCALE_SKIP": 1} if p.rescale_skip else {}),  # only where set
            **({"OWN_COPY_THREADS": OWN_COPY_THREADS} if p.own_copy_first else {}),  # only where set
            "THREADS": spec.launch.threads,
            "BLOCKS": spec.launch.blocks,
            "SMEM_BYTES": smem_bytes(spec),
            "SIGNALS": SIGNALS,
            "TRACE": p.trace,
            **({"STAMP_WORDS": STAMP_WORDS, "TRACE_WORDS": TRACE_WORDS} if p.trace else {}),  # trace variants only
        }

    def abi(self, spec):
        # the copy engine's copies address peers' k_full / v_full from the host: the host copy of the table
        return one_kernel_abi(self, spec, smem_bytes(spec), self.constants(spec), peers_host=True)

    def template_vars(self, spec):
        return {**launcher_vars(self.abi(spec)), **scale_vars(spec)}

    # -- as torch tensors (tsgen.torch) ---------------------------------------
    def torch_tensors(self, constants, world):
        """The tensors tsgen.torch's op takes and returns (tsgen/torch/signature.py); count = this rank's
        rows n. In: q [B, n, H, D], k and v [B, n, H_kv, D] (bhsd: the heads before the rows). Out: O
        (q's shape), LSE fp32 [B, H, n], and the gathered K and V (scratch k_full / v_full, [B, W n, H_kv,
        D]), which the backward of tsgen.torch.cp_attention needs: in position order where causal, the
        shards rotated (slot j rank + 1 + j's) otherwise (`segments`). With LOCAL_KV this rank's own rows
        may be missing from them (the kernel read them in place): the caller puts them there
        (tsgen/torch/cp_attention_op.py)."""
        b, h, kv, d = constants["BATCH"], constants["HEADS"], constants["KV_HEADS"], constants["HEAD_DIM"]

        def rows(heads, name, per):  # (dims, count dim) in the spec's layout; the rows' dim counts `per` x n
            if constants["BHSD"]:
                return (("B", b), ("H", heads), (name, per), ("D", d)), 2
            return (("B", b), (name, per), ("H", heads), ("D", d)), 1

        return {"q": rows(h, "n", 1), "k": rows(kv, "n", 1), "v": rows(kv, "n", 1), "o": rows(h, "n", 1),
                "lse": ((("B", b), ("H", h), ("n", 1)), 2),
                "k_full": rows(kv, "S", world), "v_full": rows(kv, "S", world)}

    def torch_local(self, constants, world, buffers):
        """Q, K, V, O and LSE: the attention kernel's tensor maps and the copies' sources, encoded from the
        pointers of each call (tsgen/cp.cuh launch), so the caller's tensors serve. Not k_full / v_full:
        the peers' copies land in them, at their offset in every rank's heap."""
        return {"q", "k", "v", "o", "lse"}

    # -- reference ----------------------------------------------------------
    def make_inputs(self, spec, world, count, rng, pattern):
        """Normal random Q, K, V on every rank (a pattern would make every score alike)."""
        out = {}
        for b in self.buffers(spec):
            if b.role == "input":
                out[b.name] = [from_f64(rng.standard_normal(b.elems(count, world)), spec.dtype) for _ in range(world)]
        return out

    def whole(self, spec, world, count, inputs):
        """Float64 Q, K, V of the whole sequence [batch, S, heads, d] (every rank's rows at their
        positions), and each rank's positions."""
        p = spec.params
        pos = [positions(p.layout, world, count, r) for r in range(world)]
        full = {}
        for name, heads in (("q", p.heads), ("k", p.kv_heads), ("v", p.kv_heads)):
            x = np.zeros((p.batch, world * count, heads, p.head_dim))
            for r in range(world):
                x[:, pos[r]] = to_bshd(to_f64(inputs[name][r], spec.dtype), p.batch, count, heads, p.head_dim,
                                       p.tensors)
            full[name] = x
        return full, pos

    def outputs(self, spec, world, count, inputs):
        """Attention over the whole sequence, then each rank's rows: O [batch, count, heads, d],
        LSE [batch, heads, count] and sum_j p_ij |v_j| (like O) per rank (float64; cached for the
        call's tolerance)."""
        def compute():
            full, pos = self.whole(spec, world, count, inputs)
            o, lse, o_abs = attention_reference(full["q"], full["k"], full["v"], scale_of(spec), spec.params.causal,
                                                with_abs=True)
            return ([o[:, pos[r]] for r in range(world)], [lse[:, :, pos[r]] for r in range(world)],
                     [o_abs[:, pos[r]] for r in range(world)])
        return self.once_per_inputs(inputs, (spec, world, count), compute)

    def reference(self, spec, world, count, inputs):
        o, lse, _ = self.outputs(spec, world, count, inputs)
        t = spec.params.tensors
        return {"o": [from_f64(from_bshd(x, t).reshape(-1), spec.dtype) for x in o],
                "lse": [x.reshape(-1).astype(np.float32) for x in lse]}

    def tolerance(self, spec, world, count, inputs):
        """As the attention op's: O within o_tolerance (per element), LSE 1e-3 relative (absolute
        below 1)."""
        o, lse, o_abs = self.outputs(spec, world, count, inputs)
        t = spec.params.tensors
        return {"o": [o_tolerance(from_bshd(x, t).reshape(-1), from_bshd(a, t).reshape(-1), spec.dtype)
                      for x, a in zip(o, o_abs)],
                "lse": [1e-3 * np.maximum(1.0, np.abs(x.reshape(-1))) for x in lse]}

    def bytes_moved(self, spec, world, count):
        """This rank's K and V rows into every peer's gathered buffers."""
        p = spec.params
        return 2 * (world - 1) * p.batch * count * p.kv_heads * p.head_dim * 2

    def flops(self, spec, world, count) -> float:
        """Per rank: its count queries against the whole sequence (halved for causal: zig-zag
        balances it; contiguous ranks differ, this is their mean)."""
        p = spec.params
        return flops(p.batch, count, world * count, p.heads, p.head_dim, p.causal)


FAMILIES: list[OpFamily] = [CpAttentionFamily()]
