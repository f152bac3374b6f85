"""The cp_attention call timeline on the CPU (tsgen/ops/cp_timeline.py, tools/cp_call_timeline.py): its layout
constants against the headers', the stamps / host rows / records parsed from words, the phases of a made-up
two-rank timeline whose every number is known, the report, the clock checks, the tool's pure parts, and the
launcher's host rows from the compiled header (host code; no GPU)."""

from __future__ import annotations

import importlib.util
import re
import subprocess

import numpy as np
import pytest

from conftest import ROOT, compile_test, missing_tool, rendered_source
from tsgen.headers import include_flags
from tsgen.ops import cp_timeline as T
from tsgen.spec import load_spec, spec_variant
from tsgen.toolchain import find_nvcc, gencode_flags

US = 1000  # ns


def header_int(path, name):
    m = re.search(rf"\b{name} = ([^,;]+)[,;]", (ROOT / "templates" / "include" / "tsgen" / path).read_text())
    return m.group(1).strip()


def test_constants_match_the_headers():
    from tsgen.ops.cp_attention import STAMP_WORDS, TRACE_WORDS

    assert int(header_int("cp.cuh", "STAMP_CALLS")) == T.STAMP_CALLS
    assert int(header_int("cp.cuh", "STAMP_SLOT")) == T.STAMP_SLOT
    assert int(header_int("cp.cuh", "STAMP_ENTRY")) == T.STAMP_ENTRY
    assert int(header_int("cp.cuh", "STAMP_WAIT_FREE")) == T.STAMP_WAIT_FREE
    assert int(header_int("cp.cuh", "STAMP_SIGNAL")) == T.STAMP_SIGNAL
    assert int(header_int("cp.cuh", "HOST_CALLS")) == T.HOST_CALLS
    assert int(header_int("cp.cuh", "HOST_STEPS")) == T.HOST_STEPS
    assert header_int("cp.cuh", "HOST_ATTENTION") == "4 + 2 * MAX_WORLD" and T.HOST_ATTENTION == 4 + 2 * T.MAX_WORLD
    assert int(header_int("attention.cuh", "TRACE_WORDS")) == TRACE_WORDS == 7
    assert STAMP_WORDS == T.STAMP_WORDS == T.STAMP_CALLS * T.STAMP_SLOT


# ---------------------------------------------------------------------------
# A made-up timeline: two ranks, epochs 10 (the lineup call), 11 and 12, 2 CTAs of 2 tiles each
# ---------------------------------------------------------------------------

TILES = 4
CALL = 530 * US  # each call: 5 us after the previous kernel, a 3 us entry, 4 us to the kernel, 518 us of kernel


def stamps_of(rank, e, local_kv=False):
    """Rank's stamps of epoch e; rank 1's 1 us after rank 0's."""
    t = 4_600 * US + (e - 11) * CALL + rank * US  # the previous kernel's end
    own = None if local_kv else (t + 100 * US, t + 103 * US)
    return {"entry": (t + 5 * US, t + 8 * US), "wait_free": (t + 10 * US, t + 50 * US),
            "signals": [own, (t + 190 * US, t + 193 * US)]}


def records_of(rank, e):
    """Call e's 4 records (2 CTAs x 2 tiles), with their count indexes (the lineup call, 10, made 0 .. 3)."""
    t = 4_600 * US + (e - 11) * CALL + rank * US
    k0 = t + 12 * US  # kernel start
    base = (e - 10) * TILES
    recs = []
    for cta in range(2):
        s = k0 + cta * US
        first_end = s + (288 + 9 * cta) * US
        second = (230 - 10 * cta) * US
        recs.append({"index": base + 2 * cta, "sm": cta, "cta": cta, "tile": cta, "start": s, "end": first_end,
                     "waited": 190 * US, "first_ready": s + 93 * US, "last_ready": s + 188 * US,
                     "cycles": round((first_end - s) * 1.98)})  # the first tiles at 1.98 GHz, the later at 1.755
        recs.append({"index": base + 2 * cta + 1, "sm": cta, "cta": cta, "tile": 2 + cta, "start": first_end,
                     "end": first_end + second, "waited": 30 * US, "first_ready": first_end + US,
                     "last_ready": first_end + 90 * US, "cycles": round(second * 1.755)})
    return recs


def encode_stamps(table):
    w = np.zeros(T.STAMP_WORDS, np.uint64)
    for e, x in table.items():
        slot = (e % T.STAMP_CALLS) * T.STAMP_SLOT
        w[slot] = e
        for at, pair in ((T.STAMP_ENTRY, x["entry"]), (T.STAMP_WAIT_FREE, x["wait_free"])):
            if pair:
                w[slot + at:slot + at + 2] = pair
        for i, pair in enumerate(x["signals"]):
            if pair:
                w[slot + T.STAMP_SIGNAL + 2 * i:slot + T.STAMP_SIGNAL + 2 * i + 2] = pair
    return w


