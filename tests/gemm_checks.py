"""Correctness checks of the `gemm` op on a GPU, beyond `tsgen test` (moved from the retired
tools/gpu_gemm.py; its timing part is `tsgen bench --suite gemm` / `gemm-tune` now):

For every M in MS, fresh random A (and B) on the GPU, C poisoned with a NaN pattern before
every one of CALLS back-to-back calls through the runtime (World(1), module.alloc,
module.launch), then ||C - ref|| / ||ref|| <= 1e-2 against a float32 cuBLAS product of the same
16-bit inputs, and no poisoned element left. Also the host launcher called directly with C
inside a larger allocation whose rows >= M hold a sentinel: the kernel must not write them.
VARIANTS are spec changes (nested dicts merge) rendered into OUT/build.
Used by tests/test_gemm_gpu.py (and its CPU parts by tests/test_gemm_cpu.py).
"""

from __future__ import annotations

import ctypes
import json
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "specs" / "gemm_bf16.yaml"
MS = [1, 77, 129, 257, 461, 8192 + 77]
CALLS = 20
MAX_REL_ERR = 1e-2

# name -> changes to the shipped spec (nested dicts merge)
VARIANTS = {
    "shipped": {},
    "no_cluster": {"params": {"cluster": {"size": 1}}},
    "cluster_n": {"params": {"cluster": {"size": 2, "along": "n"}}},
    "tile_256x128": {"params": {"tile": {"m": 256, "n": 128}}},
    "one_consumer": {"params": {"tile": {"m": 128, "n": 128}, "stages": 6}, "launch": {"threads": 256}},
    "fp16": {"dtype": "float16"},
    "raster_4": {"params": {"raster_group": 4}},
    "raster_16": {"params": {"raster_group": 16}},
}
CHECK_VARIANTS = ["shipped", "no_cluster", "cluster_n", "tile_256x128", "one_consumer", "fp16"]



def variant_manifest(out: Path, name: str, timeout_ms: int | None) -> Path:
    """Render the shipped spec with VARIANTS[name] applied into OUT/build; the manifest path."""
    from tsgen.render import render, write_if_different
    from tsgen.spec import load_spec, merge, spec_variant

    updates = merge(VARIANTS[name], {} if name == "shipped" else {"name": f"gemm_{name}"})
    if timeout_ms is not None:
        updates = merge(updates, {"sync": {"timeout_ms": timeout_ms}})
    rendered = render(spec_variant(load_spec(SPEC), updates), base=ROOT)
    for file, text in rendered.files().items():
        write_if_different(out / "build" / "generated" / file, text)
    return out / "build" / "generated" / f"{rendered.name}.json"


def to_f32(cp, bits, dtype: str):
    """16-bit values (as stored: uint16 bits) -> float32."""
    if dtype == "bfloat16":
        return (bits.astype(cp.uint32) << 16).view(cp.float32)
    return bits.view(cp.float16).astype(cp.float32)


def from_f32(cp, x, dtype: str):
    """float32 -> 16-bit bits (round to nearest even)."""
    if dtype == "bfloat16":
        u = x.view(cp.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)
    return x.astype(cp.float16).view(cp.uint16)


def bits16(bufs, name: str, rank: int = 0):
    """Buffer `name` of `rank` as its 16-bit patterns (uint16), whatever the dtype. The
    runtime's view of a float16 buffer is a float16 array (bfloat16 travels as uint16):
    writing from_f32's bits into that view would convert the bit patterns as numbers
    (0x3C00 -> 15360.0), which is what made the fp16 variant fail in run 3."""
    return bufs.array(name, rank).view("uint16")


def nan_poison(call: int, dtype: str) -> int:
    """A NaN bit pattern that changes with the call: no finite product is ever equal to it."""
    return (0x7F80 if dtype == "bfloat16" else 0x7C00) | (0x41 + call % 60)


# ---------------------------------------------------------------------------
# Child: correctness of one variant
# ---------------------------------------------------------------------------


