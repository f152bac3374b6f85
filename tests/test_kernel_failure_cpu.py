"""A kernel that fails on the GPU (a wait times out and traps; CUDA's error is sticky, so freeing
fails afterwards too) ends `tsgen test` with one message: the ranks, their GPU, the kernel and
what the kernel printed, exit 1, and no second error from the cleanup (issue 29, item 4).
Runs the real World, Module and Buffers over a fake CuPy (tests/fake_cuda.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import fake_cuda
from conftest import ROOT

DIAGNOSIS = "tsgen: timeout: rank {r} block 0 thread 0 waited 10000 ms on ready[0]"


def _tsgen_test(tmp_path, fail: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TSGEN_CACHE_DIR=str(tmp_path / "cache"), TSGEN_FAKE_FAIL_GPUS=fail,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(ROOT / "tests" / "fake_cuda.py"), "tsgen", "test",
                           "specs/simple_shift.yaml", "--gpus", "2", "--iters", "3", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def test_a_failed_kernel_ends_in_one_message_naming_rank_gpu_kernel_and_its_diagnosis(tmp_path):
    r = _tsgen_test(tmp_path, "0")
    assert r.returncode == 1, r.stderr  # the README's exit codes: 1, the kernel under test failed
    assert "Traceback" not in r.stderr and "During handling of the above exception" not in r.stderr, r.stderr
    first, *rest = r.stderr.splitlines()
    assert first == ("tsgen: simple_shift, call 0 of 3: kernel failed on rank 0 (GPU 0, kernel "
                     "simple_shift/simple_shift_w2): cudaErrorLaunchFailure: unspecified launch failure; "
                     "the kernel printed:"), r.stderr
    assert len(rest) == 1 and rest[0].strip().startswith(DIAGNOSIS.format(r=0)), r.stderr
    assert DIAGNOSIS.format(r=0) in r.stdout  # still on stdout, where the device printf goes


def test_every_failed_gpu_is_named_in_the_one_message(tmp_path):
    r = _tsgen_test(tmp_path, "0,1")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\ntsgen: ") == 0 and r.stderr.startswith("tsgen: "), r.stderr
    assert ("kernel failed on rank 0 (GPU 0, kernel simple_shift/simple_shift_w2): cudaErrorLaunchFailure: "
            "unspecified launch failure; rank 1 (GPU 1, kernel simple_shift/simple_shift_w2)") in r.stderr
    assert DIAGNOSIS.format(r=0) in r.stderr and DIAGNOSIS.format(r=1) in r.stderr


def test_run_test_raises_the_kernel_failure_alone(monkeypatch, tmp_path):
    """For a Python caller: KernelFailed (exit code 1) with no chained exception, and what
    closing the World raised afterwards kept on the World rather than raised."""
    from tsgen.errors import KernelFailed
    from tsgen.harness import run_test
    from tsgen.runtime import world as world_mod

    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("tsgen.toolchain.compile_for", lambda m, s, arch="sm_90a": type("R", (), {"output": s})())
    monkeypatch.setitem(sys.modules, "cupy", fake_cuda.fake_cupy(2, {1}))
    worlds = []
    monkeypatch.setattr(world_mod.World, "close", lambda self, close=world_mod.World.close: (worlds.append(self),
                                                                                             close(self)))
    with pytest.raises(KernelFailed) as e:
        run_test(ROOT / "specs" / "simple_shift.yaml", 2, iters=2, echo=lambda line: None)
    assert e.value.exit_code == 1 and e.value.__suppress_context__ and e.value.__cause__ is None
    assert "rank 1 (GPU 1, kernel simple_shift/simple_shift_w2)" in str(e.value)
    assert DIAGNOSIS.format(r=1) in str(e.value)
    assert worlds and worlds[0].cleanup_errors, "closing after the failure raised nothing?"
