"""Sizes and buffer rotation: how `--sizes` is read and printed, and how many buffer sets a
timing rotates over so that small sizes are not timed out of a hot L2."""

from __future__ import annotations

import math
import re

from ..errors import RuntimeSetupError

MiB = 1 << 20
DEFAULT_L2_BYTES = 50 * MiB  # H100's L2 (H200: 60 MB); the device's own value is used when known
ROTATE_BELOW = 64 * MiB  # per-set footprints from here up are larger than the L2 anyway
MAX_SLOTS = 4096  # buffer slots of one baseline allocation
SLOT_ALIGN = 4096  # bytes between the starts of rotation slots
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class BenchConfigError(RuntimeSetupError, ValueError):
    """Bad sizes, op, dtype, world or backend: found before anything runs."""


def parse_size(text: str) -> int:
    """`4096`, `64K`, `1M`, `2G` (powers of 1024; `KiB`, `KB`, `B` suffixes too)."""
    m = re.fullmatch(r"(\d+)\s*([KMG]?)(?:i?B)?", str(text).strip(), re.IGNORECASE)
    if not m:
        raise BenchConfigError(f"size {text!r}: write a number with an optional K, M or G suffix")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(text) -> list[int]:
    """`1M,256M` (a list), `1K:1G` (powers of two between) or `1M:1G:4` (factor 4); a list of
    ints passes through."""
    if isinstance(text, (list, tuple)):
        return [parse_size(str(t)) for t in text]
    if isinstance(text, int):
        return [text]
    text = str(text).strip()
    if ":" in text:
        parts = text.split(":")
        if len(parts) > 3 or (len(parts) == 3 and not parts[2].strip().isdigit()):
            raise BenchConfigError(f"sizes {text!r}: write LO:HI or LO:HI:FACTOR (FACTOR a whole number)")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 else 2
        if lo < 1 or factor < 2 or lo > hi:
            raise BenchConfigError(f"sizes {text!r}: need 1 <= LO <= HI and FACTOR >= 2")
        out = []
        while lo <= hi:
            out.append(lo)
            lo *= factor
        return out
    items = text.split(",")
    if not text or any(not t.strip() for t in items):
        raise BenchConfigError(f"sizes {text!r}: an empty entry; write e.g. 64K,1M,256M")
    return [parse_size(t) for t in items]


def human(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def rotation_slots(nbytes: int, footprint: int, l2_bytes: int = DEFAULT_L2_BYTES, rotate: bool = True,
                   most: int = MAX_SLOTS) -> int:
    """How many buffer sets to rotate over: 1 at or above 64 MiB (or with rotate off);
    otherwise enough that the sets together exceed 2x the L2 (taken as at least 50 MiB),
    at most `most`."""
    if not rotate or nbytes >= ROTATE_BELOW or footprint <= 0:
        return 1
    target = 2 * max(int(l2_bytes or 0), DEFAULT_L2_BYTES)
    return max(1, min(most, target // footprint + 1))


def calls_per_sample(iters: int, slots: int) -> int:
    """Calls per timed sample: at least `iters`, a whole number of rotations."""
    slots = max(1, int(slots))
    return slots * max(1, math.ceil(max(1, int(iters)) / slots))


def slot_stride(n: int, item: int) -> int:
    """Elements between rotation slots: n rounded up to SLOT_ALIGN bytes."""
    per = max(1, SLOT_ALIGN // item)
    return -(-max(1, n) // per) * per
