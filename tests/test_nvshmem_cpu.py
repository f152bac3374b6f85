"""The NVSHMEM device transport (params.transport: nvshmem), on CPU: the shipped
specs render the same verified plans into NVSHMEM device calls, compile with
-rdc=true and device-link against libnvshmem_device from the pip wheel
(nvidia-nvshmem-cu13 / -cu12) into a cubin with the NVSHMEM entry points and
no spills; bad combinations are spec errors; the runtime refuses the modules
without an NVSHMEM backend. Compiling needs nvcc and the wheel (skips say which
is missing); no GPU."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from conftest import ROOT, compile_test, missing_tool, run_cli
from tsgen import toolchain
from tsgen.errors import SpecError, ToolchainError
from tsgen.shipped import shipped_specs
from tsgen.spec import load_spec
from tsgen.toolchain import compile_source, find_cuobjdump, find_device_lib, find_nvcc

# the shipped specs of the NVSHMEM transport (tsgen.shipped), and of them the collectives'
NVSHMEM_SPECS = [p.stem for p in shipped_specs(transport="nvshmem")]
NVSHMEM_COLLECTIVES = [p.stem for p in shipped_specs(transport="nvshmem", category="collective")]
# primitive -> the NVSHMEM device calls its kernel body must make (and no peer pointer)
NVSHMEM_PRIMITIVES = {
    "put_warp_nvshmem": ("nvshmemx_putmem_nbi_warp(", "nvshmem_quiet()", "tsgen::nvshmem::check_pe("),
    "get_block_nvshmem": ("nvshmemx_getmem_nbi_block(", "nvshmem_quiet()", "tsgen::nvshmem::check_pe("),
    "simple_shift_nvshmem": ("nvshmemx_putmem_signal_nbi_block(", "tsgen::nvshmem::wait_ge(", "nvshmemx_signal_op(",
                             "NVSHMEM_SIGNAL_ADD", "nvshmem_quiet()"),
    "barrier_all_nvshmem": ("tsgen::nvshmem::barrier_all(", "nvshmemx_getmem_block("),
}
# the library's transport path of each kernel's main call, seen in the linked cubin
LINKED_PATH = {name: b"nvshmemi_transfer_put_signal_dispatch" for name in NVSHMEM_COLLECTIVES} | {
    "put_warp_nvshmem": b"nvshmemi_transfer_rma_nbi", "get_block_nvshmem": b"nvshmemi_transfer_rma_nbi",
    "simple_shift_nvshmem": b"nvshmemi_transfer_put_signal_dispatch",
    "barrier_all_nvshmem": b"nvshmemi_barrier_threadgroup"}



NO_NVCC = missing_tool(find_nvcc)
NO_WHEEL = missing_tool(lambda: find_device_lib("nvshmem"))
needs_link = compile_test(
    (NO_NVCC or NO_WHEEL) and f"compiling the nvshmem transport needs nvcc and the NVSHMEM wheel: {NO_NVCC or NO_WHEEL}")


def _write(tmp_path, text: str):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


# ---------------------------------------------------------------------------
# Specs, rendering, plans
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NVSHMEM_COLLECTIVES)
def test_nvshmem_specs_render_put_with_signal(name):
    spec = load_spec(ROOT / "specs" / f"{name}.yaml").model
    assert spec.params.transport == "nvshmem"
    manifest = json.loads((ROOT / "generated" / f"{name}.json").read_text())
    assert manifest["device_libs"] == ["nvshmem"] and manifest["host_launch"] is False
    text = (ROOT / "generated" / f"{name}.cu").read_text()
    assert '#include "tsgen/nvshmem.cuh"' in text and '#include "tsgen/plan.cuh"' in text
    body = text.split("namespace " + name + " {", 1)[1]
    assert "tsgen::nvshmem::run_plan<T, UNROLL, WORLD>" in body and "tsgen::run_plan<" not in body
    header = (ROOT / "templates" / "include" / "tsgen/nvshmem.cuh").read_text()
    assert "#include <nvshmem.h>" in header and "#ifdef TSGEN_PLAN_CUH" in header  # the executor: with a plan
    for call in ("nvshmemx_putmem_signal_nbi_block", "NVSHMEM_SIGNAL_ADD", "nvshmem_signal_wait_until",
                 "NVSHMEM_CMP_GE", "nvshmemx_signal_op", "nvshmem_quiet", "nvshmemx_getmem_block",
                 "wait_ge_acquire_sys"):  # the repo's bounded spin with the timeout diagnostic
        assert call in header, call


@pytest.mark.parametrize("name", list(NVSHMEM_PRIMITIVES))
def test_nvshmem_primitives_render_nvshmem_calls(name):
    """Primitives with transport: nvshmem call NVSHMEM (at the op's warp or block level) where
    the p2p form touches peer memory, and run as PE = rank."""
    manifest = json.loads((ROOT / "generated" / f"{name}.json").read_text())
    assert manifest["device_libs"] == ["nvshmem"]
    text = (ROOT / "generated" / f"{name}.cu").read_text()
    assert '#include "tsgen/nvshmem.cuh"' in text
    body = text.split("namespace " + name + " {", 1)[1]
    for call in NVSHMEM_PRIMITIVES[name]:
        assert call in body, (name, call)
    assert "tsgen::peer_ptr(" not in body and "tsgen::barrier_all<" not in body
    # the plan executor (tsgen/nvshmem.cuh's #ifdef TSGEN_PLAN_CUH) stays out of sources without a plan
    assert '#include "tsgen/plan.cuh"' not in text and "TSGEN_PLAN_CUH" not in text


def test_every_nvshmem_spec_is_checked():
    assert sorted(NVSHMEM_COLLECTIVES + list(NVSHMEM_PRIMITIVES)) == sorted(NVSHMEM_SPECS)
    assert set(LINKED_PATH) == set(NVSHMEM_SPECS)


def test_p2p_specs_do_not_change():
    """Only nvshmem specs carry device_libs; the p2p sources (NAME of each NAME_nvshmem) inline no
    NVSHMEM header."""
    for name in (n.removesuffix("_nvshmem") for n in NVSHMEM_SPECS):
        manifest = json.loads((ROOT / "generated" / f"{name}.json").read_text())
        assert "device_libs" not in manifest
        assert "nvshmem" not in (ROOT / "generated" / f"{name}.cu").read_text()


@pytest.mark.plans
def test_nvshmem_plans_verify():
    """Same plans as p2p: `tsgen verify` runs them on the CPU, at the world sizes they are compiled for
    (a few schedules: test_plan.py's sweep verifies these plans in full)."""
    r = run_cli("verify", *(f"specs/{n}.yaml" for n in NVSHMEM_SPECS), "--schedules", "3")
    assert r.code == 0, r
    assert "8 plans verified" in r.stdout, r  # all_to_all_nvshmem, allgather_nvshmem at 2, 3, 4, 8


def test_nvshmem_spec_errors(tmp_path):
    head = "name: bad\nworld_sizes: [2, 4]\n"
    cases = {
        "op: allgather\nparams:\n  transport: nvshmem\n  direction: multimem\n": "multicast, not NVSHMEM",
        "op: all_reduce\nparams:\n  transport: nvshmem\n  algorithm: multimem\n": "multicast, not NVSHMEM",
        "op: all_reduce\nparams:\n  transport: nvshmem\n  algorithm: one_shot\n": "reduces local memory only",
        "op: reduce_scatter\nparams:\n  transport: nvshmem\n  algorithm: ring\n": "reduces local memory only",
        # one field: a transport is nvshmem or copy_engine, never both
        "op: allgather\nparams:\n  transport: [nvshmem, copy_engine]\n": "transport",
        "op: allgather\nparams:\n  transport: nvshmem_ce\n": "transport",
    }
    for body, message in cases.items():
        with pytest.raises(SpecError, match=re.escape(message)):
            load_spec(_write(tmp_path, head + body))
    # push algorithms whose reductions are local are accepted
    for body in ("op: all_reduce\nparams:\n  transport: nvshmem\n  algorithm: two_shot\n",
                 "op: reduce_scatter\nparams:\n  transport: nvshmem\n",
                 "op: allgather\nparams:\n  transport: nvshmem\n  direction: ring\n  pieces: 2\n",
                 "op: allgather\nparams:\n  transport: nvshmem\n  direction: pull\n"):
        assert load_spec(_write(tmp_path, head + body)).model.params.transport == "nvshmem"


def test_runtime_refuses_without_nvshmem_backend():
    from tsgen.manifest import Manifest
    from tsgen.runtime.world import device_lib_refusal

    manifest = Manifest.load(ROOT / "generated" / "allgather_nvshmem.json")
    msg = device_lib_refusal(manifest, object())
    assert msg and "the nvshmem backend" in msg and "allgather_nvshmem" in msg and "--backend nvshmem" in msg

    class Nvshmem:
        nvshmem = True

    assert device_lib_refusal(manifest, Nvshmem()) is None
    assert device_lib_refusal(Manifest.load(ROOT / "generated" / "allgather.json"), object()) is None


# ---------------------------------------------------------------------------
# Toolchain: finding the wheel, compiling, device-linking
# ---------------------------------------------------------------------------


def test_missing_wheel_names_the_pip_package(monkeypatch, tmp_path):
    monkeypatch.setattr(toolchain, "_device_lib_roots", lambda name: [tmp_path])
    with pytest.raises(ToolchainError, match=re.escape("pip install nvidia-nvshmem-cu13")):
        find_device_lib("nvshmem")
    with pytest.raises(ToolchainError, match="unknown device library"):
        find_device_lib("nccl")


def test_nvshmem_home_is_found(monkeypatch, tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "include" / "nvshmem.h").write_text("")
    (tmp_path / "lib" / "libnvshmem_device.a").write_bytes(b"!<arch>\n")
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path))
    lib = find_device_lib("nvshmem")
    assert lib.include == tmp_path / "include"
    assert lib.link_flags == [f"-L{tmp_path / 'lib'}", "-lnvshmem_device"]


