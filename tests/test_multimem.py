"""NVLink multicast (multimem) variants: generated and compiled only.

They must contain the multimem instructions (PTX and SASS), and the runtime
must refuse them unless explicitly enabled on hardware that supports them.
Nothing here or anywhere in the test suite executes them."""

import subprocess

import pytest

from conftest import ROOT

from tsgen.errors import ToolchainError
from tsgen.manifest import Manifest
from tsgen.runtime.world import multimem_refusal
from tsgen.spec import load_spec
from tsgen.errors import SpecError


@pytest.fixture(scope="module")
def toolchain():
    from tsgen.toolchain import find_cuobjdump, find_nvcc

    try:
        return find_nvcc(), find_cuobjdump()
    except ToolchainError as e:
        pytest.skip(str(e))


def _ptx(nvcc, name, tmp_path):
    out = tmp_path / f"{name}.ptx"
    from tsgen.headers import include_flags

    subprocess.run([str(nvcc), "-ptx", "-gencode=arch=compute_90a,code=compute_90a", "-std=c++17", *include_flags(),
                    "-o", str(out), str(ROOT / "generated" / f"{name}.cu")], check=True)
    return out.read_text()


@pytest.mark.compile
def test_all_reduce_multimem_instructions(toolchain, tmp_path):
    from tsgen.toolchain import compile_source, dump_sass

    ptx = _ptx(toolchain[0], "all_reduce_multimem", tmp_path)
    assert "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2" in ptx
    assert "multimem.st.relaxed.sys.global.v4.bf16x2" in ptx
    assert "multimem.red.release.sys.global.add.u32" in ptx
    sass = dump_sass(compile_source(ROOT / "generated" / "all_reduce_multimem.cu").output)
    assert "LDGMC" in sass  # the switch reduction really is emitted
    assert "REDG.E.ADD.STRONG.SYS" in sass  # the multimem.red barrier


@pytest.mark.compile
def test_allgather_multimem_instructions(toolchain, tmp_path):
    ptx = _ptx(toolchain[0], "allgather_multimem", tmp_path)
    assert "multimem.st.relaxed.sys.global.v4.f32" in ptx
    assert "multimem.red.release.sys.global.add.u32" in ptx


@pytest.mark.compile
def test_non_multimem_sources_have_no_multimem_code(toolchain, tmp_path):
    ptx = _ptx(toolchain[0], "all_reduce_two_shot", tmp_path)
    assert "multimem." not in ptx


@pytest.mark.parametrize("env,supported,expect", [
    ({}, True, "TSGEN_ALLOW_MULTIMEM=1"),
    ({"TSGEN_ALLOW_MULTIMEM": "yes"}, True, "TSGEN_ALLOW_MULTIMEM=1"),
    ({"TSGEN_ALLOW_MULTIMEM": "1"}, False, "no multicast support"),
    ({"TSGEN_ALLOW_MULTIMEM": "1"}, True, "not implemented"),
])
def test_runtime_refuses_multimem(env, supported, expect):
    reason = multimem_refusal(Manifest.load(ROOT / "generated" / "all_reduce_multimem.json"), env, supported)
    assert reason and expect in reason


def test_runtime_accepts_ordinary_modules():
    assert multimem_refusal(Manifest.load(ROOT / "generated" / "allgather.json"), {}, False) is None


def test_manifest_marks_multimem():
    import json

    assert json.loads((ROOT / "generated" / "all_reduce_multimem.json").read_text())["multimem"] is True
    assert json.loads((ROOT / "generated" / "all_reduce_two_shot.json").read_text())["multimem"] is False


@pytest.mark.parametrize("extra,field", [("  in_place: true\n", "params.in_place"), (None, "dtype")])
def test_multimem_spec_limits(tmp_path, extra, field):
    text = (ROOT / "specs" / "all_reduce_multimem.yaml").read_text()
    text = text.replace("  algorithm: multimem\n", "  algorithm: multimem\n" + extra) if extra else \
        text.replace("dtype: bfloat16", "dtype: float16")
    path = tmp_path / "mm.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        load_spec(path)
    assert any(f": {field}: " in p for p in e.value.problems), e.value.problems
