"""Every generated source compiles for sm_90a without spills, as the runtime loads it
(what `tsgen build --compile` compiled: these find it in the compile cache); the SASS
of a few kernels has the memory ordering it is meant to; nvcc errors and a missing
toolchain are reported clearly. Needs nvcc (and cuobjdump for SASS, the NVSHMEM
wheel for the device-linked sources), no GPU."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, compile_test, run_cli
from tsgen import toolchain
from tsgen.errors import ToolchainError
from tsgen.toolchain import (cache_dir, compile_module, compile_source, dump_sass, find_cuobjdump, find_device_lib,
                             find_nvcc)

GENERATED = sorted((ROOT / "generated").glob("*.cu"))


def _have(find) -> str | None:
    try:
        find()
        return None
    except ToolchainError as e:
        return str(e)


NO_NVCC = _have(find_nvcc)
NO_CUOBJDUMP = _have(find_cuobjdump)
NO_NVSHMEM = _have(lambda: find_device_lib("nvshmem"))
needs_nvcc = compile_test(NO_NVCC and f"nvcc not found: {NO_NVCC}")
needs_sass = compile_test((NO_NVCC or NO_CUOBJDUMP)
                          and f"SASS checks need nvcc and cuobjdump: {NO_NVCC or NO_CUOBJDUMP}")


def _manifest(source: Path) -> dict:
    return json.loads(source.with_suffix(".json").read_text())


@needs_nvcc
@pytest.mark.parametrize("source", GENERATED, ids=lambda p: p.stem)
def test_generated_source_compiles_without_spills(source):
    manifest = _manifest(source)
    if manifest.get("device_libs") and NO_NVSHMEM:
        pytest.skip(f"device-linked against {manifest['device_libs']}: {NO_NVSHMEM}")
    res = compile_module(source, arch="sm_90a")
    assert res.output.parent == cache_dir()
    assert res.output.read_bytes()[:4] == b"\x7fELF"
    kernels = [k["name"] for k in manifest["kernels"]]
    if manifest["host_launch"]:  # device kernels are <name>_sync, <name>_reduce, ... around the launcher
        kernels = [r for r in res.report if any(r.startswith(k + "_") for k in kernels) and "registers" in res.report[r]]
    assert kernels and set(kernels) <= set(res.report), (kernels, res.report)
    for name in kernels:
        entry = res.report[name]
        assert entry["registers"] > 0, (name, entry)
        assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0, (name, entry)
    for name, entry in res.own_report.items():  # non-inlined helpers too (a device library's are its own)
        assert entry.get("spill_stores", 0) == 0 and entry.get("spill_loads", 0) == 0, (name, entry)
    assert res.serialized == [], "ptxas serialized wgmma (right answers, several times slower)"
    if res.output.suffix == ".so":  # what the runtime looks up: every launcher and prepare the manifest names
        nm = shutil.which("nm")
        if nm is None:
            pytest.skip("nm not found; the library compiled but its symbols are unchecked")
        out = subprocess.run([nm, "-D", "--defined-only", str(res.output)], capture_output=True, text=True,
                             check=True).stdout
        defined = {line.split()[-1] for line in out.splitlines() if line.split()[-2:-1] == ["T"]}
        named = [k[key] for k in manifest["kernels"] for key in ("launcher", "prepare") if k.get(key)]
        assert set(named) <= defined, sorted(set(named) - defined)


@needs_nvcc
def test_compile_is_cached(own_cache):
    source = ROOT / "generated" / "put_warp.cu"
    first = compile_source(source)
    assert not first.cached and first.output.parent == own_cache
    second = compile_source(source)
    assert second.cached and second.output == first.output
    assert second.report == first.report
    other = compile_source(source, extra=["-DTSGEN_TEST_VARIANT=1"])
    assert not other.cached and other.output != first.output


@needs_nvcc
def test_host_launcher_object():
    source = ROOT / "generated" / "put_block.cu"
    res = compile_source(source, mode="obj")
    assert res.output.suffix == ".o" and res.output.stat().st_size > 0
    launchers = [k["launcher"] for k in _manifest(source)["kernels"]]
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found; the object compiled but its symbols are unchecked")
    out = subprocess.run([nm, "--defined-only", str(res.output)], capture_output=True, text=True, check=True).stdout
    defined = {line.split()[-1]: line.split()[-2] for line in out.splitlines() if len(line.split()) >= 2}
    for name in launchers:
        assert defined.get(name) == "T", f"extern \"C\" {name} missing from the object:\n{out}"


@needs_nvcc
def test_cli_build_compile(tmp_path, own_cache):
    """A line per source, in the order of the specs whatever order they finish in, then the totals."""
    r = run_cli("build", "specs/put_block.yaml", "specs/barrier_all.yaml", "-o", tmp_path / "out", "--compile",
                "--jobs", "2")
    assert r.code == 0, r
    lines = r.stdout.splitlines()
    assert lines[1] == f"tsgen: compiling 2 source(s) for sm_90a, 2 at a time; outputs in {own_cache}", lines
    for i, name in enumerate(["put_block", "barrier_all"]):
        assert re.fullmatch(rf"\[{i + 1}/2\] {name}\.cu -> {name}-[0-9a-f]{{24}}\.cubin \(compiled in \d+\.\d s; "
                            r"max \d+ registers, 0 spill bytes\)", lines[2 + i]), lines
    assert re.fullmatch(r"tsgen: 2 source\(s\): 2 compiled, 0 cached, in \d+\.\d s", lines[4]), lines
    again = run_cli("build", "specs/put_block.yaml", "-o", tmp_path / "out", "--compile")
    assert re.fullmatch(r"\[1/1\] put_block\.cu -> \S+\.cubin \(cached; max \d+ registers, 0 spill bytes\)",
                        again.stdout.splitlines()[2]), again
    r = run_cli("build", "specs/put_block.yaml", "-o", tmp_path / "out", "--compile", "--arch", "sm90")
    assert r.code == 2, r
    assert "arch 'sm90' is not of the form sm_90a / sm_90 / sm_100a" in r.stderr


# ---------------------------------------------------------------------------
# SASS
# ---------------------------------------------------------------------------

_INSN = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([^;]*?)\s*;")


def sass_functions(text: str) -> dict[str, list[str]]:
    """Kernel name -> its instructions (predicate stripped), in order."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if m := re.search(r"Function : (\S+)", line):
            current = out.setdefault(m.group(1), [])
        elif current is not None and (m := _INSN.search(line)):
            current.append(m.group(1))
    return out


