"""Experiment: do the copy engines add bandwidth on top of SM stores?

Runs the p2p allgather (SM stores) on one stream and the copy-engine
allgather on another, concurrently, on disjoint buffers, with a fraction f
of the bytes given to the copy engines. If the aggregate busbw beats the
p2p-only number, a hybrid plan (some pieces by DMA, the rest by SMs) is
worth building. Usage: python tools/exp_hybrid.py OUT [--bytes 1G]
"""

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tsgen.bench.sizes import parse_size  # noqa: E402
from tsgen.harness import materialize  # noqa: E402
from tsgen.runtime import World  # noqa: E402
from tsgen.spec import load_spec  # noqa: E402


def main():
    out = Path(sys.argv[1])
    total = parse_size(sys.argv[sys.argv.index("--bytes") + 1]) if "--bytes" in sys.argv else 1 << 30
    rows = []
    with World(4) as world:
        sm = world.load(materialize(load_spec(ROOT / "specs/allgather.yaml")))
        ce = world.load(materialize(load_spec(ROOT / "specs/allgather_ce.yaml")))
        sa, sb = world.make_streams(), world.make_streams()
        elems = total // 2 // 4  # bf16 elements per rank
        for f in (0.0, 0.15, 0.25, 0.35, 0.5, 1.0):
            n_ce = int(elems * f) // 64 * 64
            n_sm = elems - n_ce
            bufs_sm = sm.alloc(n_sm) if n_sm else None
            bufs_ce = ce.alloc(n_ce) if n_ce else None
            iters = 10

            def calls():
                for _ in range(iters):
                    if bufs_sm:
                        sm.launch(bufs_sm, streams=sa)
                    if bufs_ce:
                        ce.launch(bufs_ce, streams=sb)

            calls()  # warm-up
            world.synchronize()
            samples = []
            # two streams per GPU (SM kernels and copy engines at once): tsgen's timing core records events
            # on one stream per rank, so this experiment keeps a host clock around a device-wide sync
            for _ in range(5):
                t0 = time.perf_counter()
                calls()
                world.synchronize()
                samples.append((time.perf_counter() - t0) / iters)
            t = statistics.median(samples)
            busbw = total * 3 / 4 / t / 1e9
            rows.append({"bytes": total, "ce_fraction": f, "time_us": t * 1e6, "busbw_GBps": busbw})
            print(f"f_ce={f:.2f}  {t * 1e6:9.1f} us  busbw {busbw:6.1f} GB/s", flush=True)
            for b in (bufs_sm, bufs_ce):
                if b:
                    b.free()
    (out / "exp_hybrid.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
