"""The bench wing on CPU: every op kind through `tsgen bench` on a simulated GPU (tests/bench_fakes.py),
the negative controls that must fail, the guard, ratios, baselines, suites and the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import bench_fakes
import tsgen.bench.baselines as B
from bench_fakes import install
from conftest import run_cli
from tsgen.bench.ceilings import Device, ceilings_for, floor, guard
from tsgen.bench.runner import SHARED_NOTE, add_ratios, bench_spec
from tsgen.bench.timing import MIN_CALL_US, Timing, time_calls
from tsgen.errors import RuntimeSetupError
from tsgen.ops import families, get_family
from tsgen.ops.conventions import BenchCase, baseline_names
from tsgen.shipped import shipped
from tsgen.spec import load_spec, spec_variant

# GEMMs shrunk so the NumPy references stay fast (N and K are compile-time)
SMALL = {"gemm": {"params": {"n": 256, "k": 256}}, "allgather_gemm": {"params": {"n": 256, "k": 256}},
         "gemm_reduce_scatter": {"params": {"n": 256, "k": 256}}, "cannon": {"params": {"n": 512, "k": 512}},
         "summa": {"params": {"n": 512, "k": 512}},
         # size = sequence length S (64K rows of the collectives' sizes): a small head count
         "ulysses_pre_a2a": {"params": {"batch": 1, "heads": 2, "head_dim": 8}, "world_sizes": [2]},
         "ulysses_post_a2a": {"params": {"batch": 1, "heads": 2, "head_dim": 8}, "world_sizes": [2]},
         # the float64 backward reference of 32 heads took 40 s here: 4 heads (one head group)
         "attention_backward": {"params": {"heads": 4, "kv_heads": 4}}}
SIZES = {"collective": "64K", "copy": "64K", "latency": "1000", "gemm": "128,200", "grid": "256",
         "moe": "200"}  # by conventions kind, or by op where its count is bounded (moe: tokens <= capacity)
FAST = dict(iters=3, reps=2, warmup=1)


def spec_of(kind: str):
    """The first shipped spec of op `kind` that runs in one process (no NVSHMEM, no multicast)."""
    for loaded in shipped(op=kind, multimem=False):
        if get_family(kind).transport(loaded.model) != "nvshmem":
            return loaded.path, loaded.model
    raise AssertionError(f"no shipped spec of op {kind}")


def case_of(kind: str):
    path, model = spec_of(kind)
    conv = get_family(kind).bench
    world = min(model.world_sizes)
    sizes = SIZES.get(kind) or SIZES.get(conv.kind, str(128 * world))  # fused: M = 128 rows per rank
    return path, world, sizes


def fake_multiprocess(monkeypatch, factor: float = 2.0):
    """Multi-process baselines that take `factor` x tsgen's fake kernel time (fused: components too)."""
    def collectives(names, family, spec, world, sizes, iters, reps, warmup):
        return [B.Measured("nccl", s, Timing([40.0 * factor] * 2, 4, "graph")) for s in sizes]

    def fused(names, family, spec, world, sizes, iters, reps, warmup):
        out = []
        for s in sizes:
            case = family.bench.case(family, spec, world, s)
            for role, us, compare in (("gemm", 30.0, False), ("comm", 25.0, False), ("sequential", 55.0, True),
                                      ("fused", 40.0 * factor, True)):
                c = dataclasses.replace(case, link_bytes=0.0) if role == "gemm" else case
                out.append(B.Measured(role, s, Timing([us] * 2, 4, "eager"), case=c, compare=compare, role=role))
        return out

    def cp_sdpa(names, family, spec, world, sizes, iters, reps, warmup):
        return [B.Measured("torch all_gather + SDPA", s, Timing([40.0 * factor] * 2, 4, "eager"),
                           case=family.bench.case(family, spec, world, s)) for s in sizes]

    def moe(names, family, spec, world, sizes, iters, reps, warmup):
        return [B.Measured("torch all_to_all_single dispatch+combine", s, Timing([40.0 * factor] * 2, 4, "eager"))
                for s in sizes]

    def deepep(names, family, spec, world, sizes, iters, reps, warmup):  # the pair compared, a phase beside it
        return [m for s in sizes for m in (
            B.Measured("DeepEP normal dispatch+combine (bf16, 24 SMs)", s, Timing([30.0 * factor] * 2, 4, "eager")),
            B.Measured("DeepEP normal dispatch (bf16, 24 SMs)", s, Timing([15.0 * factor] * 2, 4, "eager"),
                       case=BenchCase(s, s, link_bytes=1.0, bw_bytes=2.0), compare=False, role="dispatch"))]

    for name, fn in (("collectives", collectives), ("fused", fused), ("cp_sdpa", cp_sdpa), ("torch_a2a", collectives),
                     ("moe_a2a", moe), ("deepep", deepep)):
        monkeypatch.setattr(B, name, fn)  # the functions the families' Baselines name

    def sdpa(step):  # in this process (torch is not installed here): one backend that runs, one that does not
        stream = step.world.streams[step.world.ranks[0]]  # a call of `factor` x tsgen's fake kernel time
        return B._candidates(step, [("torch SDPA flash", lambda: stream.run(40.0 * factor), None),
                                    ("torch SDPA cuDNN", None, "not built here")])

    monkeypatch.setattr(B, "sdpa", sdpa)
    monkeypatch.setattr(B, "cudnn_frontend", lambda step: [])
    monkeypatch.setattr(B, "flash_attn_4", lambda step: [])


@pytest.mark.parametrize("kind", [f.kind for f in families()])
def test_every_op_kind_runs_through_tsgen_bench(monkeypatch, kind):
    install(monkeypatch)
    fake_multiprocess(monkeypatch)
    path, world, sizes = case_of(kind)
    conv = get_family(kind).bench
    out = bench_spec(path, world, sizes, variant=SMALL.get(kind), echo=lambda s: None, **FAST)
    assert out.errors == []
    tsgen = [r for r in out.rows if r["impl"] == "tsgen"]
    assert len(tsgen) == len(sizes.split(",")) * len(conv.patterns)
    for r in tsgen:
        assert r["time_us"] > 0 and r["spread_pct"] >= 0 and r["calls"] >= 3 and r["reps"] == 2
        assert r.get("wrong", 0) == 0 and r.get("poison_left", 0) == 0 and "check" in r
        if conv.kind in ("collective", "copy"):
            assert r["algbw_GBps"] > 0
        if conv.kind in ("gemm", "fused", "grid"):
            assert r["TFLOPs"] > 0 and r["rel_err"] <= 1e-2
    baselines = {r["impl"] for r in out.rows if r.get("baseline")}
    if conv.baselines:
        assert baselines, f"{kind} names baselines {conv.baselines} but none was timed"
        assert all(r.get("ratios") for r in tsgen)
    else:
        assert not baselines


