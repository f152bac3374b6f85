"""Fused compute + communication GEMMs on Hopper (sm_90a): `allgather_gemm`.

allgather_gemm: A is row-sharded over the ranks (rank r holds A_r, M_local x K), B
and C are sharded by columns (rank r holds B_r, K x N_local, and computes
C_r = allgather(A) . B_r, (world x M_local) x N_local, source s's rows at
s x M_local). The run-time `count` is M_local; N_local (`params.n`) and K are
compile-time. The GEMM is the `gemm` op's kernel (templates/include/tsgen_gemm.cuh)
with one batch per source rank and a hook in its producer
(templates/include/tsgen_fused.cuh):

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

from ..spec import SpecBase, WorldSizes
from .base import CALLS, LEADING_ARGS, Arg, Buffer, Kernel, OpFamily, Plan
from .collectives import from_f64, to_f64
from .gemm import GemmFamily, GemmLaunch, GemmParams, smem_bytes

MAX_WORLD = 8  # tsgen_fused::MAX_WORLD
SIGNALS = 2 * MAX_WORLD  # tsgen_fused::SIGNALS


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


class AllgatherGemmFamily(OpFamily):
    kind = "allgather_gemm"
    Spec = AllgatherGemmSpec
    template = "allgather_gemm.cu.j2"
    count_unit = "rows"  # M_local
    host_launch = True
    summary = ("C_r = allgather(A) . B_r: A row-sharded, B and C column-sharded; the gather on the copy "
               "engine, overlapped with a TMA + wgmma GEMM whose tiles wait per source rank")

    def check(self, spec):
        problems = GemmFamily().check(spec)
        if max(spec.world_sizes) > MAX_WORLD:
            problems.append((("world_sizes",), f"at most {MAX_WORLD} ranks"))
        if spec.params.overlap != "none" and spec.params.reserve_sms % spec.params.cluster.size:
            problems.append((("params", "reserve_sms"),
                             f"{spec.params.reserve_sms} is not a multiple of the cluster size "
                             f"{spec.params.cluster.size}"))
        return problems

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

    def plan(self, spec):
        buffers = (CALLS,) + self.buffers(spec)
        args = tuple(Arg(n, t, r) for n, t, r in LEADING_ARGS) + tuple(
            Arg(b.name, f"{b.ctype}*", "buffer") for b in buffers if b is not CALLS)
        # the launcher also addresses peers' a_full for cudaMemcpyAsync: the host copy of the table
        launcher_args = args[:1] + (Arg("peers_host", "char* const*", "peers_host"),) + args[1:]
        kernels = tuple(
            Kernel(name=f"{spec.name}_w{w}", world_size=w, grid=spec.launch.blocks, block=spec.launch.threads,
                   smem=smem_bytes(spec), args=args, launcher_args=launcher_args)
            for w in spec.world_sizes)
        return Plan(self, spec, buffers, kernels, self.constants(spec))

    # -- reference ----------------------------------------------------------
    def template_vars(self, spec):
        args = self.plan(spec).kernels[0].launcher_args
        return {"launcher_params": ", ".join(f"{a.ctype} {a.name}" for a in args)}

    def make_inputs(self, spec, world, count, rng, pattern):
        p = spec.params
        a, b = [], []
        for r in range(world):
            if pattern:  # small integers (exact in 16 bits) that depend on rank, row and column
                i, j = np.arange(count * p.k), np.arange(p.k * p.n)
                av = ((i * 7 + i // p.k * 3 + r * 5) % 5 - 2).astype(np.float64)
                bv = ((j * 5 + j // p.n + r * 3) % 7 - 3).astype(np.float64)
            else:
                av, bv = rng.standard_normal(count * p.k), rng.standard_normal(p.k * p.n)
            a.append(from_f64(av, spec.dtype))
            b.append(from_f64(bv, spec.dtype))
        return {"a": a, "b": b}

    def product(self, spec, world, count, inputs, r) -> np.ndarray:
        p = spec.params
        full = np.concatenate([to_f64(inputs["a"][s], spec.dtype).reshape(count, p.k) for s in range(world)])
        return full @ to_f64(inputs["b"][r], spec.dtype).reshape(p.k, p.n)

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


FAMILIES: list[OpFamily] = [AllgatherGemmFamily()]
