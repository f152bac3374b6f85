"""How an op is benchmarked: the conventions each family states for itself.

`tsgen bench` knows no op by name. A family's `bench` attribute (a `BenchConventions`)
says what a size means (bytes, nccl-tests style, or rows M of a GEMM), which `count` a size
gives, how many FLOPs and bytes one call does per GPU (the ceilings guard turns them into a
time no correct run can beat), which bandwidth it reports (algbw bytes and the bus-bandwidth
factor), which baselines it is compared with, whether its calls may be timed as CUDA graph
replays, and how its timed outputs are checked. Each family module defines its own subclass
next to its schema and reference; tests and tools select ops by these attributes (`kind`,
`baselines`, ...), never by lists of names. Pure: nothing here touches a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np

# fetch(buffer, rank, start, stop) -> the buffer's elements [start, stop) of `rank`, on the host
Fetch = Callable[[str, int, int, int], np.ndarray]


@dataclass(frozen=True)
class Baseline:
    """One implementation an op is timed against, stated by the op's family: its name (in the
    rows, the ratios and the NCCL runner's backends), the function of tsgen/bench/baselines.py
    that times it (imported by `tsgen bench` only: nothing here touches a GPU), and whether it
    runs in tsgen's process on tsgen's streams after each size (its function takes the Step) or
    one process per GPU after all sizes (its function takes names, family, spec, world, sizes,
    iters, reps, warmup; a function that several baselines share runs once for all of them)."""

    name: str
    runner: str
    in_process: bool = False


def baseline_names(baselines: tuple[Baseline, ...]) -> tuple[str, ...]:
    return tuple(b.name for b in baselines)


@dataclass(frozen=True)
class BenchCase:
    """One size of one op on one world: what one call is and does, per GPU."""

    size: int  # in the family's `size_unit`
    count: int  # the kernel's run-time `count` for this size
    flops: float = 0.0  # floating-point operations per GPU per call
    link_bytes: float = 0.0  # bytes per GPU per call over NVLink, in one direction (at least)
    hbm_bytes: float = 0.0  # bytes per GPU per call through device memory (at least)
    bw_bytes: float = 0.0  # the bytes of the algorithm bandwidth (0: no bandwidth column)
    busbw_factor: float = 1.0  # bus bandwidth = algbw x this (nccl-tests)
    note: str = ""
    fields: tuple = ()  # (name, value) pairs `tsgen bench` adds to tsgen's row (e.g. bytes moved vs the minimum)


class BenchConventions:
    """Defaults: a latency benchmark of `count` in the family's own unit, no baseline."""

    kind: ClassVar[str] = "latency"  # copy | collective | gemm | fused | grid | latency
    size_unit: ClassVar[str] = "count"  # what --sizes means: bytes | rows | count (the family's count_unit)
    default_sizes: ClassVar[str | None] = None  # None: the spec's test.count
    metric: ClassVar[str] = "time_us"  # headline column: busbw_GBps | GBps | TFLOPs | time_us
    baselines: ClassVar[tuple[Baseline, ...]] = ()  # what the op is timed against (Baseline)
    patterns: ClassVar[tuple[str, ...]] = ("all",)  # which ranks run: all | pair (rank 0 only) | ring
    graphs: ClassVar[bool] = True  # time CUDA graph replays of back-to-back calls where capture works
    interleave: ClassVar[bool] = False  # tsgen and its in-process baselines timed in rounds (--reps of them), paired ratios
    counts_calls: ClassVar[bool] = True  # the module advances its device call counter once per call
    check: ClassVar[str] = "exact"  # exact: the NumPy reference of every output; rows: sampled GEMM rows
    check_up_to: ClassVar[int] = 64 << 20  # exact: checked while one rank's inputs are at most this many bytes
    fill_on_device: ClassVar[bool] = True  # above check_up_to: random inputs made on the GPU (else NumPy's)

    def case(self, family: Any, spec: Any, world: int, size: int) -> BenchCase:
        moved = family.bytes_moved(spec, world, size)
        return BenchCase(size, size, link_bytes=moved, bw_bytes=moved)

    def bench_inputs(self, family: Any, spec: Any, world: int, count: int, rng) -> dict:
        """Per-rank NumPy inputs of a timed call (default: the family's random inputs)."""
        return family.make_inputs(spec, world, count, rng, pattern=False)

    def checked_ranks(self, family: Any, spec: Any, world: int, pattern: str) -> list[int]:
        """Ranks whose outputs a call of `pattern` writes (all of them but for copies' pair)."""
        return list(range(world))

    def group_shape(self, spec: Any) -> str:
        """What besides op, dtype and world makes rows time the same work (rows-checked GEMMs: the
        compile-time N and K)."""
        return f"/n{spec.params.n}/k{spec.params.k}" if self.check == "rows" else ""

    def check_rows(self, family: Any, spec: Any, world: int, count: int, fetch: Fetch) -> float:
        """check "rows": the largest ||got - ref|| / ||ref|| over sampled output rows (inf for NaN)."""
        raise NotImplementedError


def sample_rows(rows: int) -> list[int]:
    """Output rows a GEMM check compares: the first and last of the first tile, a middle one,
    and the last (the M tail), each once."""
    picks = [0, min(127, rows - 1), rows // 2, rows - 1]
    return sorted(set(p for p in picks if 0 <= p < rows))


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """||got - ref|| / ||ref||; inf where got holds a NaN or inf (a poisoned element)."""
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(float(np.linalg.norm(ref)), 1e-30))