def test_attention_baselines_timed_in_tsgens_rounds(monkeypatch):
    """attention's in-process baselines are timed in the same rounds as tsgen: raw samples of both
    in the rows, the ratio paired round by round with its spread."""
    install(monkeypatch)
    fake_multiprocess(monkeypatch)
    path, world, sizes = case_of("attention")
    assert get_family("attention").bench.interleave
    out = bench_spec(path, world, sizes, echo=lambda s: None, iters=3, reps=4, warmup=1)
    assert out.errors == []
    for r in [r for r in out.rows if r["impl"] == "tsgen"]:
        base = next(b for b in out.rows if b.get("baseline") and b["size"] == r["size"])
        assert r["round_set"] == base["round_set"] and len(r["samples_us"]) == len(base["samples_us"]) == 4
        spread = r["ratio_spread"]["torch SDPA flash"]
        assert spread["rounds"] == 4 and spread["min"] <= r["ratios"]["torch SDPA flash"] <= spread["max"]
        assert r["ratios"]["torch SDPA flash"] > 1.2  # the fake baseline's call is twice tsgen's kernel


def test_interleaved_samples_all_start_behind_an_untimed_call(monkeypatch):
    """In attention's interleaved rounds every sample starts behind one untimed call of its own: tsgen's
    (settle 1) as each in-process baseline's (lineup), so that no side's first timed call waits for its
    own host-side launch on an idle GPU (before 2026-11-29 tsgen's samples started idle, the baselines'
    not: tsgen's launch path was in its samples only). A collective's W 2 samples keep their lineup."""
    import tsgen.bench.runner as R

    install(monkeypatch)
    fake_multiprocess(monkeypatch)
    made = []
    real = R.Sampler

    class Spy(real):
        def __init__(self, *a, **kw):
            made.append((kw.get("label", ""), kw.get("lineup", False), kw.get("settle", 0)))
            super().__init__(*a, **kw)

    monkeypatch.setattr(R, "Sampler", Spy)
    monkeypatch.setattr(B, "Sampler", Spy)
    path, world, sizes = case_of("attention")
    out = bench_spec(path, world, sizes, echo=lambda s: None, iters=3, reps=2, warmup=1)
    assert out.errors == [] and len(made) >= 2
    tsgen = [m for m in made if m[0].startswith("tsgen")]
    rivals = [m for m in made if not m[0].startswith("tsgen")]
    assert tsgen and rivals
    assert all(settle == 1 and not lineup for _, lineup, settle in tsgen), tsgen
    assert all(lineup for _, lineup, _ in rivals), rivals
    made.clear()
    out = bench_spec("specs/allgather.yaml", 2, "64K", baselines=False, echo=lambda s: None, **FAST)
    assert out.errors == [] and made and all(lineup and settle == 0 for _, lineup, settle in made), made


@pytest.mark.parametrize("control", ["skip-launch", "other-stream"])
@pytest.mark.parametrize("kind", ["allgather", "gemm", "all_reduce", "put_block", "allgather_gemm"])
def test_negative_controls_fail(monkeypatch, kind, control):
    """A skipped launch, or events on another stream: every result must be an error, none a row."""
    install(monkeypatch)
    path, world, sizes = case_of(kind)
    out = bench_spec(path, world, sizes, variant=SMALL.get(kind), control=control, echo=lambda s: None, **FAST)
    assert [r for r in out.rows if r["impl"] == "tsgen"] == []
    assert out.errors
    if control == "other-stream":
        assert any("events are not on the stream the calls run on" in e for e in out.errors)
    else:
        assert any("shorter than one kernel launch" in e or "did not write" in e or "counter" in e for e in out.errors)


def test_negative_control_cli_exit_codes(monkeypatch):
    install(monkeypatch)
    args = ["bench", "specs/allgather.yaml", "--gpus", "2", "--sizes", "64K", "--iters", "2", "--reps", "2",
            "--warmup", "1"]
    r = run_cli(*args, "--negative-control", "other-stream")
    assert r.code == 0 and "caught, as it must be" in r.stdout, r
    r = run_cli(*args, "--no-baselines")
    assert r.code == 0 and "allgather" in r.stdout and "busbw" in r.stdout, r


def test_wrong_output_is_an_error_not_a_row(monkeypatch):
    install(monkeypatch, break_rank=1)
    out = bench_spec("specs/allgather.yaml", 2, "64K", baselines=False, echo=lambda s: None, **FAST)
    assert out.rows == [] and any("timed output is wrong" in e for e in out.errors)
    r = run_cli("bench", "specs/allgather.yaml", "--gpus", "2", "--sizes", "64K", "--no-baselines", "--iters", "2")
    assert r.code == 1 and "failed a check" in r.stderr


def test_result_above_its_ceiling_is_an_error(monkeypatch):
    install(monkeypatch)
    fam = get_family("gemm")
    real = fam.bench.case
    monkeypatch.setattr(fam.bench, "case", lambda f, s, w, size: dataclasses.replace(real(f, s, w, size), flops=1e15))
    out = bench_spec("specs/gemm_bf16.yaml", None, "128", variant=SMALL["gemm"], echo=lambda s: None, **FAST)
    assert [r for r in out.rows if r["impl"] == "tsgen"] == []
    assert any("matrix-rate ceiling" in e and "above its ceiling" in e for e in out.errors)


def test_shared_gpu_rows_are_labelled_with_no_baselines(monkeypatch):
    install(monkeypatch, share=True)
    fake_multiprocess(monkeypatch)
    for kind in ("allgather", "allgather_gemm"):
        path, world, sizes = case_of(kind)
        out = bench_spec(path, world, sizes, variant=SMALL.get(kind), echo=lambda s: None, **FAST)
        assert out.errors == [] and out.shared and out.rows
        assert all(r["note"].endswith(SHARED_NOTE) and not r.get("ratios") and not r.get("baseline") for r in out.rows)


# ---------------------------------------------------------------------------
# the timing core, the ceilings, the ratios
# ---------------------------------------------------------------------------


class Clock:
    """A device where every call takes 10 us, on the right stream or not."""

    def __init__(self, events_on_work_stream=True):
        self.t, self.host, self.ok = 0.0, 0.0, events_on_work_stream

    def record(self, rank, stream):
        return self.t if (stream == "work" or self.ok) else self.host

    def wait(self, ev):
        self.host = max(self.host, ev)

    def done(self, ev):
        return ev <= self.host

    def elapsed_ms(self, a, b):
        return (b - a) / 1e3

    def capture(self, rank, stream, fn):
        raise RuntimeError("not capturable")

    def replay(self, g, s):
        raise AssertionError

    def synchronize(self):
        self.host = max(self.host, self.t)

    def max_over_processes(self, label, v):
        return v

    def agree(self, label, err):
        return err