def opcodes(insns: list[str]) -> list[str]:
    return [i.split()[0] for i in insns]


@pytest.fixture(scope="module")
def sass():
    if NO_NVCC or NO_CUOBJDUMP:
        pytest.skip(f"SASS checks need nvcc and cuobjdump: {NO_NVCC or NO_CUOBJDUMP}")
    memo: dict[str, dict[str, list[str]]] = {}

    def get(name: str) -> dict[str, list[str]]:
        if name not in memo:
            source = ROOT / "generated" / f"{name}.cu"
            funcs = sass_functions(dump_sass(compile_source(source).output))
            kernels = [k["name"] for k in _manifest(source)["kernels"]]
            assert sorted(funcs) == sorted(kernels), (sorted(funcs), kernels)
            memo[name] = {k: opcodes(funcs[k]) for k in kernels}
        return memo[name]

    return get


_MEMORY = re.compile(r"(LD|ST|RED|ATOM|MEMBAR|FENCE|CCTL)")


def prev_memory_op(ops: list[str], i: int) -> str | None:
    """The nearest memory instruction or fence before ops[i] (skips ERRBAR, NOP, ALU...)."""
    return next((op for op in reversed(ops[:i]) if _MEMORY.match(op)), None)


def next_memory_op(ops: list[str], i: int) -> str | None:
    return next((op for op in ops[i + 1:] if _MEMORY.match(op)), None)


