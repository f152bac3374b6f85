"""examples/vendor: a plain C++ program that vendors the one-file form of specs/allgather.yaml
(`tsgen build --amalgamate`). It must keep building (built once here: with CMake, as its README
says, or `tsgen build --amalgamate` and nvcc alone where CMake is not installed; either way with
the vendored folder as the only include path), its copy of the manifest's buffer table must
match the manifest, and on a machine without a GPU it must say so. It runs on GPUs in
tools/gpu_shared.sh (W ranks sharing one GPU)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, gpu_count

EXAMPLE = ROOT / "examples" / "vendor"


def test_buffer_table_matches_the_manifest():
    manifest = json.loads((ROOT / "generated" / "allgather.json").read_text())
    rows = re.findall(r'\{"(\w+)", (\d+), (\d+), (\d+), (\d+)\}', (EXAMPLE / "main.cu").read_text())
    sizes = {"uint64": 8, "bfloat16": 2}
    want = [(b["name"], sizes[b["dtype"]], b["elems"]["per_count"], b["elems"]["per_world_count"], b["elems"]["fixed"])
            for b in manifest["buffers"]]
    assert [(n, int(a), int(b), int(c), int(d)) for n, a, b, c, d in rows] == want
    assert manifest["world_sizes"] == [2, 3, 4, 8]  # the example's switch over world sizes


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The example's program, built once for this module's tests."""
    from tsgen.toolchain import ToolchainError, find_nvcc

    try:
        nvcc = str(find_nvcc())
    except ToolchainError as e:
        pytest.skip(str(e))
    build = tmp_path_factory.mktemp("vendor")
    if shutil.which("cmake"):  # configuring makes the one-file copy with this checkout's tsgen
        cfg = subprocess.run(["cmake", "-S", str(EXAMPLE), "-B", str(build), f"-DCMAKE_CUDA_COMPILER={nvcc}",
                              f"-DPython3_EXECUTABLE={sys.executable}"], capture_output=True, text=True, timeout=300)
        assert cfg.returncode == 0, cfg.stdout + cfg.stderr
        b = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True, timeout=600)
    else:
        made = subprocess.run([sys.executable, "-m", "tsgen", "build", "--amalgamate", "specs/allgather.yaml", "-o",
                               str(build / "vendored")], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert made.returncode == 0, made.stdout + made.stderr
        b = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90a", f"-I{build / 'vendored'}", "-o",
                            str(build / "allgather_demo"), str(EXAMPLE / "main.cu")],
                           capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stdout + b.stderr
    return build / "allgather_demo"


@pytest.mark.compile
def test_builds(demo):
    """Built from one self-contained file: the vendored allgather.cu includes no tsgen header."""
    assert demo.is_file() and os.access(demo, os.X_OK)
    vendored = (demo.parent / "vendored" / "allgather.cu").read_text()
    assert '#include "tsgen/' not in vendored.replace('// #include "tsgen/', "")
    assert "// Inlined from templates/include/tsgen/ptx.cuh" in vendored


@pytest.mark.compile
@pytest.mark.skipif(gpu_count() > 0 or os.path.exists("/dev/nvidiactl"), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so(demo):
    """No driver or no device: one line that says so, exit 2 (was: "CUDA driver version is
    insufficient for CUDA runtime version" from the first CUDA call)."""
    p = subprocess.run([str(demo), "2"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stdout == "" and re.fullmatch(r".*allgather_demo: no CUDA GPU found \(cudaGetDeviceCount: .+\)\n",
                                          p.stderr), p.stderr