def test_time_calls_witness_region_counter():
    clock = Clock()
    calls = {"n": 0}

    def enqueue(i, ranks):
        clock.t += 10.0
        calls["n"] += 1

    t = time_calls(clock, [0], {0: "work"}, enqueue, calls=5, reps=3, warmup=2, graphs=True,
                   counter=lambda r: calls["n"], label="x")
    assert t.problems == [] and t.median_us == pytest.approx(10.0) and t.mode == "eager"
    assert t.note.startswith("graph capture failed, timed eagerly")
    bad = Clock(events_on_work_stream=False)
    t = time_calls(bad, [0], {0: "work"}, lambda i, r: setattr(bad, "t", bad.t + 10.0), calls=5, reps=2,
                   warmup=1, graphs=False, event_streams={0: "other"}, label="x")
    assert any("not on the stream" in p for p in t.problems)
    idle = Clock()
    t = time_calls(idle, [0], {0: "work"}, lambda i, r: None, calls=5, reps=2, warmup=1, graphs=False,
                   counter=lambda r: 0, label="x")
    assert any(f"({MIN_CALL_US} us)" in p for p in t.problems) and any("counter advanced by 0" in p for p in t.problems)


def test_settle_calls_run_untimed_before_each_sample_and_take_the_carried_over_boost():
    """A device whose first call after an idle gap runs at a boost (8 us instead of 10): without
    settle calls every sample starts boosted; with one, the boost falls on an untimed call and the
    sample times the sustained 10 us. The settle calls count as enqueued (the counter check holds)."""

    class BoostClock(Clock):
        def synchronize(self):
            super().synchronize()
            self.cool = True

    def timing(settle):
        clock = BoostClock()
        clock.cool, calls = True, {"n": 0}

        def enqueue(i, ranks):
            clock.t += 8.0 if clock.cool else 10.0
            clock.cool = False
            calls["n"] += 1

        return time_calls(clock, [0], {0: "work"}, enqueue, calls=2, reps=3, warmup=1, graphs=False,
                          counter=lambda r: calls["n"], label="x", settle=settle)

    assert timing(0).median_us == pytest.approx(9.0) and timing(0).problems == []
    t = timing(1)
    assert t.median_us == pytest.approx(10.0) and t.problems == []


H100 = Device("NVIDIA H100 80GB HBM3", 132, 1980000, (9, 0), 50 << 20)
H200 = Device("NVIDIA H200", 132, 1980000, (9, 0), 60 << 20)


def test_ceilings_table_and_sources():
    c = ceilings_for(H100)
    assert c.model == "H100 SXM" and c.tflops["bfloat16"] == pytest.approx(132 * 4096 * 1.98e9 / 1e12)
    assert c.tflops["bfloat16"] > 989.4  # above the datasheet's (taken at 1.83 GHz): never a false alarm
    assert ceilings_for(H200).hbm_GBps == 4800 and c.hbm_GBps == 3350 and c.nvlink_GBps == 478
    assert all(c.sources[k] for k in ("tflops", "hbm", "nvlink"))
    with pytest.raises(RuntimeSetupError, match="no ceilings for 'Tesla T4'.*ceilings.py"):
        ceilings_for(Device("Tesla T4", 40, 1590000, (7, 5), 4 << 20))


def test_floor_terms_and_guard():
    c = ceilings_for(H100)
    gemm = BenchCase(8192, 8192, flops=2.0 * 8192**3, hbm_bytes=3 * 2 * 8192**2)
    f = floor(gemm, c, "bfloat16")
    assert "matrix-rate" in f.term and f.us == pytest.approx(2.0 * 8192**3 / (c.tflops["bfloat16"] * 1e6))
    # the 89,362 TFLOP/s (0.012 ms per 8192^3 call) is an error; cuBLAS's 1.37 ms is not
    assert guard("gemm", 12.0, gemm, c, "bfloat16") and not guard("cuBLAS", 1370.0, gemm, c, "bfloat16")
    ag = BenchCase(1 << 30, 0, link_bytes=0.75 * (1 << 30), bw_bytes=1 << 30, busbw_factor=0.75)
    assert "NVLink" in floor(ag, c, "bfloat16").term
    assert guard("allgather", 1000.0, ag, c, "bfloat16")  # 805 GB/s busbw: above NVLink
    assert not guard("allgather", 1000.0, ag, c, "bfloat16", colocated=4)  # a shared GPU: no NVLink term
    small = BenchCase(1 << 20, 0, hbm_bytes=2 << 20)
    assert floor(small, c, "bfloat16", l2_bytes=50 << 20).us == 0  # fits the L2: no device-memory term


def test_ratios_and_overlap():
    rows = [{"impl": "tsgen", "group": "g", "size": 1, "time_us": 10.0},
            {"impl": "seq", "baseline": True, "compare": True, "group": "g", "size": 1, "time_us": 20.0},
            {"impl": "gemm", "baseline": True, "compare": False, "role": "gemm", "group": "g", "size": 1, "time_us": 8.0},
            {"impl": "comm", "baseline": True, "compare": False, "role": "comm", "group": "g", "size": 1, "time_us": 6.0},
            {"impl": "other op", "baseline": True, "compare": True, "group": "h", "size": 1, "time_us": 1.0}]
    add_ratios(rows)
    assert rows[0]["ratios"] == {"seq": 2.0} and rows[0]["overlap"] == 0.8 and rows[1]["overlap"] == 0.4


def test_baseline_above_its_ceiling_is_an_error(monkeypatch):
    install(monkeypatch)

    def absurd(names, family, spec, world, sizes, iters, reps, warmup):
        return [B.Measured("nccl", s, Timing([1e-3] * 2, 4, "graph")) for s in sizes]

    monkeypatch.setattr(B, "collectives", absurd)
    out = bench_spec("specs/allgather.yaml", 2, "1M", echo=lambda s: None, **FAST)
    assert [r["impl"] for r in out.rows] == ["tsgen"] and any(e.startswith("nccl:") for e in out.errors)


def test_deepep_rows_become_measurements(monkeypatch):
    """The DeepEP worker's rows (tsgen/bench/moe_deepep.py) as bench measurements: each phase with its
    own bytes, only the pair compared with tsgen's, a skipped size a note, the ceiling beside the first size."""
    import tsgen.bench.workers as W

    timed = {"time_us": 500.0, "samples_us": [500.0, 510.0], "calls": 10, "mode": "eager", "problems": []}
    rows = [dict(timed, phase="dispatch", tokens=4096, ep_mode="normal", payload="fp8", sms=24, wrong=0,
                 deepep_bytes=3000, link_bytes=1500),
            dict(timed, phase="pair", tokens=4096, ep_mode="normal", payload="fp8", sms=24, wrong=0,
                 deepep_bytes=9000, link_bytes=4500),
            {"phase": "all", "tokens": 128, "skipped": "deep_ep cannot be imported"},
            dict(timed, phase="ceiling", tokens=0, ep_mode="peer copy", payload="bytes", wrong=0,
                 deepep_bytes=256 << 20, link_bytes=256 << 20)]
    got = {}
    monkeypatch.setattr(W, "launch_workers", lambda cfg, world: got.update(cfg=cfg, world=world) or rows)
    spec = spec_variant(load_spec("specs/moe_fp8.yaml"), {"params": {"experts": 32, "hidden": 7168}}).model
    ms = B.deepep(["deepep"], get_family("moe"), spec, 2, [4096, 128], 10, 5, 3)
    assert got["world"] == 2 and got["cfg"]["worker"] == "tsgen.bench.moe_deepep:deepep_worker"
    assert got["cfg"]["payload"] == "fp8" and got["cfg"]["hidden"] == 7168 and got["cfg"]["mode"] == "normal"
    assert got["cfg"]["sizes"] == [4096, 128]
    d, pair, skipped, ceiling = ms
    assert d.impl == "DeepEP normal dispatch (fp8, 24 SMs)" and not d.compare and d.role == "dispatch"
    assert d.case.bw_bytes == 1500 and d.case.link_bytes == 1500 and d.extra["deepep_bytes"] == 3000 and d.timing.median_us == 505.0
    assert pair.impl == "DeepEP normal dispatch+combine (fp8, 24 SMs)" and pair.compare and pair.case.bw_bytes == 4500
    assert skipped.timing is None and skipped.size == 128 and "cannot be imported" in skipped.skipped
    assert ceiling.size == 4096 and ceiling.impl.startswith("peer copy ceiling (cudaMemcpyPeerAsync 256 MiB")
    assert not ceiling.compare and ceiling.extra["wrong"] == 0


