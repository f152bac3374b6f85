"""all_to_all_v: per-peer counts given at run time (MoE dispatch, sequence parallelism).

Every rank holds the same `counts` matrix (counts[i][j] = elements rank i sends
to rank j; an all-gather of the per-rank split sizes produces it). Rank i's
send buffer holds its segments back to back in peer order; rank j receives
them back to back in source order, and the rest of its receive buffer is
zeroed, so every element of the output is defined. The run-time `count` is
the capacity: the most elements one rank may send to one peer; a larger
entry in `counts` makes the kernel stop with a message naming it.

Not a plan: the offsets depend on run-time data, so `tsgen verify` has
nothing to check; the GPU tests compare with the NumPy reference.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ..runtime.placement import fit_blocks
from ..spec_types import SpecBase, StrictModel
from .base import Buffer, OpFamily
from .collectives import CollectiveDtype, _values
from .collectives.bench import CollectiveBench


class AllToAllVBench(CollectiveBench):
    """Timed with every entry of `counts` full (each pair sends the capacity): the same bytes
    as all_to_all, whose NCCL call (all_to_all_single) is the baseline; size = each rank's
    send buffer in bytes, world x count elements."""

    fill_on_device = False  # the counts must stay a valid matrix

    def nccl_op(self, family):
        return "all_to_all"

    def bench_inputs(self, family, spec, world, count, rng):
        wmax = max(spec.world_sizes)
        flat = np.zeros(wmax * wmax, dtype=np.int32)
        flat[: world * world] = count
        src = [_values(spec.dtype, world * count, rng, False, r) for r in range(world)]
        return {"counts": [flat.copy() for _ in range(world)], "src": src}


class AllToAllVParams(StrictModel):
    blocks_per_peer: int = Field(8, ge=1, le=64, description="blocks that copy to each peer (the local copy too)")


class AllToAllVSpec(SpecBase):
    """Spec of collective `all_to_all_v`."""

    op: Literal["all_to_all_v"]
    dtype: CollectiveDtype = "bfloat16"
    params: AllToAllVParams = AllToAllVParams()


class AllToAllVFamily(OpFamily):
    kind = "all_to_all_v"
    summary = ("rank i sends counts[i][j] elements to rank j (run-time counts, packed segments); "
               "count = capacity per pair")
    Spec = AllToAllVSpec
    template = "all_to_all_v.cu.j2"
    category = "collective"
    gpu_sweep = "collective"
    variant_worlds = (2, 3, 4, 8)
    blocks_wait = True
    bench = AllToAllVBench()

    def check(self, spec):
        need = max(spec.world_sizes) * spec.params.blocks_per_peer
        if spec.launch.blocks < need:
            return [(("launch", "blocks"), f"needs world x blocks_per_peer = {need} blocks "
                     f"(world size {max(spec.world_sizes)}), not {spec.launch.blocks}")]
        if spec.launch.blocks > 132:
            return [(("launch", "blocks"), "its blocks wait on peers: at most 132 (one per SM)")]
        return []

    def shared_fit(self, spec, colocated, sms):
        """Fewer blocks per peer where world x blocks_per_peer no longer fits a rank's SMs."""
        world = max(spec.world_sizes)
        blocks = fit_blocks(spec.launch.blocks, colocated, sms, floor=world)
        per_peer = min(spec.params.blocks_per_peer, blocks // world)
        updates = {"launch": {"blocks": blocks}} if blocks != spec.launch.blocks else {}
        return updates | ({"params": {"blocks_per_peer": per_peer}} if per_peer != spec.params.blocks_per_peer else {})

    def buffers(self, spec):
        wmax = max(spec.world_sizes)
        return (
            Buffer("counts", "int32", "input", per_count=0, fixed=wmax * wmax),
            Buffer("src", spec.dtype, "input", per_count=0, per_world_count=1),
            Buffer("dst", spec.dtype, "output", per_count=0, per_world_count=1),
            Buffer("entry", "uint64", "signal", per_count=0, fixed=wmax),
            Buffer("arrive", "uint64", "signal", per_count=0, fixed=wmax),
        )

    def constants(self, spec):
        return {"BLOCKS_PER_PEER": spec.params.blocks_per_peer}

    def template_vars(self, spec):
        return {"plan_header": True, "copy_engine": False}  # tsgen_copy_elems lives in tsgen/plan.cuh

    def make_inputs(self, spec, world, count, rng, pattern):
        counts = rng.integers(0, count + 1, size=(world, world), dtype=np.int64)
        if count:  # the edges: an empty segment and a full one
            counts[0, 1 % world] = 0
            counts[world - 1, 0] = count
        flat = np.zeros(max(spec.world_sizes) ** 2, dtype=np.int32)
        flat[: world * world] = counts.reshape(-1)
        src = []
        for r in range(world):
            data = _values(spec.dtype, world * count, rng, pattern, r)
            data[counts[r].sum():] = 0  # beyond the packed segments: not sent
            src.append(data)
        return {"counts": [flat.copy() for _ in range(world)], "src": src}

    def reference(self, spec, world, count, inputs):
        counts = inputs["counts"][0][: world * world].astype(np.int64).reshape(world, world)
        out = []
        for q in range(world):
            parts = []
            for j in range(world):
                start = counts[j, :q].sum()
                parts.append(inputs["src"][j][start:start + counts[j, q]])
            got = np.concatenate(parts)
            full = np.zeros(world * count, dtype=inputs["src"][0].dtype)
            full[: got.size] = got
            out.append(full)
        return {"dst": out}

    def bytes_moved(self, spec, world, count):
        return count * (world - 1) * (2 if spec.dtype in ("bfloat16", "float16") else 4)


FAMILIES: list[OpFamily] = [AllToAllVFamily()]
