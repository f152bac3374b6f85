"""GEMMs on a sqrt(P) x sqrt(P) process grid (sm_90a): `cannon` and `summa`.

C = A . B with A (M x K), B (K x N) and C (M x N) block-distributed over a q x q grid,
q = sqrt(world): rank r = i q + j holds A_ij ((M/q) x (K/q)), B_ij ((K/q) x (N/q)) and
computes C_ij = sum_s A_is . B_sj ((M/q) x (N/q)), all row-major in the symmetric heap.
The run-time `count` is the block's rows M/q; the global N and K are compile-time
(`params.n`, `params.k`; N/q and K/q are whole tiles). The buffers are sized for the
smallest q of the spec (exact for one world size): `a` holds A_ij, `b` B_ij, `c` C_ij at
their starts.

Both ops are ONE launch of the `gemm` op's kernel (templates/include/tsgen/gemm.cuh) per
call, over K = q panels of K/q, into fp32 registers (bf16 out once): its operands are two
symmetric scratch buffers, `a_pan` (M/q x K: A's row panel i, panel s in columns
[s K/q, (s+1) K/q)) and `b_pan` (K x N/q: B's column panel j, panel s in rows
[s K/q, (s+1) K/q)), filled by copy-engine pushes (cudaMemcpy2DAsync / cudaMemcpyAsync on
two side streams, one per operand) while the GEMM runs. Rank (i, j) walks panels
(i + j) mod q, (i + j + 1) mod q, ... (the K-block hook `k_block` of the producer rotates
the K loop), and its producer waits for sig[A_READY + s] and sig[B_READY + s] >= epoch
before its first TMA load of panel s (templates/include/tsgen/grid.cuh, PanelHook).

  cannon  initial skew: rank (i, j) pushes A_ij to (i, j - i) and B_ij to (i - j, j) (both
          land in panel slot j resp. i); then for steps t = 0 .. q - 2 it waits until its
          panel (i + j + t) mod q of A (of B) has arrived and forwards it to its left (upper)
          neighbour, which needs it at step t + 1: shifts by one, neighbour to neighbour.
  summa   rank (i, j) broadcasts A_ij along row i (to every (i, j'), itself included) and
          B_ij along column j, each destination in the order its walk needs the panel.

The schedule is data (`schedule`): per rank an ordered list of copies (operand, source:
input or panel slot, slot, destination, the own-panel arrival to wait for first), rendered
as a constexpr table that the host launcher walks, and simulated on the CPU by the tests
(every panel of every rank written exactly once with the right block, every wait matched,
no deadlock across the per-operand copy streams). Cross-call hazard: a rank pushes into a
peer's panels only after the peer entered the call (sig[FREE + peer] >= epoch, raised by
its entry kernel after its previous GEMM in stream order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from ..spec_types import SpecBase, WorldSizes
from .base import Buffer, OpFamily, launcher_vars, one_kernel_abi
from ..errors import RuntimeSetupError
from .collectives import from_f64, to_f64
from .conventions import Baseline, BenchCase, BenchConventions, rel_err, sample_rows
from .gemm import GemmFamily, GemmLaunch, GemmParams, gemm_shared_fit, smem_bytes

MAX_Q = 8  # tsgen::grid::MAX_Q
MAX_WORLD = MAX_Q * MAX_Q  # tsgen::grid::MAX_WORLD
SIGNALS = MAX_WORLD + 2 * MAX_Q  # tsgen::grid::SIGNALS: FREE[world], A_READY[q], B_READY[q]
A, B = 0, 1  # operands


def grid_side(world: int) -> int | None:
    """q with q x q = world, None when world is not a perfect square."""
    q = math.isqrt(world)
    return q if q * q == world else None


@dataclass(frozen=True)
class Copy:
    """One copy-engine push of rank `rank`: operand A or B; from the input block
    (`from_input`) or from the rank's own panel `slot`; into panel `slot` of rank `dst`;
    `wait`: the own panel slot whose arrival (this call) it waits for first, -1 none."""

    operand: int
    from_input: bool
    slot: int
    dst: int
    wait: int = -1


def walk(q: int, rank: int) -> list[int]:
    """The panel order of rank (i, j)'s GEMM: (i + j) mod q, (i + j + 1) mod q, ..."""
    i, j = divmod(rank, q)
    return [(i + j + t) % q for t in range(q)]


