"""cp_attention on GPUs: world sizes 2, 4 and 8 (on one GPU with TSGEN_SHARE_GPUS=1, the SM push
variant: the copy engine is refused there), contiguous and zig-zag, causal and not, grouped-query,
both tensor layouts, lengths that are no multiple of the tile, 20 back-to-back calls with poisoned
outputs against the NumPy reference of attention over the whole sequence; the rank skew; and the
negative control (the wait for the first remote chunk removed, rank skew on) that must fail.
tools/gpu_cp_attention.sh runs these on one lent GPU."""

from __future__ import annotations

import zlib

import pytest

from conftest import ROOT, gpu_count, need_gpus, sharing
from results_rows import CONTROL_CALLS, record, record_control
from tsgen.harness import run_test

pytestmark = pytest.mark.gpu

SM_SPEC = ROOT / "specs" / "cp_attention_zigzag_causal_sm.yaml"
CE_SPEC = ROOT / "specs" / "cp_attention_zigzag_causal.yaml"
# few heads keep the float64 reference of the whole sequence (S = world x count) quick
CASES = {  # name -> (params, count)
    "contiguous_full_gqa": ({"layout": "contiguous", "causal": False, "heads": 4, "kv_heads": 2}, 333),
    "contiguous_causal_bhsd": ({"layout": "contiguous", "causal": True, "heads": 4, "kv_heads": 4,
                                "tensors": "bhsd"}, 333),
    "zigzag_causal_gqa": ({"layout": "zigzag", "causal": True, "heads": 4, "kv_heads": 1}, 250),
    "zigzag_full_hd64": ({"layout": "zigzag", "causal": False, "heads": 2, "kv_heads": 1, "head_dim": 64}, 250),
}


NAME_MAX = 64  # a spec name's longest (tsgen/spec_types.py)


def variant_name(name: str) -> str:
    """cp_<name> as a spec name: a case name too long for one (the copy-engine knobs' ids) keeps its first part and
    the CRC-32 of the whole, so that two cases never share a name (2026-11-29: the first 2-GPU run of
    own_copy_first's bhsd case failed on its 67-character name, not on the kernel)."""
    full = f"cp_{name}"
    if len(full) <= NAME_MAX:
        return full
    return f"{full[:NAME_MAX - 9].rstrip('_')}_{zlib.crc32(full.encode()):08x}"


def _run(name, world, params, count, iters=20, skew=None, spec=SM_SPEC, report=None, launch=None, after_call=None):
    need_gpus(world)
    lines = []
    ok = run_test(spec, world, count=count, iters=iters, echo=lines.append, skew=skew, report=report,
                  after_call=after_call,
                  variant={"name": variant_name(name), "params": params, "sync": {"timeout_ms": 3000},
                           **({"world_sizes": [world]} if world not in (2, 4, 8) else {}),
                           **({"launch": launch} if launch else {})})
    record("cp_attention", {"case": name, "world": world, "skew": skew, "pass": ok, "lines": lines})
    return ok, lines


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_cp_attention(case, world):
    params, count = CASES[case]
    ok, lines = _run(case, world, params, count)
    assert ok, "\n".join(lines)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("case", ["zigzag_causal_gqa", "contiguous_full_gqa"])
def test_cp_attention_epilogue_overlap(case, world):
    """params.epilogue_overlap (O staged apart, Q released after a tile's last S) on 3 attention CTAs a
    rank, so that each CTA walks several tiles and the next tile's Q loads under this one's epilogue:
    causal from the dynamic counter, not causal by the static stride; 20 calls, poisoned outputs."""
    params, count = CASES[case]
    ok, lines = _run(f"{case}_overlap", world, {**params, "epilogue_overlap": True}, count, launch={"blocks": 3})
    assert ok, "\n".join(lines)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["zigzag_causal_gqa", "contiguous_full_gqa"])
