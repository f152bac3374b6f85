"""The per-tile timeline of cp_attention's attention kernel on GPUs (issue 33): SPEC run with
tsgen/attention.cuh's test-only trace compiled in (params.trace), random inputs, CALLS calls; the
trace of the last call read back from every rank, and that call's output checked as the bench
checks it (tsgen/ops/attention.py check_query_rows: 64+ rows per rank, each against its own norm).

    python3 tools/attention_trace.py OUT [--spec specs/cp_attention_zigzag_causal.yaml] [--world 2]
                                         [--seq 16384] [--calls 3] [--blocks N] [--param KEY=VALUE ...]

Writes OUT/attention_trace.json (per rank: every tile's record, SM, CTA, tile, start, end and chunk
waits in ns, and tsgen.ops.cp_attention.trace_summary) and prints per rank: every tile once, the
CTAs, the span, the efficiency (CTA busy time over CTAs x span: tsgen/ops/cp_schedule.py's, which
predicts 0.99 at 16K and 32K for the shipped zig-zag causal spec at W 2), each CTA's busy time, the
tail and the waits. One process drives every rank (one GPU each, or TSGEN_SHARE_GPUS=1 on one GPU
with the SM-gather spec). The trace costs two globaltimer reads per KV block in the producer: the
times are the traced kernel's, not the shipped one's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tsgen.bench.runner import MAX_REL_ERR, fill_random  # noqa: E402
from tsgen.harness import render_to_cache, shared_gpu_variant  # noqa: E402
from tsgen.ops import get_family  # noqa: E402
from tsgen.ops.cp_attention import SIGNALS, STAMP_WORDS, trace_summary, trace_table  # noqa: E402
from tsgen.spec import load_spec, spec_variant  # noqa: E402


def tiles_per_rank(params, count: int) -> int:
    return math.ceil(count / params.tile.m) * params.heads * params.batch


def parse_params(items) -> dict:
    """--param KEY=VALUE items -> {KEY: VALUE read as YAML} (true -> True, 3 -> 3)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--param {item!r}: KEY=VALUE expected")
        out[key] = yaml.safe_load(value)
    return out


def read_trace(world, bufs) -> dict:
    """Every local rank's trace of the call just done ({rank: trace_table}; the trace follows the
    signals and the call timeline's stamps); the count is reset for the next call (stream order: the
    kernel is done, the next has not started; the reset is waited for, so a launch on any stream comes
    after it)."""
    out = {}
    at = SIGNALS + STAMP_WORDS
    for r in world.ranks:
        with world.cp.cuda.Device(world.devices[r]):
            sig = bufs.array("sig", r)
            out[r] = trace_table(sig[at:].get())
            sig[at:at + 1] = 0
            world.cp.cuda.runtime.deviceSynchronize()
    return out


def run(spec_path: Path, world_size: int, seq: int, calls: int, blocks: int | None = None, echo=print,
        params: dict | None = None) -> dict:
    from tsgen.runtime import World

    loaded = load_spec(spec_path)
    p = loaded.model.params
    count = seq // world_size
    tiles = tiles_per_rank(p, count)
    changes = {"name": f"{loaded.model.name}_trace", "params": {**(params or {}), "trace": tiles}}
    if blocks:
        changes["launch"] = {"blocks": blocks}
    loaded = spec_variant(loaded, changes)
    family = get_family(loaded.model.op)
    with World(world_size) as w:
        loaded = shared_gpu_variant(loaded, w, echo)
        spec = loaded.model
        cached = render_to_cache(loaded)
        module = w.load(cached.manifest, source=cached.source)
        bufs = module.alloc(count)
        fill_random(w, bufs)
        tables = {}
        for _ in range(calls):
            module.launch(bufs)
            w.synchronize()
            tables = read_trace(w, bufs)

        def fetch(name, r, a, b):
            with w.cp.cuda.Device(w.devices[r]):
                return bufs.array(name, r)[a:b].get()

        err = family.bench.check_rows(family, spec, world_size, count, fetch)
        bufs.free()
    return {"spec": spec.name, "world": world_size, "seq": seq, "count": count, "tiles_per_rank": tiles,
            "calls": calls, "params": params or {}, "grid": spec.launch.blocks or None, "row_error": err, "row_error_ok": err <= MAX_REL_ERR,
            "ranks": {r: {"summary": trace_summary(t, tiles), "records": t["records"]} for r, t in tables.items()}}


def report(result: dict) -> str:
    lines = [f"{result['spec']} at W {result['world']}, S = {result['seq']} ({result['tiles_per_rank']} tiles a rank), "
             f"last of {result['calls']} calls; rows check: worst row error {result['row_error']:.2e} "
             f"({'ok' if result['row_error_ok'] else 'WRONG'})"]
    for r, x in sorted(result["ranks"].items()):
        s = x["summary"]
        if not s["complete"]:
            lines.append(f"  rank {r}: trace incomplete: {s['records']} records kept of {s['count']}")
            continue
        b = s["busy_us"]
        lines.append(f"  rank {r}: every tile once: {s['tiles_once']}; {s['ctas']} CTAs; span {s['span_us']:.0f} us; "
                     f"efficiency {s['efficiency']:.3f}; CTA busy max / mean / min {b['max']:.0f} / {b['mean']:.0f} / "
                     f"{b['min']:.0f} us; tail {s['tail_us']:.0f} us; waits {s['waited_us_per_cta']:.1f} us per CTA")
        if "tile_us" in s:
            t, f = s["tile_us"], s["first_wait_us"]
            lines.append(f"    tiles a CTA {s['tiles_per_cta']['max']} / {s['tiles_per_cta']['min']}; a CTA's mean tile "
                         f"max / median / min {t['max']:.1f} / {t['median']:.1f} / {t['min']:.1f} us; first tile's "
                         f"chunk wait max / mean {f['max']:.1f} / {f['mean']:.1f} us")
        if s.get("first_tile_us"):
            ft = s["first_tile_us"]

            def us(x):
                return "-" if x is None else f"{x:.1f}"

            lines.append(f"    first tile (median CTA): {us(ft['duration'])} us long, chunk waits summed "
                         f"{us(ft['waited'])} us, first / last chunk ready {us(ft['first_ready'])} / {us(ft['last_ready'])} us after its "
                         f"start; later tiles median {us(s.get('later_tile_us'))} us at "
                         f"{'-' if s.get('sm_clock_ghz') is None else format(s['sm_clock_ghz'], '.3f')} GHz (SM clock)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--spec", type=Path, default=ROOT / "specs" / "cp_attention_zigzag_causal.yaml")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16384, help="the whole sequence (S = world x rows per rank)")
    ap.add_argument("--calls", type=int, default=3, help="calls run; the last is traced")
    ap.add_argument("--blocks", type=int, default=None, help="attention CTAs a rank (launch.blocks; default the spec's)")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="a spec param for the traced variant (VALUE read as YAML), e.g. tile_counter=true; repeatable")
    a = ap.parse_args(argv)
    result = run(a.spec, a.world, a.seq, a.calls, a.blocks, params=parse_params(a.param))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "attention_trace.json").write_text(json.dumps(result) + "\n")
    print(report(result))
    ok = result["row_error_ok"] and all(x["summary"]["complete"] and x["summary"]["tiles_once"]
                                        for x in result["ranks"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
