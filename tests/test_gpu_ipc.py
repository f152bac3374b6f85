"""GPU tests of the one-process-per-GPU (ipc) backend, each rank its own process
started by `tsgen launch`. Skipped with a reason on machines without enough GPUs.
tools/gpu_ipc.sh runs the longer checks (all specs, 100 World cycles, timing)."""

import json
import os
import sys

import pytest

from conftest import need_gpus
from tsgen.harness import run_in_turn

pytestmark = pytest.mark.gpu

TSGEN = [sys.executable, "-m", "tsgen"]


def launch(nproc, *cmd, grace=30, timeout=180):
    # the GPU's turn held here; the ranks (processes) run without the lock
    p = run_in_turn([*TSGEN, "launch", "--nproc", str(nproc), "--grace", str(grace), "--", *cmd],
                    capture_output=True, text=True, timeout=timeout)
    out = os.environ.get("TSGEN_RESULTS_DIR")
    if out:  # what every run printed, also when a device call's time limit stops pytest before its report
        with open(os.path.join(out, "ipc.jsonl"), "a") as f:
            f.write(json.dumps({"nproc": nproc, "cmd": [str(c) for c in cmd], "rc": p.returncode,
                                "stdout": p.stdout[-4000:], "stderr": p.stderr[-4000:]}) + "\n")
    return p


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("spec", ["simple_shift", "barrier_all", "allgather", "all_reduce_one_shot"])
def test_ipc_backend_passes(spec, world):
    need_gpus(world, processes=True)
    p = launch(world, *TSGEN, "test", f"specs/{spec}.yaml", "--backend", "ipc", "--iters", "10")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"[rank 0] {spec}: PASS on {world} " in p.stdout, p.stdout
    assert "(ipc: one process per rank)" in p.stdout, p.stdout


def test_ipc_negative_control_fails_on_every_rank():
    """A kernel that skips its wait gives wrong results; every rank exits 1, not only the one that saw them."""
    need_gpus(2, processes=True)
    code = ("import sys; from tsgen.harness import run_test; "
            "ok = run_test('specs/simple_shift.yaml', None, iters=10, backend='ipc', mutate=lambda t: t.replace("
            "'wait_ge_acquire_sys(ready, epoch * BLOCKS,', 'wait_ge_acquire_sys(ready, 0ull,')); "
            "sys.exit(0 if ok else 1)")
    p = launch(2, sys.executable, "-c", code)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "tsgen launch: exit codes: rank 0: 1, rank 1: 1" in p.stderr, p.stderr


def test_a_dying_rank_makes_the_others_time_out():
    need_gpus(2, processes=True)
    p = run_in_turn([sys.executable, "tools/ipc_checks.py", "dying-rank", "specs/allgather.yaml", "--nproc",
                     "2", "--rank", "1", "--call", "1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