@needs_link
@pytest.mark.parametrize("name", NVSHMEM_SPECS)
def test_nvshmem_source_device_links(name):
    source = ROOT / "generated" / f"{name}.cu"
    manifest = json.loads(source.with_suffix(".json").read_text())
    res = compile_source(source, arch="sm_90a", link=tuple(manifest["device_libs"]))
    data = res.output.read_bytes()
    assert data[:4] == b"\x7fELF"
    kernels = [k["name"] for k in manifest["kernels"]]
    for k in kernels:
        entry = res.report[k]
        assert entry["registers"] > 0 and entry["spill_stores"] == 0 and entry["spill_loads"] == 0, (k, entry)
        assert entry["linked_lmem"] == 0, (k, entry)  # after the device link: no local memory
    for fn, entry in res.own_report.items():  # our helpers; NVSHMEM's own templates are theirs
        assert entry.get("spill_stores", 0) == 0 and entry.get("spill_loads", 0) == 0, (fn, entry)
    # The device link pulled in libnvshmem_device: the state nvshmemx_cumodule_init fills
    # in, and the transport path of the kernel's main call (used when the target is not
    # NVLink-reachable).
    for symbol in (b"nvshmemi_device_state_d", LINKED_PATH[name], *(k.encode() for k in kernels)):
        assert symbol in data, symbol
    if missing_tool(find_cuobjdump) is None:
        elf = subprocess.run([str(find_cuobjdump()), "-elf", str(res.output)], capture_output=True, text=True,
                             check=True).stdout
        entries = set(re.findall(r"FUNC\s+GLOBAL\s+DEFAULT\s+ENTRY\s+\S+\s+(\S+)", elf))
        assert set(kernels) <= entries, (kernels, entries)
        assert re.search(r"OBJECT\s+GLOBAL.*\snvshmemi_device_state_d\s*$", elf, re.M), "device state symbol"
    again = compile_source(source, arch="sm_90a", link=tuple(manifest["device_libs"]))
    assert again.cached and again.output == res.output


