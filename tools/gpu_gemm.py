"""The `gemm` op on one GPU: correctness, then tsgen against cuBLAS at 8192^3.

Usage: python tools/gpu_gemm.py OUT_DIR [--quick]
       (on the lent machines: bash tools/gpu_gemm.sh, which sets up the environment)

1. Correctness, one child process per spec variant (a kernel that traps ends its
   CUDA context; a stuck pipeline traps after sync.timeout_ms, 3 s here): for every
   M in MS, fresh random A (and B) on the GPU, C poisoned with a NaN pattern before
   every one of CALLS back-to-back calls through the runtime (World(1), module.alloc,
   module.launch), then ||C - ref|| / ||ref|| <= 1e-2 against a float32 cuBLAS
   product of the same 16-bit inputs, and no poisoned element left. Also the host
   launcher called directly with C inside a larger allocation whose rows >= M hold a
   sentinel: the kernel must not write them.
2. Timing, one child process: tsgen (the shipped spec, and BENCH_VARIANTS for tuning)
   and cuBLAS (torch.matmul in bf16; cupy.matmul in fp16 where torch is missing, cupy
   has no bf16) at M = N = K = 8192: warm-up, then the median of ITERS calls, each
   between two CUDA events. Each tsgen row also checks the timed output.

Writes OUT_DIR/gemm_bench.json and OUT_DIR/gemm_bench.md (device, date, command) and
prints the table last. Exit code 0: every check passed; 1: a check failed or a child
crashed; 2: setup (no GPU, no CuPy). Runs in about a minute.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}.items():
    os.environ[_k] = _v  # never NVLink multicast (irrelevant to a GEMM; the rule for everything here)

SPEC = ROOT / "specs" / "gemm_bf16.yaml"
MS = [1, 77, 129, 257, 461, 8192 + 77]
CALLS = 20
ITERS = 30
BENCH_M = 8192
MAX_REL_ERR = 1e-2
TARGET = 0.80  # of cuBLAS's TFLOP/s (issue 4)
CHECK_TIMEOUT_S, BENCH_TIMEOUT_S, DEADLINE_S = 60, 90, 170  # a check takes ~10 s, the bench ~20 s

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
BENCH_VARIANTS = ["shipped", "no_cluster", "cluster_n", "tile_256x128", "raster_4", "raster_16"]


# ---------------------------------------------------------------------------
# Specs and modules
# ---------------------------------------------------------------------------


def variant_manifest(out: Path, name: str, timeout_ms: int | None) -> Path:
    """Render the shipped spec with VARIANTS[name] applied into OUT/build; the manifest path."""
    from tsgen.render import render, write_if_different
    from tsgen.spec import load_spec

    data = yaml.safe_load(SPEC.read_text())
    data["name"] = "gemm_bf16" if name == "shipped" else f"gemm_{name}"

    def merge(into: dict, new: dict) -> None:
        for key, value in new.items():
            if isinstance(value, dict):
                merge(into.setdefault(key, {}), value)
            else:
                into[key] = value

    merge(data, VARIANTS[name])
    if timeout_ms is not None:
        data.setdefault("sync", {})["timeout_ms"] = timeout_ms
    spec_path = out / "build" / "specs" / f"{data['name']}.yaml"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    rendered = render(load_spec(spec_path), base=spec_path.parent.parent)
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
    (0x3C00 -> 15360.0), which is what made the fp16 variant fail on its first device run
    (2026-11-21)."""
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


# ---------------------------------------------------------------------------
# Child: timing
# ---------------------------------------------------------------------------


def median_ms(cp, fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(iters)]
    for start, end in events:  # queued back to back: the GPU never waits for the host
        start.record()
        fn()
        end.record()
    events[-1][1].synchronize()
    return statistics.median(cp.cuda.get_elapsed_time(s, e) for s, e in events)