def check_variant(manifest: Path, ms: list[int], calls: int, echo=print) -> dict:
    """CALLS back-to-back calls per M through the runtime, plus the guard-row check."""
    import cupy as cp

    from tsgen.runtime import World

    m = json.loads(manifest.read_text())
    dtype, consts = m["buffers"][1]["dtype"], m["constants"]
    n, k = consts["N"], consts["K"]
    rows_out = []
    ok = True
    with World(1) as world:
        module = world.load(manifest)
        with cp.cuda.Device(world.devices[0]):
            rng = cp.random.default_rng(1234)
            for rows in ms:
                t0 = time.perf_counter()
                bufs = module.alloc(rows)
                try:
                    a, b, c = (bits16(bufs, x) for x in "abc")
                    b[...] = from_f32(cp, rng.standard_normal(k * n, dtype=cp.float32), dtype)
                    b32 = to_f32(cp, b, dtype).reshape(k, n)
                    errs, poisoned = [], []
                    for call in range(calls):
                        a[...] = from_f32(cp, rng.standard_normal(rows * k, dtype=cp.float32), dtype)
                        poison = nan_poison(call, dtype)
                        c[...] = poison
                        module.launch(bufs)
                        ref = to_f32(cp, a, dtype).reshape(rows, k) @ b32
                        got = to_f32(cp, c, dtype).reshape(rows, n)
                        poisoned.append(cp.count_nonzero(c == poison))
                        bad = ~cp.isfinite(got)
                        diff = cp.where(bad, 0, got - ref)
                        errs.append(cp.linalg.norm(diff) / cp.maximum(cp.linalg.norm(ref), 1e-30)
                                    + cp.count_nonzero(bad))  # a NaN / inf anywhere fails the call
                    world.synchronize()
                    err = max(float(e) for e in errs)
                    left = max(int(p) for p in poisoned)
                finally:
                    bufs.free()
                guard = guard_rows(manifest, rows, n, k)
                passed = err <= MAX_REL_ERR and left == 0 and guard == 0
                ok &= passed
                rows_out.append({"m": rows, "calls": calls, "max_rel_err": err, "poison_left": left,
                                 "rows_past_m_written": guard, "pass": passed,
                                 "seconds": round(time.perf_counter() - t0, 2)})
                echo(f"  M={rows:5d}: {'PASS' if passed else 'FAIL'}  max rel err {err:.2e} over {calls} calls, "
                     f"{left} poisoned left, {guard} elements past row M written")
    return {"pass": ok, "rows": rows_out}


def guard_rows(manifest: Path, rows: int, n: int, k: int) -> int:
    """Call the host launcher directly with C inside a buffer 130 rows longer whose extra
    rows hold a sentinel; returns how many sentinel elements the kernel overwrote."""
    import cupy as cp

    from tsgen.toolchain import compile_source

    source = manifest.with_name(json.loads(manifest.read_text())["source"])
    lib = ctypes.CDLL(str(compile_source(source, mode="shared").output))
    kernel = json.loads(manifest.read_text())["kernels"][0]
    launch = getattr(lib, kernel["launcher"])
    launch.restype = ctypes.c_int
    sentinel = 0x1234
    a = cp.zeros(rows * k, dtype=cp.uint16)
    b = cp.zeros(k * n, dtype=cp.uint16)
    c = cp.full((rows + 130) * n, sentinel, dtype=cp.uint16)
    calls = cp.zeros(2, dtype=cp.uint64)  # the launcher runs on the device that holds `calls`
    p = ctypes.c_void_p
    err = launch(p(0), ctypes.c_int(0), p(calls.data.ptr), ctypes.c_uint64(rows), p(a.data.ptr), p(b.data.ptr),
                 p(c.data.ptr), p(cp.cuda.get_current_stream().ptr))
    if err != 0:
        raise RuntimeError(f"{kernel['launcher']} returned cudaError {err}")
    cp.cuda.runtime.deviceSynchronize()
    return int(cp.count_nonzero(c[rows * n:] != sentinel))
