"""Is the not-causal cp call slower than its ideal per cycle, or at a lower SM clock? (issue 33,
docs/design/cp_attention.md: "The clock beside the rate")

Alternates PHASES times: a phase of the shipped cp_attention call at W 2 (both GPUs), then (--solo) a
phase of rank 0's attention kernel alone over the K and V the calls gathered (params.attention_only_entry:
no entry exchange, copies, signals or peer; every chunk already signalled), then a phase of the ideal (the
single-GPU attention kernel of the same heads over the whole sequence, on GPU 0 alone),
each phase CALLS back-to-back calls between CUDA events on the streams they run on, after one untimed
call. Beside it a thread reads GPU 0's and GPU 1's SM clock and power from NVML every few ms. Per phase:
the time per call (the cp call: the slower rank's), GPU 0's median SM clock and power over the phase's
timed window; then per phase round, for the cp call and the solo kernel against the ideal: the rate ratio
(FLOP rate per GPU over the ideal's), the clock ratio (the phase's GPU 0 median clock over the ideal
phase's) and their quotient, the ratio per cycle. If the rate ratio follows the clock ratio, the gap is the
clock (power: the H200 runs these kernels at its power limit); if the clocks are equal and the rate is
not, the gap is cycles; the solo kernel's per-cycle ratio says whether those cycles are lost in the kernel
itself or beside the copies and the peer. The outputs of the last phase (the solo kernel's, where run) and
the ideal's are checked as the bench checks them.

    python3 tools/cp_clock_probe.py OUT [--seq 16384,32768] [--phases 8] [--calls 20] [--solo]
                                    [--param KEY=VALUE ...]

--param sets a parameter of the cp spec (the variant's name says which: cp_attention_probe).


Writes OUT/cp_clock_probe.json (per size and phase: times, the NVML samples in the window) and prints
a table. Needs 2 GPUs and nvidia-ml-py (pynvml).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # attention_trace's --param parser

from tsgen.bench.runner import MAX_REL_ERR, fill_random  # noqa: E402
from tsgen.harness import render_to_cache  # noqa: E402
from tsgen.ops import get_family  # noqa: E402
from tsgen.spec import load_spec, spec_variant  # noqa: E402
from attention_trace import parse_params  # noqa: E402

CP_SPEC = ROOT / "specs" / "cp_attention.yaml"
IDEAL_SPEC = ROOT / "specs" / "attention_hd128.yaml"


class Nvml:
    """A thread reading each GPU's SM clock (MHz) and power (W) every `period` s: rows (t, gpu, mhz, watts)."""

    def __init__(self, gpus: list[int], period: float = 0.002):
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handles = {g: pynvml.nvmlDeviceGetHandleByIndex(g) for g in gpus}
        self.period, self.rows, self._stop = period, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        nv = self.nv
        while not self._stop.is_set():
            t = time.perf_counter()
            for g, h in self.handles.items():
                self.rows.append((t, g, nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                  nv.nvmlDeviceGetPowerUsage(h) / 1000.0))
            time.sleep(self.period)

    def __enter__(self) -> "Nvml":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.nv.nvmlShutdown()

    def window(self, gpu: int, t0: float, t1: float) -> tuple[float | None, float | None, int]:
        got = [(mhz, w) for t, g, mhz, w in self.rows if g == gpu and t0 <= t <= t1]
        if not got:
            return None, None, 0
        return statistics.median(m for m, _ in got), statistics.median(w for _, w in got), len(got)


def timed_phase(w, streams, call, calls: int) -> tuple[float, float, float]:
    """One untimed call, then `calls` between events on every stream; the slowest stream's time per call
    (us) and the host's perf_counter window of the timed calls (from after the first event to the sync)."""
    cp = w.cp
    call()
    w.synchronize()
    starts, ends = {}, {}
    for r in w.ranks:
        with cp.cuda.Device(w.devices[r]):
            starts[r], ends[r] = cp.cuda.Event(), cp.cuda.Event()
            starts[r].record(streams[r])
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    for r in w.ranks:
        with cp.cuda.Device(w.devices[r]):
            ends[r].record(streams[r])
    w.synchronize()
    t1 = time.perf_counter()
    per_call = max(cp.cuda.get_elapsed_time(starts[r], ends[r]) for r in w.ranks) * 1000.0 / calls
    return per_call, t0, t1


