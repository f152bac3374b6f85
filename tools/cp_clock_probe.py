"""Is the not-causal cp call slower than its ideal per cycle, or at a lower SM clock? (issue 33,
docs/design/cp_attention.md: "The clock beside the rate")

PHASES rounds, each of: a phase of the shipped cp_attention call at W 2 (both GPUs); with --solo a phase
of rank 0's attention kernel alone over the K and V the round's cp calls gathered (params.attention_only_
entry: no entry exchange, copies, signals or peer; every chunk already signalled at the current epoch);
and a phase of the ideal (the single-GPU attention kernel of the same heads over the whole sequence, on
rank 0's GPU alone). The order is cp, solo, ideal in even rounds and ideal, cp, solo in odd ones (the
power manager answers with a delay, so a fixed order would bias each phase's clock by its predecessor).
A phase is one sample of the bench's timing core (tsgen.bench.timing.Sampler): one untimed line-up call,
then CALLS back-to-back calls between CUDA events on the streams they run on. Beside it a thread reads each
rank's GPU (found by PCI bus id) from NVML every 2 ms (tsgen.bench.clocks.SmClocks): the SM clock and the
instantaneous power (NVML_FI_DEV_POWER_INSTANT; nvmlDeviceGetPowerUsage averages over a second on
these GPUs). Per phase: the time per call (the cp call: the slower rank's, and which rank it was), each
rank's GPU's median SM clock and power over the phase's timed window; then per round, for the cp call and
the solo kernel against that round's ideal: the rate ratio (FLOP rate per GPU over the ideal's), the
clock ratio (the median clock of the slower rank's GPU in the phase over rank 0's GPU in the ideal's) and
their quotient, the ratio per cycle. If the rate ratio follows the clock ratio, the gap is the clock
(power: the H200 runs these kernels at its power limit); if the clocks are equal and the rate is not, the
gap is cycles; the solo kernel's per-cycle ratio says whether those cycles are lost in the kernel itself
or beside the copies and the peer. After the rounds each kind of call runs once more over poisoned
outputs (rank 0's only for the solo kernel) and is checked as the bench checks it (every rank's rows).

    python3 tools/cp_clock_probe.py OUT [--seq 16384,32768] [--phases 8] [--calls 20] [--solo]
                                    [--param KEY=VALUE ...]

--param sets a parameter of the cp spec (its variant is named cp_attention_probe); the ones that change
the work the ideal must match (causal, layout, heads, kv_heads, head_dim, tile, batch) are refused.

Writes OUT/cp_clock_probe.json (per size: every phase's time, slower rank and per-GPU medians, the
rounds' ratios and their medians, the checks) and OUT/cp_clock_probe.txt (the printed tables). Needs 2
GPUs and nvidia-ml-py (pynvml).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # attention_trace's --param parser

from tsgen.bench.clocks import SmClocks  # noqa: E402
from tsgen.bench.runner import MAX_REL_ERR, POISON_CALL, fill_random  # noqa: E402
from tsgen.bench.timing import CupyClock, Sampler  # noqa: E402
from tsgen.harness import poison_byte, render_to_cache  # noqa: E402
from tsgen.ops import get_family  # noqa: E402
from tsgen.spec import load_spec, spec_variant  # noqa: E402
from attention_trace import parse_params  # noqa: E402

CP_SPEC = ROOT / "specs" / "cp_attention.yaml"
IDEAL_SPEC = ROOT / "specs" / "attention_hd128.yaml"
# cp parameters that change the work per GPU or its shape: the ideal (kv_heads copied, not causal) and the rate
# formula ((ideal / 2) / cp, not causal at W 2) would no longer match
REFUSED = ("causal", "layout", "heads", "kv_heads", "head_dim", "tile", "batch")


def gpu_window(clocks: SmClocks, device: int, t0: float, t1: float) -> dict:
    """A GPU's median SM clock and power over a phase's window, and how many readings it had."""
    return {"mhz": clocks.window(device, t0, t1), "watts": clocks.power_window(device, t0, t1),
            "samples": clocks.samples(device, t0, t1)}


def poison(world, bufs, ranks) -> None:
    """Every output slot of `ranks` filled with the bench's poison byte (bf16 and float32 NaNs), so that an
    output a call does not write fails its check."""
    for r in ranks:
        with world.cp.cuda.Device(world.devices[r]):
            for sl in bufs.slots:
                if sl.role == "output":
                    bufs.array(sl.name, r).view("uint8")[...] = poison_byte(POISON_CALL)
    world.synchronize()


def timed_phase(w, call, calls: int, label: str) -> tuple[float, int, float, float]:
    """One sample of the bench's timing core (tsgen.bench.timing.Sampler: one untimed line-up call, then
    `calls` between events on every stream of `w`): the slowest stream's time per call (us), its rank, and the
    sample's host perf_counter window. A rank that launched nothing (the solo kernel's rank 1) times about 0."""
    sampler = Sampler(CupyClock(w), w.ranks, w.streams, lambda i, ranks: call(), calls=calls, warmup=0,
                      graphs=False, lineup=True, label=label)
    us = sampler.sample()
    if sampler.problems:
        raise SystemExit("; ".join(sampler.problems))
    t0, t1, slow = sampler.windows[-1]
    return us, slow, t0, t1


def against(c: dict, ideal: dict) -> dict:
    """A W 2 phase against the ideal phase of its round: rate (FLOP rate per GPU over the ideal's: the ideal's
    time / 2 over the phase's; not causal), clock (the median SM clock of the phase's slower rank's GPU over
    rank 0's GPU's in the ideal phase), and rate / clock."""
    rate = (ideal["us_per_call"] / 2) / c["us_per_call"]
    mc, mi = c["gpus"][c["slow_rank"]]["mhz"], ideal["gpus"][0]["mhz"]
    clock = mc / mi if mc and mi else None
    return {"rate": rate, "clock": clock, "per_cycle": rate / clock if clock else None}


def median_of(rows: list[dict], key: str) -> float | None:
    got = [r[key] for r in rows if r[key] is not None]
    return statistics.median(got) if got else None


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


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

    params = parse_params(a.param)
    refused = sorted(set(params) & set(REFUSED))
    if refused:
        raise SystemExit(f"--param {', '.join(refused)}: changes the work the ideal and the rate formula assume "
                         f"(not causal, the shipped shape); refused")
    a.out.mkdir(parents=True, exist_ok=True)  # before the run: a bad OUT fails at once
    seqs = [int(x) for x in a.seq.split(",")]
    cp_loaded = load_spec(CP_SPEC)
    params = {**params, **({"attention_only_entry": True} if a.solo else {})}
    if params:  # the shipped spec with the test-only entry (the same kernel and launcher) and --param
        cp_loaded = spec_variant(cp_loaded, {"name": "cp_attention_probe", "params": params})
    kv_heads = cp_loaded.model.params.kv_heads
    ideal_loaded = spec_variant(load_spec(IDEAL_SPEC), {"name": f"ideal_h32_kv{kv_heads}",
                                                        "params": {"kv_heads": kv_heads}})
    out = {"cp_spec": str(CP_SPEC.relative_to(ROOT)), "params": params, "ideal": ideal_loaded.model.name,
           "calls": a.calls, "phases": a.phases, "sizes": {}}
    lines, ok = [], True
    with World(2, share_gpus=False) as w2, World(1, share_gpus=False) as w1:
        if w1.devices[0] != w2.devices[0] or w2.devices[0] == w2.devices[1]:
            raise SystemExit(f"needs 2 GPUs, the ideal on rank 0's: cp on {w2.devices}, the ideal on {w1.devices}")
        cached = render_to_cache(cp_loaded)
        cp_mod = w2.load(cached.manifest, source=cached.source)
        cached = render_to_cache(ideal_loaded)
        ideal_mod = w1.load(cached.manifest, source=cached.source)
        cp_fam, ideal_fam = get_family(cp_loaded.model.op), get_family(ideal_loaded.model.op)
        nvml = SmClocks({w2.devices[r]: w2.backend.bus_ids[r] for r in w2.ranks}, power=True).start()
        try:
            for seq in seqs:
                count = seq // 2
                cbufs, ibufs = cp_mod.alloc(count), ideal_mod.alloc(seq)
                try:
                    fill_random(w2, cbufs)
                    fill_random(w1, ibufs)
                    w2.synchronize()
                    w1.synchronize()

                    def cp_call():
                        cp_mod.launch(cbufs, ranks=w2.ranks, streams=w2.streams)

                    def solo_call():  # rank 0 alone, after the cp phase's full calls signalled every chunk
                        cp_mod.launch_entry("attention_only", cbufs, [w2.ranks[0]], w2.streams)

                    def ideal_call():
                        ideal_mod.launch(ibufs, ranks=w1.ranks, streams=w1.streams)

                    kinds = [("cp", w2, cp_call)] + ([("solo", w2, solo_call)] if a.solo else []) + \
                        [("ideal", w1, ideal_call)]
                    rounds = []
                    for k in range(a.phases):
                        # cp before solo always (solo needs the round's full calls); the ideal first in odd rounds
                        order = kinds if k % 2 == 0 else kinds[-1:] + kinds[:-1]
                        got = {}
                        for who, world, call in order:
                            us, slow, t0, t1 = timed_phase(world, call, a.calls, f"{who} {seq}")
                            got[who] = {"us_per_call": us, "slow_rank": slow,
                                        "gpus": {r: gpu_window(nvml, w2.devices[r], t0, t1) for r in w2.ranks}}
                        got["order"] = [who for who, _, _ in order]
                        got["ratios"] = {who: against(got[who], got["ideal"]) for who, _, _ in kinds[:-1]}
                        rounds.append(got)
                    checks = check_each(w2, w1, cbufs, ibufs, cp_fam, ideal_fam, cp_loaded, ideal_loaded, count, seq,
                                        cp_call, solo_call if a.solo else None, ideal_call)
                finally:
                    cbufs.free()
                    ibufs.free()
                ok = ok and all(err <= MAX_REL_ERR for err in checks.values())
                med = {who: {key: median_of([r["ratios"][who] for r in rounds], key)
                             for key in ("rate", "clock", "per_cycle")} for who, _, _ in kinds[:-1]}
                out["sizes"][str(seq)] = {"rounds": rounds, "median": med, "checks": checks}
                lines += report(seq, rounds, med, checks, [who for who, _, _ in kinds[:-1]])
                print("\n".join(lines[-(len(rounds) * (len(kinds) - 1) + len(kinds) + 1):]), flush=True)
        finally:
            nvml.close()
    (a.out / "cp_clock_probe.json").write_text(json.dumps(out, indent=1))
    (a.out / "cp_clock_probe.txt").write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


def check_each(w2, w1, cbufs, ibufs, cp_fam, ideal_fam, cp_loaded, ideal_loaded, count, seq, cp_call, solo_call,
               ideal_call) -> dict:
    """Each kind of call once more over poisoned outputs, then the bench's row check: the cp call (every rank),
    the solo kernel (rank 0 poisoned; rank 1's rows are the cp call's), the ideal. {kind: worst row error}."""
    def fetch_from(world, bufs):
        def fetch(name, r, lo, hi):
            with world.cp.cuda.Device(world.devices[r]):
                return bufs.array(name, r)[lo:hi].get()
        return fetch

    errs = {}
    for who, world, bufs, ranks, call, fam, loaded, size, n in (
            ("cp", w2, cbufs, w2.ranks, cp_call, cp_fam, cp_loaded, count, 2),
            ("solo", w2, cbufs, [w2.ranks[0]], solo_call, cp_fam, cp_loaded, count, 2),
            ("ideal", w1, ibufs, w1.ranks, ideal_call, ideal_fam, ideal_loaded, seq, 1)):
        if call is None:
            continue
        poison(world, bufs, ranks)
        call()
        world.synchronize()
        errs[who] = fam.bench.check_rows(fam, loaded.model, n, size, fetch_from(world, bufs))
    return errs


def report(seq: int, rounds: list[dict], med: dict, checks: dict, kinds: list[str]) -> list[str]:
    lines = [f"S = {seq}: rows checked over poisoned outputs: "
             + ", ".join(f"{k} {e:.2e}" for k, e in checks.items())
             + f" ({'ok' if all(e <= MAX_REL_ERR for e in checks.values()) else 'WRONG'})",
             f"{'round':>5} {'who':>5} {'us':>9} {'ideal us':>9} {'slow':>4} {'MHz':>6} {'id MHz':>6} {'W':>5} "
             f"{'id W':>5} {'r1 MHz':>6} {'rate':>6} {'clock':>6} {'/cycle':>6}  order"]
    for k, r in enumerate(rounds):
        i = r["ideal"]
        for who in kinds:
            c, p = r[who], r["ratios"][who]
            g = c["gpus"][c["slow_rank"]]
            lines.append(f"{k:>5} {who:>5} {c['us_per_call']:>9.1f} {i['us_per_call']:>9.1f} {c['slow_rank']:>4} "
                         f"{fmt(g['mhz'], '6.0f'):>6} {fmt(i['gpus'][0]['mhz'], '6.0f'):>6} "
                         f"{fmt(g['watts'], '5.0f'):>5} {fmt(i['gpus'][0]['watts'], '5.0f'):>5} "
                         f"{fmt(c['gpus'][1]['mhz'], '6.0f'):>6} {p['rate']:>6.3f} {fmt(p['clock'], '6.3f'):>6} "
                         f"{fmt(p['per_cycle'], '6.3f'):>6}  {','.join(r['order'])}")
    for who, m in med.items():
        lines.append(f"median {who}: rate {fmt(m['rate'], '.3f')} (per GPU over the ideal), clock "
                     f"{fmt(m['clock'], '.3f')} (the slower rank's GPU's SM clock over rank 0's in the ideal "
                     f"phase), per cycle {fmt(m['per_cycle'], '.3f')}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
