"""GPU tests: every shipped primitive and collective at world sizes 2, 3, 4 and 8,
100 back-to-back calls each, bit-exact against the NumPy reference; the dtype
matrix, the negative controls and the timeout path.

Skipped with a reason on machines without enough GPUs (CI has none). With
TSGEN_SHARE_GPUS=1 a world larger than the machine runs with ranks sharing its
GPUs (the spec variant that fits is derived and printed): one GPU runs it all.
World size 8 runs each spec as a variant built for 8 ranks.
"""

import sys
from pathlib import Path

import pytest

from conftest import ROOT, need_gpus
from mutations import reduce_without_waits, wrong_chunk_offset
from results_rows import CONTROL_CALLS, record, record_control

from tsgen.harness import run_in_turn, run_test
from tsgen.ops import get_family
from tsgen.shipped import shipped, shipped_specs

pytestmark = pytest.mark.gpu


def _loaded(spec_path):
    """The shipped spec's model and family (tsgen.shipped loads every spec once)."""
    loaded = next(s for s in shipped() if s.path == spec_path)
    return loaded.model, get_family(loaded.model.op)


def _cases(specs):
    """(spec, world) at each shipped world size of 2, 3, 4, and at 8 (a variant) for ops of any
    world size (the family's `variant_worlds`)."""
    out = []
    for s in specs:
        spec, family = _loaded(s)
        out += [(s, w) for w in (2, 3, 4, 8) if w in spec.world_sizes or w in family.variant_worlds]
    return out


def _skip_copy_engine_when_shared(spec_path, world):
    """The runtime refuses copy-engine collectives on a shared GPU (harness.shared_gpu_variant)."""
    from conftest import gpu_count, sharing

    spec, family = _loaded(Path(spec_path).resolve())
    if family.transport(spec) == "copy_engine" and sharing() and gpu_count() < world:
        pytest.skip("copy-engine transport: refused on a shared GPU (stalls measured); runs on separate GPUs")


def _variant(spec_path, world):
    """Spec fields to change so the spec runs at `world` (world size 8 is not shipped)."""
    return None if world in _loaded(spec_path)[0].world_sizes else {"world_sizes": [world]}


# The families say which sweep runs their specs (OpFamily.gpu_sweep): the others have GPU test
# files of their own (gemm: tests/test_gemm_gpu.py; cp_attention: tests/test_cp_attention_gpu.py).
# The nvshmem transport runs only under `--backend nvshmem` (one process per GPU,
# tools/gpu_nvshmem.sh); here the single-process runtime must refuse it.
PRIMITIVE_SPECS = [s for s in shipped_specs(gpu_sweep="specs") if s not in shipped_specs(transport="nvshmem")]


# each spec at the world sizes it is built for (cannon / summa: 4 = a 2 x 2 grid; the
# gemm_reduce_scatter specs: 2 and 4, as K does not split into 64-deep tiles over 3)
@pytest.mark.parametrize("spec,world", _cases(PRIMITIVE_SPECS), ids=lambda x: x.stem if isinstance(x, Path) else str(x))
def test_primitive_on_gpus(spec, world):
    need_gpus(world)
    lines = []
    ok = run_test(spec, world, echo=lines.append, variant=_variant(spec, world))
    record("correctness", {"spec": spec.stem, "world": world, "pass": ok, "lines": lines})
    assert ok, "\n".join(lines)