def followed_by(ops: list[str], first: str, then: str) -> bool:
    """`first` occurs with `then` somewhere after it."""
    return first in ops and then in ops[ops.index(first) + 1:]


def test_sass_parser():
    text = """
        Function : k_w2
        /*0000*/                   LDC R1, c[0x0][0x28] ;        /* 0x00000a00ff017b82 */
        /*0010*/              @!P0 LDG.E.64.STRONG.SYS R6, desc[UR4][R2.64] ;   /* 0x0000000402067981 */
        /*0020*/                   CCTL.IVALL ;     /* 0x00000000ff00798f */
        Function : k_w3
        /*0000*/               @P1 EXIT ;   /* 0x000000000000194d */
    """
    assert sass_functions(text) == {
        "k_w2": ["LDC R1, c[0x0][0x28]", "LDG.E.64.STRONG.SYS R6, desc[UR4][R2.64]", "CCTL.IVALL"],
        "k_w3": ["EXIT"],
    }
    assert followed_by(["A", "B", "C"], "A", "C") and not followed_by(["C", "A"], "A", "C")
    ops = ["MEMBAR.ALL.SYS", "ERRBAR", "CGAERRBAR", "STG.E.64.STRONG.SYS", "IADD3", "CCTL.IVALL"]
    assert prev_memory_op(ops, 3) == "MEMBAR.ALL.SYS" and next_memory_op(ops, 3) == "CCTL.IVALL"
    assert prev_memory_op(["LDG.E", "MEMBAR.ALL.SYS", "STG.E", "STG.E.64"], 3) == "STG.E"


@needs_sass
def test_sass_signal_wait_acquire_and_release(sass):
    for kernel, ops in sass("signal_wait_ge_peer").items():
        # wait: acquire.sys load, then the L1 invalidation that makes it an acquire
        assert followed_by(ops, "LDG.E.64.STRONG.SYS", "CCTL.IVALL"), kernel
        # signal: release.sys store = full fence, then the strong store
        i = ops.index("STG.E.64.STRONG.SYS")
        assert prev_memory_op(ops, i) == "MEMBAR.ALL.SYS", (kernel, ops[i - 3:i + 1])


@needs_sass
def test_sass_barrier_blocks(sass):
    for kernel, ops in sass("barrier_blocks").items():
        # arrive: release.gpu reduction (fence.gpu, then red)
        i = ops.index("REDG.E.ADD.64.STRONG.GPU")
        assert prev_memory_op(ops, i) == "MEMBAR.ALL.GPU", (kernel, ops[i - 3:i + 1])
        # wait: acquire.gpu load + invalidation, not a system-scope one
        assert followed_by(ops, "LDG.E.64.STRONG.GPU", "CCTL.IVALL"), kernel
        assert "LDG.E.64.STRONG.SYS" not in ops and "MEMBAR.ALL.SYS" not in ops, kernel


@needs_sass
def test_sass_put_block_vector_copy(sass):
    for kernel, ops in sass("put_block").items():
        # src read once, no L1 allocation; 16-byte stores to the peer; unroll 4 loads in flight
        assert ops.count("LDG.E.NA.128.CONSTANT") >= 4, kernel
        assert "STG.E.128" in ops, kernel
        assert "MEMBAR.ALL.SYS" not in ops, kernel


