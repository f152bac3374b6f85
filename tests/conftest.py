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
