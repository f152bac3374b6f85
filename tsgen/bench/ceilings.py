"""Ceilings per device, and the guard that turns an impossible timing into an error.

A timed call does at least `BenchCase.flops` floating-point operations on a GPU, moves at
least `link_bytes` over its NVLink links in one direction and `hbm_bytes` through its device
memory (tsgen/ops/conventions.py). Divided by the device's ceilings, each gives a time no
correct run can beat; the largest is the floor. A result faster than its floor is above its
ceiling: the timing bracketed less than the work (events on another stream than the calls,
a skipped launch, an output nobody wrote), and `tsgen bench` reports it as an error, never as
a table row (tsgen/bench/runner.py).

Ceilings come from the datasheet (the vendor's number, with where it is from) or, for the
matrix rate, from the device itself: SMs x dense FLOP per clock per SM of its architecture x
its maximum clock (cudaDeviceProp.clockRate), which is above the datasheet's number (taken at
a lower boost clock), so a guard never fires on a legitimately fast run. Measured numbers on
the lent machines sit below these (tsgen's NOTES.md; /work/.library/device/KINDS.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import RuntimeSetupError

# Dense FLOP per clock per SM by compute capability and dtype. sm_90: H100 SXM's datasheet
# 989.4 TFLOP/s dense bf16/fp16 = 132 SMs x 4096 x 1.83 GHz; tf32 half of it, fp8 double,
# plain fp32 128 FMA (256 FLOP). sm_80: A100's 312 TFLOP/s bf16 = 108 SMs x 2048 x 1.41 GHz.
PER_SM_CLOCK = {
    (9, 0): {"bfloat16": 4096, "float16": 4096, "tf32": 2048, "fp8": 8192, "float32": 256},
    (8, 0): {"bfloat16": 2048, "float16": 2048, "tf32": 1024, "float32": 128},
}


@dataclass(frozen=True)
class Memory:
    """Datasheet HBM and NVLink bandwidth of one device model (GB/s; NVLink per direction)."""

    pattern: str  # regular expression on the device name (cudaDeviceProp.name)
    model: str
    hbm_GBps: float
    hbm_source: str
    nvlink_GBps: float
    nvlink_source: str


# First match wins: the more specific names first.
MEMORY = [
    Memory(r"H200", "H200 SXM", 4800.0, "NVIDIA H200 datasheet: 4.8 TB/s HBM3e", 478.0,
           "18 NVLink 4 links x 26.56 GB/s per direction (signalling rate per link, nvidia-smi nvlink -s on "
           "the lent 4xH200, NOTES.md 2026-11-21); datasheet 900 GB/s both directions"),
    Memory(r"H100.*PCIe", "H100 PCIe", 2000.0, "NVIDIA H100 datasheet: 2.0 TB/s HBM2e", 300.0,
           "NVLink bridge: 600 GB/s both directions (datasheet)"),
    Memory(r"H100 NVL", "H100 NVL", 3900.0, "NVIDIA H100 NVL datasheet: 3.9 TB/s HBM3", 300.0,
           "NVLink bridge: 600 GB/s both directions (datasheet)"),
    Memory(r"H100", "H100 SXM", 3350.0, "NVIDIA H100 datasheet: 3.35 TB/s HBM3", 478.0,
           "18 NVLink 4 links x 26.56 GB/s per direction; datasheet 900 GB/s both directions"),
    Memory(r"A100", "A100 SXM", 2039.0, "NVIDIA A100 80GB datasheet: 2,039 GB/s HBM2e", 300.0,
           "12 NVLink 3 links x 25 GB/s per direction (datasheet 600 GB/s both directions)"),
]


@dataclass(frozen=True)
class Device:
    """What the ceilings need of a GPU (tsgen.bench.results.device_info reads it)."""

    name: str
    sms: int
    clock_khz: int  # maximum SM clock
    cc: tuple[int, int]
    l2_bytes: int


@dataclass(frozen=True)
class Ceilings:
    model: str
    tflops: dict  # dense TFLOP/s per dtype
    hbm_GBps: float
    nvlink_GBps: float  # per direction per GPU
    sources: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"model": self.model, "tflops": self.tflops, "hbm_GBps": self.hbm_GBps,
                "nvlink_GBps_per_direction": self.nvlink_GBps, "sources": self.sources}


def ceilings_for(dev: Device) -> Ceilings:
    """The ceilings of `dev`; RuntimeSetupError when the table has none (add it, with a source)."""
    mem = next((m for m in MEMORY if re.search(m.pattern, dev.name)), None)
    rates = PER_SM_CLOCK.get(tuple(dev.cc))
    if mem is None or rates is None:
        raise RuntimeSetupError(
            f"no ceilings for {dev.name!r} (compute capability {dev.cc[0]}.{dev.cc[1]}): tsgen bench refuses to "
            "report numbers it cannot bound; add the device to tsgen/bench/ceilings.py (MEMORY: HBM and NVLink "
            "bandwidth with their source; PER_SM_CLOCK: its matrix rate)")
    clock = dev.clock_khz * 1e3
    tflops = {dt: dev.sms * per * clock / 1e12 for dt, per in rates.items()}
    src = (f"{dev.sms} SMs x dense FLOP/clock/SM of sm_{dev.cc[0]}{dev.cc[1]} ({rates['bfloat16']} for bf16) x "
           f"{dev.clock_khz / 1e3:.0f} MHz (the device's maximum clock)")
    return Ceilings(mem.model, tflops, mem.hbm_GBps, mem.nvlink_GBps,
                    {"tflops": src, "hbm": mem.hbm_source, "nvlink": mem.nvlink_source})


@dataclass(frozen=True)
class Floor:
    us: float  # no correct call is faster
    term: str  # which ceiling binds, in words


def floor(case, ceil: Ceilings, dtype: str, colocated: int = 1, l2_bytes: int = 0) -> Floor:
    """The fastest time per call that the ceilings allow. Ranks sharing a GPU (`colocated` > 1)
    share its matrix units and memory, and their "peer" traffic never leaves it: the compute
    and memory terms count every co-located rank, NVLink none. Device-memory bytes count only
    when one call's footprint exceeds the L2 (smaller ones may be served from it)."""
    terms = [Floor(0.0, "none")]
    if case.flops:
        rate = ceil.tflops.get(dtype, ceil.tflops["bfloat16"])
        terms.append(Floor(case.flops * colocated / (rate * 1e12) * 1e6,
                           f"matrix-rate ceiling ({rate:.0f} TFLOP/s {dtype})"))
    if case.link_bytes and colocated == 1:
        terms.append(Floor(case.link_bytes / (ceil.nvlink_GBps * 1e9) * 1e6,
                           f"NVLink ceiling ({ceil.nvlink_GBps:.0f} GB/s per direction)"))
    if case.hbm_bytes and case.hbm_bytes > l2_bytes:
        terms.append(Floor(case.hbm_bytes * colocated / (ceil.hbm_GBps * 1e9) * 1e6,
                           f"device-memory ceiling ({ceil.hbm_GBps:.0f} GB/s)"))
    return max(terms, key=lambda f: f.us)


def guard(what: str, time_us: float, case, ceil: Ceilings, dtype: str, colocated: int = 1,
          l2_bytes: int = 0) -> list[str]:
    """Problems with one timed result ([] when it is possible)."""
    f = floor(case, ceil, dtype, colocated, l2_bytes)
    if time_us < f.us:
        return [f"{what}: {time_us:.2f} us per call is faster than the {f.term} allows ({f.us:.2f} us "
                f"on {ceil.model}): the result is above its ceiling, so the timing bracketed less than the "
                "work (events on another stream than the calls? a skipped launch?)"]
    return []


def fraction_of_ceiling(time_us: float, case, ceil: Ceilings, dtype: str, colocated: int = 1,
                        l2_bytes: int = 0) -> float | None:
    """floor / time: how close a result is to its binding ceiling (None without one)."""
    f = floor(case, ceil, dtype, colocated, l2_bytes)
    return f.us / time_us if f.us > 0 and time_us > 0 else None
