"""Where one cp_attention call's time goes, on the bench's own call sequence (issue 33, docs/design/cp_attention.md:
"Outside the tiles"). SPEC (default the shipped not-causal specs/cp_attention.yaml) is run as a trace variant
(params.trace: the kernel's per-tile records, the sync kernels' globaltimer stamps, the launcher's host times)
exactly as `tsgen bench` times it: one World, one buffer set, warm-up calls, then per sample a synchronize, an
untimed lineup call and CALLS back-to-back calls between events on the World's streams (tsgen.bench.timing's
Sampler itself, eager as the cp bench is), every rank launched from its own thread. After each sample it reads,
per rank, the stamps, the tile records and the host times of those 1 + CALLS calls and prints the phases of the
timed calls: the gap after the previous kernel, the entry kernel, the kernel's start, WAIT_FREE, the copies
(their signal kernels' starts), when each CTA's first tile saw its first and last chunk, the kernel's span, the
call, and the host's lead; then the clock checks and the bench's own figure for the same calls.

    python3 tools/cp_call_timeline.py OUT [--spec specs/cp_attention.yaml] [--world 2] [--seq 16384,32768]
                                      [--calls 3] [--samples 2] [--warmup 3] [--param KEY=VALUE ...]

Writes OUT/cp_call_timeline.txt (the printed report) and OUT/cp_call_timeline.json.gz (per size and sample, per
rank, the stamps, the host rows, the phases, and the first sample's tile records, packed: pack_records): two
files, whatever the sizes (the device tool leaves out folders of many files). Exit 1 when an output check fails or
a trace is incomplete. The trace costs the producer two globaltimer reads per KV block and the sync kernels two
each: the times are the traced call's, within a few us of the shipped one's (compare the bench figure printed
beside).
"""

from __future__ import annotations

import argparse
import ctypes
import gzip
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # attention_trace, the per-tile trace tool beside this one

from tsgen.bench.runner import MAX_REL_ERR, fill_random  # noqa: E402
from tsgen.bench.timing import CupyClock, Sampler  # noqa: E402
from tsgen.harness import render_to_cache, shared_gpu_variant  # noqa: E402
from tsgen.ops import get_family  # noqa: E402
from tsgen.ops import cp_timeline as T  # noqa: E402
from tsgen.ops.cp_attention import SIGNALS, STAMP_WORDS, own_in_place, trace_table  # noqa: E402
from tsgen.spec import load_spec, spec_variant  # noqa: E402
from attention_trace import parse_params, tiles_per_rank  # noqa: E402  (one home for both tools)

CALLS_MAX = T.STAMP_CALLS - 1  # the lineup call and the timed ones must fit the stamp ring


def in_place(p, world: int, count: int) -> bool:
    """Whether every rank's calls at `count` rows read their own rows in place (params.local_kv and
    tsgen/cp.cuh own_in_place, per call and rank): the phases then have no own copy."""
    return bool(p.local_kv) and all(own_in_place(p.layout, p.causal, world, count, r, p.tile.n) for r in range(world))


def timeline_variant(loaded, params: dict, room: int):
    """The trace variant: SPEC with `params`, room for `room` tile records (the timed sizes are the --seq)."""
    return spec_variant(loaded, {"name": f"{loaded.model.name}_timeline", "params": {**params, "trace": room}})


def parse_rank(sig, host_words, epoch: int, world: int) -> dict:
    """One rank's sig buffer (its signals, the stamps, the trace), its NAME_host_timeline words (None: not
    read) and its call counter -> {"stamps", "trace", "host", "epoch"}."""
    return {"stamps": T.stamp_table(sig[SIGNALS:SIGNALS + STAMP_WORDS], world),
            "trace": trace_table(sig[SIGNALS + STAMP_WORDS:]),
            "host": T.host_table(list(host_words), world) if host_words is not None else [], "epoch": epoch}


