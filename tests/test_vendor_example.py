"""examples/vendor: a plain C++ program that vendors generated/allgather.cu. It must keep
building (nvcc; CMake where installed) and its copy of the manifest's buffer table must
match the manifest. It runs on GPUs in tools/gpu_shared.sh (W ranks sharing one GPU)."""

import json
import re
import shutil
import subprocess

import pytest

from conftest import ROOT

EXAMPLE = ROOT / "examples" / "vendor"


def test_buffer_table_matches_the_manifest():
    manifest = json.loads((ROOT / "generated" / "allgather.json").read_text())
    rows = re.findall(r'\{"(\w+)", (\d+), (\d+), (\d+), (\d+)\}', (EXAMPLE / "main.cu").read_text())
    sizes = {"uint64": 8, "bfloat16": 2}
    want = [(b["name"], sizes[b["dtype"]], b["elems"]["per_count"], b["elems"]["per_world_count"], b["elems"]["fixed"])
            for b in manifest["buffers"]]
    assert [(n, int(a), int(b), int(c), int(d)) for n, a, b, c, d in rows] == want
    assert manifest["world_sizes"] == [2, 3, 4, 8]  # the example's switch over world sizes


def _nvcc():
    from tsgen.toolchain import ToolchainError, find_nvcc

    try:
        return str(find_nvcc())
    except ToolchainError as e:
        pytest.skip(str(e))


@pytest.mark.compile
def test_builds_with_nvcc(tmp_path):
    nvcc = _nvcc()
    out = tmp_path / "allgather_demo"
    p = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90a", f"-I{ROOT / 'generated'}", "-o", str(out),
                        str(EXAMPLE / "main.cu")], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert out.exists()


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_builds_with_cmake(tmp_path):
    nvcc = _nvcc()
    build = tmp_path / "build"
    cfg = subprocess.run(["cmake", "-S", str(EXAMPLE), "-B", str(build), f"-DCMAKE_CUDA_COMPILER={nvcc}"],
                         capture_output=True, text=True, timeout=300)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    b = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stdout + b.stderr
    assert (build / "allgather_demo").exists()
