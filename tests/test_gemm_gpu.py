"""The `gemm` op on one GPU: `tsgen test` (NumPy reference, poisoned outputs) and the
checks of tests/gemm_checks.py (M tails, tiny M, 20 back-to-back calls, no write to rows
>= M, a cuBLAS float32 reference). Skipped with a reason on machines without a GPU."""

import pytest

import gemm_checks as tool
from conftest import ROOT, need_gpus

from tsgen.harness import run_test

pytestmark = pytest.mark.gpu


def test_gemm_against_numpy():
    need_gpus(1)
    lines = []
    ok = run_test(ROOT / "specs" / "gemm_bf16.yaml", 1, echo=lines.append)
    assert ok, "\n".join(lines)


def test_gemm_tails_and_back_to_back_calls(tmp_path):
    need_gpus(1)
    manifest = tool.variant_manifest(tmp_path, "shipped", timeout_ms=3000)
    lines = []
    result = tool.check_variant(manifest, [1, 129, 257, 8192 + 77], calls=20, echo=lines.append)
    assert result["pass"], "\n".join(lines)