def bench(manifests: dict[str, Path], iters: int, echo=print) -> dict:
    import cupy as cp

    from tsgen.runtime import World

    size = BENCH_M
    flops = 2.0 * size**3
    rows = []
    with World(1) as world:
        dev = world.devices[0]
        with cp.cuda.Device(dev):
            rng = cp.random.default_rng(7)
            for name, manifest in manifests.items():
                module = world.load(manifest)
                bufs = module.alloc(size)
                try:
                    dtype = json.loads(manifest.read_text())["buffers"][1]["dtype"]
                    a, b, c = (bits16(bufs, x) for x in "abc")
                    a[...] = from_f32(cp, rng.standard_normal(size * size, dtype=cp.float32), dtype)
                    b[...] = from_f32(cp, rng.standard_normal(size * size, dtype=cp.float32), dtype)
                    t = median_ms(cp, lambda: module.launch(bufs), iters)
                    # the timed kernel computed the right thing: compare one row block
                    ref = to_f32(cp, a, dtype).reshape(size, size)[:256] @ to_f32(cp, b, dtype).reshape(size, size)
                    got = to_f32(cp, c, dtype).reshape(size, size)[:256]
                    err = float(cp.linalg.norm(got - ref) / cp.linalg.norm(ref))
                finally:
                    bufs.free()
                rows.append({"impl": f"tsgen {name}", "dtype": dtype, "ms": t, "tflops": flops / t / 1e9,
                             "rel_err": err})
                echo(f"  tsgen {name}: {t:.3f} ms, {flops / t / 1e9:.0f} TFLOP/s (rel err {err:.1e})")
            rows.append(cublas_row(cp, size, iters))
            echo(f"  {rows[-1]['impl']}: {rows[-1]['ms']:.3f} ms, {rows[-1]['tflops']:.0f} TFLOP/s")
            props = cp.cuda.runtime.getDeviceProperties(dev)
    return {"rows": rows, "device": props["name"].decode() if isinstance(props["name"], bytes) else props["name"]}


def cublas_row(cp, size: int, iters: int) -> dict:
    flops = 2.0 * size**3
    try:
        import torch

        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        # torch's current stream is the legacy default stream, the one cupy's events record on
        t = median_ms(cp, lambda: torch.matmul(a, b), iters)
        return {"impl": f"cuBLAS (torch {torch.__version__} matmul)", "dtype": "bfloat16", "ms": t,
                "tflops": flops / t / 1e9}
    except ImportError:
        a = cp.random.standard_normal((size, size), dtype=cp.float32).astype(cp.float16)
        b = cp.random.standard_normal((size, size), dtype=cp.float32).astype(cp.float16)
        t = median_ms(cp, lambda: cp.matmul(a, b), iters)
        return {"impl": "cuBLAS (cupy.matmul; no torch)", "dtype": "float16", "ms": t, "tflops": flops / t / 1e9}


# ---------------------------------------------------------------------------
# Parent: children, summary, files
# ---------------------------------------------------------------------------