@needs_sass
def test_sass_remote_store_release_vs_relaxed(sass):
    for kernel, ops in sass("remote_st_release_sys_u64").items():
        # (the kernel's call counter is advanced with a relaxed gpu-scope store: not data)
        stores = [i for i, op in enumerate(ops) if op.startswith("STG") and op != "STG.E.64.STRONG.GPU"]
        assert stores, kernel
        for i in stores:
            assert ops[i] == "STG.E.64.STRONG.SYS", (kernel, ops[i])
            assert prev_memory_op(ops, i) == "MEMBAR.ALL.SYS", (kernel, ops[i - 3:i + 1])
    # the contrast that shows the check above means something: relaxed has no fence
    for kernel, ops in sass("remote_st_relaxed_sys_u32").items():
        assert "STG.E.STRONG.SYS" in ops, kernel
        assert not any(op.startswith("MEMBAR") for op in ops), kernel


@needs_sass
def test_sass_remote_load_acquire(sass):
    for kernel, ops in sass("remote_ld_acquire_sys_u64").items():
        loads = [i for i, op in enumerate(ops) if op == "LDG.E.64.STRONG.SYS"]
        assert loads, kernel
        for i in loads:
            assert next_memory_op(ops, i) == "CCTL.IVALL", (kernel, ops[i:i + 3])
    for kernel, ops in sass("remote_ld_relaxed_gpu_u32").items():
        assert "LDG.E.STRONG.GPU" in ops and "CCTL.IVALL" not in ops, kernel


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


@needs_nvcc
def test_nvcc_error_names_file_line_and_spec(tmp_path, own_cache):
    bad = tmp_path / "broken.cu"
    bad.write_text(
        "// Generated by tsgen 0.1.0 from specs/fake.yaml\n"
        "#include <stdint.h>\n"
        "__global__ void k(uint32_t* p) { p[0] = ; }\n"
    )
    with pytest.raises(ToolchainError) as e:
        compile_source(bad)
    msg = str(e.value)
    assert msg.startswith(f"nvcc failed on {bad} (rendered from spec specs/fake.yaml):")
    assert re.search(re.escape(str(bad)) + r"\(3\): error", msg), msg
    assert e.value.exit_code == 2
    assert not [p for p in own_cache.iterdir() if "broken" in p.name], "a failed compile leaves nothing in the cache"


def test_missing_nvcc(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(toolchain, "_wheel_bin_dirs", lambda: [])
    with pytest.raises(ToolchainError) as e:
        find_nvcc()
    assert "nvcc not found on PATH, in CUDA_HOME/CUDA_PATH, or in the pip CUDA wheels" in str(e.value)
    assert "`pip install nvidia-cuda-nvcc`" in str(e.value)
    with pytest.raises(ToolchainError) as e:
        find_cuobjdump()
    assert "`pip install nvidia-cuda-cuobjdump`" in str(e.value)

    r = run_cli("build", "specs/put_block.yaml", "-o", tmp_path / "out", "--compile")
    assert r.code == 2, r
    assert r.stderr.startswith("tsgen: nvcc not found on PATH"), r


def test_cuda_home_is_searched(tmp_path, monkeypatch):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    fake = home / "bin" / "nvcc"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setattr(toolchain, "_wheel_bin_dirs", lambda: [])
    assert find_nvcc() == fake



def test_serialized_wgmma_notes_are_found_and_other_notes_are_not():
    """ptxas's serialization notes (a kernel that computes the right answer several times slower: the
    attention backward's s_prefetch experiment at 0952bc9 compiled with C7518) are what `tsgen build
    --compile` warns of and the compile sweep refuses; C7519 (an injected warpgroup.arrive, which the
    shipped forward kernels carry) is not one."""
    from tsgen.toolchain import serialized_wgmma

    text = "\n".join([
        "ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "program dependence on compiler-inserted WG.DP in divergent path in the function 'k'",
        "ptxas info    : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "the presence of Extern calls in the function 'k'",
        "ptxas info    : (C7519) warpgroup.arrive is injected in around line 2586 by compiler to allow use of "
        "registers in GMMA in function 'attention_hd128_w1_kernel'",
        "ptxas info    : Used 168 registers, used 1 barriers",
    ])
    found = serialized_wgmma(text)
    assert [line[16:23] for line in found] == ["(C7518)", "(C7510)"], found
