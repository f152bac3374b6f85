"""GPU tests: every shipped primitive and collective at world sizes 2, 3, 4 and 8,
100 back-to-back calls each, bit-exact against the NumPy reference; the dtype
matrix, the negative controls and the timeout path.

Skipped with a reason on machines without enough GPUs (CI has none). With
TSGEN_SHARE_GPUS=1 a world larger than the machine runs with ranks sharing its
GPUs (the spec variant that fits is derived and printed): one GPU runs it all.
World size 8 runs each spec as a variant built for 8 ranks.
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SPECS, need_gpus

from tsgen.harness import run_test

pytestmark = pytest.mark.gpu


@functools.lru_cache(maxsize=None)
def _data(spec_path):
    """The spec's YAML, read once (the lists below ask several questions of each spec)."""
    import yaml

    return yaml.safe_load(spec_path.read_text())


def _op(spec_path):
    return _data(spec_path)["op"]


def _is_collective(spec_path):
    return _op(spec_path) in COLLECTIVE_OPS


def _is_multimem(spec_path):
    return "multimem" in spec_path.read_text()


def _is_nvshmem(spec_path):
    """Built for the NVSHMEM transport: runs only under `--backend nvshmem` (one process per
    GPU, tools/gpu_nvshmem.sh); here, the single-process runtime must refuse it."""
    return (_data(spec_path).get("params") or {}).get("transport") == "nvshmem"


COLLECTIVE_OPS = {"allgather", "reduce_scatter", "all_to_all", "all_to_all_v", "all_reduce", "broadcast"}
COMPUTE_OPS = {"gemm", "attention", "cp_attention"}  # tests/test_gemm_gpu.py, tools/gpu_attention.py,
# tests/test_cp_attention_gpu.py (variants with few heads: its reference is attention over the whole sequence)
PRIMITIVE_SPECS = [s for s in SPECS if not _is_collective(s) and _op(s) not in COMPUTE_OPS and not _is_nvshmem(s)]


def _worlds(spec_path):
    return _data(spec_path).get("world_sizes") or [2, 3, 4]


FUSED_OPS = {"allgather_gemm", "gemm_reduce_scatter", "cannon", "summa"}  # at their shipped world sizes


def _cases(specs):
    """(spec, world) at each shipped world size of 2, 3, 4, and at 8 (a variant) for ops of any world size."""
    return [(s, w) for s in specs for w in (2, 3, 4, 8)
            if w in _worlds(s) or (w == 8 and _op(s) not in FUSED_OPS and max(_worlds(s)) > 1)]


def _skip_copy_engine_when_shared(spec_path, world):
    """The runtime refuses copy-engine collectives on a shared GPU (harness.shared_gpu_variant)."""
    from conftest import gpu_count, sharing

    transport = (_data(spec_path).get("params") or {}).get("transport")
    if transport == "copy_engine" and sharing() and gpu_count() < world:
        pytest.skip("copy-engine transport: refused on a shared GPU (stalls measured); runs on separate GPUs")


def _variant(spec_path, world):
    """Spec fields to change so the spec runs at `world` (world size 8 is not shipped)."""
    return None if world in _worlds(spec_path) else {"world_sizes": [world]}


# each spec at the world sizes it is built for (cannon / summa: 4 = a 2 x 2 grid; the
# gemm_reduce_scatter specs: 2 and 4, as K does not split into 64-deep tiles over 3)
@pytest.mark.parametrize("spec,world", _cases(PRIMITIVE_SPECS), ids=lambda x: x.stem if isinstance(x, Path) else str(x))
def test_primitive_on_gpus(spec, world):
    need_gpus(world)
    lines = []
    ok = run_test(spec, world, echo=lines.append, variant=_variant(spec, world))
    record("correctness", {"spec": spec.stem, "world": world, "pass": ok, "lines": lines})
    assert ok, "\n".join(lines)


def record(kind, row):
    """Append a result row to $TSGEN_RESULTS_DIR/KIND.jsonl (device runs collect these)."""
    out = os.environ.get("TSGEN_RESULTS_DIR")
    if out:
        with open(os.path.join(out, f"{kind}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("spec", ["signal_wait_ge_peer", "barrier_all", "simple_shift"])
def test_wait_that_never_completes_times_out(spec):
    """Only rank 0 runs: its wait can never be satisfied, so it must print the
    diagnosis and trap within the timeout, not hang. Runs in a subprocess
    because a trap ends the CUDA context."""
    need_gpus(2)
    proc = subprocess.run(
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


@pytest.mark.parametrize("skew", [None, SKEW_SEED], ids=["no-skew", "skew"])
@pytest.mark.parametrize("spec", sorted(NEGATIVE_CONTROLS))
def test_negative_control_fails(spec, skew):
    """With each rank on its own GPU the broken kernel must fail as it is. Ranks sharing one
    GPU share its L2 and clock, which can hide a missing wait: there the control must fail
    with the rank skew; without it the result is recorded (which controls need skew)."""
    need_gpus(2)
    old, new = NEGATIVE_CONTROLS[spec]
    lines = []
    ok = run_test(f"specs/{spec}.yaml", 2, iters=20, echo=lines.append, skew=skew,
                  mutate=lambda text: text.replace(old, new))
    shared = any("shared GPU" in line for line in lines)
    record("negative_control", {"spec": spec, "removed": old, "skew": skew, "shared": shared, "pass": ok,
                                "lines": lines})
    if ok and shared and skew is None:
        pytest.skip("not caught on a shared GPU without rank skew (the skew case must catch it)")
    assert not ok, "broken kernel passed:\n" + "\n".join(lines)


# ---------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------

COLLECTIVE_SPECS = [s for s in SPECS if _is_collective(s) and not _is_multimem(s) and not _is_nvshmem(s)]
MULTIMEM_SPECS = [s for s in SPECS if _is_multimem(s)]
NVSHMEM_SPECS = [s for s in SPECS if _is_nvshmem(s)]


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
    import re

    need_gpus(2)

    def mutate(text):
        head, tail = text.split("static __device__ const tsgen::step steps_w2[]", 1)
        tail = re.sub(r"(// rank 1 step 1: put to rank 0;[^\n]*\n\s*\{TSGEN_OP_COPY, 1, 1, 1, 0, )\{0, 2, 0, 1, 1, 0\}",
                      r"\1{0, 2, 0, 1, 0, 0}", tail, count=1)
        return head + "static __device__ const tsgen::step steps_w2[]" + tail

    lines = []
    ok = run_test("specs/allgather.yaml", 2, iters=5, echo=lines.append, mutate=mutate)
    record("negative_control", {"spec": "allgather (plan table)", "removed": "rank 1's put offset 1 -> 0",
                                "pass": ok, "lines": lines})
    assert not ok, "broken plan passed:\n" + "\n".join(lines)


@pytest.mark.parametrize("spec", [s for s in SPECS if _op(s) == "attention"], ids=lambda p: p.stem)
def test_attention_through_the_harness(spec):
    """The attention op through `tsgen test`'s path on one GPU (tools/gpu_attention.py runs the
    full case list: lengths, offsets, zig-zag, GQA, waits, and the bench)."""
    need_gpus(1)
    lines = []
    ok = run_test(spec, 1, echo=lines.append)
    record("correctness", {"spec": spec.stem, "world": 1, "pass": ok, "lines": lines})
    assert ok, "\n".join(lines)
