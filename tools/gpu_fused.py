"""allgather_gemm on 2-4 GPUs: correctness, then tsgen (plain, overlapped) against cuBLAS +
NCCL one after the other and PyTorch SymmetricMemory's fused_all_gather_matmul.

Usage: python tools/gpu_fused.py OUT_DIR [--ops allgather_gemm gemm_reduce_scatter cannon summa]
       (on the lent machines: bash tools/gpu_fused.sh [--ops ...]); --ops picks the ops (default
       all). gemm_reduce_scatter's part (checks at world 2 and 4, timing at world 4 against
       cuBLAS + NCCL reduce_scatter_tensor and symm_mem's fused_matmul_reduce_scatter) is
       described above run_gemm_rs and writes OUT/gemm_rs_bench.{json,md}; cannon's and summa's
       (2 x 2 grid: checks, then TFLOP/s against cuBLAS on the whole matrix on one GPU) above
       run_grid, OUT/grid_bench.{json,md}; what follows is allgather_gemm's.

1. Correctness (one child per world size 2, 3, 4; single-process tsgen World): both shipped
   specs (specs/allgather_gemm.yaml: overlap copy_engine; allgather_gemm_plain.yaml: none),
   M_local = CHECK_M, K = 8192, N_local = 2048; CALLS back-to-back calls, fresh random bf16
   A on every rank before each call, C poisoned with a NaN pattern; ||C_r - ref_r|| / ||ref_r||
   <= 1e-2 per rank against a float32 product of the same inputs; no poison left.
2. Timing at world 4, K = N = 8192 (N_local = 2048), M = 4096, 8192, 16384 total rows:
   tsgen plain / overlapped (one process drives the 4 GPUs; ITERS calls queued back to back
   on every GPU between two events per GPU, time = the slowest GPU's / ITERS), and, one
   process per GPU (tsgen.baselines.launch_workers): cuBLAS alone (torch.matmul of the
   gathered (M x K) . (K x N_local)), NCCL all_gather_into_tensor alone, the two one after
   the other, and torch.ops.symm_mem.fused_all_gather_matmul.
NVLink multicast is off everywhere (NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 in every process). Writes OUT/fused_bench.json and
OUT/fused_bench.md and prints the table last. Exit 0: all checks passed; 1: a check failed
or a step crashed; 2: setup.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
os.environ.update(SAFE_ENV)

SPECS = {"overlapped": ROOT / "specs" / "allgather_gemm.yaml", "plain": ROOT / "specs" / "allgather_gemm_plain.yaml"}
WORLDS = [2, 3, 4]
CHECK_M = 259  # M_local: two full row tiles and a tail per source
CALLS = 20
BENCH_WORLD = 4
BENCH_M = [4096, 8192, 16384]  # total rows
K, N = 8192, 8192
ITERS, WARMUP = 20, 3
SAMPLES = 5  # timed samples of ITERS calls each; the median is reported
MAX_REL_ERR = 1e-2
CHECK_TIMEOUT_S, TSGEN_BENCH_TIMEOUT_S, TORCH_TIMEOUT_S, DEADLINE_S = 75, 90, 120, 280


def build(out: Path, name: str, timeout_ms: int | None, specs: dict | None = None) -> Path:
    """Render shipped spec `name` of `specs` (default SPECS; with a short timeout for checks)
    into OUT/build; the manifest."""
    import yaml

    from tsgen.render import render, write_if_different
    from tsgen.spec import load_spec

    data = yaml.safe_load((specs or SPECS)[name].read_text())
    data["name"] = f"{data['name']}_t" if timeout_ms else data["name"]
    if timeout_ms:
        data.setdefault("sync", {})["timeout_ms"] = timeout_ms
    path = out / "build" / "specs" / f"{data['name']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    r = render(load_spec(path), base=path.parent.parent)
    for f, text in r.files().items():
        write_if_different(out / "build" / "generated" / f, text)
    return out / "build" / "generated" / f"{r.name}.json"


def to_f32(cp, bits):
    return (bits.astype(cp.uint32) << 16).view(cp.float32)


def from_f32(cp, x):
    u = x.view(cp.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)


# ---------------------------------------------------------------------------
# Child: correctness at one world size
# ---------------------------------------------------------------------------


def time_tsgen(world, module, bufs, iters: int, warmup: int) -> float:
    """Milliseconds per call: `iters` calls queued back to back on one stream per GPU between
    two events per GPU, the slowest GPU's time / iters; the median of SAMPLES such samples
    (after `warmup` calls), so one disturbed sample does not decide a ratio."""
    import cupy as cp

    streams = {}  # the events must be on the stream the calls run on
    for r in world.ranks:
        with cp.cuda.Device(world.devices[r]):
            streams[r] = cp.cuda.Stream(non_blocking=True)
    for _ in range(warmup):
        module.launch(bufs, streams=streams)
    world.synchronize()
    samples = []
    for _ in range(SAMPLES):
        ev = {}
        for r in world.ranks:
            with cp.cuda.Device(world.devices[r]):
                ev[r] = (cp.cuda.Event(), cp.cuda.Event())
                ev[r][0].record(streams[r])
        for _ in range(iters):
            module.launch(bufs, streams=streams)
        for r in world.ranks:
            with cp.cuda.Device(world.devices[r]):
                ev[r][1].record(streams[r])
        world.synchronize()
        samples.append(max(cp.cuda.get_elapsed_time(*ev[r]) for r in world.ranks) / iters)
    return sorted(samples)[len(samples) // 2]


def time_torch(fn, iters: int, warmup: int, dev=None) -> float:
    """Microseconds per call of fn (torch, on the current device), the same way: `iters`
    calls between two events, median of SAMPLES samples; with a process group (dev given),
    the slowest rank's."""
    import torch

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(SAMPLES):
        if dev is not None:
            torch.distributed.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / iters * 1e3)
    us = sorted(samples)[len(samples) // 2]
    if dev is None:
        return us
    t = torch.tensor([us], device=dev)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def check(out: Path, world_size: int) -> dict:
    import cupy as cp

    from tsgen.runtime import World

    rows, ok = [], True
    with World(world_size) as world:
        for name in SPECS:
            t0 = time.perf_counter()
            module = world.load(build(out, name, timeout_ms=5000))
            n_local = module.manifest["constants"]["N"]
            m = CHECK_M
            bufs = module.alloc(m)
            try:
                arr = {(x, r): bufs.array(x, r).view(cp.uint16) for x in "abc" for r in world.ranks}
                rng = {}
                for r in world.ranks:
                    with cp.cuda.Device(world.devices[r]):
                        rng[r] = cp.random.default_rng(100 + r)
                        arr["b", r][...] = from_f32(cp, rng[r].standard_normal(K * n_local, dtype=cp.float32))
                errs, left = [], 0
                for call in range(CALLS):
                    poison = 0x7F80 | (0x41 + call % 60)
                    for r in world.ranks:
                        with cp.cuda.Device(world.devices[r]):
                            arr["a", r][...] = from_f32(cp, rng[r].standard_normal(m * K, dtype=cp.float32))
                            arr["c", r][...] = poison
                    world.synchronize()
                    module.launch(bufs)
                    world.synchronize()
                    host_a = {s: arr["a", s].get() for s in world.ranks}
                    for r in world.ranks:
                        with cp.cuda.Device(world.devices[r]):
                            # through the host: arrays of other GPUs are not used here directly
                            full = cp.concatenate([to_f32(cp, cp.asarray(host_a[s])).reshape(m, K)
                                                   for s in world.ranks])
                            ref = full @ to_f32(cp, arr["b", r]).reshape(K, n_local)
                            got = to_f32(cp, arr["c", r]).reshape(world_size * m, n_local)
                            bad = ~cp.isfinite(got)
                            err = float(cp.linalg.norm(cp.where(bad, 0, got - ref)) / cp.linalg.norm(ref))
                            errs.append(err + float(cp.count_nonzero(bad)))
                            left = max(left, int(cp.count_nonzero(arr["c", r] == poison)))
            finally:
                bufs.free()
            err = max(errs)
            passed = err <= MAX_REL_ERR and left == 0
            ok &= passed
            rows.append({"spec": name, "world": world_size, "m_local": m, "calls": CALLS, "max_rel_err": err,
                         "poison_left": left, "pass": passed, "seconds": round(time.perf_counter() - t0, 1)})
            print(f"  {name} world {world_size}: {'PASS' if passed else 'FAIL'} max rel err {err:.2e}, "
                  f"{left} poisoned left", flush=True)
    return {"pass": ok, "rows": rows}


# ---------------------------------------------------------------------------
# Child: tsgen timing at world 4
# ---------------------------------------------------------------------------


def bench_tsgen(out: Path) -> dict:
    import cupy as cp

    from tsgen.runtime import World

    rows = []
    with World(BENCH_WORLD) as world:
        for name in SPECS:
            module = world.load(build(out, name, timeout_ms=None))
            n_local = module.manifest["constants"]["N"]
            for m_total in BENCH_M:
                m = m_total // BENCH_WORLD
                bufs = module.alloc(m)
                try:
                    for r in world.ranks:
                        with cp.cuda.Device(world.devices[r]):
                            g = cp.random.default_rng(r)
                            bufs.array("a", r).view(cp.uint16)[...] = from_f32(cp, g.standard_normal(m * K, dtype=cp.float32))
                            bufs.array("b", r).view(cp.uint16)[...] = from_f32(
                                cp, g.standard_normal(K * n_local, dtype=cp.float32))
                    ms = time_tsgen(world, module, bufs, ITERS, WARMUP)
                    # the timed output is right: one row block of rank 0 against its reference
                    with cp.cuda.Device(world.devices[0]):
                        a1 = to_f32(cp, cp.asarray(bufs.array("a", 1).view(cp.uint16)[:128 * K].get())).reshape(128, K)
                        ref = a1 @ to_f32(cp, bufs.array("b", 0).view(cp.uint16)).reshape(K, n_local)
                        got = to_f32(cp, bufs.array("c", 0).view(cp.uint16)).reshape(-1, n_local)[m:m + 128]
                        err = float(cp.linalg.norm(got - ref) / cp.linalg.norm(ref))
                finally:
                    bufs.free()
                rows.append({"impl": f"tsgen {name}", "m": m_total, "us": ms * 1e3, "rel_err": err})
                print(f"  tsgen {name} M={m_total}: {ms * 1e3:.1f} us (rel err {err:.1e})", flush=True)
    return {"rows": rows}


# ---------------------------------------------------------------------------
# Workers: cuBLAS / NCCL / symm_mem, one process per GPU
# ---------------------------------------------------------------------------


def torch_worker(cfg: dict, rank: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    world = cfg["world"]
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=cfg["init_method"], rank=rank, world_size=world, device_id=dev)
    group = dist.group.WORLD
    fused = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        try:
            symm_mem.enable_symm_mem_for_group(group.group_name)
        except Exception:  # noqa: BLE001 -- newer torch needs no enabling
            pass
        fused = torch.ops.symm_mem.fused_all_gather_matmul
    except Exception as e:  # noqa: BLE001
        fused_err = f"{type(e).__name__}: {e}"
    n_local = cfg["n"] // world

    def timed(fn) -> float:
        return time_torch(fn, cfg["iters"], cfg["warmup"], dev)

    rows = []
    for m_total in cfg["ms"]:
        m = m_total // world
        a = torch.randn(m, cfg["k"], device=dev, dtype=torch.bfloat16)
        b = torch.randn(cfg["k"], n_local, device=dev, dtype=torch.bfloat16)
        full = torch.empty(m_total, cfg["k"], device=dev, dtype=torch.bfloat16)
        row = {"m": m_total}
        row["gemm"] = timed(lambda: torch.matmul(full, b))
        row["comm"] = timed(lambda: dist.all_gather_into_tensor(full, a, group=group))

        def seq():
            dist.all_gather_into_tensor(full, a, group=group)
            return torch.matmul(full, b)

        row["sequential"] = timed(seq)
        if fused is not None:
            try:
                _, outs = fused(a, [b], 0, group.group_name)
                ref = seq()
                row["fused_rel_err"] = float((outs[0].float() - ref.float()).norm() / ref.float().norm())
                row["fused"] = timed(lambda: fused(a, [b], 0, group.group_name))
            except Exception as e:  # noqa: BLE001
                row["fused_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        else:
            row["fused_error"] = fused_err
        rows.append(row)
    dist.barrier()
    dist.destroy_process_group()
    return rows


def worker_main(cfg_path: str, rank: int) -> None:
    import traceback

    os.environ.update(SAFE_ENV)
    cfg = json.loads(Path(cfg_path).read_text())
    try:
        rows = (rs_torch_worker if cfg.get("op") == "gemm_reduce_scatter" else torch_worker)(cfg, rank)
        if rank == 0:
            Path(cfg["result_path"]).write_text(json.dumps(rows))
        code = 0
    except BaseException:  # noqa: BLE001
        text = f"rank {rank}:\n{traceback.format_exc()}"
        Path(cfg["error_dir"], f"error-{rank}.txt").write_text(text)
        sys.stderr.write(text)
        code = 1
    sys.stdout.flush()
    os._exit(code)


def bench_torch() -> dict:
    from tsgen.baselines import free_port, launch_workers

    cfg = {"world": BENCH_WORLD, "ms": BENCH_M, "k": K, "n": N, "iters": ITERS, "warmup": WARMUP,
           "init_method": f"tcp://127.0.0.1:{free_port()}"}
    rows = launch_workers(cfg, BENCH_WORLD, timeout=TORCH_TIMEOUT_S,
                          argv=[sys.executable, str(Path(__file__).resolve()), "--worker"])
    return {"rows": rows}


# ---------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------


def child(args: list[str], timeout: int) -> tuple[dict | None, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **SAFE_ENV})
    except subprocess.TimeoutExpired as e:
        out = b"".join(x if isinstance(x, bytes) else x.encode() for x in (e.stdout or b"", e.stderr or b""))
        return None, out.decode(errors="replace") + f"\ntimed out after {timeout} s"
    text = proc.stdout + proc.stderr
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), text
    return None, text + f"\n(exit code {proc.returncode})"


