"""gemm: C = A . B on one Hopper GPU (sm_90a), the base of the fused compute +
communication ops.

A is M x K and C is M x N, both row-major; B is K x N row-major, as torch
holds the second operand of torch.matmul(A, B) (wgmma reads it "N-major"
through its transpose bit, so nothing is transposed in memory). The run-time
`count` is M (any M >= 1); N and K are compile-time constants of the spec.
Inputs are bfloat16 or float16, accumulation is fp32, C has the input type.

The kernel (templates/include/tsgen/gemm.cuh) is persistent and warp
specialized: one producer warpgroup loads tiles of A and B with TMA into a
ring of 128B-swizzled shared-memory stages (full/empty mbarriers), one or
two consumer warpgroups multiply them with wgmma into fp32 registers and
store C through shared memory with TMA (rows >= M are clipped by the tensor
map). Clusters of 2 CTAs share the operand they have in common with TMA
multicast. TMA descriptors are encoded on the host, so the runtime calls the
module's host launcher (`host_launch`).
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import BeforeValidator, Field

from ..runtime.placement import fit_blocks
from ..spec_types import SpecBase, StrictModel, _as_list
from .base import Buffer, OpFamily, one_kernel_abi
from .collectives import from_f64, to_f64
from .conventions import Baseline, BenchCase, BenchConventions, rel_err, sample_rows

# sm_90: at most 227 KiB of shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin)
SMEM_LIMIT = 232448
# 1024-byte alignment of the swizzled tiles is done by hand: the dynamic shared
# memory base is only 16-byte aligned
SMEM_ALIGN_SLACK = 1024
# fp32 accumulators one consumer thread can hold without spilling (of 232 registers)
MAX_ACCUMULATORS = 128
# one epilogue chunk: 64 rows x 64 columns of C, two per consumer warpgroup in flight
EPILOGUE_CHUNK_BYTES = 64 * 64 * 2


class GemmTile(StrictModel):
    """CTA tile: each CTA computes tile.m x tile.n of C, tile.k of K per pipeline stage."""

    m: int = Field(128, ge=64, le=256, multiple_of=64,
                   description="rows of C per CTA; split over the consumer warpgroups, 64 rows per wgmma")
    n: Literal[64, 128, 192, 256] = Field(256, description="columns of C per CTA (the wgmma N)")
    k: Literal[64] = Field(64, description="K per stage: one 128-byte swizzle row of 16-bit elements")


class GemmCluster(StrictModel):
    """Thread-block cluster: 2 CTAs that share an operand tile through TMA multicast."""

    size: Literal[1, 2] = Field(2, description="CTAs per cluster (1 = no cluster)")
    along: Literal["m", "n"] = Field(
        "m", description="m: the 2 CTAs take adjacent row tiles and share the B tile; "
        "n: adjacent column tiles sharing the A tile")


class GemmParams(StrictModel):
    n: int = Field(8192, ge=64, le=1 << 20, description="columns of B and C (compile-time)")
    k: int = Field(8192, ge=64, le=1 << 20, description="columns of A, rows of B (compile-time)")
    tile: GemmTile = GemmTile()
    stages: int = Field(4, ge=2, le=8, description="shared-memory pipeline depth (A and B tiles in flight)")
    cluster: GemmCluster = GemmCluster()
    swizzle: Literal[128] = Field(128, description="shared-memory swizzle of the TMA tiles, in bytes")
    raster_group: int = Field(
        8, ge=1, le=64, description="tiles are visited in groups of this many (cluster) row tiles, "
        "down the group's rows first, so CTAs running at the same time share A and B tiles in L2")


class GemmLaunch(StrictModel):
    """Launch shape of the persistent kernel."""

    blocks: int = Field(132, ge=1, le=1024,
                        description="CTAs at most (persistent); the launcher also caps it at what is "
                        "resident on the device (one CTA per SM) and at the number of tiles")
    threads: Literal[256, 384] = Field(
        384, description="one producer warpgroup + 1 (256) or 2 (384) consumer warpgroups")


class GemmSpec(SpecBase):
    """Spec of op `gemm`: C (M x N) = A (M x K) . B (K x N), row-major, fp32 accumulation."""

    op: Literal["gemm"]
    world_sizes: Annotated[
        list[Literal[1]], BeforeValidator(_as_list), Field(min_length=1, max_length=1)
    ] = Field(description="a gemm runs on one GPU: [1]")
    dtype: Literal["bfloat16", "float16"] = Field("bfloat16", description="A, B and C element type")
    params: GemmParams = GemmParams()
    launch: GemmLaunch = GemmLaunch()


def consumers(spec: GemmSpec) -> int:
    return spec.launch.threads // 128 - 1


def smem_bytes(spec: GemmSpec) -> int:
    """Dynamic shared memory: the stages, the epilogue buffers, the barriers, alignment slack
    (the same sum as tsgen::gemm::Layout in the header, which static_asserts it)."""
    t = spec.params.tile
    stage = (t.m * t.k + t.k * t.n) * 2
    epilogue = consumers(spec) * 2 * EPILOGUE_CHUNK_BYTES
    barriers = 2 * spec.params.stages * 8
    return spec.params.stages * stage + epilogue + barriers + SMEM_ALIGN_SLACK


class GemmBench(BenchConventions):
    """Size = M (rows of A and C; N and K are the spec's). FLOPs = 2 M N K; device memory at
    least A, B and C once. Baseline: cuBLAS (torch.matmul of the same shapes and dtype, on the
    same stream). Calls are timed eagerly (each is >= 100 us: launch gaps do not matter, and the
    host launcher's per-call work stays in the loop). The timed C is checked on sampled rows
    against a float32 product of the same 16-bit inputs."""

    kind = "gemm"
    size_unit = "rows"
    default_sizes = "4096,8192,16384"
    metric = "TFLOPs"
    baselines = (Baseline("cublas", "cublas", in_process=True),)
    graphs = False
    counts_calls = False  # one kernel, no call counter
    check = "rows"

    def case(self, family, spec, world, size):
        p = spec.params
        return BenchCase(size, size, flops=2.0 * size * p.n * p.k, hbm_bytes=2.0 * (size * p.k + p.k * p.n + size * p.n))

    def check_rows(self, family, spec, world, count, fetch):
        p = spec.params
        b = to_f64(fetch("b", 0, 0, p.k * p.n), spec.dtype).astype(np.float32).reshape(p.k, p.n)
        rows = sample_rows(count)
        a = np.stack([to_f64(fetch("a", 0, i * p.k, (i + 1) * p.k), spec.dtype) for i in rows]).astype(np.float32)
        c = np.stack([to_f64(fetch("c", 0, i * p.n, (i + 1) * p.n), spec.dtype) for i in rows])
        return rel_err(c, a @ b)


class GemmFamily(OpFamily):
    kind = "gemm"
    Spec = GemmSpec
    template = "gemm.cu.j2"
    category = "compute"
    gpu_sweep = None  # tests/test_gemm_gpu.py
    variant_worlds = ()
    min_world = 1
    count_unit = "rows"  # M
    host_launch = True  # TMA descriptors are encoded on the host
    bench = GemmBench()
    summary = (
        "C = A . B on one Hopper GPU: TMA loads into a multistage mbarrier pipeline, wgmma by "
        "consumer warpgroups, fp32 accumulation, persistent tiles; M at run time"
    )

    def check(self, spec):
        p, t = spec.params, spec.params.tile
        problems = []
        if p.n % t.n:
            problems.append((("params", "n"), f"{p.n} is not a multiple of tile.n = {t.n}"))
        if p.k % t.k:
            problems.append((("params", "k"), f"{p.k} is not a multiple of tile.k = {t.k}"))
        c = consumers(spec)
        if t.m % (64 * c):
            problems.append((("params", "tile", "m"),
                             f"{t.m} rows do not split into 64-row wgmma blocks over {c} consumer warpgroups "
                             f"(launch.threads {spec.launch.threads}): use a multiple of {64 * c}"))
        else:
            acc = t.m // c // 64 * t.n // 2
            if acc > MAX_ACCUMULATORS:
                problems.append((("params", "tile"),
                                 f"{t.m} x {t.n} over {c} consumer warpgroup(s) needs {acc} fp32 accumulators "
                                 f"per thread; at most {MAX_ACCUMULATORS} fit in registers (use 2 consumers, "
                                 "launch.threads 384, or a smaller tile)"))
        need = smem_bytes(spec)
        if need > SMEM_LIMIT:
            problems.append((("params", "stages"),
                             f"{p.stages} stages of a {t.m} x {t.n} x {t.k} tile need {need} bytes of shared "
                             f"memory; sm_90 has {SMEM_LIMIT} per block: use fewer stages or a smaller tile"))
        cl = p.cluster
        if spec.launch.blocks % cl.size:
            problems.append((("launch", "blocks"),
                             f"{spec.launch.blocks} is not a multiple of the cluster size {cl.size}"))
        if cl.size == 2 and cl.along == "n" and p.n % (2 * t.n):
            problems.append((("params", "cluster", "along"),
                             f"a cluster along n takes 2 column tiles at a time: n = {p.n} is not a multiple "
                             f"of 2 x tile.n = {2 * t.n}"))
        if cl.size == 2 and cl.along == "m" and t.n < 128:
            problems.append((("params", "cluster", "along"),
                             "a cluster along m splits the shared B tile into 64-column boxes, one per CTA: "
                             "needs tile.n >= 128"))
        return problems

    def buffers(self, spec):
        p = spec.params
        return (
            Buffer("a", spec.dtype, "input", per_count=p.k),  # M x K row-major
            Buffer("b", spec.dtype, "input", per_count=0, fixed=p.k * p.n),  # K x N row-major
            Buffer("c", spec.dtype, "output", per_count=p.n),  # M x N row-major
        )

    def constants(self, spec):
        p = spec.params
        return {
            "N": p.n,
            "K": p.k,
            "TILE_M": p.tile.m,
            "TILE_N": p.tile.n,
            "TILE_K": p.tile.k,
            "STAGES": p.stages,
            "CONSUMERS": consumers(spec),
            "CLUSTER": p.cluster.size,
            "CLUSTER_ALONG_M": int(p.cluster.along == "m"),
            "RASTER_GROUP": p.raster_group,
            "THREADS": spec.launch.threads,
            "BLOCKS": spec.launch.blocks,
            "SMEM_BYTES": smem_bytes(spec),
        }

    def abi(self, spec):
        # `args` are the launcher's: every op's calling convention. The device kernel,
        # <kernel>_kernel, takes the TMA descriptors the launcher encodes, and M.
        return one_kernel_abi(self, spec, smem=smem_bytes(spec), constants=self.constants(spec))

    # -- reference ----------------------------------------------------------
    def make_inputs(self, spec, world, count, rng, pattern):
        """Normal random A and B; `pattern`: small integers that depend on the row / column
        (a misplaced tile of C then shows up), exact in 16 bits."""
        p = spec.params
        if pattern:
            i, j = np.arange(count * p.k), np.arange(p.k * p.n)
            a = ((i * 7 + i // p.k * 3) % 5 - 2).astype(np.float64)  # in [-2, 2]
            b = ((j * 5 + j // p.n) % 7 - 3).astype(np.float64)  # in [-3, 3]
        else:
            a, b = rng.standard_normal(count * p.k), rng.standard_normal(p.k * p.n)
        return {"a": [from_f64(a, spec.dtype)], "b": [from_f64(b, spec.dtype)]}

    def _product(self, spec, count, inputs) -> np.ndarray:
        p = spec.params

        def compute():
            a = to_f64(inputs["a"][0], spec.dtype).reshape(count, p.k)
            b = to_f64(inputs["b"][0], spec.dtype).reshape(p.k, p.n)
            return a @ b  # float64: the kernel's fp32 sums are compared within `tolerance`
        return self.once_per_inputs(inputs, (spec, count), compute)  # reference and tolerance share it

    def reference(self, spec, world, count, inputs):
        return {"c": [from_f64(self._product(spec, count, inputs).reshape(-1), spec.dtype)]}

    def tolerance(self, spec, world, count, inputs):
        """One unit in the last place of the 16-bit output (the kernel rounds an fp32 sum
        whose last bits differ from the float64 one), plus room for the fp32 sum's own
        rounding, which matters where C is near 0: 2^-16 of sqrt(K) max|a| max|b|."""
        c = self._product(spec, count, inputs).reshape(-1)
        ulp = 2.0**-7 if spec.dtype == "bfloat16" else 2.0**-10
        a = to_f64(inputs["a"][0], spec.dtype)
        b = to_f64(inputs["b"][0], spec.dtype)
        scale = np.sqrt(spec.params.k) * np.abs(a).max(initial=0) * np.abs(b).max(initial=0)
        return {"c": [ulp * np.abs(c) + 2.0**-16 * scale]}


FAMILIES: list[OpFamily] = [GemmFamily()]


def gemm_shared_fit(spec, colocated: int, sms: int) -> dict:
    """OpFamily.shared_fit for the GEMM-based ops of several ranks: persistent CTAs in whole
    clusters, each rank leaving SMs to the kernels beside its GEMM: its `reserve_sms`, or a
    quarter of its share of the GPU (an even number, at least 2) where those would leave the
    GEMM less than one cluster."""
    if colocated == 1:
        return {}
    p = spec.params
    room = sms // colocated
    reserve = p.reserve_sms if room - p.reserve_sms >= 2 else max(2, room // 4 // 2 * 2)
    blocks = fit_blocks(spec.launch.blocks, colocated, sms, multiple=p.cluster.size, reserve=reserve)
    updates = {"launch": {"blocks": blocks}} if blocks != spec.launch.blocks else {}
    return updates | ({"params": {"reserve_sms": reserve}} if reserve != p.reserve_sms else {})