def test_trace_shows_every_tile_once(case, world):
    """3 attention CTAs a rank, so each takes several tiles (the shipped grids take one each at
    these sizes): causal, drawn from the dynamic schedule's counter, which must be back at 0 after
    each of the 20 calls (else the next would skip tiles and leave poison); not causal, the static
    stride. The outputs are right, and the test-only trace (params.trace, tools/attention_trace.py)
    shows every rank ran each of its tiles exactly once in every call, on at most 3 CTAs."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from attention_trace import read_trace, tiles_per_rank
    from tsgen.ops.cp_attention import CpAttentionParams, trace_summary

    params, count = CASES[case]
    need_gpus(world)
    tiles = tiles_per_rank(CpAttentionParams(**params), count)
    seen = []

    def after_call(call, w, bufs):
        for rank, table in read_trace(w, bufs).items():
            s = trace_summary(table, tiles)
            seen.append((call, rank, s["complete"] and s["tiles_once"] and s["ctas"] <= 3))

    lines = []
    ok = run_test(SM_SPEC, world, count=count, iters=20, echo=lines.append, after_call=after_call,
                  variant={"name": f"cp_trace_{case}", "params": {**params, "trace": tiles},
                           "launch": {"blocks": 3}, "sync": {"timeout_ms": 3000}})
    assert ok, "\n".join(lines)
    assert len(seen) == 20 * world and all(good for _, _, good in seen), [x for x in seen if not x[2]]


def own_signals_check(params: dict, world: int, count: int, seen: list):
    """after_call: each rank's READY signals of its own chunks (sig[READY + c], tsgen/cp.cuh READY = MAX_WORLD):
    0 where the call read them in place (own_in_place: nothing copies or signals them), the call's epoch where it
    gathered them; `seen` gets (call, rank, in place, whether the signals say so)."""
    from tsgen.ops.cp_attention import MAX_WORLD, own_in_place, segments

    layout, causal = params.get("layout", "contiguous"), params.get("causal", False)

    def check(call, w, bufs):
        for r in w.ranks:
            chunks = [c for _, _, _, c in segments(layout, causal, world, count, r, r)]
            with w.cp.cuda.Device(w.devices[r]):
                ready = bufs.array("sig", r)[MAX_WORLD:3 * MAX_WORLD].get()
            place = params.get("local_kv", False) and own_in_place(layout, causal, world, count, r, 128)
            seen.append((call, r, place, all((int(ready[c]) == 0) == place for c in chunks)))
    return check


LOCAL_CASES = [  # (case, extra params, count, blocks, local_kv): at 256 rows the own rows are read in place
    ("contiguous_full_gqa", {}, 256, None, True), ("contiguous_full_gqa", {}, 256, 3, True),
    ("contiguous_full_gqa", {}, 333, None, True),
    ("zigzag_causal_gqa", {}, 256, None, True), ("zigzag_causal_gqa", {}, 256, 3, True),
    ("zigzag_causal_gqa", {}, 250, None, True),
    ("contiguous_causal_bhsd", {}, 256, None, True), ("contiguous_causal_bhsd", {}, 333, None, True),
    ("contiguous_full_gqa", {"tensors": "bhsd", "batch": 2}, 256, None, True),  # the local maps' batch stride
    ("zigzag_causal_gqa", {"batch": 2}, 256, None, True),
    ("zigzag_full_hd64", {}, 256, None, True),
    ("zigzag_causal_gqa", {}, 256, None, False)]


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("case,extra,count,blocks,local_kv", LOCAL_CASES,
                         ids=[f"{c}{''.join(f'_{k}{v}' for k, v in x.items())}_{n}_{b or 'grid'}{'' if lk else '_off'}"
                              for c, x, n, b, lk in LOCAL_CASES])
def test_cp_attention_local_kv(world, case, extra, count, blocks, local_kv):
    """params.local_kv on the SM push (the variant that runs where ranks share a GPU), 20 calls, poisoned outputs.
    256 rows a rank: the own rows (not causal the last slot; causal the rank's chunk, zig-zag its two) start and
    end on 128-row blocks, so they are read in place through two more tensor maps, not copied to ourselves, not
    waited for; with 3 CTAs a rank each CTA's tiles switch between the gathered and the local maps; bhsd and batch 2
    (the local maps' strides), head dim 64. 333 / 250 rows: a KV block would straddle an own chunk and a gathered
    one, so the call gathers its own rows like a peer's (tsgen/cp.cuh own_in_place). local_kv off at 256 rows:
    every chunk gathered, as before it shipped. After every call each rank's own READY signals say which path ran
    (0: in place, nothing signalled them)."""
    params = {**CASES[case][0], **extra, "local_kv": local_kv}
    seen = []
    ok, lines = _run(f"local_kv_{case}_{'_'.join(map(str, extra.values()))}_{count}_{blocks or 'grid'}_{local_kv}",
                     world, params, count, launch={"blocks": blocks} if blocks else None,
                     after_call=own_signals_check(params, world, count, seen))
    assert ok, "\n".join(lines)
    assert len(seen) == 20 * world and all(good for *_, good in seen), [x for x in seen if not x[3]][:4]


@pytest.mark.parametrize("case", ["contiguous_causal_bhsd", "contiguous_full_gqa"])
def test_cp_attention_local_kv_world_3(case):
    """World 3 at 64 rows a rank, own chunks of 64 rows (fewer than the 128-row TMA box: the local map's rows past
    64 load as zeros). Not causal every rank's own shard (the last slot, from row 128) is read in place. Contiguous
    causal the ranks decide apart: rank 2's chunk (rows 128-191, ending at kv_len) in place, ranks 0 and 1 (a block
    would straddle their chunk and a peer's) gather theirs, in the same calls."""
    from tsgen.ops.cp_attention import own_in_place

    params = {**CASES[case][0], "local_kv": True}
    layout, causal = params["layout"], params["causal"]
    assert [own_in_place(layout, causal, 3, 64, r, 128) for r in range(3)] == ([False, False, True] if causal else
                                                                               [True, True, True])
    seen = []
    ok, lines = _run(f"local_kv_w3_{case}", 3, params, 64, after_call=own_signals_check(params, 3, 64, seen))
    assert ok, "\n".join(lines)
    assert len(seen) == 60 and all(good for *_, good in seen), [x for x in seen if not x[3]][:4]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("case", ["contiguous_full_gqa", "zigzag_full_hd64"])
def test_cp_attention_rescale_at(case, world):
    """params.rescale_at 4 (O rescaled among the exp2s; shipped in specs/cp_attention.yaml since 2026-11-29) in cp's
    not-causal kernels, contiguous and zig-zag, hd 128 and 64, an odd world among them: 20 calls, poisoned outputs,
    lengths no multiple of the tile."""
    params, count = CASES[case]
    shipped = {"pingpong": False, "row_max_chains": 2} if case == "contiguous_full_gqa" else {}  # as the shipped spec
    ok, lines = _run(f"{case}_rs4_w{world}", world, {**params, **shipped, "rescale_at": 4}, count)
    assert ok, "\n".join(lines)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("case", ["zigzag_causal_gqa", "contiguous_causal_bhsd"])
def test_cp_attention_rescale_skip(case, world):
    """params.rescale_skip (a warp skips O's rescale after a block where none of its 16 rows' maxima grew; shipped in
    the single-GPU causal GQA spec) in cp's causal kernels, zig-zag and contiguous: 20 calls, poisoned outputs."""
    params, count = CASES[case]
    ok, lines = _run(f"{case}_rskip", world, {**params, "rescale_skip": True}, count)
    assert ok, "\n".join(lines)


CE_KNOBS = [("contiguous_full_gqa", {"local_kv": True}, 256), ("contiguous_full_gqa", {"local_kv": True}, 333),
            ("zigzag_causal_gqa", {"local_kv": True}, 256), ("zigzag_causal_gqa", {"local_kv": False}, 256),
            ("contiguous_full_gqa", {"local_kv": False, "copy_1d": True}, 256),
            ("contiguous_full_gqa", {"local_kv": True, "copy_1d": True}, 256),
            # params.own_copy_first: the own rows copied by the SMs before the kernel (every chunk read from k_full):
            # local_kv off in every layout (zig-zag: two own segments; bhsd: lines > 1 with pitches), and with
            # local_kv at 333 rows (no block boundary: copied first too) and at 256 (in place: the copy not run)
            ("contiguous_full_gqa", {"local_kv": False, "own_copy_first": True}, 256),
            ("zigzag_causal_gqa", {"local_kv": False, "own_copy_first": True}, 256),
            ("contiguous_causal_bhsd", {"local_kv": False, "own_copy_first": True}, 333),
            ("contiguous_full_gqa", {"local_kv": True, "own_copy_first": True}, 333),
            ("contiguous_full_gqa", {"local_kv": True, "own_copy_first": True}, 256)]


def knob_tag(knobs: dict) -> str:
    return "_".join(f"{k}_{v}" for k, v in knobs.items())


def ce_case_name(case: str, knobs: dict, count: int) -> str:
    return f"ce_{case}_{count}_{knob_tag(knobs)}"


def test_every_case_makes_a_valid_distinct_spec_name():
    """Runs without a GPU: each copy-engine case's variant name is one a spec takes (each validated as the spec is),
    and no two cases share one."""
    from tsgen.spec import load_spec, spec_variant

    names = [variant_name(ce_case_name(case, knobs, count)) for case, knobs, count in CE_KNOBS]
    assert len(set(names)) == len(names)
    assert max(len(n) for n in names) <= NAME_MAX
    spec = load_spec(CE_SPEC)
    for name in names:
        spec_variant(spec, {"name": name})


@pytest.mark.parametrize("case,knobs,count", CE_KNOBS,
                         ids=[f"{c}_{knob_tag(kn)}_{n}" for c, kn, n in CE_KNOBS])
def test_cp_attention_copy_engine_knobs(case, knobs, count):
    """params.local_kv (256 rows: only the peers' copies and their signals, not causal and zig-zag causal; 333:
    the own shard copied, signalled and waited for like a peer's; off: every chunk copied), params.copy_1d
    (one-run pieces, bshd with batch 1, copied with cudaMemcpyAsync) and params.own_copy_first (the own rows copied
    by the SMs on the call's stream before the kernel and signalled there) on the shipped copy-engine gather (one
    GPU per rank)."""
    if gpu_count() < 2:
        pytest.skip(f"the copy-engine gather needs 2 GPUs (this machine has {gpu_count()})")
    params, _ = CASES[case]
    ok, lines = _run(ce_case_name(case, knobs, count), min(gpu_count(), 8) // 2 * 2,
                     {**params, **knobs, "gather": "copy_engine"}, count, spec=CE_SPEC)
    assert ok, "\n".join(lines)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("local_kv", [False, True], ids=["shipped", "local_kv"])
def test_call_timeline_tool(local_kv):
    """tools/cp_call_timeline.py on the shipped not-causal spec at S 4096 (2 GPUs): every timed call's trace is
    complete, its stamps and kernel are there, the phases add up (the call = the gap + the entry + its start +
    the span) and the output rows are right."""
    import sys

    if gpu_count() < 2:
        pytest.skip(f"the copy-engine gather needs 2 GPUs (this machine has {gpu_count()})")
    sys.path.insert(0, str(ROOT / "tools"))
    import cp_call_timeline as tool

    out = tool.run(ROOT / "specs" / "cp_attention.yaml", 2, [4096], calls=3, samples=1, warmup=1,
                   params={"local_kv": local_kv}, echo=lambda s: None)
    size = out["sizes"]["4096"]
    assert size["row_error_ok"], size["row_error"]
    sample = size["samples"][0]
    assert sample["complete"]
    for r, x in sample["summary"]["ranks"].items():
        for c in x["calls"]:
            ph = c["phases"]
            parts = [ph["previous kernel end -> entry kernel start"], ph["entry kernel (epoch, FREE to the peers)"],
                     ph["entry end -> attention kernel start"],
                     ph["attention kernel span (first tile start -> last tile end)"]]
            assert None not in parts, (r, c)
            assert sum(parts) == pytest.approx(ph["call: previous kernel end -> kernel end"], abs=0.01)
            assert (ph["WAIT_FREE end -> own copy signalled (signal 0 start)"] is None) == local_kv


@pytest.mark.parametrize("world,skew", [(4, 3), (8, 3), (4, "lag")])
def test_cp_attention_with_rank_skew(world, skew):
    """The seeded skew, and the negative control's lag schedule with the wait compiled in."""
    params, count = CASES["zigzag_causal_gqa"]
    ok, lines = _run(f"skewed_{skew}", world, params, count, skew=skew)
    assert ok, "\n".join(lines)


# Its 50 calls each check fresh data against a float64 reference of the whole sequence (S = 2664 at
# W 8: four float64 GEMMs of 2664 x 128 x 2664 per head, ~4 s a call on a busy 2-core machine):
# past the gate's 180 s per test when the machine is loaded (2026-11-27, 26 workers), so its own limit.
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case,world,rows", [("zigzag_causal_gqa", 4, None), ("contiguous_full_gqa", 8, None),
                                           ("zigzag_causal_gqa", 4, 256), ("contiguous_full_gqa", 2, 256)])