@pytest.mark.parametrize("spec_path", ["specs/moe.yaml", "specs/moe_fp8.yaml", "specs/moe_ll.yaml"])
def test_moe_dispatch_and_combine_are_timed_each_alone(monkeypatch, spec_path):
    """Beside tsgen's pair, its dispatch alone and its combine alone (tsgen/bench/moe_phases.py): each
    through its own host entry, its own bytes (the bottleneck rank's, that phase only), its SM count,
    its output checked, compared with nothing; they add up to the pair's bytes."""
    from tsgen.ops.moe import phase_sms, traffic

    install(monkeypatch)
    fake_multiprocess(monkeypatch)
    out = bench_spec(spec_path, 2, "100", echo=lambda s: None, **FAST)
    assert out.errors == []
    pair = next(r for r in out.rows if r["impl"] == "tsgen")
    phases = {r["phase"]: r for r in out.rows if r["impl"].startswith("tsgen ") and r.get("phase")}
    assert set(phases) == {"dispatch", "combine"}
    spec = load_spec(spec_path).model
    payload = spec.params.payload
    sms = {name: phase_sms(spec, name) for name in ("dispatch", "combine")}  # the shipped normal specs: 64, 128
    assert phases["dispatch"]["impl"] == f"tsgen dispatch ({payload}, {sms['dispatch']} SMs)"
    assert phases["combine"]["impl"] == f"tsgen combine (bf16, {sms['combine']} SMs)"
    family = get_family("moe")
    sent = traffic(spec, 2, family.bench.bench_inputs(family, spec, 2, 100, np.random.default_rng(12345)))
    for name, r in phases.items():
        assert r["wrong"] == 0 and not r["compare"] and r["role"] == name and r["sms"] == sms[name]
        assert r["busbw_GBps"] == pytest.approx(max(sent[name]) / r["time_us"] / 1e3)
    rows = phases["dispatch"]["received_check"]  # what the ranks received, compared row by row
    assert phases["dispatch"]["received_wrong"] == 0 and rows.endswith("rows on rank(s) 0, 1")
    assert int(rows.split("bit-exact: ")[1].split()[0]) > 0
    assert "ratios" in pair and not any("tsgen " in k for k in pair["ratios"])


def test_moe_phase_compared_with_the_fastest_same_phase_baseline(monkeypatch):
    """tsgen's dispatch alone gets a ratio against the fastest DeepEP row of the same phase, mode and
    payload (here of two SM counts); its combine, with no such row, none; the pair keeps its own."""
    from tsgen.bench.runner import PHASE_RATIO

    install(monkeypatch)
    fake_multiprocess(monkeypatch)
    fields = {"phase": "dispatch", "ep_mode": "normal", "payload": "bf16", "wrong": 0}
    case = BenchCase(100, 100, link_bytes=1.0, bw_bytes=2.0)

    def deepep(names, family, spec, world, sizes, iters, reps, warmup):
        return [m for s in sizes for m in (
            B.Measured("DeepEP normal dispatch+combine (bf16, 24 SMs)", s, Timing([160.0] * 2, 4, "eager")),
            B.Measured("DeepEP normal dispatch (bf16, 24 SMs)", s, Timing([120.0] * 2, 4, "eager"), case=case,
                       compare=False, role="dispatch", extra=dict(fields, sms=24)),
            B.Measured("DeepEP normal dispatch (bf16, 48 SMs)", s, Timing([80.0] * 2, 4, "eager"), case=case,
                       compare=False, role="dispatch", extra=dict(fields, sms=48)),
            B.Measured("DeepEP normal dispatch (fp8, 48 SMs)", s, Timing([20.0] * 2, 4, "eager"), case=case,
                       compare=False, role="dispatch", extra=dict(fields, payload="fp8", sms=48)))]

    monkeypatch.setattr(B, "deepep", deepep)
    out = bench_spec("specs/moe.yaml", 2, "100", echo=lambda s: None, **FAST)
    assert out.errors == []
    phases = {r["phase"]: r for r in out.rows if r["impl"].startswith("tsgen ") and r.get("phase")}
    d = phases["dispatch"]
    assert d["phase_rival"] == "DeepEP normal dispatch (bf16, 48 SMs)"
    assert d["ratios"] == {PHASE_RATIO: pytest.approx(80.0 / d["time_us"])}
    assert "ratios" not in phases["combine"]
    pair = next(r for r in out.rows if r["impl"] == "tsgen")
    assert PHASE_RATIO not in pair["ratios"] and "DeepEP normal dispatch+combine (bf16, 24 SMs)" in pair["ratios"]


def test_moe_phase_that_writes_nothing_is_an_error(monkeypatch):
    """A dispatch entry that counts its call but leaves recv_counts alone (poisoned after the warm-up)
    is caught by the phase's own check: an error, not a row."""
    install(monkeypatch)
    fake_multiprocess(monkeypatch)
    real = bench_fakes.Module.launch_entry

    def broken(self, entry, bufs, ranks, streams, extra=None):
        if entry != "dispatch":
            return real(self, entry, bufs, ranks, streams, extra)
        for r in ranks:  # counts the call, writes nothing

            def count(r=r):
                bufs.array("calls", r)[0] += 1

            streams[r].run(self.world.kernel_us, count)

    monkeypatch.setattr(bench_fakes.Module, "launch_entry", broken)
    out = bench_spec("specs/moe.yaml", 2, "100", echo=lambda s: None, **FAST)
    assert any("tsgen dispatch" in e and "wrong" in e for e in out.errors), out.errors
    assert not any(r.get("phase") == "dispatch" and r["impl"].startswith("tsgen") for r in out.rows)


def _no_rows(segments):
    return []


def _two_rows_swapped(segments):
    """The first payload rows (bf16 recv_x, fp8 recv_q, a low-latency slot's recv_x) with two rows
    or more: its rows 0 and 1 trade places; their handles stay."""
    seg = next(s for s in segments if s.name in ("recv_x", "recv_q") and len(s.rows) >= 2)
    rows = seg.rows.copy()
    rows[[0, 1]] = rows[[1, 0]]
    return [dataclasses.replace(s, rows=rows) if s is seg else s for s in segments]


