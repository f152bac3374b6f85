"""A schedule model of cp_attention's causal time (issue 33): no GPU, no change to the kernel.

What it models, from the source (templates/include/tsgen/attention.cuh, tsgen/cp.cuh):

* **Work items.** One item = one query tile (TILE_M rows of one head of one sequence). The
  kernel numbers them t = (batch * HEADS + head) * m_tiles + within, and with CAUSAL takes
  m = m_tiles - 1 - within (the last rows of each head first: `tile_of`); cp_attention's causal
  kernel (issue 33) numbers them longest first within groups of `head_group` (batch, head)
  pairs whose K and V fit in half of L2 (`kernel_items`, `head_group`). An item's cost is
  the KV blocks it loads: every block up to the one holding the last key any of its rows sees
  (`tile_of`'s `blocks`), walked from the top block down.
* **Positions.** The kernel's `Problem`: query row r at q_offset + r below q_split, at
  q_offset2 + (r - q_split) above; keys at kv_offset + j. cp_attention's launcher sets them
  per rank (`cp_problem`); the single-GPU kernel over the whole sequence has one segment
  from 0 (`single_problem`).
* **The grid.** cp_attention: a persistent grid of SMs - RESERVE_SMS CTAs (copy-engine gather:
  2 SMs for the signal kernels; SM gather: gather_blocks), and CTA c takes items c, c + G,
  c + 2G, ... (a **static stride**, in both the producer and the consumers): not causal, and
  causal before issue 33; causal since, CTA c takes item c and then the next item of an atomic
  counter whenever it is done (`Variant(order="groups", scheduler="dynamic")`). The single-GPU kernel (the
  suite's ideal) is a plain grid, one CTA per item, one CTA per SM (its shared memory): the
  hardware hands the next CTA in blockIdx order to the first SM that frees, which is the
  **dynamic** scheduler here (an assumption: the order CUDA dispatches a grid in is not
  documented).
* **The gather** (copy engine, `tsgen::cp::launch`): each rank copies its K and V rows to
  itself first (a device-to-device copy at `hbm_copy_GBps`), then to rank + 1, rank + 2, ...
  (over NVLink at `nvlink_GBps`), one signal per receiver after its copies (`signal_us`
  each). A chunk is usable at the receiver when the signal after its copy is raised; the
  kernel's producer waits before the first block of each chunk, so a CTA stalls until then.
* **Time.** Every KV block costs `block_us` on one SM (the same in every kernel: the model
  is about the schedule, not the block's speed), each item `tile_overhead` blocks more (its
  Q load, pipeline fill and epilogue), a split item's LSE merge `merge_blocks` more. Not
  modelled: the producer's run-ahead of STAGES blocks, L2 and HBM contention, clock changes.

The ratio the suite measures, cp TFLOP/s per GPU over the single-GPU kernel's on the whole
sequence, is then T_ideal / (W T_cp) (both count causal FLOPs as half of the square), with
T_cp the slowest rank's makespan (the bench times the slowest GPU).

`python -m tsgen.ops.cp_schedule` prints the table docs/design/cp_attention.md quotes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

import numpy as np

FLOPS_PER_BLOCK_ELEMENT = 4  # Q K^T and P V: 2 x 2 FLOPs per (query, key, head-dim column)


@dataclass(frozen=True)
class Shape:
    """One cp_attention call's shape (the spec's params plus the run's world and sequence)."""

    seq: int  # S, the whole sequence (count = S / world rows per rank)
    world: int
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    batch: int = 1
    tile_m: int = 128
    tile_n: int = 128
    causal: bool = True
    zigzag: bool = True
    l2_bytes: int = 50 << 20  # H100 / H200

    @property
    def count(self) -> int:
        return self.seq // self.world


