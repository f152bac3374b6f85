"""Experiment: the bare cost of a small all_reduce's synchronization on 4 GPUs, next to
tsgen's one_shot / two_shot_pull at 1 KiB in the same run.

tsgen's one_shot takes ~10.5 us at 1 KiB where PyTorch symm-mem's takes ~6.4 (2026-11-21,
commit ab1d18b): a fixed cost, not data. The kernels in tools/exp_sync_latency.cu do only
the two signal hops of a one_shot (block-pairwise, as symm-mem does), with and without a
fence on the entry signal, plus an empty kernel and tsgen's call numbering alone. Each is
timed as tsgen bench times collectives: a CUDA graph of CALLS back-to-back calls per GPU,
one untimed call on every rank first to line them up, time per call = max over GPUs of graph
time / CALLS, median of REPS.

Prediction (written before its first run): hops ~5-6 us (symm-mem's 6.4 minus its data);
then ~4 us of tsgen's 10.5 is the plan interpreter (table loads, per-share barriers, 64-bit
range math) and a rendering without tables is worth building; if hops is ~9-10 us, the
signal primitives themselves are the cost. Outcome: hops 4.0-5.3 us, the interpreter was the
cost (results/exp_sync_latency_w4.md, 2026-11-21; docs/design/plans.md).

Usage: python tools/exp_sync_latency.py OUT
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tsgen.runtime import World  # noqa: E402
from tsgen.toolchain import compile_source  # noqa: E402

MAX_WORLD, MAX_BLOCKS = 8, 64  # as in exp_sync_latency.cu
SIG_BYTES = 2 * MAX_BLOCKS * MAX_WORLD * 8
CALLS, REPS, THREADS = 32, 7, 512
VARIANTS = [("empty", 1), ("epoch", 1), ("epoch", 32), ("hops", 1), ("hops", 8), ("hops", 32),
            ("hops_fenced", 1), ("hops_fenced", 32)]


def main() -> int:
    import cupy as cp

    from tsgen.bench import bench_spec
    from tsgen.bench.timing import CupyClock, time_calls

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    world_size = 4
    cubin = compile_source(ROOT / "tools" / "exp_sync_latency.cu").output
    rows = []
    with World(world_size) as world:
        bases = world.backend.alloc_heap(SIG_BYTES + 16)
        tables = world.backend.peer_tables(bases)
        fns, streams = {}, {}
        for r in world.ranks:
            with cp.cuda.Device(world.devices[r]):
                mod = cp.RawModule(path=str(cubin))
                fns[r] = {n: mod.get_function(n) for n in ("empty", "epoch", "hops", "hops_fenced")}
                streams[r] = cp.cuda.Stream(non_blocking=True)
        try:
            for name, blocks in VARIANTS:
                for r in world.ranks:  # fresh counters: every variant starts at epoch 1
                    with cp.cuda.Device(world.devices[r]):
                        cp.cuda.runtime.memset(bases[r], 0, SIG_BYTES + 16)
                world.synchronize()

                def launch(i, ranks):
                    for r in ranks:
                        with cp.cuda.Device(world.devices[r]):
                            args = (tables[r].data.ptr, cp.int32(r), cp.int32(world_size),
                                    cp.uint64(bases[r] + SIG_BYTES), cp.uint64(bases[r]))
                            fns[r][name]((blocks,), (THREADS,), args, stream=streams[r])

                # tsgen's timing core: a CUDA graph of CALLS calls per GPU, an untimed call lining the
                # ranks up before each sample, the slowest GPU's time per call, median of REPS
                timing = time_calls(CupyClock(world), world.ranks, streams, launch, calls=CALLS, reps=REPS, warmup=1,
                                    graphs=True, lineup=True, label=name)
                assert not timing.problems, timing.problems
                t = timing.median_us
                rows.append({"kernel": name, "blocks": blocks, "threads": THREADS, "time_us": t})
                print(f"{name:12s} blocks {blocks:3d}  {t:7.2f} us per call", flush=True)
        finally:
            world.backend.free_heap(bases)
    for spec in ("all_reduce_one_shot", "all_reduce_two_shot_pull"):
        for r in bench_spec(ROOT / "specs" / f"{spec}.yaml", world_size, [1024], baselines=False,
                            echo=lambda s: None).rows:
            rows.append({"kernel": f"tsgen {spec} (1 KiB)", "blocks": None, "threads": None, "time_us": r["time_us"]})
            print(f"tsgen {spec} 1 KiB  {r['time_us']:7.2f} us per call", flush=True)
    (out / "exp_sync_latency.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
