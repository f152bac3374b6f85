"""How the collectives are benchmarked (their `bench` conventions): nccl-tests' conventions.

A size is bytes, as nccl-tests counts them: allgather the whole output (world chunks),
reduce_scatter the whole input (world chunks), all_to_all, all_reduce and broadcast each
rank's buffer. algbw = bytes / time; busbw = algbw x the bus factor ((n-1)/n for allgather,
reduce_scatter and all_to_all, 2(n-1)/n for all_reduce, 1 for broadcast), which is also the
least a GPU must send (or receive) over its links per call: the NVLink ceiling bounds it.
Baselines: NCCL through torch.distributed (all_gather_into_tensor, reduce_scatter_tensor,
all_to_all_single, all_reduce, broadcast) and, for all_reduce, PyTorch SymmetricMemory's
one_shot_all_reduce / two_shot_all_reduce_; one process per GPU (tsgen/bench/nccl.py).
"""

from __future__ import annotations

from ...errors import RuntimeSetupError
from ..conventions import Baseline, BenchCase, BenchConventions

NCCL = Baseline("nccl", "collectives")  # the collective through NCCL, one process per GPU (tsgen/bench/nccl.py)
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4}
# op -> the torch.distributed call the NCCL baseline makes
NCCL_CALLS = {"allgather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
              "all_to_all": "all_to_all_single", "all_reduce": "all_reduce", "broadcast": "broadcast"}


def busbw_factor(op: str, world: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth."""
    n = int(world)
    if op in ("allgather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"op {op!r}: no nccl-tests convention")


def nccl_counts(op: str, nbytes: int, item: int, world: int) -> tuple[int, int]:
    """(input, output) elements per rank of a size in bytes; ValueError when it does not divide."""
    if op in ("allgather", "reduce_scatter", "all_to_all"):
        if nbytes % (world * item):
            raise ValueError(f"{op} size {nbytes} B: must be a multiple of world x itemsize = "
                             f"{world} x {item} = {world * item} B")
        total = nbytes // item
        return {"allgather": (total // world, total), "reduce_scatter": (total, total // world)}.get(op, (total, total))
    if op not in NCCL_CALLS:
        raise ValueError(f"op {op!r}: no nccl-tests convention")
    if nbytes % item:
        raise ValueError(f"{op} size {nbytes} B: must be a multiple of the {item}-byte itemsize")
    return nbytes // item, nbytes // item


def tsgen_count(op: str, nbytes: int, item: int, world: int) -> int:
    """tsgen's `count` (elements per rank of the smaller side, per peer for all_to_all)."""
    n_in, n_out = nccl_counts(op, nbytes, item, world)
    return {"reduce_scatter": n_out, "all_to_all": n_in // world}.get(op, n_in)


class CollectiveBench(BenchConventions):
    kind = "collective"
    size_unit = "bytes"
    default_sizes = "64K,1M,16M,256M,1G"
    metric = "busbw_GBps"
    baselines = (NCCL,)

    def nccl_op(self, family) -> str:
        """The collective whose NCCL call is the baseline."""
        return family.kind

    def case(self, family, spec, world, size):
        op, item = self.nccl_op(family), ITEMSIZE[spec.dtype]
        try:
            count = tsgen_count(op, size, item, world)
        except ValueError as e:
            raise RuntimeSetupError(f"{spec.name}: {e}") from None
        factor = busbw_factor(op, world)
        return BenchCase(size, count, link_bytes=size * factor, bw_bytes=size, busbw_factor=factor)


class AllReduceBench(CollectiveBench):
    baselines = (NCCL, Baseline("symm_mem", "collectives"))
