"""GPU checks of the one-process-per-GPU backends (ipc, nvshmem) that need more than
`tsgen test` (tools/gpu_ipc.sh and tools/gpu_nvshmem.sh run them; each prints PASS or
FAIL and exits 0 or 1).

  warm SPEC...              render + compile the specs in parallel (every rank then hits the cache)
  dying-rank SPEC [--nproc 4] [--rank 1] [--call 2] [--backend ipc|nvshmem]
                            `tsgen launch` of `die` below; PASS when launch returns rank R's
                            137 and every other rank printed the kernel's timeout diagnostic
                            and exited non-zero on its own (1 or 2, not stopped by the launcher)
  die SPEC --rank R --call K --backend B
                            (one rank of the above) `tsgen test --backend B`, but rank R
                            kills itself (SIGKILL) just before launching call K
  cycles SPEC --backend B [--gpus N] [--cycles 100]
                            create / use / destroy a World that many times; device memory
                            (cudaMemGetInfo) must come back to where it was after the first
  compare SINGLE.json IPC.json [--bar 0.05]
                            `tsgen bench --json` rows of the same spec and size: the ipc time
                            within `bar` of the single-process time
  busbw JSON...             one table of `tsgen bench --json` files' tsgen rows (spec, backend,
                            size, time, busbw), for results files
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tsgen.errors import TsgenError  # noqa: E402
from tsgen.harness import leave_now, materialize, run_test  # noqa: E402
from tsgen.spec import load_spec  # noqa: E402

MiB = 1 << 20


def warm(specs: list[str]) -> int:
    from tsgen.toolchain import compile_source

    jobs = []  # (source, mode): what World.load compiles
    for s in specs:
        manifest = materialize(load_spec(s))
        data = json.loads(manifest.read_text())
        source = manifest.with_name(data["source"])
        libs = tuple(data.get("device_libs", []))
        jobs += [(source, "cubin", libs)] + ([(source, "shared", ())] if data.get("host_launch") else [])
    with ThreadPoolExecutor(max_workers=min(16, len(jobs))) as pool:  # nvcc runs as a subprocess
        results = list(pool.map(lambda job: compile_source(job[0], mode=job[1], link=job[2]), jobs))
    for (source, mode, _), r in zip(jobs, results):
        print(f"{source.name} ({mode}): {'cached' if r.cached else 'compiled'} {r.output.name}")
    return 0


def die(spec: str, rank: int, call: int, backend: str) -> int:
    from tsgen.runtime.ipc import process_env

    me = process_env(os.environ).rank

    def maybe_die(c: int) -> None:
        if me == rank and c == call:
            print(f"rank {me}: dying before call {c} (SIGKILL)", flush=True)
            time.sleep(0.5)  # the peers launch call c meanwhile: they wait for a rank that is gone
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        ok = run_test(spec, None, iters=call + 3, backend=backend, before_launch=maybe_die)
    except TsgenError as e:
        print(f"tsgen: {e}", file=sys.stderr)
        leave_now(e.exit_code)
    print(f"rank {me}: FAIL: the run ended ({'right' if ok else 'wrong'} results) although rank {rank} died")
    return 1


def dying_rank_verdict(rc: int, out: str, nproc: int, rank: int) -> list[str]:
    """What is wrong with a dying-rank run (launch's exit code and output), or []. Pure."""
    import re

    problems = [] if rc == 128 + signal.SIGKILL else [f"tsgen launch returned {rc}, not {128 + signal.SIGKILL} "
                                                       f"(rank {rank}'s SIGKILL)"]
    codes = dict((int(r), int(c)) for r, c in re.findall(r"rank (\d+): (-?\d+)", "".join(
        re.findall(r"tsgen launch: exit codes: (.*)", out)[-1:])))
    for r in range(nproc):
        if r == rank:
            continue
        if not re.search(rf"^\[rank {r}\] tsgen: timeout: rank {r} ", out, re.MULTILINE):
            problems.append(f"rank {r} printed no timeout diagnostic")
        if codes.get(r) not in (1, 2):
            problems.append(f"rank {r} exit code {codes.get(r)} (want 1 or 2: ended on its own)")
    return problems


def dying_rank(spec: str, nproc: int, rank: int, call: int, backend: str, limit: float = 80) -> int:
    import subprocess

    cmd = [sys.executable, "-m", "tsgen", "launch", "--nproc", str(nproc), "--grace", "45", "--",
           sys.executable, __file__, "die", spec, "--rank", str(rank), "--call", str(call), "--backend", backend]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"{e.stdout or ''}{e.stderr or ''}\n(hung: still running after {limit:g} s)"
    print(out.rstrip())
    problems = dying_rank_verdict(rc, out, nproc, rank)
    print(f"dying rank {rank} at call {call}, {nproc} ranks ({backend}), {time.perf_counter() - t0:.1f} s: "
          + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
    return 1 if problems else 0


def device_memory_used(cp, devices: list[int]) -> dict[int, int]:
    gc.collect()
    used = {}
    for d in devices:
        with cp.cuda.Device(d):
            cp.cuda.runtime.deviceSynchronize()
            cp.get_default_memory_pool().free_all_blocks()  # the current device's pool
            free, total = cp.cuda.runtime.memGetInfo()
            used[d] = total - free
    return used


def cycles(spec: str, backend: str, gpus: int | None, n: int, tolerance: int = 2 * MiB) -> int:
    from tsgen.runtime import World

    manifest = materialize(load_spec(spec))
    count = 4 << 20  # elements per rank: a heap of tens of MiB, so one leaked heap shows

    def one_cycle() -> list[int]:
        with World(gpus, backend=backend) as world:
            module = world.load(manifest)
            bufs = module.alloc(count)
            try:
                module.launch(bufs)
                world.synchronize()
                world.barrier("cycle: every kernel done")
            finally:
                bufs.free()
            return sorted(world.devices.values())

    devices = one_cycle()  # first: contexts, peer access, module code; not counted
    import cupy as cp

    before = device_memory_used(cp, devices)
    t0 = time.perf_counter()
    for i in range(n):
        one_cycle()
        if (i + 1) % 10 == 0:
            print(f"{backend}: {i + 1} cycles, {time.perf_counter() - t0:.1f} s", flush=True)
    elapsed = time.perf_counter() - t0
    after = device_memory_used(cp, devices)
    ok = True
    for d in devices:
        delta = after[d] - before[d]
        ok &= abs(delta) <= tolerance
        print(f"{backend} GPU {d}: {n} cycles in {elapsed:.1f} s; device memory used {before[d] / MiB:.1f} MiB "
              f"before, {after[d] / MiB:.1f} MiB after ({delta:+d} bytes): {'PASS' if abs(delta) <= tolerance else 'FAIL'}")
    return 0 if ok else 1


def compare(single_json: str, ipc_json: str, bar: float) -> int:
    rows = {}
    for label, path in (("single", single_json), ("ipc", ipc_json)):
        data = json.loads(Path(path).read_text())["rows"]
        rows[label] = {(r["spec"], r["size"]): r for r in data if r.get("impl") == "tsgen"}
    common = sorted(set(rows["single"]) & set(rows["ipc"]))
    if not common:
        print(f"FAIL: no (spec, size) in both {single_json} and {ipc_json}")
        return 1
    ok = True
    for key in common:
        s, i = rows["single"][key]["time_us"], rows["ipc"][key]["time_us"]
        ratio = i / s
        good = abs(ratio - 1) <= bar
        ok &= good
        print(f"{key[0]} {key[1] / MiB:g} MiB: single {s:.1f} us ({rows['single'][key]['busbw_GBps']:.1f} GB/s busbw), "
              f"ipc {i:.1f} us ({rows['ipc'][key]['busbw_GBps']:.1f} GB/s); ipc/single time {ratio:.3f}: "
              f"{'PASS' if good else 'FAIL'} (bar: within {bar:.0%})")
    return 0 if ok else 1


def busbw(paths: list[str]) -> int:
    """A Markdown table of the tsgen rows of `tsgen bench --json` files."""
    print("| spec | backend | size | time (us) | busbw (GB/s) | #wrong |\n|---|---|---|---|---|---|")
    for path in paths:
        data = json.loads(Path(path).read_text())
        for r in data["rows"]:
            if r.get("impl") == "tsgen" and r.get("time_us"):
                wrong = "-" if r.get("wrong") is None else r["wrong"]
                print(f"| {r['spec']} | {data['meta'].get('backend', 'single')} | {r['size'] / MiB:g} MiB "
                      f"| {r['time_us']:.1f} | {r['busbw_GBps']:.1f} | {wrong} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("warm")
    p.add_argument("specs", nargs="+")
    p = sub.add_parser("dying-rank")
    p.add_argument("spec")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--call", type=int, default=2)
    p.add_argument("--backend", choices=["ipc", "nvshmem"], default="ipc")
    p = sub.add_parser("die")
    p.add_argument("spec")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--call", type=int, default=2)
    p.add_argument("--backend", choices=["ipc", "nvshmem"], default="ipc")
    p = sub.add_parser("cycles")
    p.add_argument("spec")
    p.add_argument("--backend", choices=["single", "ipc", "nvshmem"], required=True)
    p.add_argument("--gpus", type=int, default=None)
    p.add_argument("--cycles", type=int, default=100)
    p = sub.add_parser("compare")
    p.add_argument("single_json")
    p.add_argument("ipc_json")
    p.add_argument("--bar", type=float, default=0.05)
    p = sub.add_parser("busbw")
    p.add_argument("jsons", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "warm":
        return warm([s if s.endswith(".yaml") else f"specs/{s}.yaml" for s in a.specs])
    if a.cmd == "dying-rank":
        return dying_rank(a.spec, a.nproc, a.rank, a.call, a.backend)
    if a.cmd == "die":
        return die(a.spec, a.rank, a.call, a.backend)
    if a.cmd == "busbw":
        return busbw(a.jsons)
    if a.cmd == "cycles":
        return cycles(a.spec, a.backend, a.gpus, a.cycles)
    return compare(a.single_json, a.ipc_json, a.bar)


if __name__ == "__main__":
    sys.exit(main())