def child(args: list[str], timeout: int) -> tuple[dict | None, str]:
    """Run this script as a child; (its JSON result or None, its output)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # its output comes as bytes, whatever text= says
        out = b"".join(x if isinstance(x, bytes) else x.encode() for x in (e.stdout or b"", e.stderr or b""))
        return None, out.decode(errors="replace") + f"\ntimed out after {timeout} s"
    text = proc.stdout + proc.stderr
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), text
    return None, text + f"\n(exit code {proc.returncode})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--quick", action="store_true", help="shipped spec only, M in (1, 129, 8192 + 77), 5 calls")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "ARG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        kind, arg = args.child
        if kind == "check":
            ms, calls = ([1, 129, 8192 + 77], 5) if args.quick else (MS, CALLS)
            result = check_variant(variant_manifest(out, arg, timeout_ms=3000), ms, calls)
        else:
            names = arg.split(",")
            result = bench({n: variant_manifest(out, n, timeout_ms=None) for n in names}, ITERS)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 -- any reason means: no usable GPU here
        print(f"gpu_gemm: needs CuPy and a GPU: {e}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    deadline = started + DEADLINE_S  # a hanging child must not take the run past its budget
    command = " ".join(["python", "tools/gpu_gemm.py", *sys.argv[1:]])
    variants = ["shipped"] if args.quick else CHECK_VARIANTS
    quick = ["--quick"] if args.quick else []
    checks, all_ok = {}, True
    for name in variants:
        left = deadline - BENCH_TIMEOUT_S - time.perf_counter()
        if left < 20:
            checks[name] = {"pass": False, "crashed": ["skipped: out of time (an earlier child hung?)"]}
            all_ok = False
            continue
        t0 = time.perf_counter()
        result, text = child([str(out), *quick, "--child", "check", name], timeout=int(min(CHECK_TIMEOUT_S, left)))
        print(f"check {name} ({time.perf_counter() - t0:.0f} s):")
        print("\n".join("  " + line for line in text.strip().splitlines()[-12:] if not line.startswith("RESULT ")))
        if result is None:
            checks[name] = {"pass": False, "crashed": text.strip().splitlines()[-20:]}
        else:
            checks[name] = result
        all_ok &= checks[name]["pass"]
    bench_names = ["shipped"] if args.quick else BENCH_VARIANTS
    t0 = time.perf_counter()
    timing, text = child([str(out), "--child", "bench", ",".join(bench_names)],
                         timeout=int(max(30, min(BENCH_TIMEOUT_S, deadline - time.perf_counter()))))
    print(f"bench ({time.perf_counter() - t0:.0f} s):")
    print("\n".join("  " + line for line in text.strip().splitlines()[-12:] if not line.startswith("RESULT ")))
    if timing is None:
        all_ok = False
        timing = {"rows": [], "device": "?", "crashed": text.strip().splitlines()[-20:]}

    rows = timing["rows"]
    cublas = next((r for r in rows if r["impl"].startswith("cuBLAS")), None)
    for r in rows:
        r["vs_cublas"] = r["tflops"] / cublas["tflops"] if cublas else None
    shipped = next((r for r in rows if r["impl"] == "tsgen shipped"), None)
    ratio = shipped["vs_cublas"] if shipped and cublas else None
    summary = {
        "device": timing["device"],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "spec": "specs/gemm_bf16.yaml",
        "size": [BENCH_M] * 3,
        "iters": ITERS,
        "checks": checks,
        "bench": rows,
        "ratio_to_cublas": ratio,
        "target": TARGET,
        "target_met": ratio is not None and ratio >= TARGET,
        "all_checks_pass": all_ok,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "gemm_bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = markdown(summary)
    (out / "gemm_bench.md").write_text(table)
    print()
    print(table)
    return 0 if all_ok else 1


def markdown(s: dict) -> str:
    lines = [
        f"# gemm: tsgen vs cuBLAS, M = N = K = {BENCH_M}",
        "",
        f"Device: {s['device']}; {s['date']}; `{s['command']}`; median of {s['iters']} calls each.",
        "",
        "| impl | dtype | time (ms) | TFLOP/s | vs cuBLAS | rel err |",
        "|---|---|---|---|---|---|",
    ]
    for r in s["bench"]:
        vs = f"{r['vs_cublas']:.3f}" if r.get("vs_cublas") else ""
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
        lines.append(f"| {r['impl']} | {r['dtype']} | {r['ms']:.3f} | {r['tflops']:.0f} | {vs} | {err} |")
    ratio = s["ratio_to_cublas"]
    lines += ["", f"tsgen (shipped spec) / cuBLAS = {ratio:.3f}; target >= {s['target']}: "
              f"{'met' if s['target_met'] else 'NOT met'}" if ratio is not None else "no ratio: a timing failed", ""]
    lines += ["| correctness | M | calls | max rel err | poison left | rows >= M written | result |",
              "|---|---|---|---|---|---|---|"]
    for name, c in s["checks"].items():
        if "crashed" in c:
            why = next((x for x in reversed(c["crashed"]) if "rror" in x or "skipped" in x or "timed out" in x),
                       c["crashed"][-1] if c["crashed"] else "")
            lines.append(f"| {name} | | | | | | CRASHED: {why.strip()} |")
        for r in c.get("rows", []):
            lines.append(f"| {name} | {r['m']} | {r['calls']} | {r['max_rel_err']:.2e} | {r['poison_left']} | "
                         f"{r['rows_past_m_written']} | {'PASS' if r['pass'] else 'FAIL'} |")
    lines += ["", f"All checks: {'PASS' if s['all_checks_pass'] else 'FAIL'} ({s['seconds']} s)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