@needs_link
def test_nvshmem_source_needs_the_link():
    """Negative control: without the device library the source does not build."""
    with pytest.raises(ToolchainError, match="nvshmem.h"):
        compile_source(ROOT / "generated" / "allgather_nvshmem.cu", arch="sm_90a")
    with pytest.raises(ToolchainError, match="load as cubins"):
        compile_source(ROOT / "generated" / "allgather_nvshmem.cu", mode="shared", link=("nvshmem",))


@needs_link
def test_cache_key_holds_the_headers_not_their_path(tmp_path, monkeypatch, own_cache):
    """The same NVSHMEM headers under another path (a new venv) hit the cache; an edited
    header does not."""
    real = find_device_lib("nvshmem")
    source = tmp_path / "k.cu"
    source.write_text('extern "C" __global__ void k(int* p) { *p = 1; }\n')

    def compile_against(name: str, edit: bool = False):
        home = tmp_path / name
        shutil.copytree(real.include, home / "include")
        (home / "lib").mkdir()
        (home / "lib" / real.archive.name).symlink_to(real.archive)
        if edit:
            with open(home / "include" / "nvshmem.h", "a") as f:
                f.write("// edited\n")
        monkeypatch.setenv("NVSHMEM_HOME", str(home))
        assert find_device_lib("nvshmem").include == home / "include"
        return compile_source(source, link=("nvshmem",))

    first = compile_against("a")
    moved = compile_against("b")
    assert not first.cached and moved.cached and moved.output == first.output
    assert not compile_against("c", edit=True).cached
