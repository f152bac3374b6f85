"""Fused compute + communication GEMMs on Hopper (sm_90a): `allgather_gemm` and
`gemm_reduce_scatter` (described at its family, below).

allgather_gemm: A is row-sharded over the ranks (rank r holds A_r, M_local x K), B
and C are sharded by columns (rank r holds B_r, K x N_local, and computes
C_r = allgather(A) . B_r, (world x M_local) x N_local, source s's rows at
s x M_local). The run-time `count` is M_local; N_local (`params.n`) and K are
compile-time. The GEMM is the `gemm` op's kernel (templates/include/tsgen/gemm.cuh)
with one batch per source rank and a hook in its producer
(templates/include/tsgen/fused.cuh):

  overlap: none         gather first (copy-engine pushes of our shard into every
                        peer's a_full, one signal exchange), then the GEMM;
  overlap: copy_engine  the pushes run on a second stream (the copy engine, in the
                        order the peers' GEMMs need them) with a signal per source
                        after each copy, while the GEMM starts with the local rows
                        (read from `a` directly) and walks sources rank + 1, rank + 2,
                        ...; its producer waits for a source's signal before loading
                        that source's rows. The GEMM leaves `reserve_sms` SMs free
                        for the one-block signal kernels.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ..spec_types import SpecBase, WorldSizes
from .base import Buffer, OpFamily, launcher_vars, one_kernel_abi
from ..errors import RuntimeSetupError
from .collectives import from_f64, to_f64
from .conventions import Baseline, BenchCase, BenchConventions, rel_err, sample_rows
from .gemm import GemmFamily, GemmLaunch, GemmParams, gemm_shared_fit, smem_bytes

MAX_WORLD = 8  # tsgen::fused::MAX_WORLD
SIGNALS = 2 * MAX_WORLD  # tsgen::fused::SIGNALS


def gemm_operands(spec, world: int, a_elems: int, a_cols: int, rng: np.random.Generator, pattern: bool) -> dict:
    """Every rank's A (a_elems values, rows of a_cols) and B (K x N) in the spec's 16-bit type: random
    normals (drawn in float32: tens of millions of values a call), or with `pattern` small integers (exact
    in 16 bits) that depend on rank, row and column, so a misplaced tile shows."""
    p = spec.params
    a, b = [], []
    for r in range(world):
        if pattern:
            i, j = np.arange(a_elems, dtype=np.int64), np.arange(p.k * p.n, dtype=np.int64)
            av = ((i * 7 + i // a_cols * 3 + r * 5) % 5 - 2).astype(np.float32)
            bv = ((j * 5 + j // p.n + r * 3) % 7 - 3).astype(np.float32)
        else:
            av, bv = rng.standard_normal(a_elems, dtype=np.float32), rng.standard_normal(p.k * p.n, dtype=np.float32)
        a.append(from_f64(av, spec.dtype))
        b.append(from_f64(bv, spec.dtype))
    return {"a": a, "b": b}


class AllgatherGemmParams(GemmParams):
    n: int = Field(2048, ge=64, le=1 << 20,
                   description="columns of B and C on each rank (N_local; the global N is n x world)")
    overlap: Literal["none", "copy_engine"] = Field(
        "copy_engine", description="none: gather, then GEMM; copy_engine: the gather's copies run on the "
        "copy engine of a second stream while GEMM tiles wait per source rank")
    reserve_sms: int = Field(2, ge=1, le=32, description="overlapped: SMs (whole clusters) the GEMM leaves "
                             "free for the one-block signal kernels that run beside it")


class AllgatherGemmSpec(SpecBase):
    """Spec of op `allgather_gemm`: C_r = allgather(A) . B_r, A row-sharded, B and C column-sharded."""

    op: Literal["allgather_gemm"]
    world_sizes: WorldSizes
    dtype: Literal["bfloat16", "float16"] = Field("bfloat16", description="A, B and C element type")
    params: AllgatherGemmParams = AllgatherGemmParams()
    launch: GemmLaunch = GemmLaunch()


class FusedBench(BenchConventions):
    """Size = M, the total rows (count = M / world per rank). FLOPs and NVLink bytes per GPU from
    the family (`flops`, `bytes_moved`). Baselines, one process per GPU (tsgen/bench/torch_ops.py):
    the GEMM alone (cuBLAS), the communication alone (NCCL), the two one after the other
    ("cublas+nccl") and PyTorch SymmetricMemory's fused op ("torch_fused"); rows also get the
    overlap efficiency max(t_gemm, t_comm) / t. Timed eagerly, checked on sampled rows of C."""

    kind = "fused"
    size_unit = "rows"
    default_sizes = "4096,8192,16384"
    metric = "TFLOPs"
    baselines = (Baseline("cublas+nccl", "fused"), Baseline("torch_fused", "fused"))
    graphs = False
    check = "rows"
    # the torch calls of the baselines: the GEMM's shapes are the op's own
    comm_call = "all_gather_into_tensor"
    fused_call = "fused_all_gather_matmul"

    def case(self, family, spec, world, size):
        if size % world:
            raise RuntimeSetupError(f"{spec.name}: M = {size} rows do not split over {world} ranks")
        count = size // world
        return BenchCase(size, count, flops=family.flops(spec, world, count),
                         link_bytes=family.bytes_moved(spec, world, count))

    def check_rows(self, family, spec, world, count, fetch):
        """C_r row g = A_s row i . B_r (s = g // count, i = g % count)."""
        p, worst = spec.params, 0.0
        for r in range(world):
            b = to_f64(fetch("b", r, 0, p.k * p.n), spec.dtype).astype(np.float32).reshape(p.k, p.n)
            rows = sample_rows(world * count)
            a = np.stack([to_f64(fetch("a", g // count, g % count * p.k, (g % count + 1) * p.k), spec.dtype)
                          for g in rows]).astype(np.float32)
            c = np.stack([to_f64(fetch("c", r, g * p.n, (g + 1) * p.n), spec.dtype) for g in rows])
            worst = max(worst, rel_err(c, a @ b))
        return worst


class AllgatherGemmFamily(OpFamily):
    kind = "allgather_gemm"
    Spec = AllgatherGemmSpec
    template = "allgather_gemm.cu.j2"
    category = "fused"
    variant_worlds = ()  # shapes split over the shipped world sizes only
    count_unit = "rows"  # M_local
    host_launch = True
    side_streams = True  # tsgen/fused.cuh lanes
    bench = FusedBench()
    summary = ("C_r = allgather(A) . B_r: A row-sharded, B and C column-sharded; the gather on the copy "
               "engine, overlapped with a TMA + wgmma GEMM whose tiles wait per source rank")

    def reserved_sms(self, spec):
        return spec.params.reserve_sms

    def check(self, spec):
        problems = GemmFamily().check(spec)
        if max(spec.world_sizes) > MAX_WORLD:
            problems.append((("world_sizes",), f"at most {MAX_WORLD} ranks"))
        if spec.params.overlap != "none" and spec.params.reserve_sms % spec.params.cluster.size:
            problems.append((("params", "reserve_sms"),
                             f"{spec.params.reserve_sms} is not a multiple of the cluster size "
                             f"{spec.params.cluster.size}"))
        return problems

    def shared_fit(self, spec, colocated, sms):
        """Persistent GEMM CTAs in whole clusters, each rank leaving its `reserve_sms` to the
        kernels that run beside its GEMM (signals, copies, the reduce)."""
        return gemm_shared_fit(spec, colocated, sms)

    def buffers(self, spec):
        p = spec.params
        return (
            Buffer("a", spec.dtype, "input", per_count=p.k),  # M_local x K
            Buffer("b", spec.dtype, "input", per_count=0, fixed=p.k * p.n),  # K x N_local
            Buffer("c", spec.dtype, "output", per_count=0, per_world_count=p.n),  # (W M_local) x N_local
            Buffer("a_full", spec.dtype, "scratch", per_count=0, per_world_count=p.k),  # W x M_local x K
            Buffer("sig", "uint64", "signal", per_count=0, fixed=SIGNALS),
        )

    def constants(self, spec):
        return GemmFamily().constants(spec)

    # -- as torch tensors (tsgen.torch) ---------------------------------------
    def torch_tensors(self, constants, world):
        """The tensors tsgen.torch's op takes and returns (tsgen/torch/signature.py), from the
        manifest's N (N_local) and K: buffer name -> (dims, count dim[, own rows from]); count =
        M_local rows. Besides C the op returns the gathered A (scratch a_full: every source's rows,
        as torch's fused_all_gather_matmul does), which the backward's weight gradient needs; the
        kernel reads this rank's own rows from `a`, so they are taken from there."""
        k, n = constants["K"], constants["N"]
        return {"a": ((("M/P", 1), ("K", k)), 0), "b": ((("K", k), ("N/P", n)), None),
                "c": ((("M", world), ("N/P", n)), 0), "a_full": ((("M", world), ("K", k)), 0, "a")}

    def torch_local(self, constants, world, buffers):
        """The buffers only this rank's kernel touches (tsgen.torch hands the launcher the caller's
        tensors for them: no copy in or out; tsgen/fused.cuh allgather_gemm_launch): A (the GEMM's
        own rows, and the source of the copies into the peers' a_full), B and C (the GEMM's tensor
        maps, encoded from these pointers). Not a_full: the peers' copies land in it, at its offset
        in their heaps."""
        return {"a", "b", "c"}

    def abi(self, spec):
        # the launcher also addresses peers' a_full for cudaMemcpyAsync: the host copy of the table
        return one_kernel_abi(self, spec, smem_bytes(spec), self.constants(spec), peers_host=True)

    # -- reference ----------------------------------------------------------
    def template_vars(self, spec):
        return launcher_vars(self.abi(spec))

    def make_inputs(self, spec, world, count, rng, pattern):
        p = spec.params
        return gemm_operands(spec, world, count * p.k, p.k, rng, pattern)

    def product(self, spec, world, count, inputs, r) -> np.ndarray:
        """Rank r's C = A_all . B_r (float64); every rank's once per call's inputs (reference and tolerance)."""
        def compute():
            p = spec.params
            full = np.concatenate([to_f64(inputs["a"][s], spec.dtype).reshape(count, p.k) for s in range(world)])
            return [full @ to_f64(inputs["b"][q], spec.dtype).reshape(p.k, p.n) for q in range(world)]
        return self.once_per_inputs(inputs, (spec, world, count), compute)[r]

    def reference(self, spec, world, count, inputs):
        return {"c": [from_f64(self.product(spec, world, count, inputs, r).reshape(-1), spec.dtype)
                      for r in range(world)]}

    def tolerance(self, spec, world, count, inputs):
        ulp = 2.0**-7 if spec.dtype == "bfloat16" else 2.0**-10
        out = []
        for r in range(world):
            c = self.product(spec, world, count, inputs, r).reshape(-1)
            amax = max(np.abs(to_f64(x, spec.dtype)).max(initial=0) for x in inputs["a"])
            bmax = np.abs(to_f64(inputs["b"][r], spec.dtype)).max(initial=0)
            out.append(ulp * np.abs(c) + 2.0**-16 * np.sqrt(spec.params.k) * amax * bmax)
        return {"c": out}

    def bytes_moved(self, spec, world, count):
        return (world - 1) * count * spec.params.k * 2

    def flops(self, spec, world, count) -> float:
        """Per rank: (world x count) x N_local x K multiply-adds."""
        return 2.0 * world * count * spec.params.n * spec.params.k


# ---------------------------------------------------------------------------
# gemm_reduce_scatter
# ---------------------------------------------------------------------------

RS_SIGNALS = 3 * MAX_WORLD + 2  # tsgen::fused::RS_SIGNALS: FREE, READY, TILES, ZEROING, ZEROED


class GemmReduceScatterParams(GemmParams):
    n: int = Field(8192, ge=64, le=1 << 20, description="columns of B and C (N, compile-time)")
    k: int = Field(8192, ge=64, le=1 << 20,
                   description="the full K (compile-time): rank r holds columns [r K/world, (r + 1) K/world) of "
                   "A and those rows of B; K/world must be whole tile.k blocks for every world size")
    overlap: Literal["none", "pull", "push"] = Field(
        "pull", description="none: GEMM, signal exchange, then each rank pulls and sums its row block from "
        "every rank; pull: the GEMM computes the row blocks peers own first and signals each one to its owner "
        "when its last tile is stored, while a reduce kernel on reserved SMs pulls and accumulates them; push: "
        "the GEMM stores each row block's tiles straight into its owner's memory (TMA stores over NVLink) and "
        "signals it; after the GEMM each rank sums the slots it received, locally, on every SM")
    reserve_sms: int = Field(16, ge=2, le=64, description="pull: SMs the GEMM leaves to the reduce kernel "
                             "(clusters of 2 CTAs, one per SM): an even number; unused by none and push")
    batch_order: Literal["blocked", "interleaved"] = Field(
        "blocked", description="push: blocked walks the row blocks one after the other (all pushes go to one "
        "owner at a time); interleaved deals tiles round-robin over the owners, so the pushes spread over every "
        "link for the whole GEMM (pull and none: blocked only, their reduce waits for whole blocks in order)")
    reduce: Literal["slots", "add"] = Field(
        "slots", description="push: slots stores each source's tiles in its own slot of the owner's partial and "
        "sums the slots in fp32 after the GEMM (deterministic: the same bits every call); add adds the tiles "
        "straight into the owner's C (TMA reduce-add, done in the owner's memory): no partial buffer and no "
        "sum kernel, but each add rounds to 16 bits and the adds land in no fixed order (the result may "
        "differ in the last bits from call to call)")


class GemmReduceScatterSpec(SpecBase):
    """Spec of op `gemm_reduce_scatter`: C_r = rows r of sum_s A_s . B_s (A column-, B row-sharded)."""

    op: Literal["gemm_reduce_scatter"]
    world_sizes: WorldSizes
    dtype: Literal["bfloat16", "float16"] = Field("bfloat16", description="A, B, partial and C element type")
    params: GemmReduceScatterParams = GemmReduceScatterParams()
    launch: GemmLaunch = GemmLaunch()


class GemmReduceScatterBench(FusedBench):
    comm_call = "reduce_scatter_tensor"
    fused_call = "fused_matmul_reduce_scatter"

    def check_rows(self, family, spec, world, count, fetch):
        """C_r row i = sum_s A_s row (r count + i) . B_s (A_s: K/world columns, B_s: K/world rows)."""
        p, worst = spec.params, 0.0
        kl = p.k // world
        b = [to_f64(fetch("b", s, 0, kl * p.n), spec.dtype).astype(np.float32).reshape(kl, p.n) for s in range(world)]
        for r in range(world):
            rows = sample_rows(count)
            ref = sum(np.stack([to_f64(fetch("a", s, (r * count + i) * kl, (r * count + i + 1) * kl), spec.dtype)
                                for i in rows]).astype(np.float32) @ b[s] for s in range(world))
            c = np.stack([to_f64(fetch("c", r, i * p.n, (i + 1) * p.n), spec.dtype) for i in rows])
            worst = max(worst, rel_err(c, ref))
        return worst


class GemmReduceScatterFamily(AllgatherGemmFamily):
    """gemm_reduce_scatter: A is sharded by columns (rank s holds A_s, M x K/world), B by rows
    (B_s, K/world x N); rank r's output is rows [r M/world, (r + 1) M/world) of sum_s A_s . B_s,
    summed in fp32, 16-bit out. The run-time `count` is M/world, the rows of C on each rank (the
    manifest's buffer sizes are count x per-rank or world x count: so M = world x count and is
    always divisible); N and K (the full K) are compile-time, K/world whole tile.k blocks.

    The GEMM is the `gemm` op's kernel with one batch per row block (owner rank), walked
    rank + 1, rank + 2, ..., own block last, into a 16-bit symmetric scratch `partial` (M x N):
    16-bit partials are what NCCL's reduce-scatter moves, half the NVLink bytes of fp32 ones,
    at the price of one rounding per partial (relative 2^-9 in bf16, far inside 1e-2).

      overlap: none  GEMM; signal exchange (every rank's partial is stored); each rank pulls
                     block r from every rank and writes c = their fp32 sum (all SMs).
      overlap: pull  the GEMM's epilogue hook counts stored tiles per block and the last one
                     raises READY at the owner; a reduce kernel on `reserve_sms` SMs (a side
                     stream, clusters of 2) accumulates each source's block into fp32 `acc` as
                     it is announced (source rank - 1 first: it computes our block first);
                     after the GEMM, c = acc + own block (all SMs, local).
      overlap: push  the same walk, but the epilogue's TMA stores of block q go to rank q's
                     `partial`, slot `rank` (a tensor map per owner, encoded from the host copy
                     of the peer table); the last tile of block q raises READY at q once
                     written; after the GEMM (all SMs) each rank waits for every READY and
                     writes c = the fp32 sum of its partial's slots, all local reads.
                     With reduce: add there are no slots: the owner zeroes c before its entry
                     (FREE), the epilogues add their tiles into the owner's c (TMA reduce-add,
                     16-bit adds in the owner's memory), and a one-block kernel waits for every
                     READY (no sum kernel, no `partial`; not bit-reproducible).
    Cross-call hazard: a rank writes block q of `partial` only after rank q entered the call
    (FREE[q], raised by q's entry kernel after q's previous reduce ended, in stream order).
    """

    kind = "gemm_reduce_scatter"
    Spec = GemmReduceScatterSpec
    bench = GemmReduceScatterBench()
    template = "gemm_reduce_scatter.cu.j2"
    count_unit = "rows"  # M / world: the rows of C on each rank
    summary = ("C_r = row block r of sum_s A_s . B_s: A column-sharded, B row-sharded; a TMA + wgmma GEMM of "
               "16-bit partials that signals each finished row block to its owner, which pulls and sums in fp32")

    def summary_of(self, spec):
        p = spec.params
        how = {"none": "of 16-bit partials, then a signal exchange; each owner pulls its row block from every rank "
                       "and sums in fp32",
               "pull": "of 16-bit partials that signals each finished row block to its owner, which pulls and sums "
                       "in fp32 meanwhile",
               "push": ("that stores each row block's 16-bit tiles into its owner's partial slots (TMA over "
                        "NVLink) and signals it; the owner sums its slots in fp32" if p.reduce == "slots" else
                        "whose epilogue adds each row block's tiles into its owner's C (TMA reduce-add over "
                        "NVLink, 16-bit adds) and signals it; no sum kernel")}[p.overlap]
        return (f"C_r = row block r of sum_s A_s . B_s: A column-sharded, B row-sharded; a TMA + wgmma GEMM {how} "
                f"(overlap {p.overlap}, reduce {p.reduce})")

    def check(self, spec):
        p = spec.params
        problems = GemmFamily().check(spec)
        if max(spec.world_sizes) > MAX_WORLD:
            problems.append((("world_sizes",), f"at most {MAX_WORLD} ranks"))
        for w in spec.world_sizes:
            if p.k % (w * p.tile.k):
                problems.append((("params", "k"),
                                 f"K = {p.k} over {w} ranks is not whole tile.k = {p.tile.k} blocks per rank: "
                                 f"K must be a multiple of {w} x {p.tile.k} = {w * p.tile.k} for world size {w}"))
        if p.batch_order == "interleaved" and p.overlap != "push":
            problems.append((("params", "batch_order"),
                             f"interleaved needs overlap: push (overlap: {p.overlap} reduces whole row blocks in "
                             "the order they finish)"))
        if p.reduce == "add" and p.overlap != "push":
            problems.append((("params", "reduce"),
                             f"add needs overlap: push (overlap: {p.overlap} sums the partials it pulls; only push "
                             "stores tiles into the owner's memory, where they can be added)"))
        if p.overlap == "pull" and p.reserve_sms % 2:
            problems.append((("params", "reserve_sms"),
                             f"{p.reserve_sms} is odd: the reduce kernel runs in clusters of 2 CTAs"))
        if p.overlap == "pull" and p.reserve_sms % p.cluster.size:
            problems.append((("params", "reserve_sms"),
                             f"{p.reserve_sms} is not a multiple of the cluster size {p.cluster.size}"))
        return problems

    def buffers(self, spec):
        p = spec.params
        bufs = [
            Buffer("a", spec.dtype, "input", per_count=p.k),  # (world x count) x K/world
            # K/world x N; sized K x N (the manifest's sizes have no 1/world term): the first K/world rows
            Buffer("b", spec.dtype, "input", per_count=0, fixed=p.k * p.n),
            Buffer("c", spec.dtype, "output", per_count=p.n),  # count x N
        ]
        if p.reduce != "add":  # add sums into c itself
            bufs.append(Buffer("partial", spec.dtype, "scratch", per_count=0, per_world_count=p.n))  # (world x count) x N
        if p.overlap == "pull":
            bufs.append(Buffer("acc", "float32", "scratch", per_count=p.n))  # count x N, fp32
        bufs.append(Buffer("sig", "uint64", "signal", per_count=0, fixed=RS_SIGNALS))
        return tuple(bufs)

    def torch_tensors(self, constants, world):
        """The tensors tsgen.torch's op takes and returns: A (M x K/P), this rank's B (K/P x N: the
        first K/P rows of its buffer) and C (M/P x N); count = M/P rows."""
        k, n = constants["K"], constants["N"]
        return {"a": ((("M", world), ("K/P", k // world)), 0), "b": ((("K/P", k // world), ("N", n)), None),
                "c": ((("M/P", 1), ("N", n)), 0)}

    def torch_local(self, constants, world, buffers):
        """A and B (the GEMM's tensor maps) and C, which the reduce writes locally (tsgen/fused.cuh
        gemm_reduce_scatter_launch) but with reduce: add, where the peers' epilogues add their tiles
        into the owner's C (that spec has no `partial`): then C is in the heap."""
        return {"a", "b", "c"} if "partial" in buffers else {"a", "b"}

    def abi(self, spec):
        # push: the launcher encodes a tensor map of every owner's partial: the host copy of the table
        return one_kernel_abi(self, spec, smem_bytes(spec), self.constants(spec),
                              peers_host=spec.params.overlap == "push")

    def template_vars(self, spec):
        return launcher_vars(self.abi(spec))

    # -- reference ----------------------------------------------------------
    def make_inputs(self, spec, world, count, rng, pattern):
        p = spec.params
        k_local = p.k // world
        return gemm_operands(spec, world, world * count * k_local, k_local, rng, pattern)

    def partials(self, spec, world, count, inputs) -> list[np.ndarray]:
        """A_s . B_s of every rank s, float32 products summed in float32 ((world x count) x N); once per
        call's inputs (reference and tolerance)."""
        def compute():
            p = spec.params
            k_local = p.k // world
            out = []
            for s in range(world):
                a = to_f64(inputs["a"][s], spec.dtype).astype(np.float32).reshape(world * count, k_local)
                b = to_f64(inputs["b"][s], spec.dtype).astype(np.float32)[:k_local * p.n].reshape(k_local, p.n)
                out.append(a @ b)
            return out
        return self.once_per_inputs(inputs, (spec, world, count), compute)

    def product(self, spec, world, count, inputs, r) -> np.ndarray:
        parts = self.partials(spec, world, count, inputs)
        return sum(x[r * count:(r + 1) * count] for x in parts)

    def reference(self, spec, world, count, inputs):
        parts = self.partials(spec, world, count, inputs)
        total = sum(parts)
        return {"c": [from_f64(total[r * count:(r + 1) * count].reshape(-1).astype(np.float64), spec.dtype)
                      for r in range(world)]}

    def tolerance(self, spec, world, count, inputs):
        """Each partial is rounded to 16 bits before the fp32 sum, the sum once more: one unit in
        the last place of every partial and of the result, plus the fp32 sums' own rounding.
        reduce: add rounds the running sum after each of the world adds instead (a unit of the
        magnitude summed so far, at most `mag`, per add)."""
        ulp = 2.0**-7 if spec.dtype == "bfloat16" else 2.0**-10
        parts = self.partials(spec, world, count, inputs)
        amax = max(np.abs(to_f64(x, spec.dtype)).max(initial=0) for x in inputs["a"])
        bmax = max(np.abs(to_f64(x, spec.dtype)).max(initial=0) for x in inputs["b"])
        out = []
        for r in range(world):
            rows = slice(r * count, (r + 1) * count)
            mag = sum(np.abs(x[rows]) for x in parts).astype(np.float64)
            total = np.abs(sum(x[rows] for x in parts)).astype(np.float64)
            roundings = world if spec.params.reduce == "add" else 1
            out.append((ulp * (roundings * mag + total) + 2.0**-16 * world * np.sqrt(spec.params.k) * amax * bmax).reshape(-1))
        return {"c": out}

    def poison_survives(self, spec):
        """reduce: add zeroes c at the start of every call (its adds land on zeros): poison never
        survives, and a correct sum may equal the poison's bits while the reference, rounded
        once instead of after each add, differs in the last bit."""
        return spec.params.reduce != "add"

    def bytes_moved(self, spec, world, count):
        """Each rank pulls its row block from every peer: (world - 1) x count x N 16-bit values."""
        return (world - 1) * count * spec.params.n * 2

    def flops(self, spec, world, count) -> float:
        """Per rank: (world x count) x N x K/world multiply-adds."""
        return 2.0 * count * spec.params.n * spec.params.k


FAMILIES: list[OpFamily] = [AllgatherGemmFamily(), GemmReduceScatterFamily()]