@pytest.mark.parametrize("spec", ["signal_wait_ge_peer", "barrier_all", "simple_shift"])
def test_wait_that_never_completes_times_out(spec):
    """Only rank 0 runs: its wait can never be satisfied, so it must print the
    diagnosis and trap within the timeout, not hang. Runs in a subprocess
    because a trap ends the CUDA context."""
    need_gpus(2)
    proc = run_in_turn(  # the GPU's turn held here: the 120 s bound the child's own work
        [sys.executable, "-m", "tsgen", "test", f"specs/{spec}.yaml", "--gpus", "2", "--probe-timeout"],
        capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    record("timeout_probe", {"spec": spec, "rc": proc.returncode, "output": out})
    assert proc.returncode == 0, out
    assert "tsgen: timeout: rank 0" in out, out


# Negative controls: remove one synchronization (or the tail copy) from the
# generated source; the same test must then fail, or it proves nothing.
NEGATIVE_CONTROLS = {
    "barrier_blocks": ("tsgen::barrier_blocks(counter, epoch, rank);", ""),
    # the cross-rank wait inside tsgen::barrier_all (counts stay balanced: no trap)
    "barrier_all": ("wait_ge_acquire_sys(flags + peer, generation,", "wait_ge_acquire_sys(flags + peer, 0ull,"),
    # wait for >= 0: satisfied at once, i.e. no wait
    "signal_wait_ge_peer": ("wait_ge_acquire_sys(signal, epoch,", "wait_ge_acquire_sys(signal, 0ull,"),
    "simple_shift": ("wait_ge_acquire_sys(ready, epoch * BLOCKS,", "wait_ge_acquire_sys(ready, 0ull,"),
    "put_block": ("for (uint64_t b = nvec * 16 + tid; b < nbytes; b += nthreads)",
                  "for (uint64_t b = nbytes; b < nbytes; b += nthreads)"),
}


SKEW_SEED = 7  # the rank skew of `tsgen test --skew`: seeded, so a failure reproduces


@pytest.mark.parametrize("skew", [None, "lag"], ids=["no-skew", "lag"])
@pytest.mark.parametrize("spec", sorted(NEGATIVE_CONTROLS))
def test_negative_control_fails(spec, skew):
    """With each rank on its own GPU the broken kernel must fail as it is. Ranks sharing one
    GPU share its L2 and clock, which can hide a missing wait: there the control must fail under
    the lag schedule (rank 0 runs ahead of every peer, templates/ops/skew.j2), at every one of its
    CONTROL_CALLS calls (recorded); without it the result is recorded (which controls need it).
    Under the lag schedule the intact kernel must pass first: the schedule alone breaks nothing."""
    need_gpus(2)
    old, new = NEGATIVE_CONTROLS[spec]
    lines, report = [], {}
    if skew is not None:
        assert run_test(f"specs/{spec}.yaml", 2, iters=5, echo=lines.append, skew=skew), "\n".join(lines)
    ok = run_test(f"specs/{spec}.yaml", 2, iters=CONTROL_CALLS, echo=lines.append, skew=skew,
                  mutate=lambda text: text.replace(old, new), report=report)
    shared = any("shared GPU" in line for line in lines)
    record("negative_control", {"spec": spec, "removed": old, "skew": skew, "shared": shared, "pass": ok,
                                "calls": report["calls"], "calls_wrong": report["calls_wrong"], "lines": lines})
    if skew is not None:
        record_control(spec, report["calls"], report["calls_wrong"], world=2, shared=shared, skew=skew,
                       missed=report["calls_right"])
    if ok and shared and skew is None:
        pytest.skip("not caught on a shared GPU without the lag schedule (the lag case must catch it)")
    assert not ok, "broken kernel passed:\n" + "\n".join(lines)


# ---------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------

NVSHMEM_SPECS = shipped_specs(transport="nvshmem")
MULTIMEM_SPECS = shipped_specs(multimem=True)
COLLECTIVE_SPECS = [s for s in shipped_specs(gpu_sweep="collective", multimem=False) if s not in NVSHMEM_SPECS]


@pytest.mark.parametrize("spec", NVSHMEM_SPECS, ids=lambda p: p.stem)
def test_nvshmem_transport_is_refused_in_one_process(spec):
    """The single-process runtime names the backend these need instead of running them."""
    need_gpus(2)
    from tsgen.errors import RuntimeSetupError

    with pytest.raises(RuntimeSetupError, match="--backend nvshmem"):
        run_test(spec, 2, iters=1)


@pytest.mark.parametrize("spec", MULTIMEM_SPECS, ids=lambda p: p.stem)
def test_multimem_is_refused_on_these_machines(spec):
    """Never executed: the runtime refuses before compiling or loading anything."""
    need_gpus(2)
    from tsgen.errors import RuntimeSetupError

    with pytest.raises(RuntimeSetupError, match="TSGEN_ALLOW_MULTIMEM"):
        run_test(spec, 2, iters=1)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("spec", COLLECTIVE_SPECS, ids=lambda p: "collective-" + p.stem)
def test_collective_odd_count(spec, world):
    """The shipped spec's test count (not a multiple of 8: misaligned chunks take the
    element-wise path), its iters back-to-back calls, bit-exact or within tolerance."""
    need_gpus(world)
    _skip_copy_engine_when_shared(spec, world)
    lines = []
    ok = run_test(spec, world, echo=lines.append, variant=_variant(spec, world))
    record("correctness", {"spec": spec.stem, "world": world, "pass": ok, "lines": lines})
    assert ok, "\n".join(lines)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int32"])
@pytest.mark.parametrize("spec", ["allgather", "reduce_scatter", "all_to_all", "all_reduce_one_shot",
                                  "all_reduce_two_shot", "broadcast", "allgather_pull", "all_reduce_two_shot_pull",
                                  "allgather_ring", "reduce_scatter_ring", "all_reduce_ring", "broadcast_ring",
                                  "all_reduce_two_shot_ce", "all_to_all_v"])
def test_collective_dtype_matrix(spec, dtype, world):
    """Every collective in every dtype on the vector path (count a multiple of 8)."""
    need_gpus(world)
    _skip_copy_engine_when_shared(Path(f"specs/{spec}.yaml"), world)
    lines = []
    ok = run_test(f"specs/{spec}.yaml", world, count=65536, iters=5, dtype=dtype, echo=lines.append)
    record("dtype_matrix", {"spec": spec, "dtype": dtype, "world": world, "pass": ok, "lines": lines[-1:]})
    assert ok, "\n".join(lines)


def test_collective_negative_control_wrong_chunk_offset():
    """The plan table with one chunk offset broken (rank 1 puts its chunk at offset 0
    of rank 0's output instead of offset 1) must fail on the GPU as it fails `tsgen verify`."""
    need_gpus(2)
    mutate = wrong_chunk_offset
    lines, report = [], {}
    ok = run_test("specs/allgather.yaml", 2, iters=CONTROL_CALLS, echo=lines.append, mutate=mutate, report=report)
    record("negative_control", {"spec": "allgather (plan table)", "removed": "rank 1's put offset 1 -> 0",
                                "pass": ok, "lines": lines})
    record_control("allgather (plan table)", report["calls"], report["calls_wrong"], world=2)
    assert not ok, "broken plan passed:\n" + "\n".join(lines)


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_negative_control_reduce_without_waits(world):
    """The reduce-scatter without its reduce steps' waits (the adjoint of the all-gather: what
    tsgen.torch.cp_attention's backward sums dK and dV with) must fail at every call under the lag
    schedule (rank 0 ahead of every peer: it sums an inbox its peers have not written yet); the
    intact kernel passes under the same schedule first."""
    need_gpus(world)
    lines, report = [], {}
    assert run_test("specs/reduce_scatter.yaml", world, iters=5, echo=lines.append, skew="lag"), "\n".join(lines)
    ok = run_test("specs/reduce_scatter.yaml", world, iters=CONTROL_CALLS, echo=lines.append, skew="lag",
                  mutate=reduce_without_waits, report=report)
    shared = any("shared GPU" in line for line in lines)
    record("negative_control", {"spec": f"reduce_scatter w{world} (reduce waits)", "removed": "every reduce step's waits",
                                "skew": "lag", "shared": shared, "pass": ok, "calls": report["calls"],
                                "calls_wrong": report["calls_wrong"], "lines": lines})
    record_control(f"reduce_scatter reduce waits (w{world})", report["calls"], report["calls_wrong"], world=world,
                   shared=shared, skew="lag")
    assert not ok, "broken kernel passed:\n" + "\n".join(lines)


# Opt-in kernels of the shipped attention specs that no shipped spec sets, each run through the harness as the shipped
# ones are, so that the gate checks them at every commit (tools/gpu_attention_bwd.py runs their full case lists):
# spec -> {variant name: params changes}
OPT_IN_ATTENTION = {
    "attention_backward_hd128": {"r80": {"step_rows": 80}},  # 80-row steps, dQ transposed (tail_split on: count 1000)
    # a share of the exp2 on the FMA pipe (tsgen::attention::exp2_fma), forward and backward
    "attention_backward_hd64_causal_gqa": {"e2": {"exp2_fma_every": 2}},
    "attention_hd64_causal": {"e4": {"exp2_fma_every": 4}},
    # O's rescale skipped where no row max of the warp grew, where rescale_at puts it among the exp2 (the shipped
    # causal GQA spec sets it where the rescale follows every exp2)
    "attention_hd128": {"rskip": {"rescale_skip": True}},
}


@pytest.mark.parametrize("stem,name", [(s, n) for s, vs in OPT_IN_ATTENTION.items() for n in vs])
def test_attention_opt_in_through_the_harness(stem, name, tmp_path):
    """An opt-in variant of a shipped attention spec through `tsgen test`'s path on one GPU (count 1000: tails)."""
    import yaml

    need_gpus(1)
    spec = yaml.safe_load((ROOT / "specs" / f"{stem}.yaml").read_text())
    spec["name"] = f"{stem}_{name}"
    spec["params"].update(OPT_IN_ATTENTION[stem][name])
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    lines = []
    ok = run_test(path, 1, echo=lines.append)
    record("correctness", {"spec": spec["name"], "world": 1, "pass": ok, "lines": lines})
    assert ok, "\n".join(lines)


@pytest.mark.parametrize("spec", shipped_specs(gpu_sweep="one_gpu"), ids=lambda p: p.stem)
def test_attention_through_the_harness(spec):
    """The attention op through `tsgen test`'s path on one GPU (tools/gpu_attention.py runs the
    full case list: lengths, offsets, zig-zag, GQA, waits, and the bench)."""
    need_gpus(1)
    lines = []
    ok = run_test(spec, 1, echo=lines.append)
    record("correctness", {"spec": spec.stem, "world": 1, "pass": ok, "lines": lines})
    assert ok, "\n".join(lines)