def schedule(op: str, q: int) -> list[list[Copy]]:
    """Per rank, its pushes in issue order (on the operand's copy stream)."""
    out = []
    for r in range(q * q):
        i, j = divmod(r, q)
        steps: list[Copy] = []
        if op == "cannon":
            steps.append(Copy(A, True, j, i * q + (j - i) % q))
            steps.append(Copy(B, True, i, ((i - j) % q) * q + j))
            for t in range(q - 1):
                s = (i + j + t) % q
                steps.append(Copy(A, False, s, i * q + (j - 1) % q, wait=s))
                steps.append(Copy(B, False, s, ((i - 1) % q) * q + j, wait=s))
        elif op == "summa":
            # destination (i, j') needs our A panel j at its step (j - i - j') mod q; (i', j) our
            # B panel i at (i - i' - j) mod q: push in that order, A and B interleaved
            for t in range(q):
                steps.append(Copy(A, True, j, i * q + (j - i - t) % q))
                steps.append(Copy(B, True, i, ((i - j - t) % q) * q + j))
        else:
            raise ValueError(op)
        out.append(steps)
    return out


class GridGemmParams(GemmParams):
    n: int = Field(8192, ge=64, le=1 << 20, description="columns of the whole B and C (N; N/q per block)")
    k: int = Field(8192, ge=64, le=1 << 20, description="columns of the whole A, rows of the whole B "
                   "(K; K/q per block, q panels)")
    reserve_sms: int = Field(2, ge=1, le=32, description="SMs (whole clusters) the GEMM leaves free for the "
                             "one-block signal / wait kernels of the copy streams that run beside it")


class _GridGemmSpec(SpecBase):
    world_sizes: WorldSizes = Field(description="ranks: perfect squares (q x q grid), e.g. [4]")
    dtype: Literal["bfloat16", "float16"] = Field("bfloat16", description="A, B and C element type")
    params: GridGemmParams = GridGemmParams()
    launch: GemmLaunch = GemmLaunch()


class CannonSpec(_GridGemmSpec):
    """Spec of op `cannon`: C = A . B block-distributed on a q x q grid, Cannon's shifts."""

    op: Literal["cannon"]


class SummaSpec(_GridGemmSpec):
    """Spec of op `summa`: C = A . B block-distributed on a q x q grid, row / column broadcasts."""

    op: Literal["summa"]


class GridBench(BenchConventions):
    """Size = M, the rows of the whole A and C (count = M / q per block; N and K are the spec's).
    FLOPs per GPU = 2 (M/q) (N/q) K; NVLink bytes per GPU from `bytes_moved`. Baseline: cuBLAS
    of the whole M x K x N product on one GPU ("cublas_whole"): the ratio says how much faster
    the grid is than one GPU. Timed eagerly, checked on sampled rows of every C block."""

    kind = "grid"
    size_unit = "rows"
    default_sizes = "8192,16384"
    metric = "TFLOPs"
    baselines = (Baseline("cublas_whole", "cublas_whole", in_process=True),)
    graphs = False
    check = "rows"

    def case(self, family, spec, world, size):
        q = grid_side(world)
        if q is None or size % q:
            raise RuntimeSetupError(f"{spec.name}: M = {size} rows do not split over a {q} x {q} grid")
        count = size // q
        return BenchCase(size, count, flops=family.flops(spec, world, count),
                         link_bytes=family.bytes_moved(spec, world, count))

    def check_rows(self, family, spec, world, count, fetch):
        """C_ij row x = sum_s A_is row x . B_sj (A_is on rank i q + s, B_sj on rank s q + j)."""
        p, q, worst = spec.params, grid_side(world), 0.0
        kb, nb = p.k // q, p.n // q
        b = [to_f64(fetch("b", r, 0, kb * nb), spec.dtype).astype(np.float32).reshape(kb, nb) for r in range(world)]
        rows = sample_rows(count)
        for r in range(world):
            i, j = divmod(r, q)
            ref = sum(np.stack([to_f64(fetch("a", i * q + s, x * kb, (x + 1) * kb), spec.dtype) for x in rows])
                      .astype(np.float32) @ b[s * q + j] for s in range(q))
            c = np.stack([to_f64(fetch("c", r, x * nb, (x + 1) * nb), spec.dtype) for x in rows])
            worst = max(worst, rel_err(c, ref))
        return worst


