"""Experiment: do bulk async copies (TMA engine: global -> shared -> peer global) push more
bytes per second into three peers at once than 16-byte SM stores?

Every GPU of 4 sends S bytes to each of its 3 peers at the same time (the all_to_all
pattern, where SM stores top out near 333 GB/s of egress per GPU: all_to_all in
results/collectives_tune3_w4.md, 2026-11-21). Kernels in tools/exp_bulk_put.cu; CTAs split
evenly over the peers. Prints egress GB/s per GPU (3 S / time, time = max over GPUs of a
CUDA-event timed loop) and checks every destination slice against its sender's source.

Prediction (written before its first run): put_bulk reaches the same ~330 GB/s -- the limit
measured so far looks like NVLink egress with three destinations, not the SM store path; if
put_bulk goes past 360 GB/s, a bulk-copy transport for all_to_all is worth building (issue
3). Outcome: both 347 GB/s (results/exp_bulk_put_w4.md, 2026-11-21;
docs/design/transports.md).

Usage: python tools/exp_bulk_put.py OUT [--bytes 256M]
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tsgen.bench.sizes import parse_size  # noqa: E402
from tsgen.bench.timing import CupyClock, time_calls  # noqa: E402
from tsgen.runtime import World  # noqa: E402
from tsgen.toolchain import compile_source  # noqa: E402

CHUNK, STAGES = 32 * 1024, 4  # as in exp_bulk_put.cu
VARIANTS = [("put_v4", c, 512) for c in (8, 16, 32, 44)] + [("put_bulk", c, 32) for c in (2, 4, 8, 16, 32, 44)]


def view(cp, world, addr, size):
    """`size` bytes at device address `addr` as a CuPy uint8 array (no copy)."""
    return cp.ndarray((size,), cp.uint8, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(addr, size, world), 0))


def summary(cp, world, rank, addr, size):
    """(sum of the 64-bit words mod 2^64, first MiB, last MiB) of `size` bytes at `addr` on `rank`."""
    with cp.cuda.Device(world.devices[rank]):
        arr = view(cp, world, addr, size)
        edge = min(size, 1 << 20)
        return int(arr.view(cp.uint64).sum()), arr[:edge].get().tobytes(), arr[-edge:].get().tobytes()


def main() -> int:
    import cupy as cp

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    size = parse_size(sys.argv[sys.argv.index("--bytes") + 1]) if "--bytes" in sys.argv else 256 << 20
    world_size, iters = 4, 10
    cubin = compile_source(ROOT / "tools" / "exp_bulk_put.cu").output
    rows, ok = [], True
    with World(world_size) as world:
        heap = size * (1 + world_size)  # src | dst slot per sender
        bases = world.backend.alloc_heap(heap)
        tables = world.backend.peer_tables(bases)
        fns, streams = {}, {}
        for r in world.ranks:
            with cp.cuda.Device(world.devices[r]):
                mod = cp.RawModule(path=str(cubin))
                fns[r] = {n: mod.get_function(n) for n in ("put_v4", "put_bulk")}
                fns[r]["put_bulk"].max_dynamic_shared_size_bytes = STAGES * CHUNK
                streams[r] = cp.cuda.Stream(non_blocking=True)
                src = view(cp, world, bases[r], size)
                src[...] = cp.random.default_rng(r).integers(0, 256, size, dtype=cp.uint8)
        world.synchronize()
        try:
            for name, ctas_per_peer, threads in VARIANTS:
                grid = ctas_per_peer * (world_size - 1)
                smem = STAGES * CHUNK if name == "put_bulk" else 0

                def launch(i=0, ranks=world.ranks):
                    for r in ranks:
                        with cp.cuda.Device(world.devices[r]):
                            fns[r][name]((grid,), (threads,), (tables[r].data.ptr, cp.uint64(bases[r]), cp.uint64(size),
                                                               cp.uint64(size), cp.int32(r), cp.int32(world_size),
                                                               cp.int32(ctas_per_peer)),
                                         shared_mem=smem, stream=streams[r])

                for r in world.ranks:  # poison every destination slot
                    with cp.cuda.Device(world.devices[r]):
                        cp.cuda.runtime.memsetAsync(bases[r] + size, 0xA5, size * world_size, streams[r].ptr)
                launch()
                world.synchronize()
                wrong = 0  # slots whose 64-bit word sum (and first / last MiB) differ from the sender's src
                for r in world.ranks:  # dst slot s on rank r == rank s's src
                    for s in world.ranks:
                        if s != r:
                            got, want = (summary(cp, world, q, base, size) for q, base in
                                         ((r, bases[r] + size * (1 + s)), (s, bases[s])))
                            wrong += int(got != want)
                ok &= wrong == 0
                # tsgen's timing core: events on each rank's stream, the slowest rank, median of 5
                timing = time_calls(CupyClock(world), world.ranks, streams, launch, calls=iters, reps=5, warmup=1,
                                    graphs=False, label=name)
                assert not timing.problems, timing.problems
                t = timing.median_us / 1e6
                egress = 3 * size / t / 1e9
                rows.append({"kernel": name, "ctas_per_peer": ctas_per_peer, "threads": threads, "bytes_per_peer": size,
                             "time_us": t * 1e6, "egress_GBps": egress, "wrong_slots": wrong})
                print(f"{name:9s} ctas/peer {ctas_per_peer:3d}  {t * 1e6:9.1f} us  egress {egress:6.1f} GB/s  "
                      f"wrong {wrong}", flush=True)
        finally:
            world.backend.free_heap(bases)
    (out / "exp_bulk_put.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