def _wrong_handle(segments):
    """The first handle (normal: [source rank, token], its token one more; low-latency: token * 32 + k,
    its k one more) is off by one; the rows stay right."""
    seg = next(s for s in segments if s.name in ("handle", "recv_src"))
    rows = seg.rows.copy()
    rows[0, -1] += 1
    return [dataclasses.replace(s, rows=rows) if s is seg else s for s in segments]


@pytest.mark.parametrize("spec_path", ["specs/moe.yaml", "specs/moe_fp8.yaml", "specs/moe_ll.yaml"])
@pytest.mark.parametrize("mangle, rank, named", [
    (_no_rows, 0, None),  # None: every received buffer
    (_two_rows_swapped, 1, ("recv_x", "recv_q")),
    (_wrong_handle, 1, ("handle", "recv_src"))])
def test_moe_dispatch_alone_checks_the_received_rows(monkeypatch, spec_path, mangle, rank, named):
    """Dispatch alone's received rows (poisoned after its warm-up) are compared bit for bit with what
    the ranks should hold: a dispatch that counts right but delivers no rows on one rank, two rows
    swapped, or a wrong handle is an error naming the rank and the buffer, not a row; the pair and
    combine alone keep their rows."""
    from tsgen.bench.moe_phases import received_buffers

    install(monkeypatch)
    fake_multiprocess(monkeypatch)
    monkeypatch.setattr(bench_fakes.Module, "deliver",
                        staticmethod(lambda r, segments: mangle(segments) if r == rank else segments))
    out = bench_spec(spec_path, 2, "100", echo=lambda s: None, **FAST)
    names = [n for n in received_buffers(load_spec(spec_path).model) if named is None or n in named]
    assert len(names) == (len(received_buffers(load_spec(spec_path).model)) if named is None else 1)
    for name in names:
        assert any(e.startswith("tsgen dispatch ") and f": rank {rank} {name}: " in e and "differ" in e
                   for e in out.errors), (name, out.errors)
    assert not any(f"rank {1 - rank} " in e for e in out.errors), out.errors
    assert any(e.startswith("tsgen dispatch (") and "wrong elements" in e for e in out.errors), out.errors
    assert sorted(r.get("phase") or "pair" for r in out.rows if r["impl"].startswith("tsgen")) == ["combine", "pair"]


def test_moe_phase_refused_is_a_note_and_the_other_phase_stays(monkeypatch):
    """A phase whose launch is refused (a cudaError from its host entry) becomes a note naming the error;
    the pair and the other phase keep their rows."""
    from tsgen.errors import RuntimeSetupError

    install(monkeypatch)
    fake_multiprocess(monkeypatch)
    real = bench_fakes.Module.launch_entry

    def refused(self, entry, bufs, ranks, streams, extra=None):
        if entry == "combine":
            raise RuntimeSetupError("rank 0: moe_w2_combine_launch failed with cudaError 1")
        return real(self, entry, bufs, ranks, streams, extra)

    monkeypatch.setattr(bench_fakes.Module, "launch_entry", refused)
    out = bench_spec("specs/moe.yaml", 2, "100", echo=lambda s: None, **FAST)
    assert out.errors == []
    assert [r["phase"] for r in out.rows if r["impl"].startswith("tsgen ") and r.get("phase")] == ["dispatch"]
    assert any(n.startswith("tsgen combine (bf16, 128 SMs) at 100: not timed: RuntimeSetupError") for n in out.notes), out.notes


def test_every_family_states_its_conventions():
    for f in families():
        conv = f.bench
        assert conv.kind in ("copy", "collective", "gemm", "fused", "grid", "latency")
        B.check_baselines(conv.baselines)
        assert conv.metric in ("busbw_GBps", "algbw_GBps", "TFLOPs", "time_us")
    names = lambda kind: baseline_names(get_family(kind).bench.baselines)  # noqa: E731
    assert names("all_reduce") == ("nccl", "symm_mem")
    assert names("gemm") == ("cublas",)
    assert set(names("allgather_gemm")) == {"cublas+nccl", "torch_fused"}
    assert names("cannon") == ("cublas_whole",)
    assert [b.in_process for b in get_family("gemm").bench.baselines] == [True]
    assert [b.in_process for b in get_family("all_reduce").bench.baselines] == [False, False]


def test_a_baseline_names_a_function_that_times_it(monkeypatch):
    """A family's Baseline names a function of tsgen/bench/baselines.py; one it does not have is a
    configuration error before anything runs, and the one named is the one called."""
    from tsgen.bench.sizes import BenchConfigError
    from tsgen.ops.conventions import Baseline

    with pytest.raises(BenchConfigError, match="no function 'nope'"):
        B.check_baselines((Baseline("x", "nope"),))
    with pytest.raises(BenchConfigError):
        B.check_baselines((Baseline("x", "_timing"),))  # a helper is no baseline
    seen = []
    monkeypatch.setattr(B, "collectives", lambda names, *a: seen.append(names) or [])
    both = (Baseline("nccl", "collectives"), Baseline("symm_mem", "collectives"), Baseline("cublas", "cublas", True))
    assert B.run_multiprocess(both, None, None, 2, [1], 1, 1, 1) == []
    assert seen == [["nccl", "symm_mem", "cublas"]]  # once for both, with every name


def test_a_worker_runs_the_function_its_config_names():
    from tsgen.bench.nccl import worker
    from tsgen.bench.workers import worker_function

    assert worker_function("tsgen.bench.nccl:worker") is worker
    for bad in ("os:system", "tsgen.bench.nccl", "tsgen.bench.nccl:worker()"):
        with pytest.raises(ValueError):
            worker_function(bad)


