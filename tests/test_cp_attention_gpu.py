"""cp_attention on GPUs: world sizes 2, 4 and 8 (on one GPU with TSGEN_SHARE_GPUS=1, the SM push
variant: the copy engine is refused there), contiguous and zig-zag, causal and not, grouped-query,
both tensor layouts, lengths that are no multiple of the tile, 20 back-to-back calls with poisoned
outputs against the NumPy reference of attention over the whole sequence; the rank skew; and the
negative control (the wait for the first remote chunk removed, rank skew on) that must fail.
tools/gpu_cp_attention.sh runs these on one lent GPU."""

from __future__ import annotations

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


def _run(name, world, params, count, iters=20, skew=None, spec=SM_SPEC, report=None, blocks=None):
    need_gpus(world)
    lines = []
    changes = {"name": f"cp_{name}", "params": params, "sync": {"timeout_ms": 3000}}
    if blocks is not None:
        changes["launch"] = {"blocks": blocks}
    ok = run_test(spec, world, count=count, iters=iters, echo=lines.append, skew=skew, report=report,
                  variant=changes)
    record("cp_attention", {"case": name, "world": world, "skew": skew, "pass": ok, "lines": lines})
    return ok, lines


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_cp_attention(case, world):
    params, count = CASES[case]
    ok, lines = _run(case, world, params, count)
    assert ok, "\n".join(lines)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["zigzag_causal_gqa", "contiguous_causal_bhsd", "contiguous_full_gqa"])
def test_cp_attention_more_tiles_than_ctas(case, world):
    """3 attention CTAs a rank (launch.blocks), so each takes several tiles: causal, from the
    dynamic schedule's counter (tsgen/attention.cuh: longest first in head groups, the counter
    back at 0 after each of the 20 calls, or the next call would skip tiles and leave poison);
    not causal, the static stride. The shipped grids (130 CTAs) take one tile each at these
    sizes, so only this test draws a tile from the counter."""
    params, count = CASES[case]
    ok, lines = _run(f"{case}_3_ctas", world, params, count, blocks=3)
    assert ok, "\n".join(lines)


@pytest.mark.parametrize("world,skew", [(4, 3), (8, 3), (4, "lag")])
def test_cp_attention_with_rank_skew(world, skew):
    """The seeded skew, and the negative control's lag schedule with the wait compiled in."""
    params, count = CASES["zigzag_causal_gqa"]
    ok, lines = _run(f"skewed_{skew}", world, params, count, skew=skew)
    assert ok, "\n".join(lines)


@pytest.mark.parametrize("case,world", [("zigzag_causal_gqa", 4), ("contiguous_full_gqa", 8)])
def test_negative_control_unwaited_chunk_fails(case, world):
    """The attention kernel does not wait for the first remote chunk it reads; with the push
    kernels skewed it reads the previous call's K and V (or nothing): the test must fail."""
    params, count = CASES[case]
    report = {}
    ok, lines = _run(f"neg_{case}", world, {**params, "skip_wait": True}, count, skew="lag", iters=CONTROL_CALLS,
                     report=report)
    record_control(f"cp_attention unwaited chunk ({case})", report["calls"], report["calls_wrong"], world=world,
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