def summarize(tsgen_rows: list[dict], torch_rows: list[dict],
              fused_name: str = "torch symm_mem fused_all_gather_matmul") -> list[dict]:
    table = []
    for tr in torch_rows:
        m = tr["m"]
        flops = 2.0 * m * K * N / BENCH_WORLD  # per GPU
        limit = max(tr["gemm"], tr["comm"])
        impls = [(r["impl"], r["us"]) for r in tsgen_rows if r["m"] == m]
        impls += [("cuBLAS + NCCL (sequential)", tr["sequential"])]
        if "fused" in tr:
            impls.append((fused_name, tr["fused"]))
        for impl, us in impls:
            table.append({"m": m, "impl": impl, "us": us, "tflops": flops / us / 1e6,
                          "speedup_vs_sequential": tr["sequential"] / us,
                          "vs_torch_fused": tr["fused"] / us if "fused" in tr else None,
                          "overlap_efficiency": limit / us, "t_gemm_us": tr["gemm"], "t_comm_us": tr["comm"]})
    return table


def markdown(s: dict) -> str:
    lines = [f"# allgather_gemm on {BENCH_WORLD} GPUs: K = N = {K} (N_local = {N // BENCH_WORLD}), bf16", "",
             f"Device: {s['device']}; {s['date']}; `{s['command']}`; {ITERS} calls back to back per sample, median of {SAMPLES} samples.", "",
             "| correctness | world | M_local | calls | max rel err | poison left | result |",
             "|---|---|---|---|---|---|---|"]
    for c in s["checks"]:
        for r in c.get("rows", []):
            lines.append(f"| {r['spec']} | {r['world']} | {r['m_local']} | {r['calls']} | {r['max_rel_err']:.2e} | "
                         f"{r['poison_left']} | {'PASS' if r['pass'] else 'FAIL'} |")
        if "crashed" in c:
            lines.append(f"| world {c['world']} | | | | | | CRASHED: {c['crashed'][-1] if c['crashed'] else ''} |")
    lines += ["", "| M (total) | impl | time (us) | TFLOP/s per GPU | vs sequential | vs torch fused | "
              "overlap eff. max(t_gemm, t_comm)/t |", "|---|---|---|---|---|---|---|"]
    for r in s["table"]:
        vs = f"{r['vs_torch_fused']:.2f}" if r["vs_torch_fused"] else ""
        lines.append(f"| {r['m']} | {r['impl']} | {r['us']:.1f} | {r['tflops']:.0f} | {r['speedup_vs_sequential']:.2f} "
                     f"| {vs} | {r['overlap_efficiency']:.2f} |")
    for tr in s.get("torch_rows", []):
        extra = f"; fused: {tr['fused_error']}" if "fused_error" in tr else ""
        lines.append(f"\nM={tr['m']}: t_gemm (cuBLAS) {tr['gemm']:.1f} us, t_comm (NCCL all_gather) "
                     f"{tr['comm']:.1f} us{extra}")
    for name, err in s.get("errors", {}).items():
        lines.append(f"\n{name}: {err}")
    lines += ["", f"All checks: {'PASS' if s['all_checks_pass'] else 'FAIL'} ({s['seconds']} s)", ""]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], int(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ops", nargs="+", choices=OPS, default=OPS,
                    help="which fused ops to check and time (default: all)")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "ARG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        kind, arg = args.child
        children = {"check": lambda: check(out, int(arg)), "bench": lambda: bench_tsgen(out),
                    "rs_check": lambda: rs_check(out, int(arg)), "rs_bench": lambda: rs_bench_tsgen(out),
                    "grid_check": lambda: grid_check(out, arg.split(",")),
                    "grid_bench": lambda: grid_bench_tsgen(out, arg.split(",")), "grid_cublas": grid_cublas}
        result = children[kind]()
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    try:
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
        props = cupy.cuda.runtime.getDeviceProperties(0)
        device = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    except Exception as e:  # noqa: BLE001
        print(f"gpu_fused: needs CuPy and GPUs: {e}", file=sys.stderr)
        return 2
    ok = True
    if "allgather_gemm" in args.ops:
        ok &= run_allgather_gemm(out, gpus, device)
    if "gemm_reduce_scatter" in args.ops:
        ok &= run_gemm_rs(out, gpus, device)
    grid_ops = [op for op in GRID_OPS if op in args.ops]
    if grid_ops:
        ok &= run_grid(out, gpus, device, grid_ops)
    return 0 if ok else 1