def test_negative_control_unwaited_chunk_fails(case, world, rows):
    """The attention kernel does not wait for the first remote chunk it reads; with the push
    kernels skewed it reads the previous call's K and V (or nothing): the test must fail. At 256
    rows the own rows are read in place (params.local_kv) beside the missing wait: zig-zag causal at W 4,
    and not causal at W 2, where the unwaited chunk (W - 2 = 0) is the only peer's."""
    params, count = CASES[case]
    report = {}
    name = case if rows is None else f"{case}_local_kv"
    ok, lines = _run(f"neg_{name}", world, {**params, "skip_wait": True}, rows or count, skew="lag",
                     iters=CONTROL_CALLS, report=report)
    record_control(f"cp_attention unwaited chunk ({name})", report["calls"], report["calls_wrong"], world=world,
                   skew="lag")
    assert not ok, "the unwaited chunk was not caught:\n" + "\n".join(lines)


def test_copy_engine_gather_on_separate_gpus():
    """The shipped (copy-engine) gather needs one GPU per rank (refused on a shared GPU)."""
    if gpu_count() < 2:
        pytest.skip(f"the copy-engine gather needs 2 GPUs (this machine has {gpu_count()}); "
                    "refused on a shared GPU: copies between ranks of one GPU stalled")
    params, count = CASES["zigzag_causal_gqa"]
    ok, lines = _run("ce", min(gpu_count(), 8) // 2 * 2, params, count, spec=CE_SPEC)
    assert ok, "\n".join(lines)


def test_copy_engine_refused_on_a_shared_gpu():
    if not sharing() or gpu_count() != 1:
        pytest.skip("checks the refusal on one shared GPU")
    from tsgen.errors import RuntimeSetupError

    with pytest.raises(RuntimeSetupError, match="copy-engine transport does not run on a shared GPU"):
        run_test(CE_SPEC, 2, count=250, iters=1, echo=lambda s: None)