def read_rank(w, bufs, module_lib, name: str, rank: int, world: int) -> dict:
    """One rank's stamps, trace and host rows, and its call counter (the last epoch)."""
    with w.cp.cuda.Device(w.devices[rank]):
        sig = bufs.array("sig", rank).get()
        epoch = int(bufs.array("calls", rank)[0:1].get()[0])
    words = (ctypes.c_uint64 * T.HOST_WORDS)()
    fn = getattr(module_lib, f"{name}_host_timeline")
    fn.restype = ctypes.c_int
    got = fn(ctypes.c_int(rank), words, ctypes.c_int(T.HOST_WORDS))
    return parse_rank(sig, list(words) if got == T.HOST_WORDS else None, epoch, world)


RECORD_FIELDS = ["index", "sm", "cta", "tile", "start", "end", "waited", "first_ready", "last_ready", "cycles"]
TIMES, READY = ("start", "end"), ("first_ready", "last_ready")  # a ready time of 0 means none


def _shift(f: str, v: int, by: int) -> int:
    return v + by if f in TIMES or (f in READY and v) else v


def pack_records(records: list[dict]) -> dict:
    """Records in few bytes for the JSON: rows of RECORD_FIELDS, times in ns after `base_ns` (the first start;
    a ready time of 0, none, stays 0)."""
    base = min((r["start"] for r in records), default=0)
    rows = [[_shift(f, r[f], -base) for f in RECORD_FIELDS] for r in records]
    return {"fields": RECORD_FIELDS, "base_ns": base, "rows": rows}


def unpack_records(packed: dict) -> list[dict]:
    base = packed["base_ns"]
    return [{f: _shift(f, v, base) for f, v in zip(packed["fields"], row)} for row in packed["rows"]]


def process_sample(ranks: dict, tiles: int, calls: int, world: int, local_kv: bool, bench_us: float | None,
                   title: str, keep_records: bool = True) -> dict:
    """One sample's parsed ranks ({rank: parse_rank}) -> {"epochs", "complete", "summary", "raw", "report"}: the
    lineup call and the `calls` timed ones are the last 1 + calls epochs; their records are the 1 + calls x
    `tiles` made since the count was reset; the host rows the last 1 + calls of each rank's launcher. The
    records go into "raw" packed (pack_records) where `keep_records`, else only their count."""
    last = ranks[min(ranks)]["epoch"]
    epochs = list(range(last - calls, last + 1))  # the lineup call, then the timed ones
    per_rank, raw = {}, {}
    for r, x in ranks.items():
        recs = x["trace"]["records"]
        by_call = T.records_by_call(recs, tiles, epochs)
        host_rows = x["host"][-len(epochs):]
        per_rank[r] = {"stamps": x["stamps"], "kernels": {e: T.kernel_of(v) for e, v in by_call.items()},
                       "host": {e: h for e, h in zip(epochs[len(epochs) - len(host_rows):], host_rows)}}
        raw[r] = {"epoch": x["epoch"], "records_count": x["trace"]["count"], "records_expected": len(epochs) * tiles,
                  "stamps": {str(e): v for e, v in x["stamps"].items()}, "host": x["host"],
                  "records": pack_records(recs) if keep_records else None}
    summary = T.summarize(per_rank, epochs[1:], world, local_kv)
    complete = all(raw[r]["records_count"] == raw[r]["records_expected"] and raw[r]["epoch"] == last for r in raw)
    if not complete:
        title += " [TRACE INCOMPLETE: " + ", ".join(f"rank {r} {raw[r]['records_count']} of "
                                                     f"{raw[r]['records_expected']} records, epoch {raw[r]['epoch']}"
                                                     for r in sorted(raw)) + "]"
    return {"bench_us_per_call": bench_us, "epochs": epochs, "complete": complete, "summary": summary, "raw": raw,
            "report": T.report(summary, bench_us, title=title)}