def against(c: dict, ideal: dict, gpu: str) -> dict:
    """A W 2 phase against the ideal phase of its round: rate (FLOP rate per GPU over the ideal's: the ideal's
    time / 2 over the phase's), clock (GPU `gpu`'s median SM clock over the ideal phase's), per cycle."""
    rate = (ideal["us_per_call"] / 2) / c["us_per_call"]
    mc, mi = c[gpu]["mhz"], ideal[gpu]["mhz"]
    clock = mc / mi if mc and mi else None
    return {"rate": rate, "clock": clock, "per_cycle": rate / clock if clock else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seq", default="16384,32768")
    ap.add_argument("--phases", type=int, default=8)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--solo", action="store_true", help="also time rank 0's attention kernel alone")
    ap.add_argument("--param", action="append", default=[], help="KEY=VALUE: a parameter of the cp spec")
    a = ap.parse_args(argv)
    from tsgen.runtime import World

    seqs = [int(x) for x in a.seq.split(",")]
    cp_loaded = load_spec(CP_SPEC)
    params = {**parse_params(a.param), **({"attention_only_entry": True} if a.solo else {})}
    if params:  # the shipped spec with the test-only entry (the same kernel and launcher) and --param
        cp_loaded = spec_variant(cp_loaded, {"name": "cp_attention_probe", "params": params})
    kv_heads = cp_loaded.model.params.kv_heads
    ideal_loaded = spec_variant(load_spec(IDEAL_SPEC), {"name": f"ideal_h32_kv{kv_heads}",
                                                        "params": {"kv_heads": kv_heads}})
    out = {"cp_spec": str(CP_SPEC.relative_to(ROOT)), "params": params, "ideal": ideal_loaded.model.name,
           "calls": a.calls, "phases": a.phases, "sizes": {}}
    lines = []
    with World(2) as w2, World(1, share_gpus=False) as w1:
        assert w1.devices[0] == w2.devices[0], "the ideal must run on rank 0's GPU"
        cached = render_to_cache(cp_loaded)
        cp_mod = w2.load(cached.manifest, source=cached.source)
        cached = render_to_cache(ideal_loaded)
        ideal_mod = w1.load(cached.manifest, source=cached.source)
        cp_fam, ideal_fam = get_family(cp_loaded.model.op), get_family(ideal_loaded.model.op)
        gpus = sorted(set(w2.devices.values()))
        with Nvml(gpus) as nvml:
            for seq in seqs:
                count = seq // 2
                cbufs, ibufs = cp_mod.alloc(count), ideal_mod.alloc(seq)
                fill_random(w2, cbufs)
                fill_random(w1, ibufs)
                w2.synchronize()
                w1.synchronize()

                def cp_call():
                    cp_mod.launch(cbufs, ranks=w2.ranks, streams=w2.streams)

                def ideal_call():
                    ideal_mod.launch(ibufs, ranks=w1.ranks, streams=w1.streams)

                def solo_call():  # rank 0 alone, after the cp phase's full calls signalled every chunk
                    cp_mod.launch_entry("attention_only", cbufs, [w2.ranks[0]], w2.streams)

                order = [("cp", w2, cp_call)] + ([("solo", w2, solo_call)] if a.solo else []) + \
                    [("ideal", w1, ideal_call)]
                phases = []
                for k in range(a.phases):
                    for who, world, call in order:
                        us, t0, t1 = timed_phase(world, world.streams, call, a.calls)
                        row = {"phase": k, "who": who, "us_per_call": us}
                        for g in gpus:
                            mhz, watts, n = nvml.window(g, t0, t1)
                            row[f"gpu{g}"] = {"mhz": mhz, "watts": watts, "samples": n}
                        phases.append(row)

                def fetch_cp(name, r, lo, hi):
                    with w2.cp.cuda.Device(w2.devices[r]):
                        return cbufs.array(name, r)[lo:hi].get()

                def fetch_ideal(name, r, lo, hi):
                    with w1.cp.cuda.Device(w1.devices[r]):
                        return ibufs.array(name, r)[lo:hi].get()

                err_cp = cp_fam.bench.check_rows(cp_fam, cp_loaded.model, 2, count, fetch_cp)
                err_ideal = ideal_fam.bench.check_rows(ideal_fam, ideal_loaded.model, 1, seq, fetch_ideal)
                cbufs.free()
                ibufs.free()
                g0, g1 = f"gpu{gpus[0]}", f"gpu{gpus[-1]}"
                n = len(order)
                # cp and solo against the ideal of the same round: half its FLOPs per GPU (not causal, W 2)
                pairs = {who: [against(phases[n * k + j], phases[n * k + n - 1], g0) for k in range(a.phases)]
                         for j, (who, _, _) in enumerate(order[:-1])}
                med = {who: {key: statistics.median(p[key] for p in ps if p[key] is not None) for key in ps[0]}
                       for who, ps in pairs.items()}
                out["sizes"][str(seq)] = {"phases": phases, "pairs": pairs, "median": med, "row_error_cp": err_cp,
                                          "row_error_ideal": err_ideal}
                lines.append(f"S = {seq}: rows check cp{' (the solo kernel last)' if a.solo else ''} {err_cp:.2e}, "
                             f"ideal {err_ideal:.2e} ({'ok' if max(err_cp, err_ideal) <= MAX_REL_ERR else 'WRONG'})")
                lines.append(f"{'phase':>5} {'who':>5} {'us':>9} {'ideal us':>9} {'MHz':>6} {'id MHz':>6} {'W':>5} "
                             f"{'id W':>5} {'gpu1 MHz':>8} {'rate':>6} {'clock':>6} {'/cycle':>6}")
                for k in range(a.phases):
                    i = phases[n * k + n - 1]
                    for j, (who, _, _) in enumerate(order[:-1]):
                        c, p = phases[n * k + j], pairs[who][k]
                        lines.append(f"{k:>5} {who:>5} {c['us_per_call']:>9.1f} {i['us_per_call']:>9.1f} "
                                     f"{c[g0]['mhz'] or 0:>6.0f} {i[g0]['mhz'] or 0:>6.0f} "
                                     f"{c[g0]['watts'] or 0:>5.0f} {i[g0]['watts'] or 0:>5.0f} "
                                     f"{c[g1]['mhz'] or 0:>8.0f} {p['rate']:>6.3f} {p['clock'] or 0:>6.3f} "
                                     f"{p['per_cycle'] or 0:>6.3f}")
                for who, m in med.items():
                    lines.append(f"median {who}: rate {m['rate']:.3f} (per GPU over the ideal), clock {m['clock']:.3f} "
                                 f"(GPU 0's SM clock over the ideal phase's), per cycle {m['per_cycle']:.3f}")
                print("\n".join(lines[-(a.phases * (n - 1) + n + 1):]), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "cp_clock_probe.json").write_text(json.dumps(out, indent=1))
    (a.out / "cp_clock_probe.txt").write_text("\n".join(lines) + "\n")
    bad = any(max(v["row_error_cp"], v["row_error_ideal"]) > MAX_REL_ERR for v in out["sizes"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