@dataclass(frozen=True)
class Problem:
    """tsgen::attention::Problem's position and size fields."""

    q_len: int
    kv_len: int
    q_offset: int
    q_split: int
    q_offset2: int
    kv_offset: int
    kv_chunk: int  # KV rows per signal (the chunks the producer waits for)
    heads: int
    batch: int
    tile_m: int
    tile_n: int
    causal: bool
    head_group: int = 0  # (batch, head) pairs per group of the longest-first order; 0: head by head

    @property
    def m_tiles(self) -> int:
        return -(-self.q_len // self.tile_m)

    @property
    def kv_blocks(self) -> int:
        return -(-self.kv_len // self.tile_n)

    def q_position(self, r):
        """Global position of query row r (an int or an array): tsgen::attention::q_position."""
        r = np.asarray(r, dtype=np.int64)
        return np.where(r < self.q_split, self.q_offset + r, self.q_offset2 + (r - self.q_split))


def head_group(heads: int, kv_heads: int, head_dim: int, kv_len: int, l2_bytes: int, balanced: bool = False) -> int:
    """Query heads per group of the longest-first order (tsgen::attention::head_group): as many
    KV heads as have their K and V (kv_len rows each) in half of L2, at least one, times the
    query heads per KV head; `balanced` (the single-GPU persistent schedule): as many groups, of
    equal sizes (within one KV head)."""
    per_kv_head = 2 * kv_len * head_dim * 2
    kv = min(max(l2_bytes // 2 // max(per_kv_head, 1), 1), kv_heads)
    if balanced:
        kv = -(-kv_heads // -(-kv_heads // kv))
    return kv * (heads // kv_heads)


def cp_problem(shape: Shape, rank: int, dynamic: bool = False) -> Problem:
    """Rank `rank`'s problem as tsgen::cp::launch sets it (dynamic: the causal kernel's
    longest-first order in head groups, as it launches since issue 33; False: the order before)."""
    c, w = shape.count, shape.world
    half = c // 2
    zig = shape.causal and shape.zigzag
    q_offset = 0 if not shape.causal else rank * half if shape.zigzag else rank * c
    return Problem(q_len=c, kv_len=w * c, q_offset=q_offset, q_split=half if zig else c,
                   q_offset2=(2 * w - 1 - rank) * half if zig else 0, kv_offset=0,
                   kv_chunk=half if zig else c, heads=shape.heads, batch=shape.batch, tile_m=shape.tile_m,
                   tile_n=shape.tile_n, causal=shape.causal,
                   head_group=head_group(shape.heads, shape.kv_heads, shape.head_dim, w * c, shape.l2_bytes)
                   if dynamic and shape.causal else 0)


def single_problem(shape: Shape) -> Problem:
    """The single-GPU attention kernel over the whole sequence (the suite's ideal): no waits. Its tiles start at
    row 0 here; the single-GPU launchers end-align causal tiles (attention.cuh `end_shift`), which differs only
    where m_tiles x tile_m - seq is 64 or more (never at the cp suites' shapes: tile_m 128, seq a multiple of 128)."""
    s = shape.seq
    return Problem(q_len=s, kv_len=s, q_offset=0, q_split=s, q_offset2=0, kv_offset=0, kv_chunk=s,
                   heads=shape.heads, batch=shape.batch, tile_m=shape.tile_m, tile_n=shape.tile_n,
                   causal=shape.causal)


@dataclass(frozen=True)
class Item:
    """One work item: KV blocks [lo, hi) of query tile m of (head, batch), walked from hi - 1 down."""

    m: int
    head: int
    batch: int
    lo: int
    hi: int
    merge: bool = False  # one half of a split tile: its partial O / LSE is merged afterwards

    @property
    def blocks(self) -> int:
        return self.hi - self.lo


def tile_blocks(p: Problem, m: int) -> int:
    """KV blocks query tile m loads (tile_of): up to the block of the last key any of its rows sees."""
    if not p.causal:
        return p.kv_blocks
    first, last = m * p.tile_m, min((m + 1) * p.tile_m, p.q_len) - 1
    max_q = int(p.q_position(last))
    if first < p.q_split <= last:  # the tile straddles the two segments
        max_q = max(max_q, int(p.q_position(p.q_split - 1)))
    visible = max_q - p.kv_offset
    return 0 if visible < 0 else min(visible // p.tile_n + 1, p.kv_blocks)


def kernel_items(p: Problem) -> list[Item]:
    """Every item in the kernel's order (tile index t = 0, 1, ...: tile_of). head_group G > 0:
    groups of G (batch, head) pairs (the last may be smaller), and within a group query tile m
    from the last down, each over the group's pairs: longest first wherever positions grow with
    the row (every layout cp_attention makes)."""
    out = []
    pairs = p.batch * p.heads
    if p.head_group:
        for g0 in range(0, pairs, p.head_group):
            group = range(g0, min(g0 + p.head_group, pairs))
            for m in range(p.m_tiles - 1, -1, -1):
                out += [Item(m, bh % p.heads, bh // p.heads, 0, tile_blocks(p, m)) for bh in group]
        return out
    for bh in range(pairs):
        for within in range(p.m_tiles):
            m = p.m_tiles - 1 - within if p.causal else within
            out.append(Item(m, bh % p.heads, bh // p.heads, 0, tile_blocks(p, m)))
    return out


def longest_first(items: list[Item]) -> list[Item]:
    """The same items by KV-block count, longest first (stable: ties keep the kernel's order)."""
    return sorted(items, key=lambda it: -it.blocks)


def split_longest(items: list[Item], above: int) -> list[Item]:
    """Items of more than `above` blocks become two (the upper and the lower half of the KV
    range), merged by LSE; each half keeps its place in the order."""
    out = []
    for it in items:
        if it.blocks > above:
            mid = it.lo + it.blocks // 2
            out += [replace(it, lo=mid, merge=True), replace(it, hi=mid, merge=True)]
        else:
            out.append(it)
    return out


def block_us_at(tflops: float, sms: int = 132, tile_m: int = 128, tile_n: int = 128, head_dim: int = 128) -> float:
    """Microseconds per KV block per SM when a whole GPU of `sms` SMs runs at `tflops`."""
    return FLOPS_PER_BLOCK_ELEMENT * tile_m * tile_n * head_dim / (tflops * 1e12 / sms) * 1e6


@dataclass(frozen=True)
class Timing:
    block_us: float = block_us_at(650.0)  # one KV block of one tile on one SM (1.70 us: the GPU at 650 TFLOP/s)
    tile_overhead: float = 1.0  # blocks' worth per item: Q load, pipeline fill, epilogue
    merge_blocks: float = 0.5  # blocks' worth per split half: writing and merging its partial O / LSE


@dataclass(frozen=True)
class Gather:
    """The copy-engine gather's arrival model (bandwidths in GB/s = 1e3 bytes / us)."""

    nvlink_GBps: float = 380.0
    hbm_copy_GBps: float = 1800.0
    signal_us: float = 5.0


def chunk_ready(shape: Shape, rank: int, gather: Gather | None) -> np.ndarray:
    """Microseconds after the call starts at which each KV chunk of `rank`'s k_full / v_full is
    usable (None: all at 0, the single-GPU kernel or a gather assumed free)."""
    chunks = 2 * shape.world if shape.causal and shape.zigzag else shape.world
    ready = np.zeros(chunks)
    if gather is None:
        return ready
    from .cp_attention import segments  # the gathered-buffer geometry (the header's is tested against it)

    layout = "zigzag" if shape.zigzag else "contiguous"
    shard = 2 * shape.batch * shape.count * shape.kv_heads * shape.head_dim * 2  # K and V bytes of one rank
    for s in range(shape.world):
        t = 0.0  # source s copies to itself, then to s + 1, s + 2, ... on one copy stream
        for i in range(shape.world):
            d = (s + i) % shape.world
            t += shard / ((gather.hbm_copy_GBps if d == s else gather.nvlink_GBps) * 1e3) + gather.signal_us
            if d == rank:
                for seg in segments(layout, shape.causal, shape.world, shape.count, s, d):
                    ready[seg[3]] = t
    return ready


@dataclass
class Run:
    makespan: float  # us
    busy: float  # us of block and overhead work summed over CTAs
    waited: float  # us CTAs spent waiting for chunks
    ctas: int

    @property
    def efficiency(self) -> float:
        """Work over (CTAs x makespan): 1 is no idle SM time."""
        return self.busy / (self.ctas * self.makespan)


def static_share(n: int, ctas: int, c: int, snake: bool) -> list[int]:
    """The items CTA c of a static grid takes: c, c + ctas, ... (snake: every other round
    backwards, c, 2 ctas - 1 - c, 2 ctas + c, ...)."""
    out = []
    for k in range(0, n, ctas):
        i = k + (ctas - 1 - c if snake and k // ctas % 2 else c)
        if i < n:
            out.append(i)
    return out


def simulate(p: Problem, items: list[Item], ctas: int, scheduler: str, timing: Timing,
             ready: np.ndarray | None = None) -> Run:
    """Run `items` on `ctas` CTAs. scheduler "static": CTA c takes items c, c + ctas, ... (the
    cp kernel today); "snake": static, every other round backwards (CTA c takes c, 2 ctas - 1 - c,
    2 ctas + c, ...); "dynamic": the next item in order goes to the CTA that frees first (an
    atomic tile counter, or the hardware's dispatch of a plain grid)."""
    chunk = p.kv_chunk
    cost = timing.block_us

    def extra(it: Item) -> float:  # blocks' worth beyond the item's KV blocks
        return timing.tile_overhead + (timing.merge_blocks if it.merge else 0.0)

    def run_item(t: float, it: Item) -> tuple[float, float]:
        waited = 0.0
        j = it.hi
        while j > it.lo:  # downwards: the blocks whose lowest key lies in chunk c, after waiting for
            top = j - 1      # every chunk the first of them touches (wait_chunks)
            c = top * p.tile_n // chunk
            lo = max(it.lo, -(-(c * chunk) // p.tile_n))
            if ready is not None:
                last = (min((top + 1) * p.tile_n, p.kv_len) - 1) // chunk
                need = float(ready[c:last + 1].max())
                if need > t:
                    waited += need - t
                    t = need
            t += (j - lo) * cost
            j = lo
        return t + extra(it) * cost, waited

    busy = sum((it.blocks + extra(it)) * cost for it in items)
    waited = 0.0
    if scheduler in ("static", "snake"):
        end = 0.0
        for c in range(min(ctas, len(items))):
            t = 0.0
            for it in (items[i] for i in static_share(len(items), ctas, c, scheduler == "snake")):
                t, w = run_item(t, it)
                waited += w
            end = max(end, t)
        return Run(end, busy, waited, ctas)
    if scheduler != "dynamic":
        raise ValueError(f"scheduler {scheduler!r}: static, snake or dynamic")
    free = [(0.0, c) for c in range(ctas)]
    end = 0.0
    for it in items:
        t, c = heapq.heappop(free)
        t, w = run_item(t, it)
        waited += w
        end = max(end, t)
        heapq.heappush(free, (t, c))
    return Run(end, busy, waited, ctas)


@dataclass(frozen=True)
class Variant:
    """One schedule of the cp kernel: its order, scheduler, split threshold and grid."""

    name: str
    order: str = "kernel"  # kernel (before issue 33) | longest_first (every item sorted) | groups (the kernel now)
    scheduler: str = "static"  # static | snake | dynamic (see simulate)
    split_above: int | None = None  # blocks; None: no split
    reserve_sms: int = 2  # the gather's SMs (copy engine: the signal kernels')
    gather: bool = True  # model the KV arrival (False: every chunk there at the start)


def cp_items(p: Problem, v: Variant) -> list[Item]:
    """p: cp_problem(..., dynamic=v.order == "groups")."""
    items = kernel_items(p)
    if v.order == "longest_first":
        items = longest_first(items)
    elif v.order not in ("kernel", "groups"):
        raise ValueError(f"order {v.order!r}: kernel, longest_first or groups")
    if v.split_above is not None:
        items = split_longest(items, v.split_above)
    return items


def cp_run(shape: Shape, v: Variant, timing: Timing, gather: Gather, sms: int = 132) -> tuple[Run, int]:
    """The slowest rank's run and that rank."""
    runs = []
    for rank in range(shape.world):
        p = cp_problem(shape, rank, dynamic=v.order == "groups")
        ready = chunk_ready(shape, rank, gather if v.gather else None)
        runs.append((simulate(p, cp_items(p, v), sms - v.reserve_sms, v.scheduler, timing, ready), rank))
    return max(runs, key=lambda r: r[0].makespan)


def ideal_run(shape: Shape, timing: Timing, sms: int = 132) -> Run:
    """The single-GPU kernel over the whole sequence: a plain grid, dispatched in order."""
    p = single_problem(shape)
    return simulate(p, kernel_items(p), sms, "dynamic", timing)


def fraction_of_ideal(shape: Shape, v: Variant, timing: Timing, gather: Gather, sms: int = 132) -> float:
    """cp TFLOP/s per GPU over the single-GPU kernel's: T_ideal / (W T_cp)."""
    return ideal_run(shape, timing, sms).makespan / (shape.world * cp_run(shape, v, timing, gather, sms)[0].makespan)


VARIANTS = (
    Variant("today (kernel order, static stride, 130 CTAs), no gather wait", gather=False),
    Variant("today (kernel order, static stride, 130 CTAs)"),
    Variant("kernel order, dynamic counter", scheduler="dynamic"),
    Variant("longest first, static stride", order="longest_first"),
    Variant("longest first, snake stride", order="longest_first", scheduler="snake"),
    Variant("longest first, dynamic counter", order="longest_first", scheduler="dynamic"),
    Variant("longest first in L2 head groups, dynamic (the kernel now)", order="groups", scheduler="dynamic"),
    Variant("longest first, dynamic, split > 64 blocks", order="longest_first", scheduler="dynamic", split_above=64),
    Variant("longest first, dynamic, 132 CTAs (gather on no SM)", order="longest_first", scheduler="dynamic",
            reserve_sms=0),
    Variant("longest first, dynamic, 124 CTAs (SM gather, 8)", order="longest_first", scheduler="dynamic",
            reserve_sms=8),
)


def table(seqs=(16384, 32768), world: int = 2, timing: Timing = Timing(), gather: Gather = Gather()) -> str:
    """The model's numbers per sequence length: the ideal kernel's own efficiency, then per
    variant the slowest rank's CTA efficiency, its waits and the fraction of ideal; last the
    suite's not-causal entry (contiguous, 8 KV heads) as the kernel runs it today."""
    lines = [f"timing {timing}, gather {gather}", ""]
    for s in seqs:
        shape = Shape(seq=s, world=world)
        ideal = ideal_run(shape, timing)
        lines.append(f"S = {s}, W = {world}, causal zig-zag: ideal kernel makespan {ideal.makespan:.0f} us, "
                     f"efficiency {ideal.efficiency:.3f}")
        for v in VARIANTS:
            run, rank = cp_run(shape, v, timing, gather)
            frac = ideal.makespan / (world * run.makespan)
            lines.append(f"  {v.name:<62} rank {rank}: makespan {run.makespan:6.0f} us, efficiency "
                         f"{run.efficiency:.3f}, waits {run.waited / run.ctas:5.1f} us per CTA, "
                         f"fraction of ideal {frac:.3f}")
        flat = Shape(seq=s, world=world, kv_heads=8, causal=False, zigzag=False)
        ideal = ideal_run(flat, timing)
        run, rank = cp_run(flat, VARIANTS[1], timing, gather)
        lines.append(f"  not causal (contiguous, 8 KV heads), today: ideal efficiency {ideal.efficiency:.3f}; cp rank "
                     f"{rank} makespan {run.makespan:.0f} us, efficiency {run.efficiency:.3f}, waits {run.waited / run.ctas:5.1f} us per CTA, "
                     f"fraction of ideal {ideal.makespan / (world * run.makespan):.3f}")
        lines.append("")
    return "\n".join(lines)


def single_runs(shape: Shape, timing: Timing, sms: int = 132, overlap_overhead: float = 0.3) -> dict[str, Run]:
    """The single-GPU attention kernel's schedules (issue 33, params.schedule): "grid", the plain
    grid (one CTA per tile in kernel order, the hardware's dispatch as a dynamic scheduler);
    "persistent", one CTA per SM taking tiles from the counter (causal: longest first in L2-sized
    head groups; not causal: head-major), the same per-tile overhead; "overlap", the same with the
    per-tile overhead cut to `overlap_overhead` blocks (epilogue_overlap: the next tile's Q and
    first K land during this tile's last P V and epilogue; what is left is its first S and
    softmax, not overlapped with a P V, and the epilogue's register-to-shared writes)."""
    p = single_problem(shape)
    grouped = replace(p, head_group=head_group(shape.heads, shape.kv_heads, shape.head_dim, shape.seq,
                                               shape.l2_bytes, balanced=True) if shape.causal else 0)
    return {"grid": simulate(p, kernel_items(p), sms, "dynamic", timing),
            "persistent": simulate(grouped, kernel_items(grouped), sms, "dynamic", timing),
            "overlap": simulate(grouped, kernel_items(grouped), sms, "dynamic",
                                replace(timing, tile_overhead=overlap_overhead))}


def single_table(seqs=(4096, 8192, 16384), timing: Timing = Timing(), overlap_overhead: float = 0.3) -> str:
    """The single-GPU schedules of `single_runs` for suite attention-variants' shapes: per shape
    and S, each schedule's CTA efficiency (work over CTAs x makespan), the tail's idle SM time,
    and its predicted speed-up over the plain grid (makespan ratio)."""
    shapes = [("hd128 32 heads, not causal", dict(heads=32, kv_heads=32, head_dim=128, causal=False)),
              ("hd128 causal GQA 32:8", dict(heads=32, kv_heads=8, head_dim=128, causal=True)),
              ("hd64 causal 32 heads", dict(heads=32, kv_heads=32, head_dim=64, causal=True)),
              ("hd128 64:8, not causal", dict(heads=64, kv_heads=8, head_dim=128, causal=False)),
              ("hd128 64:8, causal", dict(heads=64, kv_heads=8, head_dim=128, causal=True))]
    lines = [f"timing {timing}, overlap: {overlap_overhead} blocks per tile, 132 CTAs, L2 60 MiB (H200)", ""]
    for name, kw in shapes:
        for s in seqs:
            shape = Shape(seq=s, world=1, zigzag=False, l2_bytes=60 << 20, **kw)
            own = replace(timing, block_us=timing.block_us * kw["head_dim"] / 128)  # at the same rate
            runs = single_runs(shape, own, overlap_overhead=overlap_overhead)
            grid = runs["grid"].makespan
            cells = [f"{k} eff {r.efficiency:.3f} idle {(1 - r.efficiency) * r.makespan:5.0f} us/SM "
                     f"x{grid / r.makespan:.3f}" for k, r in runs.items()]
            lines.append(f"{name:<28} S={s:>5}: makespan {grid:7.0f} us | " + " | ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tsgen.ops.cp_schedule", description=table.__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seqs", default="16384,32768", help="whole-sequence lengths, comma-separated")
    ap.add_argument("--tflops", type=float, default=650.0, help="the GPU's rate while every SM works (block_us)")
    ap.add_argument("--tile-overhead", type=float, default=Timing.tile_overhead, help="blocks' worth per item")
    ap.add_argument("--merge", type=float, default=Timing.merge_blocks, help="blocks' worth per split half")
    ap.add_argument("--nvlink", type=float, default=Gather.nvlink_GBps, help="GB/s of one copy to a peer")
    ap.add_argument("--hbm-copy", type=float, default=Gather.hbm_copy_GBps, help="GB/s of the copy to itself")
    ap.add_argument("--signal-us", type=float, default=Gather.signal_us, help="us per signal kernel")
    ap.add_argument("--single", action="store_true", help="the single-GPU kernel's schedules (single_table) instead")
    ap.add_argument("--overlap-overhead", type=float, default=0.3, help="--single: blocks' worth per tile with "
                    "epilogue_overlap")
    a = ap.parse_args(argv)
    timing = Timing(block_us=block_us_at(a.tflops), tile_overhead=a.tile_overhead, merge_blocks=a.merge)
    if a.single:
        print(single_table(tuple(int(x) for x in a.seqs.split(",")) if a.seqs != "16384,32768" else (4096, 8192, 16384),
                           timing, a.overlap_overhead))
        return
    print(table(tuple(int(x) for x in a.seqs.split(",")), a.world, timing,
                Gather(nvlink_GBps=a.nvlink, hbm_copy_GBps=a.hbm_copy, signal_us=a.signal_us)))


if __name__ == "__main__":
    main()