def per_rank(local_kv=False, host=None):
    out = {}
    for r in (0, 1):
        stamps = {e: stamps_of(r, e, local_kv) for e in (10, 11, 12)}
        recs = [x for e in (10, 11, 12) for x in records_of(r, e)]
        by_call = T.records_by_call(sorted(recs, key=lambda x: x["start"]), TILES, [10, 11, 12])
        out[r] = {"stamps": T.stamp_table(encode_stamps(stamps), 2),
                  "kernels": {e: T.kernel_of(v) for e, v in by_call.items()}, "host": host or {}}
    return out


def test_stamp_table_round_trip_and_empty_slots():
    table = {e: stamps_of(0, e) for e in (10, 11, 12)}
    got = T.stamp_table(encode_stamps(table), 2)
    assert got == {e: {"entry": x["entry"], "wait_free": x["wait_free"], "signals": x["signals"]}
                   for e, x in table.items()}
    local = T.stamp_table(encode_stamps({11: stamps_of(0, 11, local_kv=True)}), 2)
    assert local[11]["signals"][0] is None and local[11]["signals"][1] is not None


def test_records_by_call_uses_the_count_order():
    recs = [x for e in (10, 11, 12) for x in records_of(0, e)]
    by = T.records_by_call(sorted(recs, key=lambda x: -x["start"]), TILES, [10, 11, 12])
    assert [len(by[e]) for e in (10, 11, 12)] == [4, 4, 4]
    assert all(r["index"] // TILES == e - 10 for e in by for r in by[e])
    assert T.records_by_call(recs, TILES, [11]) == {11: records_of(0, 10)}  # a shorter list: the first call's


def test_phases_of_a_known_call():
    x = per_rank()
    k = x[0]["kernels"][11]
    assert k["tiles"] == 4 and k["ctas"] == 2
    assert k["first_ready"] == pytest.approx(93) and k["last_ready"] == pytest.approx(188)
    assert k["first_duration"] == pytest.approx(292.5) and k["first_waited"] == pytest.approx(190)
    assert k["later_tile"] == pytest.approx(225)  # median of 230 and 220
    assert k["first_clock_ghz"] == pytest.approx(1.98, abs=1e-4)
    assert k["later_clock_ghz"] == pytest.approx(1.755, abs=1e-4)
    c = T.call_phases(x[0]["stamps"][11], k, x[0]["kernels"][10]["end"])
    ph = c["phases"]
    want = {"previous kernel end -> entry kernel start": 5, "entry kernel (epoch, FREE to the peers)": 3,
            "entry end -> attention kernel start": 4, "entry end -> WAIT_FREE start (copy stream)": 2,
            "WAIT_FREE (every peer's FREE)": 40, "WAIT_FREE end -> own copy signalled (signal 0 start)": 50,
            "own signal 0 start -> peer copy signalled (signal 1 start)": 90,
            "first tile start -> its first chunk ready (median CTA)": 93,
            "first tile start -> its last chunk ready (median CTA)": 188,
            "attention kernel span (first tile start -> last tile end)": 518,
            "call: previous kernel end -> kernel end": 530, "outside the tiles: call - span": 12}
    for name, v in want.items():
        assert ph[name] == pytest.approx(v), name
    assert ph["WAIT_FREE end -> peer copy signalled (local_kv)"] is None
    # local_kv: no own copy; the peer's copy follows WAIT_FREE
    y = per_rank(local_kv=True)
    ph = T.call_phases(y[0]["stamps"][11], y[0]["kernels"][11], y[0]["kernels"][10]["end"], local_kv=True)["phases"]
    assert ph["WAIT_FREE end -> own copy signalled (signal 0 start)"] is None
    assert ph["WAIT_FREE end -> peer copy signalled (local_kv)"] == pytest.approx(140)
    # without the previous call: the gap and the call are unknown, the rest is not
    ph = T.call_phases(x[0]["stamps"][11], k, None)["phases"]
    assert ph["call: previous kernel end -> kernel end"] is None and ph["outside the tiles: call - span"] is None
    assert ph["attention kernel span (first tile start -> last tile end)"] == pytest.approx(518)


def test_host_rows_and_lead():
    words = np.zeros(T.HOST_WORDS, np.uint64)
    words[0] = 12
    rows = {}
    for call in (10, 11, 12):
        row = np.zeros(T.HOST_STEPS, np.uint64)
        t = 4_000 * US + (call - 11) * CALL
        row[0], row[1], row[2], row[3] = call, t, t + 10 * US, t + 15 * US
        row[4:8] = [t + 20 * US, t + 24 * US, t + 40 * US, t + 44 * US]  # copies 0, signal 0, copies 1, signal 1
        row[T.HOST_ATTENTION], row[T.HOST_RETURN] = t + 300 * US, t + 305 * US  # a slow attention launch
        words[1 + (call % T.HOST_CALLS) * T.HOST_STEPS:1 + (call % T.HOST_CALLS + 1) * T.HOST_STEPS] = row
        rows[call] = row
    table = T.host_table(words, 2)
    assert [r["call"] for r in table] == [10, 11, 12]
    h = table[1]
    assert h["copies"] == [int(rows[11][4]), int(rows[11][6])] and h["signals"][1] == int(rows[11][7])
    x = per_rank(host={r["call"]: r for r in table})
    lead = T.host_lead(x[0]["host"][11], x[0]["stamps"][11])
    assert lead["launcher"] == pytest.approx(305) and lead["slowest_step"] == ["attention", pytest.approx(256)]
    # the device's entry starts at 4605 us, the host returned at 4305: 300 us ahead
    assert lead["lead"] == pytest.approx(300) and lead["comparable"]
    assert T.host_lead(None, None) is None
    far = dict(h, enter=1, **{"return": 5 * 10**9})  # another clock altogether: not comparable
    assert not T.host_lead(far, x[0]["stamps"][11])["comparable"]


def test_summary_report_and_clock_checks():
    x = per_rank()
    s = T.summarize(x, [11, 12], 2)
    m = s["ranks"][0]["mean"]
    assert m["call: previous kernel end -> kernel end"] == pytest.approx(530)
    assert m["outside the tiles: call - span"] == pytest.approx(12) and m["later_tile"] == pytest.approx(225)
    assert s["ranks"][1]["mean"]["previous kernel end -> entry kernel start"] == pytest.approx(5)
    checks = [c for c in s["clock_checks"] if c["epoch"] == 11]
    r0 = next(c for c in checks if c["rank"] == 0)
    # rank 0 saw the peer's chunk at 4600 + 12 + 188 us; rank 1's signal 1 (to rank 0) started at 4601 + 190
    assert r0["ready_margin_us"] == pytest.approx(9) and r0["free_margin_us"] == pytest.approx(44)
    text = T.report(s, bench_us=531.0, title="made up")
    lines = text.splitlines()
    assert lines[0] == "made up" and "rank 0" in lines[1] and "rank 1" in lines[1]
    row = next(line for line in lines if line.startswith("outside the tiles: call - span"))
    assert row.split()[-2:] == ["12.0", "12.0"]
    assert any(line.startswith("bench figure for these calls") and line.endswith("531.0") for line in lines)
    assert "clock check (>= 0 where the GPUs' globaltimers agree): READY seen - raised min" in text
    assert "local_kv" not in text  # rows with no value on any rank are left out
    row = next(line for line in lines if line.startswith("SM clock over the later tiles"))
    assert row.split()[-2:] == ["1.755", "1.755"]


# ---------------------------------------------------------------------------
# The tool's pure parts, and the launcher's host rows compiled from the header
# ---------------------------------------------------------------------------


def tool():
    spec = importlib.util.spec_from_file_location("cp_call_timeline", ROOT / "tools" / "cp_call_timeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tool_variant_and_params():
    t = tool()
    loaded = load_spec(ROOT / "specs" / "cp_attention.yaml")
    v = t.timeline_variant(loaded, {"local_kv": False}, 4 * 2048)
    p = v.model.params
    assert v.model.name == "cp_attention_timeline" and not p.local_kv and p.trace == 8192
    shipped = t.timeline_variant(loaded, {}, 100).model
    assert shipped.params.local_kv and shipped.params.trace == 100 and shipped.test == loaded.model.test
    assert t.tiles_per_rank(p, 8192) == 64 * 32
    # the phases follow each size's calls: in place at 8192 rows a rank, the own shard copied at 8000 (tile 128)
    assert t.in_place(shipped.params, 2, 8192) and not t.in_place(shipped.params, 2, 8000)
    assert not t.in_place(p, 2, 8192)  # local_kv off
    assert t.parse_params(["local_kv=true", "gather_blocks=4"]) == {"local_kv": True, "gather_blocks": 4}
    assert t.CALLS_MAX == T.STAMP_CALLS - 1


HOST = r"""
#include "SOURCE"
#include <cstdio>
int main() {
  for (int i = 0; i < 10; ++i) tsgen::cp::host_call(1);
  uint64_t out[1 + tsgen::cp::HOST_CALLS * tsgen::cp::HOST_STEPS];
  const int n = MODULE_host_timeline(1, out, (int)(sizeof(out) / sizeof(out[0])));
  printf("%d %d %d\n", n, MODULE_host_timeline(9, out, 1000), MODULE_host_timeline(1, out, 3));
  for (int i = 0; i < n; ++i) printf("%llu\n", (unsigned long long)out[i]);
}
"""


@compile_test(missing_tool(find_nvcc) and f"nvcc not found: {missing_tool(find_nvcc)}")
def test_host_rows_from_the_compiled_launcher_header(tmp_path):
    """tsgen/cp.cuh's host side of the call timeline (compiled into trace variants only): ten calls of rank 1
    leave the last eight rows, numbered 3 .. 10, each with its entry time; the copy-out refuses a rank out of
    range and too little room."""
    loaded = spec_variant(load_spec(ROOT / "specs" / "cp_attention.yaml"), {"name": "ht", "params": {"trace": 10}})
    main = tmp_path / "host.cu"
    main.write_text(HOST.replace("SOURCE", str(rendered_source(loaded, tmp_path))).replace("MODULE", "ht"))
    exe = tmp_path / "host"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17", "-w", "-o", str(exe),
                    str(main)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    n, bad_rank, small = (int(x) for x in out[:3])
    assert n == T.HOST_WORDS and bad_rank == -1 and small == -1
    rows = T.host_table([int(x) for x in out[3:]], 2)
    assert [r["call"] for r in rows] == list(range(3, 11))
    assert all(r["enter"] and r["return"] is None and r["entry"] is None for r in rows)
    assert [r["enter"] for r in rows] == sorted(r["enter"] for r in rows)


def sig_words(rank, local_kv=False):
    """A rank's whole sig buffer after the made-up sample: signals, the stamps of epochs 10 .. 12, the trace
    (count 12, the records in count order)."""
    from tsgen.ops.cp_attention import SIGNALS, TRACE_WORDS, trace_words

    w = np.zeros(SIGNALS + trace_words(3 * TILES), np.uint64)
    w[SIGNALS:SIGNALS + T.STAMP_WORDS] = encode_stamps({e: stamps_of(rank, e, local_kv) for e in (10, 11, 12)})
    at = SIGNALS + T.STAMP_WORDS
    recs = sorted((x for e in (10, 11, 12) for x in records_of(rank, e)), key=lambda x: x["index"])
    w[at] = len(recs)
    for r in recs:
        i = at + 2 + TRACE_WORDS * r["index"]
        w[i:i + TRACE_WORDS] = [r["sm"] << 48 | r["cta"] << 32 | r["tile"], r["start"], r["end"], r["waited"],
                                r["first_ready"], r["last_ready"], r["cycles"]]
    return w


RECORD_START = 4  # "start" in tools/cp_call_timeline.py RECORD_FIELDS


def test_tool_processes_a_sample_from_the_buffers():
    """tools/cp_call_timeline.py's per-sample step on the made-up buffers: the epochs from the call counter, the
    records split by call, the phases, the report, and a result that JSON takes."""
    import json

    t = tool()
    ranks = {r: t.parse_rank(sig_words(r), None, 12, 2) for r in (0, 1)}
    done = t.process_sample(ranks, TILES, 2, 2, False, 531.0, "made up")
    assert done["epochs"] == [10, 11, 12] and done["complete"]
    m = done["summary"]["ranks"][1]["mean"]
    assert m["call: previous kernel end -> kernel end"] == pytest.approx(530)
    assert m["WAIT_FREE end -> own copy signalled (signal 0 start)"] == pytest.approx(50)
    assert done["report"].splitlines()[0] == "made up"
    json.dumps(done)
    packed = done["raw"][0]["records"]
    assert packed["rows"][0][RECORD_START] == 0 and t.unpack_records(packed) == ranks[0]["trace"]["records"]
    assert t.process_sample(ranks, TILES, 2, 2, False, None, "x", keep_records=False)["raw"][0]["records"] is None
    short = {r: t.parse_rank(sig_words(r), None, 12, 2) for r in (0, 1)}
    short[1]["trace"]["count"] = 11  # a record lost: said, not hidden
    bad = t.process_sample(short, TILES, 2, 2, False, None, "x")
    assert not bad["complete"] and "TRACE INCOMPLETE: rank 0 12 of 12 records, epoch 12, rank 1 11 of 12" in bad["report"]
