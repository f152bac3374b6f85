"""tsgen.torch on 2 GPUs: tests/torch_checks.py under torchrun (tools/gpu_torch.sh runs the same and
the TP MLP example, with a table). Skipped without torch or with fewer than 2 CUDA GPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu


def _two_gpus() -> None:
    torch = pytest.importorskip("torch", reason="tsgen.torch needs PyTorch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs visible to torch")


@pytest.mark.parametrize("mode", [[], ["--probe"]], ids=["checks", "peer_never_arrives"])
def test_torch_checks(mode):
    _two_gpus()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "torch_checks.py"), *mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    out = proc.stdout + proc.stderr
    checks = [line for line in out.splitlines() if line.startswith("CHECK ")]
    assert checks, out[-4000:]
    assert proc.returncode == 0 and not any(" FAIL" in line for line in checks), "\n".join(checks) + out[-4000:]