def run(spec_path: Path, world_size: int, seqs: list[int], calls: int, samples: int, warmup: int,
        params: dict | None = None, echo=print) -> dict:
    from tsgen.runtime import World
    from tsgen.runtime.world import own_symbol

    if not 1 <= calls <= CALLS_MAX:
        raise SystemExit(f"--calls {calls}: 1 to {CALLS_MAX} (the stamp ring holds {T.STAMP_CALLS} calls)")
    params = params or {}
    base = load_spec(spec_path)
    p0 = base.model.params
    room = (calls + 1) * max(tiles_per_rank(p0, s // world_size) for s in seqs)
    loaded = timeline_variant(base, params, room)
    family = get_family(loaded.model.op)
    out = {"spec": str(spec_path), "variant": loaded.model.name, "params": params, "world": world_size,
           "calls": calls, "warmup": warmup, "sizes": {}}
    with World(world_size) as w:
        loaded = shared_gpu_variant(loaded, w, echo)
        spec = loaded.model
        cached = render_to_cache(loaded)
        module = w.load(cached.manifest, source=cached.source)
        lib = ctypes.CDLL(str(module.binary))
        own_symbol(lib, module.binary, f"{spec.name}_host_timeline")  # the module's own (a trace variant)
        for seq in seqs:
            count = seq // world_size
            tiles = tiles_per_rank(spec.params, count)
            local_kv = in_place(spec.params, world_size, count)  # this size's calls: the own rows read in place
            bufs = module.alloc(count)
            fill_random(w, bufs)
            w.synchronize()
            enqueued = []

            def enqueue(i, ranks):
                t0 = time.time_ns()
                module.launch(bufs, ranks=ranks, streams=w.streams)
                enqueued.append((t0, time.time_ns()))

            def reset():  # before each sample's lineup call: the trace counts back to 0, waited for
                for r in w.ranks:
                    with w.cp.cuda.Device(w.devices[r]):
                        bufs.array("sig", r)[SIGNALS + STAMP_WORDS:SIGNALS + STAMP_WORDS + 1] = 0
                w.synchronize()

            sampler = Sampler(CupyClock(w), w.ranks, w.streams, enqueue, calls=calls, warmup=warmup, graphs=False,
                              lineup=True, before_sample=reset, label=f"{spec.name} {seq}")
            sampler.prepare()
            per_sample = []
            for k in range(samples):
                enqueued.clear()
                bench_us = sampler.sample()
                ranks = {r: read_rank(w, bufs, lib, spec.name, r, world_size) for r in w.ranks}
                done = process_sample(ranks, tiles, calls, world_size, local_kv, bench_us,
                                      f"{spec.name} at W {world_size}, S = {seq} ({tiles} tiles a rank), sample "
                                      f"{k + 1} of {samples}: {calls} timed calls after a lineup call",
                                      keep_records=k == 0)  # the first sample's records: the JSON stays small
                echo(done["report"])
                done["python_enqueue_ns"] = list(enqueued)
                per_sample.append(done)

            def fetch(name, r, a, b):
                with w.cp.cuda.Device(w.devices[r]):
                    return bufs.array(name, r)[a:b].get()

            err = family.bench.check_rows(family, spec, world_size, count, fetch)
            echo(f"  rows check at S = {seq}: worst row error {err:.2e} ({'ok' if err <= MAX_REL_ERR else 'WRONG'})")
            bufs.free()
            out["sizes"][str(seq)] = {"count": count, "tiles_per_rank": tiles, "row_error": err,
                                      "row_error_ok": err <= MAX_REL_ERR, "samples": per_sample}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--spec", type=Path, default=ROOT / "specs" / "cp_attention.yaml")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", default="16384", help="whole sequences, comma-separated (S = world x rows per rank)")
    ap.add_argument("--calls", type=int, default=3, help="timed calls per sample (the cp-w2 suites' iters: 3)")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="a spec param of the traced variant (VALUE read as YAML), e.g. local_kv=true; repeatable")
    a = ap.parse_args(argv)
    seqs = [int(x) for x in a.seq.split(",") if x.strip()]
    lines = []

    def echo(text):
        print(text, flush=True)
        lines.append(text)

    result = run(a.spec, a.world, seqs, a.calls, a.samples, a.warmup, parse_params(a.param), echo)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "cp_call_timeline.txt").write_text("\n".join(lines) + "\n")
    with gzip.open(a.out / "cp_call_timeline.json.gz", "wt") as f:
        json.dump(result, f)
    ok = all(s["row_error_ok"] and all(x["complete"] for x in s["samples"]) for s in result["sizes"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