def test_json_rows_and_plot(monkeypatch, tmp_path):
    install(monkeypatch)
    out = tmp_path / "r.json"
    r = run_cli("bench", "specs/put_block.yaml", "--gpus", "2", "--sizes", "64K", "--iters", "2", "--reps", "2",
                "--json", str(out))
    assert r.code == 0, r
    data = json.loads(out.read_text())
    assert {x["impl"] for x in data["rows"]} == {"tsgen", "memcpyPeer"} and data["errors"] == []
    assert {x.get("pattern") for x in data["rows"]} == {"pair", "ring"}
    assert data["meta"]["device"]["name"] == "NVIDIA H100 80GB HBM3" and data["meta"]["commit"]
    pytest.importorskip("matplotlib")
    r = run_cli("bench", "specs/put_block.yaml", "--gpus", "2", "--sizes", "64K", "--plot", str(tmp_path / "p.png"))
    assert r.code == 0 and (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.parametrize("op,nbytes,world,count", [
    ("allgather", 1 << 20, 4, (1 << 20) // 2 // 4),  # bytes = the output of world chunks
    ("reduce_scatter", 1 << 20, 4, (1 << 20) // 2 // 4),  # bytes = the input of world chunks
    ("all_to_all", 1 << 20, 4, (1 << 20) // 2 // 4),  # bytes = each rank's buffer; count per peer
    ("all_reduce", 1 << 20, 4, (1 << 20) // 2),
    ("broadcast", 1 << 20, 2, (1 << 20) // 2),
])
def test_collective_size_conventions(op, nbytes, world, count):
    from tsgen.ops.collectives.bench import busbw_factor

    fam = get_family(op)
    loaded = load_spec(spec_of(op)[0])
    case = fam.bench.case(fam, spec_variant(loaded, {"dtype": "bfloat16"}).model, world, nbytes)
    assert case.count == count and case.bw_bytes == nbytes
    assert case.link_bytes == pytest.approx(nbytes * busbw_factor(op, world))
    with pytest.raises(RuntimeSetupError, match="multiple of"):
        fam.bench.case(fam, spec_variant(loaded, {"dtype": "float32"}).model, 3, 1002)


def test_text_table_columns():
    from tsgen.bench.report import markdown_table, text_table

    rows = [{"impl": "tsgen", "label": "ag", "group": "g", "op": "allgather", "dtype": "bfloat16", "world": 4,
             "size": 65536, "size_unit": "bytes", "time_us": 10.0, "spread_pct": 1.0, "busbw_GBps": 9.8, "wrong": 0,
             "ceiling_frac": 0.02},
            {"impl": "nccl", "baseline": True, "compare": True, "group": "g", "size": 65536, "time_us": 16.1,
             "busbw_GBps": 6.1}]
    add_ratios(rows)
    text = text_table(rows)
    assert "vs nccl" in text and "1.61" in text and "0 wrong" in text and "busbw GB/s" in text
    assert markdown_table(rows).count("\n|---") == 1 and "| tsgen ag | 64K |" in markdown_table(rows)


@pytest.mark.parametrize("kind", [k for k in SMALL if get_family(k).bench.check == "rows"])  # the GEMMs
def test_sampled_rows_check_agrees_with_the_reference(kind):
    """check_rows (what the bench compares after timing) against the family's full NumPy
    reference: the right outputs pass, one corrupted sampled row fails."""
    import numpy as np

    path, world, _ = case_of(kind)
    spec = spec_variant(load_spec(path), SMALL[kind]).model
    fam = get_family(kind)
    count = 130
    inputs = fam.make_inputs(spec, world, count, np.random.default_rng(0), pattern=False)
    bufs = {**inputs, **fam.reference(spec, world, count, inputs)}
    fetch = lambda name, r, a, b: bufs[name][r][a:b]  # noqa: E731
    assert fam.bench.check_rows(fam, spec, world, count, fetch) < 1e-2
    c = [x.copy() for x in bufs["c"]]
    c[-1][: c[-1].size // count] = c[-1][: c[-1].size // count][::-1]  # row 0 of the last rank, reversed
    bufs["c"] = c
    assert fam.bench.check_rows(fam, spec, world, count, fetch) > 1e-2


def test_a_stopped_suite_keeps_the_entries_it_finished(monkeypatch):
    """SIGTERM (a time limit) during the third entry: run_entries returns the two finished
    outcomes and says it stopped; nothing is lost to the signal."""
    import contextlib
    import signal

    import tsgen.bench.results as results_mod
    import tsgen.bench.runner as runner_mod
    import tsgen.runtime as runtime_mod
    from tsgen.bench.runner import Outcome
    from tsgen.bench.suites import Entry, run_entries, stop_on_signals

    calls = []

    def fake_bench(spec, gpus, sizes, **kw):
        calls.append(kw["label"])
        if len(calls) == 3:
            signal.raise_signal(signal.SIGTERM)
        return Outcome(kw["label"], "allgather", rows=[{"impl": "tsgen", "size": 1, "time_us": 1.0}])

    monkeypatch.setattr(runner_mod, "bench_spec", fake_bench)
    monkeypatch.setattr(runtime_mod, "World", lambda *a, **k: contextlib.nullcontext(object()))
    monkeypatch.setattr(results_mod, "environment", lambda world=None: {"commit": "abc"})
    old = signal.getsignal(signal.SIGTERM)
    try:
        stop_on_signals()
        entries = [Entry(Path("specs/allgather.yaml"), 2, "1M", f"e{i}") for i in range(4)]
        outcomes, env = run_entries(entries, echo=lambda line: None)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert [o.spec for o in outcomes] == ["e0", "e1"]
    assert calls == ["e0", "e1", "e2"]
    assert env["commit"] == "abc" and "after 2 of 4 entries" in env["stopped"] and "SIGTERM" in env["stopped"]


def test_ideal_entries_give_the_fraction_of_ideal(tmp_path):
    """An entry with ideal_of: its TFLOP/s is the ideal of the named entries' rows at the same
    size; a name no entry has is a suite error."""
    from tsgen.bench.runner import Outcome
    from tsgen.bench.suites import Entry, add_ideal_ratios, load_suite
    from tsgen.errors import SpecError

    cp = Outcome("cp", "cp_attention", rows=[{"impl": "tsgen", "size": 16, "TFLOPs": 450.0, "ratios": {"sdpa": 1.2}},
                                              {"impl": "tsgen", "size": 32, "TFLOPs": 300.0},
                                              {"impl": "torch", "size": 16, "TFLOPs": 400.0, "baseline": True}])
    ideal = Outcome("ideal", "attention", rows=[{"impl": "tsgen", "size": 16, "TFLOPs": 600.0}])
    add_ideal_ratios([Entry(Path("a"), label="cp"), Entry(Path("b"), label="ideal", ideal_of=("cp",))], [cp, ideal])
    assert cp.rows[0]["ratios"] == {"sdpa": 1.2, "ideal: ideal": 0.75}
    assert "ratios" not in cp.rows[1] and "ratios" not in cp.rows[2]  # no ideal at 32; baselines get none

    (tmp_path / "s.yaml").write_text("description: d\ngpus: 1\nentries:\n"
                                     "  - {spec: specs/attention_hd128.yaml, ideal_of: [nope]}\n")
    with pytest.raises(SpecError, match="ideal_of: no entry is labelled 'nope'"):
        load_suite(str(tmp_path / "s.yaml"))


def test_a_suite_loads_each_spec_once(monkeypatch):
    """`tsgen bench --suite large-w4` validates each entry's spec (and builds its comm plans) once:
    the suite's check, the progress count, the world sizes and the timing share it. Counted up to
    the first entry's timing (the fake World's module load stops the run there)."""
    import contextlib

    import tsgen.bench.results as results_mod
    import tsgen.bench.runner as runner_mod
    import tsgen.bench.suites as suites_mod
    import tsgen.runtime as runtime_mod
    import tsgen.spec as spec_mod
    from tsgen.bench.suites import load_suite

    class Reached(Exception):
        pass

    entries = load_suite("large-w4").entries
    needed = sum(len(load_spec(e.spec).plans) for e in entries)
    built, validate = [], spec_mod._validate

    def counting(*a, **kw):
        model, plans = validate(*a, **kw)
        built.append(len(plans))
        return model, plans

    def reached(loaded, *a, **kw):
        raise Reached(loaded.path)

    world = type("FakeWorld", (), {"size": 4, "shared": False})()
    monkeypatch.setattr(spec_mod, "_validate", counting)
    monkeypatch.setattr(suites_mod, "stop_on_signals", lambda: None)
    monkeypatch.setattr(runtime_mod, "World", lambda *a, **k: contextlib.nullcontext(world))
    monkeypatch.setattr(results_mod, "environment", lambda world=None: {})
    monkeypatch.setattr(runner_mod, "render_to_cache", reached)
    with pytest.raises(Reached, match="allgather"):
        run_cli("bench", "--suite", "large-w4")
    assert len(entries) == 6 and needed == 24
    assert sum(built) == needed, f"{sum(built)} plans built for {needed} needed ({len(built)} validations)"


def test_deepep_is_compared_at_its_fastest_sm_count(monkeypatch):
    """Normal mode is timed at several SM counts; tsgen's pair is compared with the fastest pair of
    each size, the slower pairs stay rows beside it (named by their SM count, not compared)."""
    import tsgen.bench.workers as W
    from tsgen.bench.moe_deepep import NORMAL_SMS_SWEEP, sms_sweep

    def pair(sms, t, tokens=4096):
        return {"time_us": t, "samples_us": [t, t], "calls": 10, "mode": "eager", "problems": [], "phase": "pair",
                "tokens": tokens, "ep_mode": "normal", "payload": "bf16", "sms": sms, "wrong": 0,
                "deepep_bytes": 9000, "link_bytes": 4500}

    rows = [pair(24, 790.0), pair(48, 520.0), pair(64, 560.0), pair(24, 90.0, tokens=128)]
    monkeypatch.setattr(W, "launch_workers", lambda cfg, world: rows)
    spec = spec_variant(load_spec("specs/moe.yaml"), {"params": {"experts": 32, "hidden": 7168}}).model
    ms = B.deepep(["deepep"], get_family("moe"), spec, 2, [4096, 128], 10, 5, 3)
    assert [(m.impl, m.compare) for m in ms] == [
        ("DeepEP normal dispatch+combine (bf16, 24 SMs)", False), ("DeepEP normal dispatch+combine (bf16, 48 SMs)", True),
        ("DeepEP normal dispatch+combine (bf16, 64 SMs)", False), ("DeepEP normal dispatch+combine (bf16, 24 SMs)", True)]
    assert [m.role for m in ms] == ["pair", "", "pair", ""]
    monkeypatch.delenv("TSGEN_DEEPEP_SMS", raising=False)
    assert sms_sweep({}) == NORMAL_SMS_SWEEP and sms_sweep({"sms": 32}) == (32,) and sms_sweep({"sms": [24, 24, 8]}) == (24, 8)
    from tsgen.bench.moe_deepep import sms_from_env
    assert sms_from_env(None) is None and sms_from_env(" ") is None
    assert sms_from_env("64") == [64] and sms_from_env("48, 64") == [48, 64]
    with pytest.raises(ValueError, match="TSGEN_DEEPEP_SMS"):
        sms_from_env("sixty-four")
    monkeypatch.setenv("TSGEN_DEEPEP_SMS", "64")
    assert sms_sweep({}) == (64,) and sms_sweep({"sms": 48}) == (48,)  # a suite's own count wins
    monkeypatch.setenv("TSGEN_DEEPEP_SMS", "63")
    with pytest.raises(ValueError, match="even positive"):
        sms_sweep({})
    for bad in (23, 0, [24, -2], True):
        with pytest.raises(ValueError, match="even positive"):
            sms_sweep({"sms": bad})


def _ideal_suite(monkeypatch, ideal_break: bool = False, peers_busy: bool = False):
    """cp_attention at W 2 and its ideal entry (attention over the whole sequence on one GPU) through
    run_entries on the simulated GPU: the cp kernel takes 40 us, the ideal 60 us in the World of one
    GPU the cp entry opens for it and 90 us in the ideal entry's own World (so the paired fraction and
    the fallback from two medians differ); ideal_break: the ideal's kernel writes nothing in the cp
    entry's rounds."""
    import tsgen.bench.results as results_mod
    from tsgen.bench.suites import Entry, run_entries

    install(monkeypatch)
    fake_multiprocess(monkeypatch)
    ones = iter([60.0, 60.0, 90.0] if peers_busy else [60.0, 90.0])  # with peers_busy: the peer GPU's World second
    real_init = bench_fakes.World.__init__

    def init(self, n, backend="single", share_gpus=None):
        real_init(self, n, backend, share_gpus)
        if n == 1:
            self.kernel_us = next(ones)
            self.break_rank = 0 if ideal_break and self.kernel_us == 60.0 else None

    monkeypatch.setattr(bench_fakes.World, "__init__", init)
    monkeypatch.setattr(results_mod, "environment", lambda world=None: {"commit": "abc"})
    entries = [Entry(Path("specs/cp_attention.yaml"), 2, "256", "cp"),
               Entry(Path("specs/attention_hd128.yaml"), 1, "256", "ideal", {"params": {"kv_heads": 8}},
                     ideal_of=("cp",), ideal_peers_busy=peers_busy)]
    outcomes, _ = run_entries(entries, iters=3, reps=4, warmup=1, echo=lambda line: None)
    return outcomes


def test_an_ideal_is_timed_in_the_rounds_of_the_entries_it_names(monkeypatch):
    """suites' ideal_of: the cp entry times the ideal in its own rounds (runner.Ideal), one sample of
    each per round; its fraction of the ideal is paired round by round (tsgen's FLOP rate over the
    ideal's: 60 us x 1/2 of the FLOPs over 40 us = 0.75), not the two medians' (0.5 x 90 / 40)."""
    cp, ideal = _ideal_suite(monkeypatch)
    assert cp.errors == [] and ideal.errors == []
    row = next(r for r in cp.rows if r["impl"] == "tsgen")
    own = next(r for r in cp.rows if r.get("role") == "ideal")
    assert own["baseline"] and not own["compare"] and own["round_set"] == row["round_set"]
    assert own["ideal_scale"] == pytest.approx(0.5) and len(own["samples_us"]) == len(row["samples_us"]) == 4
    assert own["impl"] not in row["ratios"]  # only the fraction, never a speed-up against it
    assert row["ratios"]["ideal: ideal"] == pytest.approx(0.75, rel=0.02)
    spread = row["ratio_spread"]["ideal: ideal"]
    assert spread["rounds"] == 4 and spread["min"] <= row["ratios"]["ideal: ideal"] <= spread["max"]
    assert own["check"] == "sampled rows" and own["poison_left"] == 0 and own["count"] == 256  # its own rows
    assert "in cp's rounds" in own["impl"]


def test_an_ideal_that_writes_nothing_in_the_rounds_is_an_error(monkeypatch):
    """The ideal's timed outputs are checked as tsgen's are: an ideal that wrote nothing is an error of
    the entry, not a row; the fraction falls back to the ideal entry's own median."""
    cp, ideal = _ideal_suite(monkeypatch, ideal_break=True)
    assert any(e.startswith("ideal ideal 256") and "poison" in e for e in cp.errors), cp.errors
    assert not any(r.get("role") == "ideal" for r in cp.rows)
    row = next(r for r in cp.rows if r["impl"] == "tsgen")
    assert row["ratios"]["ideal: ideal"] == pytest.approx(0.5 * 90 / 40, rel=0.02)
    assert "ideal: ideal" not in row.get("ratio_spread", {})


def test_the_fraction_of_an_ideal_is_paired_round_by_round():
    """add_ratios: tsgen's FLOP rate over the ideal's per round (the ideal's time x ideal_scale over
    tsgen's), the median over rounds with its quartiles; samples that drift apart between rounds give
    another number than the two medians would (1.5 here), and an ideal of other rounds gives none."""
    tsgen = {"impl": "tsgen", "size": 16, "group": "g", "round_set": 7, "time_us": 10.0,
             "samples_us": [10.0, 20.0, 10.0, 40.0, 10.0]}
    ideal = {"impl": "tsgen i (1 GPU, whole sequence, in cp's rounds: the ideal)", "baseline": True, "compare": False,
             "role": "ideal", "ideal_label": "i", "ideal_scale": 0.5, "size": 16, "group": "g", "round_set": 7,
             "time_us": 30.0, "samples_us": [15.0, 60.0, 30.0, 80.0, 25.0]}
    other = dict(tsgen, round_set=8)
    add_ratios([tsgen, ideal, other])
    assert tsgen["ratios"] == {"ideal: i": pytest.approx(1.25)}  # per round 0.75, 1.5, 1.5, 1.0, 1.25
    assert tsgen["ratio_spread"]["ideal: i"]["rounds"] == 5 and tsgen["ratio_spread"]["ideal: i"]["min"] == 0.75
    assert "ratios" not in other and "ratios" not in ideal


def test_an_entry_has_one_ideal(tmp_path):
    """Two ideal entries naming one entry: a suite error (the entry times one ideal in its rounds)."""
    from tsgen.bench.suites import load_suite
    from tsgen.errors import SpecError

    (tmp_path / "s.yaml").write_text(
        "description: d\nentries:\n  - {spec: specs/cp_attention.yaml, gpus: 2, label: cp}\n"
        "  - {spec: specs/attention_hd128.yaml, gpus: 1, label: a, ideal_of: [cp]}\n"
        "  - {spec: specs/attention_hd128.yaml, gpus: 1, label: b, ideal_of: [cp]}\n")
    with pytest.raises(SpecError, match=r"entries.2.ideal_of: 'cp' already has an ideal \(entries.1\)"):
        load_suite(str(tmp_path / "s.yaml"))


def test_an_ideal_that_fails_to_load_closes_its_world(monkeypatch):
    """runner.Ideal: an error after its World of one GPU opened (the module's load) closes that World
    before the error goes on."""
    from tsgen.bench.runner import Ideal, IdealOf

    install(monkeypatch)
    closed = []
    monkeypatch.setattr(bench_fakes.World, "__exit__", lambda self, *exc: closed.append((self.size, exc[0])))

    def load(self, manifest, arch=None, source=None):
        raise RuntimeSetupError("no such kernel")

    monkeypatch.setattr(bench_fakes.World, "load", load)
    entry = bench_fakes.World(2)
    with pytest.raises(RuntimeSetupError, match="no such kernel"):
        with Ideal(IdealOf("i", spec_variant(load_spec("specs/attention_hd128.yaml"), {})), entry, "sm_90a"):
            pass
    assert [size for size, _ in closed] == [1]


def test_an_ideal_with_its_peers_busy(monkeypatch):
    """ideal_peers_busy: the cp entry also times the ideal on rank 0's GPU while rank 1's GPU runs the same
    kernel (its own World of one GPU), a second fraction beside the ideal alone; the peer's calls are
    enqueued with the timed ones (as many), and its outputs are not the timed ones."""
    import tsgen.runtime.backends as backends

    launched, worlds = {}, []  # launches per World (the Worlds kept: an id is unique while its object lives)
    real_launch = bench_fakes.Module.launch

    def launch(self, bufs, ranks=None, streams=None, **kw):
        worlds.append(self.world)
        launched[id(self.world)] = launched.get(id(self.world), 0) + 1
        return real_launch(self, bufs, ranks, streams, **kw)

    monkeypatch.setattr(bench_fakes.Module, "launch", launch)
    asked = []
    monkeypatch.setattr(backends, "SingleProcessBackend", lambda size, cp, devices: asked.append(devices) or "b")
    cp, ideal = _ideal_suite(monkeypatch, peers_busy=True)
    assert cp.errors == [] and ideal.errors == []
    row = next(r for r in cp.rows if r["impl"] == "tsgen")
    assert row["ratios"]["ideal: ideal"] == pytest.approx(0.75, rel=0.02)
    assert row["ratios"]["ideal: ideal, peers busy"] == pytest.approx(0.75, rel=0.02)
    busy = next(r for r in cp.rows if r.get("ideal_label") == "ideal, peers busy")
    assert "the other GPUs running it too" in busy["impl"] and busy["check"] == "sampled rows"
    assert asked == [[1]]  # the peer's World on the other GPU of the cp entry's
    assert len(launched) == 4  # the cp World, the ideal's, its peer's, the ideal entry's own
    # every World, the peer's among them, launched at least the busy ideal's timed calls
    assert min(launched.values()) >= len(busy["samples_us"]) * busy["calls"]


def test_ideal_peers_busy_needs_ideal_of(tmp_path):
    from tsgen.bench.suites import load_suite
    from tsgen.errors import SpecError

    (tmp_path / "s.yaml").write_text("description: d\nentries:\n"
                                     "  - {spec: specs/attention_hd128.yaml, gpus: 1, ideal_peers_busy: true}\n")
    with pytest.raises(SpecError, match="ideal_peers_busy: set without ideal_of"):
        load_suite(str(tmp_path / "s.yaml"))


def test_an_ideal_timed_in_graphs_has_no_peers_busy_variant(monkeypatch):
    """peers_busy with an ideal whose op is timed in CUDA graphs (a capture of GPU 0's stream would leave the
    peer idle in the replays): a note, no busy row, the lone ideal still paired."""
    import tsgen.runtime.backends as backends

    monkeypatch.setattr(get_family("attention").bench, "graphs", True)
    monkeypatch.setattr(backends, "SingleProcessBackend", lambda size, cp, devices: "b")
    cp, _ = _ideal_suite(monkeypatch, peers_busy=True)
    assert any("peers busy: not timed (its op is timed in CUDA graphs)" in n for n in cp.notes), cp.notes
    assert not any(r.get("ideal_label", "").endswith("peers busy") for r in cp.rows)
    row = next(r for r in cp.rows if r["impl"] == "tsgen")
    assert "ideal: ideal" in row["ratio_spread"] and "ideal: ideal, peers busy" not in row["ratios"]
