"""`tsgen bench`: time a spec's kernel and the copy engine in the same run.

For the copy primitives the baseline is cudaMemcpyPeerAsync moving the same
bytes between the same GPUs. Two patterns:
  pair: only rank 0 runs (to its ring neighbour): one link direction, timed
        with CUDA events on rank 0's stream;
  ring: every rank runs at once (each to its neighbour), timed on the host
        around all ranks' work; GB/s is per rank.
Each size: warm-up calls, then the median of `reps` timings of `iters` calls.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

from .errors import RuntimeSetupError
from .harness import materialize
from .ops import get_family
from .spec import load_spec

# Sizes are parsed and printed one way everywhere (tsgen.baselines owns it).
from .baselines import human, parse_size, parse_sizes  # noqa: E402,F401


def bench_copy(
    spec_path: str | Path,
    gpus: int,
    sizes: list[int],
    iters: int = 20,
    reps: int = 5,
    patterns: tuple[str, ...] = ("pair", "ring"),
    arch: str = "sm_90a",
    echo: Callable[[str], None] = print,
    share_gpus: bool | None = None,
) -> list[dict]:
    from .harness import shared_gpu_variant
    from .runtime import World

    loaded = load_spec(spec_path)
    spec = loaded.model
    family = get_family(spec.op)
    if family.count_unit != "bytes":
        raise RuntimeSetupError(f"{spec_path}: bench compares byte-copy ops with the copy engine; {spec.op} is not one")
    rows = []
    with World(gpus, share_gpus=share_gpus) as world:
        cp = world.cp
        loaded = shared_gpu_variant(loaded, world, echo)
        module = world.load(materialize(loaded), arch=arch)
        streams = world.streams
        shift = spec.params.shift
        put = family.direction == "put"
        for nbytes in sizes:
            bufs = module.alloc(nbytes)
            try:
                for rank in world.ranks:
                    with cp.cuda.Device(world.devices[rank]):
                        bufs.array("src", rank)[...] = cp.random.randint(0, 256, nbytes, dtype=cp.uint8)
                world.synchronize()
                for pattern in patterns:
                    ranks = [0] if pattern == "pair" else world.ranks

                    def kernel_calls():
                        for _ in range(iters):
                            module.launch(bufs, ranks=ranks, streams=streams)

                    def engine_calls():
                        for _ in range(iters):
                            for r in ranks:
                                peer = (r + shift) % gpus
                                # same direction of data as the kernel
                                s_rank, d_rank = (r, peer) if put else (peer, r)
                                with cp.cuda.Device(world.devices[r]):
                                    cp.cuda.runtime.memcpyPeerAsync(
                                        bufs.bases[d_rank] + bufs.by_name["dst"].offset, world.devices[d_rank],
                                        bufs.bases[s_rank] + bufs.by_name["src"].offset, world.devices[s_rank],
                                        nbytes, streams[r].ptr)

                    t_kernel = _time(world, streams, ranks, kernel_calls, iters, reps)
                    t_engine = _time(world, streams, ranks, engine_calls, iters, reps)
                    row = {
                        "op": spec.op, "spec": spec.name, "gpus": gpus, "pattern": pattern, "bytes": nbytes,
                        "kernel_us": t_kernel * 1e6, "copy_engine_us": t_engine * 1e6,
                        "kernel_GBps": nbytes / t_kernel / 1e9, "copy_engine_GBps": nbytes / t_engine / 1e9,
                    }
                    if world.shared:  # ranks sharing a GPU: no ratio, see SHARED_NOTE
                        row["note"] = SHARED_NOTE
                    else:
                        row["ratio"] = row["kernel_GBps"] / row["copy_engine_GBps"]
                    rows.append(row)
                    echo(f"{spec.name:12s} {pattern:4s} {human(nbytes):>6s}  kernel {row['kernel_GBps']:7.1f} GB/s  "
                         f"memcpyPeer {row['copy_engine_GBps']:7.1f} GB/s  "
                         + (SHARED_NOTE if world.shared else f"ratio {row['ratio']:.3f}"))
            finally:
                bufs.free()
    return rows


# Ranks sharing a GPU compete for its SMs, its L2 and its copy engines, and their "peer"
# traffic never leaves the GPU: such timings say nothing about the op. They are printed (the
# bench and its correctness check still run) but carry no ratio and go into no results table.
SHARED_NOTE = "shared GPU: not comparable"


def _time(world, streams, ranks, calls, iters, reps) -> float:
    """Median seconds per call. One rank: CUDA events on its stream; several: host
    clock around all of them after a full synchronize."""
    cp = world.cp
    calls()  # warm-up
    world.synchronize()
    samples = []
    for _ in range(reps):
        if len(ranks) == 1:
            r = ranks[0]
            with cp.cuda.Device(world.devices[r]):
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(streams[r])
            calls()
            with cp.cuda.Device(world.devices[r]):
                end.record(streams[r])
                end.synchronize()
                samples.append(cp.cuda.get_elapsed_time(start, end) / 1e3 / iters)
        else:
            world.synchronize()
            t0 = time.perf_counter()
            calls()
            for r in ranks:
                with cp.cuda.Device(world.devices[r]):
                    streams[r].synchronize()
            samples.append((time.perf_counter() - t0) / iters)
    world.synchronize()
    return statistics.median(samples)


def write_results(rows: list[dict], json_path: Path, meta: dict) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


# ---------------------------------------------------------------------------
# Collectives: tsgen (CUDA graphs per GPU) against NCCL and symm-mem
# ---------------------------------------------------------------------------

# ops with an NCCL counterpart and an nccl-tests size convention
BENCH_OPS = frozenset({"allgather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast"})


def per_rank_count(op: str, nbytes: int, dtype: str, world: int) -> int:
    """tsgen's `count` for an nccl-tests size in bytes (see tsgen.baselines.elem_counts)."""
    from .baselines import elem_counts

    c = elem_counts(op, nbytes, dtype, world)
    return {"allgather": c.n_in, "reduce_scatter": c.n_out, "all_to_all": c.n_in // world}.get(op, c.n_in)


def _fill_random(cp, arr, dtype: str) -> None:
    """Random normal data of `dtype` into a CuPy array (bfloat16 as its bits)."""
    n = arr.size
    if dtype == "int32":
        arr[...] = cp.random.randint(-1000, 1000, n, dtype=cp.int32)
    elif dtype == "bfloat16":
        f = cp.random.standard_normal(n, dtype=cp.float32)
        arr[...] = (f.view(cp.uint32) >> 16).astype(cp.uint16)
    else:
        arr[...] = cp.random.standard_normal(n).astype(arr.dtype)


CHECK_UP_TO = 64 << 20  # sizes whose results are checked against the NumPy reference


def check_once(world, module, bufs, spec, gpus: int, count: int) -> int:
    """One call on fresh inputs, compared with the family's reference: wrong elements
    over all ranks (every process returns the same number)."""
    import numpy as np

    from .harness import load_call, wrong_elements

    family = get_family(spec.op)
    inputs = family.make_inputs(spec, gpus, count, np.random.default_rng(12345), pattern=False)
    load_call(world, bufs, inputs, 0)
    world.synchronize()
    world.barrier("check: inputs loaded, outputs poisoned")  # see harness.run_test
    module.launch(bufs)
    world.synchronize()
    world.barrier("check: every kernel done")
    expected = family.reference(spec, gpus, count, inputs)
    tol = family.tolerance(spec, gpus, count, inputs)
    mine = sum(int(wrong_elements(bufs.array(name, r).get(), per_rank[r],
                                  None if tol is None else tol[name][r],
                                  None if tol is None else spec.dtype,
                                  0 if family.poison_survives(spec) else None).size)
               for name, per_rank in expected.items() for r in world.ranks)
    return sum(world.exchange("check: wrong elements", mine))


def bench_collective(spec_path, gpus: int | None, sizes: list[int], iters: int = 20, reps: int = 7,
                     arch: str = "sm_90a", echo: Callable[[str], None] = print,
                     max_sets: int = 32, backend: str = "single", share_gpus: bool | None = None) -> list[dict]:
    """Median time per call of the spec's collective at each size (bytes, nccl-tests
    convention). Each GPU replays a CUDA graph of back-to-back calls (so one host
    thread's launch skew is paid once per graph, not per call); calls rotate over
    several buffer sets below 64 MiB so small sizes are not timed on a hot L2.
    Before each replay one untimed call lines the ranks up on the devices (its
    entry signals), so host skew -- across processes with the "ipc" backend --
    stays out of the timing. Time per call = max over ranks of (graph time /
    calls); with "ipc" every process times its rank and the maxima meet in the
    store, so every process returns the same rows."""
    from .baselines import busbw_factor, rotation_slots
    from .harness import shared_gpu_variant
    from .runtime import World

    loaded = load_spec(spec_path)
    spec = loaded.model
    if spec.op not in BENCH_OPS:
        raise RuntimeSetupError(
            f"{spec_path}: tsgen bench times {', '.join(sorted(BENCH_OPS))} against NCCL; op {spec.op} "
            + ("takes a counts matrix as input: time it from your own script" if spec.op == "all_to_all_v"
               else "has its own benchmark: tools/gpu_gemm.py or tools/gpu_fused.py"))
    rows = []
    with World(gpus, backend=backend, share_gpus=share_gpus) as world:
        cp = world.cp
        gpus = world.size
        loaded = shared_gpu_variant(loaded, world, echo)
        module = world.load(materialize(loaded), arch=arch)
        streams = world.streams
        for nbytes in sizes:
            count = per_rank_count(spec.op, nbytes, spec.dtype, gpus)
            probe = module.alloc(count)
            heap = probe.heap_bytes
            sets = [probe] + [module.alloc(count) for _ in range(min(max_sets, rotation_slots(nbytes, heap)) - 1)]
            try:
                for b in sets:
                    for r in world.ranks:
                        with cp.cuda.Device(world.devices[r]):
                            for s in b.slots:
                                if s.role in ("input", "inout"):
                                    _fill_random(cp, b.array(s.name, r), spec.dtype)
                world.synchronize()
                wrong = check_once(world, module, sets[0], spec, gpus, count) if nbytes <= CHECK_UP_TO else None
                calls = len(sets) * max(1, -(-iters // len(sets)))
                for _ in range(2):  # warm-up: every set once
                    for b in sets:
                        module.launch(b, streams=streams)
                world.synchronize()
                graphs = {}
                for r in world.ranks:
                    with cp.cuda.Device(world.devices[r]):
                        streams[r].begin_capture()
                        for i in range(calls):
                            module.launch(sets[i % len(sets)], ranks=[r], streams=streams)
                        graphs[r] = streams[r].end_capture()
                samples = []
                for rep in range(reps):
                    events = []
                    # untimed, on every rank at once (host launchers need that): lines the ranks up
                    module.launch(sets[0], streams=streams)
                    for r in world.ranks:
                        with cp.cuda.Device(world.devices[r]):
                            start, end = cp.cuda.Event(), cp.cuda.Event()
                            start.record(streams[r])
                            graphs[r].launch(streams[r])
                            end.record(streams[r])
                            events.append((start, end))
                    world.synchronize()
                    mine = max(cp.cuda.get_elapsed_time(s, e) for s, e in events) / 1e3 / calls
                    samples.append(max(world.exchange(f"bench {nbytes} B: sample {rep}", mine)))
                t = statistics.median(samples)
            finally:
                for b in sets:
                    b.free()
            row = {"backend": "tsgen", "spec": spec.name, "op": spec.op, "dtype": spec.dtype, "bytes": nbytes,
                   "world": gpus, "time_us": t * 1e6, "algbw_GBps": nbytes / t / 1e9,
                   "busbw_GBps": nbytes / t / 1e9 * busbw_factor(spec.op, gpus), "sets": len(sets), "calls": calls,
                   "wrong": wrong, **({"note": SHARED_NOTE} if world.shared else {})}
            rows.append(row)
            echo(f"{spec.name:28s} {human(nbytes):>6s}  {row['time_us']:9.1f} us  busbw {row['busbw_GBps']:7.1f} GB/s")
    return rows


def best_baselines(op: str, dtype: str, sizes: list[int], world: int, timeout: float = 400) -> list[dict]:
    """NCCL (and symm-mem for all_reduce) at their best: the faster of CUDA graphs over
    rotated buffers and an eager loop on one buffer (hot L2, as nccl-tests runs), per
    backend and size. Graph capture with thousands of distinct buffers made NCCL's
    small sizes 3-5x slower than its eager loop (results/tuning), so both are timed."""
    from .baselines import run_baselines

    best: dict = {}
    for cfg in ({"use_graphs": True, "rotate": True}, {"use_graphs": False, "rotate": False}):
        for r in run_baselines(op, dtype, sizes, world, timeout=timeout, **cfg):
            r["config"] = "graph+rotate" if cfg["use_graphs"] else "eager, one buffer"
            key = (r["backend"], r["bytes"])
            old = best.get(key)
            if old is None or (r.get("time_us") and (not old.get("time_us") or r["time_us"] < old["time_us"])):
                best[key] = r
    return list(best.values())


def collective_table(rows: list[dict]) -> str:
    """nccl-tests-style table: one line per size, tsgen next to every baseline, with ratios."""
    from .baselines import human as hsize

    base = sorted({r["backend"] for r in rows if r.get("backend") != "tsgen" and r.get("time_us")})
    head = f"{'size':>8} {'tsgen us':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
    for b in base:
        head += f" | {b[:18]:>18} us {'busbw':>7} {'ratio':>5}"
    lines = [head, "-" * len(head)]
    by = {}
    for r in rows:
        by.setdefault(r["bytes"], {})[r["backend"]] = r
    for size in sorted(by):
        t = by[size].get("tsgen")
        if not t:
            continue
        wrong = "-" if t.get("wrong") is None else str(t["wrong"])
        line = f"{hsize(size):>8} {t['time_us']:9.1f} {t['algbw_GBps']:7.1f} {t['busbw_GBps']:7.1f} {wrong:>6}"
        if t.get("note"):  # a shared GPU: no baseline, no ratio
            lines.append(f"{line}  {t['note']}")
            continue
        for b in base:
            o = by[size].get(b)
            if o and o.get("time_us"):
                line += f" | {o['time_us']:21.1f} {o['busbw_GBps']:7.1f} {t['busbw_GBps'] / o['busbw_GBps']:5.2f}"
            else:
                line += f" | {'-':>21} {'-':>7} {'-':>5}"
        lines.append(line)
    lines.append("ratio = tsgen busbw / baseline busbw (> 1: tsgen faster); #wrong checked up to 64 MiB")
    return "\n".join(lines)


def plot_busbw(rows: list[dict], path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeSetupError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend in sorted({r["backend"] for r in rows if r.get("time_us")}):
        pts = sorted((r["bytes"], r["busbw_GBps"]) for r in rows if r["backend"] == backend and r.get("time_us"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    op = next((r["op"] for r in rows), "")
    ax.set_title(f"{op}: tsgen vs baselines")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