class CannonFamily(OpFamily):
    kind = "cannon"
    Spec = CannonSpec
    template = "grid_gemm.cu.j2"
    category = "fused"
    variant_worlds = ()  # shapes split over the shipped world sizes only
    count_unit = "rows"  # M/q: the rows of each block
    host_launch = True
    side_streams = True  # tsgen/grid.cuh lanes
    bench = GridBench()
    summary = ("C = A . B block-distributed on a sqrt(P) x sqrt(P) grid: Cannon's skew and neighbour shifts on "
               "the copy engine, overlapped with one TMA + wgmma GEMM over K whose producer waits per K panel")

    def reserved_sms(self, spec):
        return spec.params.reserve_sms

    def check(self, spec):
        p = spec.params
        problems = []
        for w in spec.world_sizes:
            if grid_side(w) is None:
                problems.append((("world_sizes",), f"world size {w} is not a perfect square: {self.kind} runs on a "
                                 "q x q process grid (e.g. 4 = 2 x 2)"))
        if problems:
            return problems
        for q in sorted({grid_side(w) for w in spec.world_sizes}):
            if p.n % (q * p.tile.n):
                problems.append((("params", "n"), f"N = {p.n} over a {q} x {q} grid is not whole tile.n = "
                                 f"{p.tile.n} columns per block: N must be a multiple of {q * p.tile.n}"))
            if p.k % (q * p.tile.k):
                problems.append((("params", "k"), f"K = {p.k} over a {q} x {q} grid is not whole tile.k = "
                                 f"{p.tile.k} panels: K must be a multiple of {q * p.tile.k}"))
        if problems:
            return problems
        q0 = self.q_min(spec)
        problems += GemmFamily().check(self.block_spec(spec, q0))
        if p.reserve_sms % p.cluster.size:
            problems.append((("params", "reserve_sms"), f"{p.reserve_sms} is not a multiple of the cluster size "
                             f"{p.cluster.size}"))
        return problems

    def shared_fit(self, spec, colocated, sms):
        return gemm_shared_fit(spec, colocated, sms)

    @staticmethod
    def q_min(spec) -> int:
        return min(grid_side(w) or 1 for w in spec.world_sizes)

    @staticmethod
    def block_spec(spec, q):
        """The per-rank GEMM as a `gemm` spec view: N = N/q, K = K (the panels)."""
        return spec.model_copy(update={"params": spec.params.model_copy(update={"n": spec.params.n // q})})

    def buffers(self, spec):
        p, q = spec.params, self.q_min(spec)
        kb, nb = p.k // q, p.n // q
        return (
            Buffer("a", spec.dtype, "input", per_count=kb),  # A_ij: count x K/q
            Buffer("b", spec.dtype, "input", per_count=0, fixed=kb * nb),  # B_ij: K/q x N/q
            Buffer("c", spec.dtype, "output", per_count=nb),  # C_ij: count x N/q
            Buffer("a_pan", spec.dtype, "scratch", per_count=p.k),  # count x K: row panel i of A
            Buffer("b_pan", spec.dtype, "scratch", per_count=0, fixed=p.k * nb),  # K x N/q: column panel j of B
            Buffer("sig", "uint64", "signal", per_count=0, fixed=SIGNALS),
        )

    def constants(self, spec):
        c = GemmFamily().constants(spec)
        c.pop("N")  # N/q per world size: Config<WORLD>
        c["N_TOTAL"] = spec.params.n
        c["RESERVE_SMS"] = spec.params.reserve_sms
        return c

    def abi(self, spec):
        return one_kernel_abi(self, spec, smem_bytes(spec), self.constants(spec), peers_host=True)

    def template_vars(self, spec):
        return {**launcher_vars(self.abi(spec)),
                "schedules": {w: schedule(self.kind, grid_side(w)) for w in spec.world_sizes},
                "grid_sides": {w: grid_side(w) for w in spec.world_sizes}}

    # -- reference ----------------------------------------------------------
    def make_inputs(self, spec, world, count, rng, pattern):
        p, q = spec.params, grid_side(world)
        kb, nb = p.k // q, p.n // q
        a, b = [], []
        for r in range(world):
            if pattern:
                i, j = np.arange(count * kb), np.arange(kb * nb)
                av = ((i * 7 + i // kb * 3 + r * 5) % 5 - 2).astype(np.float64)
                bv = ((j * 5 + j // nb + r * 3) % 7 - 3).astype(np.float64)
            else:
                av, bv = rng.standard_normal(count * kb), rng.standard_normal(kb * nb)
            a.append(from_f64(av, spec.dtype))
            b.append(from_f64(bv, spec.dtype))
        return {"a": a, "b": b}

    @staticmethod
    def assemble(blocks: list[np.ndarray], q: int, rows: int, cols: int) -> np.ndarray:
        """The whole matrix from rank (i, j)'s rows x cols blocks (any dtype)."""
        return np.block([[blocks[i * q + j][:rows * cols].reshape(rows, cols) for j in range(q)] for i in range(q)])

    def whole(self, spec, world, count, inputs):
        """The whole A (M x K) and B (K x N) as float32."""
        p, q = spec.params, grid_side(world)
        kb, nb = p.k // q, p.n // q
        a = self.assemble([to_f64(x, spec.dtype).astype(np.float32) for x in inputs["a"]], q, count, kb)
        b = self.assemble([to_f64(x, spec.dtype).astype(np.float32) for x in inputs["b"]], q, kb, nb)
        return a, b

    def product(self, spec, world, count, inputs) -> np.ndarray:
        """C = A . B of the whole matrices, float32 (M x N); once per call's inputs (reference and tolerance)."""
        def compute():
            a, b = self.whole(spec, world, count, inputs)
            return a @ b
        return self.once_per_inputs(inputs, (spec, world, count), compute)

    def blocks_of(self, c: np.ndarray, q: int, count: int, nb: int) -> list[np.ndarray]:
        return [c[i * count:(i + 1) * count, j * nb:(j + 1) * nb] for i in range(q) for j in range(q)]

    def reference(self, spec, world, count, inputs):
        q = grid_side(world)
        c = self.product(spec, world, count, inputs).astype(np.float64)
        return {"c": [from_f64(x.reshape(-1), spec.dtype) for x in self.blocks_of(c, q, count, spec.params.n // q)]}

    def tolerance(self, spec, world, count, inputs):
        q = grid_side(world)
        ulp = 2.0**-7 if spec.dtype == "bfloat16" else 2.0**-10
        c = self.product(spec, world, count, inputs).astype(np.float64)
        amax = max(np.abs(to_f64(x, spec.dtype)).max(initial=0) for x in inputs["a"])
        bmax = max(np.abs(to_f64(x, spec.dtype)).max(initial=0) for x in inputs["b"])
        floor = 2.0**-16 * np.sqrt(spec.params.k) * amax * bmax
        return {"c": [(ulp * np.abs(x) + floor).reshape(-1) for x in self.blocks_of(c, q, count, spec.params.n // q)]}

    def bytes_moved(self, spec, world, count):
        """Bytes each rank pushes per call: cannon, the skew and q - 1 shifts of its A and B blocks
        (q panels of each); summa, its A and B blocks to q - 1 peers each (+ its own, local)."""
        q = grid_side(world)
        p = spec.params
        return q * (count * p.k // q + (p.k // q) * (p.n // q)) * 2

    def flops(self, spec, world, count) -> float:
        """Per rank: (M/q) x (N/q) x K multiply-adds."""
        q = grid_side(world)
        return 2.0 * count * (spec.params.n // q) * spec.params.k


class SummaFamily(CannonFamily):
    kind = "summa"
    Spec = SummaSpec
    summary = ("C = A . B block-distributed on a sqrt(P) x sqrt(P) grid: SUMMA's row / column broadcasts on the "
               "copy engine, overlapped with one TMA + wgmma GEMM over K whose producer waits per K panel")


FAMILIES: list[OpFamily] = [CannonFamily(), SummaFamily()]