def run_allgather_gemm(out: Path, gpus: int, device: str) -> bool:
    """allgather_gemm: checks, timing, OUT/fused_bench.{json,md}; True when all checks passed."""
    started = time.perf_counter()
    deadline = started + DEADLINE_S
    checks, all_ok, errors = [], True, {}
    for w in [w for w in WORLDS if w <= gpus]:
        left = deadline - time.perf_counter() - TSGEN_BENCH_TIMEOUT_S - TORCH_TIMEOUT_S
        if left < 20:
            checks.append({"world": w, "pass": False, "crashed": ["skipped: out of time"]})
            all_ok = False
            continue
        t0 = time.perf_counter()
        result, text = child([str(out), "--child", "check", str(w)], timeout=int(min(CHECK_TIMEOUT_S, left)))
        print(f"check world {w} ({time.perf_counter() - t0:.0f} s):")
        print("\n".join("  " + x for x in text.strip().splitlines()[-10:] if not x.startswith("RESULT ")), flush=True)
        if result is None:
            result = {"world": w, "pass": False, "crashed": text.strip().splitlines()[-20:]}
        checks.append(result)
        all_ok &= result["pass"]
    tsgen_rows, torch_rows = [], []
    if gpus >= BENCH_WORLD:
        t0 = time.perf_counter()
        left = int(max(30, min(TSGEN_BENCH_TIMEOUT_S, deadline - time.perf_counter() - TORCH_TIMEOUT_S)))
        result, text = child([str(out), "--child", "bench", "x"], timeout=left)
        print(f"tsgen bench ({time.perf_counter() - t0:.0f} s):")
        print("\n".join("  " + x for x in text.strip().splitlines()[-10:] if not x.startswith("RESULT ")), flush=True)
        if result is None:
            all_ok = False
            errors["tsgen bench"] = text.strip().splitlines()[-1] if text.strip() else "?"
        else:
            tsgen_rows = result["rows"]
        t0 = time.perf_counter()
        try:
            torch_rows = bench_torch()["rows"]
        except Exception as e:  # noqa: BLE001
            all_ok = False
            errors["torch baselines"] = str(e)[-2000:]
        print(f"torch baselines ({time.perf_counter() - t0:.0f} s)", flush=True)
    else:
        errors["bench"] = f"needs {BENCH_WORLD} GPUs, found {gpus}"
    summary = {
        "device": f"{gpus} x {device}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "tools/gpu_fused.py", *sys.argv[1:]]),
        "checks": checks, "tsgen_rows": tsgen_rows, "torch_rows": torch_rows,
        "table": summarize(tsgen_rows, torch_rows), "errors": errors,
        "all_checks_pass": all_ok, "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "fused_bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    (out / "fused_bench.md").write_text(text)
    print()
    print(text)
    return all_ok


# ---------------------------------------------------------------------------
# gemm_reduce_scatter (--ops gemm_reduce_scatter): A sharded by columns (M x K/W per rank),
# B by rows (K/W x N), C_r = rows [r M/W, (r + 1) M/W) of sum_s A_s . B_s. The tsgen `count`
# is M/W. Checks at world 2 and 4 (RS_CALLS calls, fresh random A every call, C poisoned),
# timing at world 4 against cuBLAS + NCCL reduce_scatter_tensor one after the other and
# torch.ops.symm_mem.fused_matmul_reduce_scatter; OUT/gemm_rs_bench.{json,md}. Under
# RS_DEADLINE_S (each step has its own timeout).
# ---------------------------------------------------------------------------

OPS = ["allgather_gemm", "gemm_reduce_scatter", "cannon", "summa"]
RS_SPECS = {"overlapped": ROOT / "specs" / "gemm_reduce_scatter.yaml",
            "plain": ROOT / "specs" / "gemm_reduce_scatter_plain.yaml",
            "push": ROOT / "specs" / "gemm_reduce_scatter_push.yaml",
            "push interleaved": ROOT / "specs" / "gemm_reduce_scatter_push_interleaved.yaml",
            "push add": ROOT / "specs" / "gemm_reduce_scatter_push_add.yaml"}
if os.environ.get("RS_ONLY"):  # e.g. RS_ONLY="push interleaved,push add": a shorter device run
    RS_SPECS = {k: v for k, v in RS_SPECS.items() if k in os.environ["RS_ONLY"].split(",")}
RS_WORLDS = [2, 4]
RS_CHECK_COUNT = 129  # rows of C per rank: a full row tile and a tail per block
RS_CALLS = 20
RS_FUSED = "torch symm_mem fused_matmul_reduce_scatter"
RS_CHECK_TIMEOUT_S, RS_BENCH_TIMEOUT_S, RS_TORCH_TIMEOUT_S, RS_DEADLINE_S = 60, 60, 90, 225


def rs_reference(xp, a, b, world, count, k_local, n):
    """Per rank r: rows r of sum_s A_s . B_s, float32 products summed in float32 (a[s], b[s]:
    rank s's A ((world x count) x k_local) and B (k_local x n) as float32, any shape)."""
    parts = [a[s].reshape(world * count, k_local) @ b[s].reshape(-1)[:k_local * n].reshape(k_local, n)
             for s in range(world)]
    total = parts[0]
    for x in parts[1:]:
        total = total + x
    return [total[r * count:(r + 1) * count] for r in range(world)]


def rs_check(out: Path, world_size: int) -> dict:
    import cupy as cp

    from tsgen.runtime import World

    rows, ok = [], True
    with World(world_size) as world:
        for name in RS_SPECS:
            t0 = time.perf_counter()
            module = world.load(build(out, name, timeout_ms=5000, specs=RS_SPECS))
            n, k_local, count = module.manifest["constants"]["N"], K // world_size, RS_CHECK_COUNT
            m = world_size * count
            bufs = module.alloc(count)
            try:
                arr = {(x, r): bufs.array(x, r).view(cp.uint16) for x in "abc" for r in world.ranks}
                rng, b32 = {}, {}
                for r in world.ranks:
                    with cp.cuda.Device(world.devices[r]):
                        rng[r] = cp.random.default_rng(200 + r)
                        arr["b", r][:k_local * n] = from_f32(cp, rng[r].standard_normal(k_local * n, dtype=cp.float32))
                host_b = {s: arr["b", s][:k_local * n].get() for s in world.ranks}
                for r in world.ranks:  # every rank's B on every GPU, as float32, for the references
                    with cp.cuda.Device(world.devices[r]):
                        b32[r] = [to_f32(cp, cp.asarray(host_b[s])) for s in world.ranks]
                errs, left = [], 0
                for call in range(RS_CALLS):
                    poison = 0x7F80 | (0x41 + call % 60)
                    for r in world.ranks:
                        with cp.cuda.Device(world.devices[r]):
                            arr["a", r][...] = from_f32(cp, rng[r].standard_normal(m * k_local, dtype=cp.float32))
                            arr["c", r][...] = poison
                    world.synchronize()
                    module.launch(bufs)
                    world.synchronize()
                    host_a = {s: arr["a", s].get() for s in world.ranks}
                    for r in world.ranks:
                        with cp.cuda.Device(world.devices[r]):
                            a32 = [to_f32(cp, cp.asarray(host_a[s])) for s in world.ranks]
                            ref = rs_reference(cp, a32, b32[r], world_size, count, k_local, n)[r]
                            got = to_f32(cp, arr["c", r]).reshape(count, n)
                            bad = ~cp.isfinite(got)
                            err = float(cp.linalg.norm(cp.where(bad, 0, got - ref)) / cp.linalg.norm(ref))
                            errs.append(err + float(cp.count_nonzero(bad)))
                            left = max(left, int(cp.count_nonzero(arr["c", r] == poison)))
            finally:
                bufs.free()
            err = max(errs)
            passed = err <= MAX_REL_ERR and left == 0
            ok &= passed
            rows.append({"spec": name, "world": world_size, "m_local": count, "calls": RS_CALLS, "max_rel_err": err,
                         "poison_left": left, "pass": passed, "seconds": round(time.perf_counter() - t0, 1)})
            print(f"  gemm_rs {name} world {world_size}: {'PASS' if passed else 'FAIL'} max rel err {err:.2e}, "
                  f"{left} poisoned left", flush=True)
    return {"pass": ok, "rows": rows}


def rs_bench_tsgen(out: Path) -> dict:
    import cupy as cp

    from tsgen.runtime import World

    rows = []
    k_local = K // BENCH_WORLD
    with World(BENCH_WORLD) as world:
        for name in RS_SPECS:
            module = world.load(build(out, name, timeout_ms=5000, specs=RS_SPECS))
            for m_total in BENCH_M:
                count = m_total // BENCH_WORLD
                bufs = module.alloc(count)
                try:
                    for r in world.ranks:
                        with cp.cuda.Device(world.devices[r]):
                            g = cp.random.default_rng(r)
                            bufs.array("a", r).view(cp.uint16)[...] = from_f32(
                                cp, g.standard_normal(m_total * k_local, dtype=cp.float32))
                            bufs.array("b", r).view(cp.uint16)[:k_local * N] = from_f32(
                                cp, g.standard_normal(k_local * N, dtype=cp.float32))
                    ms = time_tsgen(world, module, bufs, ITERS, WARMUP)
                    # the timed output is right: the first 64 rows of rank 0's C
                    with cp.cuda.Device(world.devices[0]):
                        ref = None
                        for s in world.ranks:
                            a_s = to_f32(cp, cp.asarray(bufs.array("a", s).view(cp.uint16)[:64 * k_local].get()))
                            b_s = to_f32(cp, cp.asarray(bufs.array("b", s).view(cp.uint16)[:k_local * N].get()))
                            x = a_s.reshape(64, k_local) @ b_s.reshape(k_local, N)
                            ref = x if ref is None else ref + x
                        got = to_f32(cp, bufs.array("c", 0).view(cp.uint16)[:64 * N]).reshape(64, N)
                        err = float(cp.linalg.norm(got - ref) / cp.linalg.norm(ref))
                finally:
                    bufs.free()
                rows.append({"impl": f"tsgen gemm_rs {name}", "m": m_total, "us": ms * 1e3, "rel_err": err})
                print(f"  tsgen gemm_rs {name} M={m_total}: {ms * 1e3:.1f} us (rel err {err:.1e})", flush=True)
    return {"rows": rows}


def rs_torch_worker(cfg: dict, rank: int) -> list[dict]:
    """cuBLAS (A_r . B_r, M x N), NCCL reduce_scatter_tensor of it, the two one after the other,
    and symm_mem's fused_matmul_reduce_scatter, per M; times are the slowest rank's."""
    import torch
    import torch.distributed as dist

    world = cfg["world"]
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=cfg["init_method"], rank=rank, world_size=world, device_id=dev)
    group = dist.group.WORLD
    fused, fused_err = None, ""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        try:
            symm_mem.enable_symm_mem_for_group(group.group_name)
        except Exception:  # noqa: BLE001 -- newer torch needs no enabling
            pass
        fused = torch.ops.symm_mem.fused_matmul_reduce_scatter
    except Exception as e:  # noqa: BLE001
        fused_err = f"{type(e).__name__}: {e}"
    k_local = cfg["k"] // world

    def timed(fn) -> float:
        return time_torch(fn, cfg["iters"], cfg["warmup"], dev)

    rows = []
    for m_total in cfg["ms"]:
        a = torch.randn(m_total, k_local, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k_local, cfg["n"], device=dev, dtype=torch.bfloat16)
        part = torch.matmul(a, b)
        outp = torch.empty(m_total // world, cfg["n"], device=dev, dtype=torch.bfloat16)
        row = {"m": m_total}
        row["gemm"] = timed(lambda: torch.matmul(a, b))
        row["comm"] = timed(lambda: dist.reduce_scatter_tensor(outp, part, group=group))

        def seq():
            dist.reduce_scatter_tensor(outp, torch.matmul(a, b), group=group)
            return outp

        row["sequential"] = timed(seq)
        if fused is not None:
            try:
                got = fused(a, b, "sum", 0, group.group_name)
                ref = seq().float()
                row["fused_rel_err"] = float((got.float() - ref).norm() / ref.norm())
                row["fused"] = timed(lambda: fused(a, b, "sum", 0, group.group_name))
            except Exception as e:  # noqa: BLE001
                row["fused_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        else:
            row["fused_error"] = fused_err
        rows.append(row)
        del a, b, part, outp
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return rows


def rs_markdown(s: dict) -> str:
    lines = [f"# gemm_reduce_scatter on {BENCH_WORLD} GPUs: K = N = {K} (K/world = {K // BENCH_WORLD}), bf16", "",
             f"Device: {s['device']}; {s['date']}; `{s['command']}`; {ITERS} calls back to back per sample, median of {SAMPLES} samples.", "",
             "| correctness | world | rows of C per rank | calls | max rel err | poison left | result |",
             "|---|---|---|---|---|---|---|"]
    for c in s["checks"]:
        for r in c.get("rows", []):
            lines.append(f"| {r['spec']} | {r['world']} | {r['m_local']} | {r['calls']} | {r['max_rel_err']:.2e} | "
                         f"{r['poison_left']} | {'PASS' if r['pass'] else 'FAIL'} |")
        if "crashed" in c:
            lines.append(f"| world {c['world']} | | | | | | CRASHED: {c['crashed'][-1] if c['crashed'] else ''} |")
    lines += ["", "| M (total) | impl | time (us) | TFLOP/s per GPU | vs sequential | vs torch fused | "
              "overlap eff. max(t_gemm, t_comm)/t |", "|---|---|---|---|---|---|---|"]
    for r in s["table"]:
        vs = f"{r['vs_torch_fused']:.2f}" if r["vs_torch_fused"] else ""
        lines.append(f"| {r['m']} | {r['impl']} | {r['us']:.1f} | {r['tflops']:.0f} | {r['speedup_vs_sequential']:.2f} "
                     f"| {vs} | {r['overlap_efficiency']:.2f} |")
    for tr in s.get("torch_rows", []):
        extra = f"; fused: {tr['fused_error']}" if "fused_error" in tr else ""
        lines.append(f"\nM={tr['m']}: t_gemm (cuBLAS) {tr['gemm']:.1f} us, t_comm (NCCL reduce_scatter) "
                     f"{tr['comm']:.1f} us{extra}")
    for name, err in s.get("errors", {}).items():
        lines.append(f"\n{name}: {err}")
    lines += ["", f"All checks: {'PASS' if s['all_checks_pass'] else 'FAIL'} ({s['seconds']} s)", ""]
    return "\n".join(lines)


def run_gemm_rs(out: Path, gpus: int, device: str) -> bool:
    """gemm_reduce_scatter: checks, timing, OUT/gemm_rs_bench.{json,md}; True when all checks passed."""
    from tsgen.baselines import free_port, launch_workers

    started = time.perf_counter()
    deadline = started + RS_DEADLINE_S
    checks, all_ok, errors = [], True, {}
    bench = gpus >= BENCH_WORLD
    reserve = (RS_BENCH_TIMEOUT_S + RS_TORCH_TIMEOUT_S) if bench else 0
    for w in [w for w in RS_WORLDS if w <= gpus]:
        left = deadline - time.perf_counter() - reserve
        if left < 20:
            checks.append({"world": w, "pass": False, "crashed": ["skipped: out of time"]})
            all_ok = False
            continue
        t0 = time.perf_counter()
        result, text = child([str(out), "--child", "rs_check", str(w)], timeout=int(min(RS_CHECK_TIMEOUT_S, left)))
        print(f"gemm_rs check world {w} ({time.perf_counter() - t0:.0f} s):")
        print("\n".join("  " + x for x in text.strip().splitlines()[-10:] if not x.startswith("RESULT ")), flush=True)
        if result is None:
            result = {"world": w, "pass": False, "crashed": text.strip().splitlines()[-20:]}
        checks.append(result)
        all_ok &= result["pass"]
    tsgen_rows, torch_rows = [], []
    if bench:
        t0 = time.perf_counter()
        left = int(max(30, min(RS_BENCH_TIMEOUT_S, deadline - time.perf_counter() - RS_TORCH_TIMEOUT_S)))
        result, text = child([str(out), "--child", "rs_bench", "x"], timeout=left)
        print(f"tsgen gemm_rs bench ({time.perf_counter() - t0:.0f} s):")
        print("\n".join("  " + x for x in text.strip().splitlines()[-10:] if not x.startswith("RESULT ")), flush=True)
        if result is None:
            all_ok = False
            errors["tsgen bench"] = text.strip().splitlines()[-1] if text.strip() else "?"
        else:
            tsgen_rows = result["rows"]
        t0 = time.perf_counter()
        cfg = {"op": "gemm_reduce_scatter", "world": BENCH_WORLD, "ms": BENCH_M, "k": K, "n": N, "iters": ITERS,
               "warmup": WARMUP, "init_method": f"tcp://127.0.0.1:{free_port()}"}
        left = int(max(30, min(RS_TORCH_TIMEOUT_S, deadline - time.perf_counter())))
        try:
            torch_rows = launch_workers(cfg, BENCH_WORLD, timeout=left,
                                        argv=[sys.executable, str(Path(__file__).resolve()), "--worker"])
        except Exception as e:  # noqa: BLE001
            all_ok = False
            errors["torch baselines"] = str(e)[-2000:]
        print(f"torch gemm_rs baselines ({time.perf_counter() - t0:.0f} s)", flush=True)
    else:
        errors["bench"] = f"needs {BENCH_WORLD} GPUs, found {gpus}"
    summary = {
        "device": f"{gpus} x {device}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "tools/gpu_fused.py", *sys.argv[1:]]),
        "checks": checks, "tsgen_rows": tsgen_rows, "torch_rows": torch_rows,
        "table": summarize(tsgen_rows, torch_rows, fused_name=RS_FUSED), "errors": errors,
        "all_checks_pass": all_ok, "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "gemm_rs_bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = rs_markdown(summary)
    (out / "gemm_rs_bench.md").write_text(text)
    print()
    print(text)
    return all_ok


# ---------------------------------------------------------------------------
# cannon / summa (--ops cannon summa): C = A . B block-distributed on a 2 x 2 grid (world 4):
# rank (i, j) = 2 i + j holds A_ij, B_ij, C_ij; count = M/2, the block's rows; N = K = 8192.
# 1. Checks (one child, world 4): GRID_CALLS calls, fresh random bf16 A and B blocks on every
#    rank before each call, C poisoned; ||C_ij - ref_ij|| / ||ref_ij|| <= 1e-2 against a float32
#    product of the whole matrices (assembled from the blocks); no poison left.
# 2. Timing: the whole problem GRID_SIZES^3 (count = size / 2), GRID_ITERS calls back to back
#    per GPU between two events (time = the slowest GPU's), TFLOP/s = 2 size^3 / time over the 4
#    GPUs together, against cuBLAS (torch.matmul) of the whole matrix on one GPU, in the same run.
# OUT/grid_bench.{json,md}; the whole part under GRID_DEADLINE_S, each child with its timeout.
# ---------------------------------------------------------------------------

GRID_OPS = ["cannon", "summa"]
GRID_SPECS = {op: ROOT / "specs" / f"{op}.yaml" for op in GRID_OPS}
GRID_WORLD, GRID_Q = 4, 2
GRID_CHECK_COUNT = 129  # rows of each block: a full row tile and a tail
GRID_CALLS = 20
GRID_SIZES = [8192, 16384]
GRID_ITERS, GRID_WARMUP = 10, 2
GRID_CHECK_TIMEOUT_S, GRID_BENCH_TIMEOUT_S, GRID_CUBLAS_TIMEOUT_S, GRID_DEADLINE_S = 32, 38, 15, 88


def grid_reference(xp, a, b, q):
    """Per rank (i, j): block (i, j) of the whole A . B, float32 (a[r], b[r]: rank r's blocks as
    float32 (count x K/q), (K/q x N/q)); the whole matrices are assembled from the blocks."""
    whole_a = xp.concatenate([xp.concatenate([a[i * q + j] for j in range(q)], axis=1) for i in range(q)])
    whole_b = xp.concatenate([xp.concatenate([b[i * q + j] for j in range(q)], axis=1) for i in range(q)])
    c = whole_a @ whole_b
    m, n = a[0].shape[0], b[0].shape[1]
    return [c[i * m:(i + 1) * m, j * n:(j + 1) * n] for i in range(q) for j in range(q)]


def grid_check(out: Path, ops: list[str]) -> dict:
    import cupy as cp

    from tsgen.runtime import World

    rows, ok = [], True
    with World(GRID_WORLD) as world:
        for name in ops:
            t0 = time.perf_counter()
            module = world.load(build(out, name, timeout_ms=5000, specs=GRID_SPECS))
            n, k = module.manifest["constants"]["N_TOTAL"], module.manifest["constants"]["K"]
            kb, nb, count = k // GRID_Q, n // GRID_Q, GRID_CHECK_COUNT
            bufs = module.alloc(count)
            try:
                arr = {(x, r): bufs.array(x, r).view(cp.uint16) for x in "abc" for r in world.ranks}
                rng = {}
                for r in world.ranks:
                    with cp.cuda.Device(world.devices[r]):
                        rng[r] = cp.random.default_rng(300 + r)
                errs, left = [], 0
                for call in range(GRID_CALLS):
                    poison = 0x7F80 | (0x41 + call % 60)
                    for r in world.ranks:
                        with cp.cuda.Device(world.devices[r]):
                            arr["a", r][:count * kb] = from_f32(cp, rng[r].standard_normal(count * kb, dtype=cp.float32))
                            arr["b", r][:kb * nb] = from_f32(cp, rng[r].standard_normal(kb * nb, dtype=cp.float32))
                            arr["c", r][...] = poison
                    world.synchronize()
                    module.launch(bufs)
                    world.synchronize()
                    host_a = {s: arr["a", s][:count * kb].get() for s in world.ranks}
                    host_b = {s: arr["b", s][:kb * nb].get() for s in world.ranks}
                    with cp.cuda.Device(world.devices[0]):  # through the host, on GPU 0
                        a32 = [to_f32(cp, cp.asarray(host_a[s])).reshape(count, kb) for s in world.ranks]
                        b32 = [to_f32(cp, cp.asarray(host_b[s])).reshape(kb, nb) for s in world.ranks]
                        refs = grid_reference(cp, a32, b32, GRID_Q)
                        for r in world.ranks:
                            got = to_f32(cp, cp.asarray(arr["c", r][:count * nb].get())).reshape(count, nb)
                            bad = ~cp.isfinite(got)
                            err = float(cp.linalg.norm(cp.where(bad, 0, got - refs[r])) / cp.linalg.norm(refs[r]))
                            errs.append(err + float(cp.count_nonzero(bad)))
                    for r in world.ranks:
                        with cp.cuda.Device(world.devices[r]):
                            left = max(left, int(cp.count_nonzero(arr["c", r][:count * nb] == poison)))
            finally:
                bufs.free()
            err = max(errs)
            passed = err <= MAX_REL_ERR and left == 0
            ok &= passed
            rows.append({"spec": name, "world": GRID_WORLD, "m_local": count, "calls": GRID_CALLS,
                         "max_rel_err": err, "poison_left": left, "pass": passed,
                         "seconds": round(time.perf_counter() - t0, 1)})
            print(f"  {name} world {GRID_WORLD}: {'PASS' if passed else 'FAIL'} max rel err {err:.2e}, "
                  f"{left} poisoned left", flush=True)
    return {"pass": ok, "rows": rows}


def grid_bench_tsgen(out: Path, ops: list[str]) -> dict:
    import cupy as cp

    from tsgen.runtime import World

    rows = []
    with World(GRID_WORLD) as world:
        for name in ops:
            module = world.load(build(out, name, timeout_ms=5000, specs=GRID_SPECS))
            n, k = module.manifest["constants"]["N_TOTAL"], module.manifest["constants"]["K"]
            for size in GRID_SIZES:
                if size != n or size != k:  # N and K are compiled in: other sizes need their own spec
                    module = world.load(build_sized(out, name, size))
                    n = k = size
                kb, nb, count = k // GRID_Q, n // GRID_Q, size // GRID_Q
                bufs = module.alloc(count)
                try:
                    for r in world.ranks:
                        with cp.cuda.Device(world.devices[r]):
                            g = cp.random.default_rng(r)
                            bufs.array("a", r).view(cp.uint16)[:count * kb] = from_f32(
                                cp, g.standard_normal(count * kb, dtype=cp.float32))
                            bufs.array("b", r).view(cp.uint16)[:kb * nb] = from_f32(
                                cp, g.standard_normal(kb * nb, dtype=cp.float32))
                    ms = time_tsgen(world, module, bufs, GRID_ITERS, GRID_WARMUP)
                    # the timed output is right: the first 64 rows of C_00 = sum_s A_0s . B_s0
                    with cp.cuda.Device(world.devices[0]):
                        ref = None
                        for s in range(GRID_Q):
                            a_s = to_f32(cp, cp.asarray(bufs.array("a", s).view(cp.uint16)[:64 * kb].get()))
                            b_s = to_f32(cp, cp.asarray(bufs.array("b", s * GRID_Q).view(cp.uint16)[:kb * nb].get()))
                            x = a_s.reshape(64, kb) @ b_s.reshape(kb, nb)
                            ref = x if ref is None else ref + x
                        got = to_f32(cp, bufs.array("c", 0).view(cp.uint16)[:64 * nb]).reshape(64, nb)
                        err = float(cp.linalg.norm(got - ref) / cp.linalg.norm(ref))
                finally:
                    bufs.free()
                rows.append({"impl": f"tsgen {name}", "size": size, "us": ms * 1e3, "rel_err": err})
                print(f"  tsgen {name} {size}^3: {ms * 1e3:.1f} us (rel err {err:.1e})", flush=True)
    return {"rows": rows}


def build_sized(out: Path, name: str, size: int) -> Path:
    """Shipped spec `name` with N = K = size (renamed), rendered into OUT/build."""
    import yaml

    data = yaml.safe_load(GRID_SPECS[name].read_text())
    data["name"] = f"{data['name']}_{size}"
    data["params"]["n"] = data["params"]["k"] = size
    data.setdefault("sync", {})["timeout_ms"] = 5000
    path = out / "build" / "sized" / f"{data['name']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return build(out, data["name"], timeout_ms=None, specs={data["name"]: path})


def grid_cublas() -> dict:
    """cuBLAS (torch.matmul) of the whole size^3 bf16 problem on GPU 0."""
    import torch

    rows = []
    dev = torch.device("cuda", 0)
    for size in GRID_SIZES:
        a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
        b = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
        with torch.cuda.device(dev):
            us = time_torch(lambda: torch.matmul(a, b), GRID_ITERS, GRID_WARMUP)
        rows.append({"impl": "cuBLAS (1 GPU, whole matrix)", "size": size, "us": us})
        print(f"  cuBLAS {size}^3 on one GPU: {us:.1f} us", flush=True)
        del a, b
        torch.cuda.empty_cache()
    return {"rows": rows}


def grid_markdown(s: dict) -> str:
    lines = [f"# cannon / summa on a {GRID_Q} x {GRID_Q} grid ({GRID_WORLD} GPUs), bf16, C = A . B (whole size^3)", "",
             f"Device: {s['device']}; {s['date']}; `{s['command']}`; {GRID_ITERS} calls back to back per sample, median of {SAMPLES} samples.", "",
             "| correctness | world | rows per block | calls | max rel err | poison left | result |",
             "|---|---|---|---|---|---|---|"]
    for c in s["checks"]:
        for r in c.get("rows", []):
            lines.append(f"| {r['spec']} | {r['world']} | {r['m_local']} | {r['calls']} | {r['max_rel_err']:.2e} | "
                         f"{r['poison_left']} | {'PASS' if r['pass'] else 'FAIL'} |")
        if "crashed" in c:
            lines.append(f"| | | | | | | CRASHED: {c['crashed'][-1] if c['crashed'] else ''} |")
    lines += ["", "| size (M = N = K) | impl | time (us) | TFLOP/s (all GPUs) | vs cuBLAS 1 GPU |", "|---|---|---|---|---|"]
    for r in s["rows"]:
        vs = f"{r['vs_cublas']:.2f}" if r.get("vs_cublas") else ""
        lines.append(f"| {r['size']} | {r['impl']} | {r['us']:.1f} | {r['tflops']:.0f} | {vs} |")
    for name, err in s.get("errors", {}).items():
        lines.append(f"\n{name}: {err}")
    lines += ["", f"All checks: {'PASS' if s['all_checks_pass'] else 'FAIL'} ({s['seconds']} s)", ""]
    return "\n".join(lines)


def run_grid(out: Path, gpus: int, device: str, ops: list[str]) -> bool:
    """cannon / summa: checks, timing, OUT/grid_bench.{json,md}; True when all checks passed."""
    started = time.perf_counter()
    deadline = started + GRID_DEADLINE_S
    checks, all_ok, errors, rows = [], True, {}, []
    if gpus < GRID_WORLD:
        errors["grid"] = f"needs {GRID_WORLD} GPUs, found {gpus}"
        all_ok = False
    else:
        steps = [("check", "grid_check", GRID_CHECK_TIMEOUT_S), ("tsgen bench", "grid_bench", GRID_BENCH_TIMEOUT_S),
                 ("cuBLAS", "grid_cublas", GRID_CUBLAS_TIMEOUT_S)]
        for label, kind, limit in steps:
            left = int(min(limit, deadline - time.perf_counter()))
            if left < 5:
                errors[label] = "skipped: out of time"
                all_ok = False
                continue
            t0 = time.perf_counter()
            result, text = child([str(out), "--child", kind, ",".join(ops)], timeout=left)
            print(f"grid {label} ({time.perf_counter() - t0:.0f} s):")
            print("\n".join("  " + x for x in text.strip().splitlines()[-10:] if not x.startswith("RESULT ")),
                  flush=True)
            if result is None:
                all_ok = False
                if kind == "grid_check":
                    checks.append({"pass": False, "crashed": text.strip().splitlines()[-20:]})
                else:
                    errors[label] = text.strip().splitlines()[-1] if text.strip() else "?"
            elif kind == "grid_check":
                checks.append(result)
                all_ok &= result["pass"]
            else:
                rows += result["rows"]
    cublas = {r["size"]: r["us"] for r in rows if r["impl"].startswith("cuBLAS")}
    for r in rows:
        r["tflops"] = 2.0 * r["size"] ** 3 / r["us"] / 1e6
        r["vs_cublas"] = cublas[r["size"]] / r["us"] if r["size"] in cublas else None
    summary = {
        "device": f"{gpus} x {device}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "tools/gpu_fused.py", *sys.argv[1:]]),
        "checks": checks, "rows": rows, "errors": errors,
        "all_checks_pass": all_ok, "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "grid_bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = grid_markdown(summary)
    (out / "grid_bench.md").write_text(text)
    print()
    print(text)
    return all_ok


if __name__ == "__main__":
    sys.exit(main())
