import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))

# Never let anything this test suite starts use NVLink multicast.
for key, value in {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                   "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}.items():
    os.environ[key] = value


def gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def need_gpus(n: int):
    have = gpu_count()
    if have < n:
        pytest.skip(f"needs {n} GPUs with CuPy; this machine has {have}")


@pytest.fixture(autouse=True)
def _chdir_root(monkeypatch):
    monkeypatch.chdir(ROOT)


class CliResult:
    def __init__(self, code: int, stdout: str, stderr: str):
        self.code, self.stdout, self.stderr = code, stdout, stderr

    def __repr__(self) -> str:
        return f"exit {self.code}\n--- stdout\n{self.stdout}--- stderr\n{self.stderr}"


def run_cli(*args: str) -> CliResult:
    """`tsgen ARGS` in this process (click's CliRunner), in the current folder:
    exit code, stdout and stderr apart. Unexpected exceptions propagate."""
    from click.testing import CliRunner

    from tsgen.cli import main

    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()  # click >= 8.2 keeps stderr apart by itself
    r = runner.invoke(main, [str(a) for a in args], catch_exceptions=False)
    return CliResult(r.exit_code, r.stdout, r.stderr)
