"""CPU-only checks of templates/include/tsgen/ptx.cuh (no GPU needed).

One .cu file with one `extern "C" __global__ void k_<helper>` kernel per
helper is compiled once to an sm_90a cubin (nvcc + ptxas) and disassembled
once (cuobjdump --dump-sass). The tests then check that

* the helper table at the top of the header matches the definitions, and
  holds every required helper;
* everything assembles without ptxas errors or warnings;
* each kernel's SASS has the instructions its helper is meant to become
  (scope, strength, fences, cache hints, in order), and no others of note;
* forms that must not exist (ld.weak with a scope, atom.load) are rejected
  by ptxas, so a checker built on ptxas would catch them.

Helpers are parsed from the header, so one added later is compiled here
automatically; its name must then also match a row of SASS_EXPECT.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tsgen.errors import ToolchainError
from tsgen.toolchain import find_cuobjdump, find_nvcc, find_tool, gencode_flags

INCLUDE_DIR = Path(__file__).resolve().parents[1] / "templates" / "include"
HEADER = INCLUDE_DIR / "tsgen/ptx.cuh"
ARCH = "sm_90a"

try:
    NVCC = find_nvcc()
except ToolchainError as exc:  # pragma: no cover - depends on the machine
    pytestmark = pytest.mark.skip(reason=f"nvcc not found, cannot compile CUDA: {exc}")
    NVCC = None

# ---------------------------------------------------------------------------
# Required helpers (the brief of the header): each must be in the table.
# ---------------------------------------------------------------------------
_T3 = ("u32", "u64", "v4")
_T2 = ("u32", "u64")
REQUIRED_HELPERS: list[str] = [
    *[f"ld_weak_global_{t}" for t in _T3],
    *[f"ld_volatile_global_{t}" for t in _T3],
    *[f"ld_{sem}_{s}_global_{t}" for sem in ("relaxed", "acquire")
      for s in ("cta", "gpu", "sys") for t in _T3],
    *[f"ld_nc_global_{t}" for t in _T3],
    *[f"ld_nc_na_global_{t}" for t in _T3],
    "ld_weak_na_global_v4",
    *[f"st_weak_global_{t}" for t in _T3],
    *[f"st_volatile_global_{t}" for t in _T3],
    *[f"st_{sem}_{s}_global_{t}" for sem in ("relaxed", "release")
      for s in ("cta", "gpu", "sys") for t in _T3],
    "st_na_global_v4",
    *[f"atom_{op}_{sem}_{s}_global_{t}" for op in ("add", "exch", "cas")
      for sem in ("relaxed", "acquire", "release", "acq_rel")
      for s in ("gpu", "sys") for t in _T2],
    *[f"red_add_{sem}_{s}_global_{t}" for sem in ("relaxed", "release")
      for s in ("gpu", "sys") for t in _T2],
    *[f"fence_{sem}_{s}" for sem in ("acq_rel", "sc") for s in ("cta", "gpu", "sys")],
    "fence_proxy_async_shared_cta",
    "warp_any_sync", "warp_all_sync", "elect_one_sync", "lane_id", "warp_id", "warpgroup_id",
    "globaltimer_ns",
    *[f"multimem_ld_reduce_add_relaxed_sys_{t}"
      for t in ("f32", "bf16x2", "f16x2", "v4_f32", "v4_bf16x2")],
    *[f"multimem_st_relaxed_sys_{t}" for t in ("f32", "bf16x2", "v4_f32", "v4_bf16x2")],
    "multimem_red_add_release_sys_u32",
]

# ---------------------------------------------------------------------------
# Expected SASS (sm_90a, ptxas 13.0), read off real cuobjdump output.
#
# Rows: (helper-name regex, instructions that must appear in this order,
#        opcodes that must not appear). The first row whose regex fullmatches
# a helper's name applies. "Required" strings are literal SASS with
# placeholders; one without a space is compared with the opcode (first token,
# predicate dropped), one with a space with the whole instruction, registers
# written as R (e.g. "S2R R, SR_LANEID"). "Forbidden" entries are regexes
# matched against the start of the opcode.
#   {W}  width: u32/f32/bf16x2 "", u64 ".64", v4* ".128"
#   {S}  scope of a memory op: cta "SM", gpu "GPU", sys "SYS"
#   {B}  scope of a MEMBAR: cta "CTA", gpu "GPU", sys "SYS"
#   {OP} atom op: add "ADD", exch "EXCH", cas "CAS"
#   {MT} multimem type: f32 "F32", bf16x2 "BF16x2", f16x2 "F16x2",
#        v4_f32 "F32x4", v4_bf16x2 "BF16x8"
#   {ACC} multimem accumulator: default "ADD", acc_f32 "F32ADD"
# The kernels' own result store (STG.E{W}, weak) follows loads and atomics.
# ---------------------------------------------------------------------------
_SC = r"(?P<s>cta|gpu|sys)"
_T = r"(?P<t>u32|u64|v4)"
_NO_FENCE = [r"MEMBAR", r"CCTL", r"FENCE", r"ERRBAR"]
SASS_EXPECT: list[tuple[str, list[str], list[str]]] = [
    # loads
    (rf"ld_weak_global_{_T}", ["LDG.E{W}"], [r"LDG\..*(STRONG|CONSTANT|NA)", *_NO_FENCE]),
    (rf"ld_volatile_global_{_T}", ["LDG.E{W}.STRONG.SYS"], [*_NO_FENCE]),
    (rf"ld_relaxed_{_SC}_global_{_T}", ["LDG.E{W}.STRONG.{S}"], [*_NO_FENCE]),
    (rf"ld_acquire_cta_global_{_T}", ["LDG.E{W}.STRONG.SM"], [r"MEMBAR", r"FENCE"]),
    (rf"ld_acquire_(?P<s>gpu|sys)_global_{_T}", ["LDG.E{W}.STRONG.{S}", "CCTL.IVALL"],
     [r"MEMBAR", r"FENCE"]),
    (rf"ld_nc_global_{_T}", ["LDG.E{W}.CONSTANT"], [r"LDG\..*STRONG", *_NO_FENCE]),
    (rf"ld_nc_na_global_{_T}", ["LDG.E.NA{W}.CONSTANT"], [r"LDG\..*STRONG", *_NO_FENCE]),
    (rf"ld_weak_na_global_{_T}", ["LDG.E.NA{W}"], [r"LDG\..*(STRONG|CONSTANT)", *_NO_FENCE]),
    # stores
    (rf"st_weak_global_{_T}", ["STG.E{W}"], [r"STG\..*(STRONG|NA)", *_NO_FENCE]),
    (rf"st_volatile_global_{_T}", ["STG.E{W}.STRONG.SYS"], [*_NO_FENCE]),
    (rf"st_relaxed_{_SC}_global_{_T}", ["STG.E{W}.STRONG.{S}"], [*_NO_FENCE]),
    (rf"st_release_{_SC}_global_{_T}", ["MEMBAR.ALL.{B}", "STG.E{W}.STRONG.{S}"],
     [r"CCTL", r"MEMBAR\.SC"]),
    (rf"st_na_global_{_T}", ["STG.E.NA{W}"], [r"STG\..*STRONG", *_NO_FENCE]),
    # atomics
    (rf"atom_(?P<op>add|exch|cas)_relaxed_{_SC}_global_{_T}",
     ["ATOMG.E.{OP}{W}.STRONG.{S}"], [*_NO_FENCE]),
    (rf"atom_(?P<op>add|exch|cas)_acquire_{_SC}_global_{_T}",
     ["ATOMG.E.{OP}{W}.STRONG.{S}", "CCTL.IVALL"], [r"MEMBAR"]),
    (rf"atom_(?P<op>add|exch|cas)_release_{_SC}_global_{_T}",
     ["MEMBAR.ALL.{B}", "ATOMG.E.{OP}{W}.STRONG.{S}"], [r"CCTL", r"MEMBAR\.SC"]),
    (rf"atom_(?P<op>add|exch|cas)_acq_rel_{_SC}_global_{_T}",
     ["MEMBAR.ALL.{B}", "ATOMG.E.{OP}{W}.STRONG.{S}", "CCTL.IVALL"], [r"MEMBAR\.SC"]),
    # reductions: REDG, never an ATOMG with a result
    (rf"red_add_relaxed_{_SC}_global_{_T}", ["REDG.E.ADD{W}.STRONG.{S}"],
     [r"ATOMG", *_NO_FENCE]),
    (rf"red_add_release_{_SC}_global_{_T}", ["MEMBAR.ALL.{B}", "REDG.E.ADD{W}.STRONG.{S}"],
     [r"ATOMG", r"CCTL", r"MEMBAR\.SC"]),
    # fences
    (r"fence_acq_rel_cta", ["MEMBAR.ALL.CTA"], [r"MEMBAR\.SC", r"CCTL"]),
    (rf"fence_acq_rel_{_SC}", ["MEMBAR.ALL.{B}", "CCTL.IVALL"], [r"MEMBAR\.SC"]),
    (r"fence_sc_cta", ["MEMBAR.SC.CTA"], [r"MEMBAR\.ALL", r"CCTL"]),
    (rf"fence_sc_{_SC}", ["MEMBAR.SC.{B}", "CCTL.IVALL"], [r"MEMBAR\.ALL"]),
    (r"fence_proxy_async_shared_cta", ["FENCE.VIEW.ASYNC.S"], [r"MEMBAR\.(SC|ALL\.(GPU|SYS))"]),
    # warp, timer
    (r"warp_any_sync", ["VOTE.ANY"], []),
    (r"warp_all_sync", ["VOTE.ALL"], []),
    (r"elect_one_sync", ["ELECT"], [r"S2R"]),  # the real instruction, not a lane==0 fallback
    (r"lane_id", ["S2R R, SR_LANEID"], []),
    (r"warp_id", ["S2R R, SR_TID.X"], []),
    (r"warpgroup_id", ["S2R R, SR_TID.X", "SHFL.IDX"], []),  # lane 0's value: warp-uniform to the compiler
    (r"globaltimer_ns", ["CS2R R, SR_GLOBALTIMERLO"], []),
    # multimem (compiled only, never run)
    (r"multimem_ld_reduce_add_relaxed_sys_(?P<acc>acc_f32_)?(?P<mt>f32|bf16x2|f16x2|v4_f32|v4_bf16x2)",
     ["LDGMC.E.{ACC}.{MT}.RN.STRONG.SYS"], [*_NO_FENCE]),
    (r"multimem_st_relaxed_sys_(?P<t>f32|bf16x2|v4_f32|v4_bf16x2)", ["STG.E{W}.STRONG.SYS"],
     [*_NO_FENCE]),
    (r"multimem_red_add_relaxed_sys_u32", ["REDG.E.ADD.STRONG.SYS"], [r"ATOMG", *_NO_FENCE]),
    (r"multimem_red_add_release_sys_u32", ["MEMBAR.ALL.SYS", "REDG.E.ADD.STRONG.SYS"],
     [r"ATOMG", r"CCTL"]),
]

_WIDTH = {"u32": "", "f32": "", "bf16x2": "", "u64": ".64", "v4": ".128",
          "v4_f32": ".128", "v4_bf16x2": ".128"}
_MEM_SCOPE = {"cta": "SM", "gpu": "GPU", "sys": "SYS"}
_BAR_SCOPE = {"cta": "CTA", "gpu": "GPU", "sys": "SYS"}
_MM_TYPE = {"f32": "F32", "bf16x2": "BF16x2", "f16x2": "F16x2", "v4_f32": "F32x4",
            "v4_bf16x2": "BF16x8"}

# ---------------------------------------------------------------------------
# Parsing the header
# ---------------------------------------------------------------------------
_NAME = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")


def table_helpers(text: str) -> list[str]:
    """Names in the @helpers-begin/@helpers-end table (text after each 'label:')."""
    m = re.search(r"@helpers-begin\n(.*?)@helpers-end", text, re.S)
    assert m, f"{HEADER.name}: no @helpers-begin ... @helpers-end table"
    names: list[str] = []
    for line in m.group(1).splitlines():
        names += _NAME.findall(line.lstrip("/ ").split(":", 1)[-1])
    return names


def defined_helpers(text: str) -> list[str]:
    """Helpers the header defines: TSGEN_*(name, "ptx") stamps and hand-written ones."""
    stamped = re.findall(r"^\s*TSGEN_[A-Z0-9_]+\(\s*([a-z]\w*)\s*,", text, re.M)
    written = re.findall(r"__forceinline__\s+[\w:]+\s+([a-z]\w*)\s*\(", text)
    return stamped + written


HEADER_TEXT = HEADER.read_text()
HELPERS = table_helpers(HEADER_TEXT)

# ---------------------------------------------------------------------------
# The test source: one kernel per helper. A small template harness deduces
# each helper's signature: pointer parameters get `p`, value parameters come
# from a struct passed by value (kernel-parameter constant bank, so no extra
# global loads), and a non-void result is stored to `out`.
# ---------------------------------------------------------------------------
HARNESS = r"""
#include "tsgen/ptx.cuh"
using namespace tsgen::ptx;

struct tsgen_test_vals { uint4 v4; float4 f4; unsigned long long u64; float f32; };

static __device__ __forceinline__ void tsgen_test_pick(const tsgen_test_vals& v, void*, uint4& a) { a = v.v4; }
static __device__ __forceinline__ void tsgen_test_pick(const tsgen_test_vals& v, void*, float4& a) { a = v.f4; }
static __device__ __forceinline__ void tsgen_test_pick(const tsgen_test_vals& v, void*, float& a) { a = v.f32; }
template <typename A>
static __device__ __forceinline__ void tsgen_test_pick(const tsgen_test_vals& v, void*, A& a) { a = (A)v.u64; }
template <typename A>
static __device__ __forceinline__ void tsgen_test_pick(const tsgen_test_vals&, void* p, A*& a) { a = (A*)p; }

template <typename A>
static __device__ __forceinline__ A tsgen_test_arg(const tsgen_test_vals& v, void* p) {
  A a;
  tsgen_test_pick(v, p, a);
  return a;
}

template <typename R, typename... A>
struct tsgen_test_call {
  static __device__ __forceinline__ void run(R (*f)(A...), void* p, const tsgen_test_vals& v, void* out) {
    *(R*)out = f(tsgen_test_arg<A>(v, p)...);
  }
};
template <typename... A>
struct tsgen_test_call<void, A...> {
  static __device__ __forceinline__ void run(void (*f)(A...), void* p, const tsgen_test_vals& v, void*) {
    f(tsgen_test_arg<A>(v, p)...);
  }
};
template <typename R, typename... A>
static __device__ __forceinline__ void tsgen_test_invoke(R (*f)(A...), void* p, const tsgen_test_vals& v, void* out) {
  tsgen_test_call<R, A...>::run(f, p, v, out);
}

"""


def kernels_source(helpers: list[str]) -> str:
    return HARNESS + "".join(
        f'extern "C" __global__ void k_{h}(void* p, tsgen_test_vals v, void* out) '
        f"{{ tsgen_test_invoke(&{h}, p, v, out); }}\n"
        for h in helpers
    )


def nvcc_cubin(src: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [str(NVCC), "-cubin", *gencode_flags(ARCH), "-I", str(INCLUDE_DIR), "-o", str(out),
           str(src)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def parse_sass(dump: str) -> dict[str, list[str]]:
    """{kernel name: [instruction text, predicate and NOPs dropped]} from cuobjdump --dump-sass."""
    kernels: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in dump.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = kernels.setdefault(m.group(1), [])
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([^;]*?)\s*;", line)
        if m and current is not None and m.group(1) != "NOP":
            current.append(m.group(1))
    return kernels


def _normalize(ins: str) -> str:
    return re.sub(r"\bU?R\d+\b", "R", ins)


def expectation(helper: str) -> tuple[list[str], list[str]]:
    for pattern, required, forbidden in SASS_EXPECT:
        m = re.fullmatch(pattern, helper)
        if not m:
            continue
        g = m.groupdict()
        subs = {
            "W": _WIDTH.get(g.get("t") or "", ""),
            "S": _MEM_SCOPE.get(g.get("s") or "", ""),
            "B": _BAR_SCOPE.get(g.get("s") or "", ""),
            "OP": (g.get("op") or "").upper(),
            "MT": _MM_TYPE.get(g.get("mt") or "", ""),
            "ACC": "F32ADD" if g.get("acc") else "ADD",
        }
        return [r.format(**subs) for r in required], forbidden
    raise AssertionError(
        f"no SASS_EXPECT row matches helper {helper!r}: add one to {Path(__file__).name}"
    )


def check_kernel(helper: str, instructions: list[str]) -> list[str]:
    """Problems with one kernel's SASS (empty if it is as expected)."""
    required, forbidden = expectation(helper)
    problems = []
    opcodes = [i.split()[0] if i.split() else "" for i in instructions]
    texts = [_normalize(i) for i in instructions]
    pos = 0
    for want in required:
        seq = texts if " " in want else opcodes
        try:
            pos = seq.index(want, pos) + 1
        except ValueError:
            problems.append(f"missing {want!r} (in order {required})")
    for bad in forbidden:
        hits = [op for op in opcodes if re.match(bad, op)]
        if hits:
            problems.append(f"unexpected {hits} (forbidden {bad!r})")
    if any(op.startswith("CALL") for op in opcodes):
        problems.append("helper was not inlined (CALL in SASS)")
    if any(op.startswith(("LDL", "STL")) for op in opcodes):
        problems.append("local memory (LDL/STL) in SASS")
    return problems


# ---------------------------------------------------------------------------
# Fixtures: one nvcc call, one cuobjdump call
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def build(tmp_path_factory):
    d = tmp_path_factory.mktemp("ptx_helpers")
    src = d / "ptx_helpers.cu"
    src.write_text(kernels_source(HELPERS))
    cubin = d / "ptx_helpers.cubin"
    proc = nvcc_cubin(src, cubin)
    return proc, cubin


@pytest.fixture(scope="module")
def sass(build):
    proc, cubin = build
    if proc.returncode != 0:  # reported once, by test_ptxas_assembles_everything
        pytest.skip("nvcc failed, no SASS to check (see test_ptxas_assembles_everything)")
    try:
        cuobjdump = find_cuobjdump()
        nvdisasm = find_tool("nvdisasm")  # cuobjdump --dump-sass runs nvdisasm
    except ToolchainError as exc:
        pytest.skip(f"cannot disassemble (pip install nvidia-cuda-cuobjdump "
                    f"nvidia-cuda-nvdisasm): {exc}")
    env = dict(os.environ)
    env["NVDISASM_PATH"] = str(nvdisasm.parent)
    env["PATH"] = f"{nvdisasm.parent}{os.pathsep}{env.get('PATH', '')}"
    dump = subprocess.run([str(cuobjdump), "--dump-sass", str(cubin)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert dump.returncode == 0, f"cuobjdump --dump-sass failed:\n{dump.stderr}"
    return parse_sass(dump.stdout)


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------
def test_table_matches_definitions():
    table = HELPERS
    dupes = sorted({h for h in table if table.count(h) > 1})
    assert not dupes, f"helpers listed twice in the table: {dupes}"
    defined = defined_helpers(HEADER_TEXT)
    dupes = sorted({h for h in defined if defined.count(h) > 1})
    assert not dupes, f"helpers defined twice: {dupes}"
    untabled = sorted(set(defined) - set(table))
    assert not untabled, f"defined but missing from the @helpers table: {untabled}"
    undefined = sorted(set(table) - set(defined))
    assert not undefined, f"in the @helpers table but not defined: {undefined}"


def test_required_helpers_present():
    missing = [h for h in REQUIRED_HELPERS if h not in HELPERS]
    assert not missing, f"required helpers missing from {HEADER.name}: {missing}"


def test_no_unscoped_strong_names():
    """Every strong (non-weak, non-volatile, non-nc) ld/st/atom/red/fence names its scope."""
    strong = re.compile(r"(?:ld|st|atom_\w+?|red_\w+?|fence)_(relaxed|acquire|release|acq_rel|sc)_"
                        r"(?!cta|gpu|sys)")
    bad = [h for h in HELPERS if strong.match(h)]
    assert not bad, f"strong helpers without a scope in the name: {bad}"


def test_every_helper_has_a_sass_expectation():
    for h in HELPERS:
        expectation(h)  # raises with a message naming the helper


@pytest.mark.compile
def test_ptxas_assembles_everything(build):
    proc, cubin = build
    assert proc.returncode == 0, f"nvcc/ptxas failed:\n{proc.stderr}"
    assert cubin.is_file() and cubin.stat().st_size > 0
    noise = [l for l in (proc.stdout + proc.stderr).splitlines()
             if re.search(r"error|warning", l, re.I)]
    assert not noise, "ptxas/nvcc reported:\n" + "\n".join(noise)


@pytest.mark.compile
def test_one_kernel_per_helper(sass):
    assert sorted(sass) == sorted(f"k_{h}" for h in HELPERS)


@pytest.mark.compile
@pytest.mark.parametrize("helper", HELPERS)
def test_sass(sass, helper):
    instructions = sass[f"k_{helper}"]
    problems = check_kernel(helper, instructions)
    assert not problems, f"{helper}:\n  " + "\n  ".join(problems) + "\nSASS:\n  " + \
        "\n  ".join(instructions)


@pytest.mark.compile
def test_header_builds_for_host_and_pre_sm90(tmp_path):
    """Generated sources are full .cu files: the header must also pass the host
    compiler (-Wall -Wextra, silent) and an sm_80 device pass, where
    elect_one_sync falls back to lane 0 and multimem is compiled out."""
    src = tmp_path / "host.cu"
    src.write_text(r"""
#include "tsgen/ptx.cuh"
using namespace tsgen::ptx;
extern "C" __global__ void k(uint64_t* flag, uint4* dst, const uint4* src, void* mc, uint32_t* out) {
  if (elect_one_sync()) out[0] = lane_id() + warp_id();
  st_weak_global_v4(dst, ld_nc_na_global_v4(src));
  st_release_sys_global_u64(flag, ld_acquire_sys_global_u64(flag) + 1);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  multimem_st_relaxed_sys_v4_f32(mc, multimem_ld_reduce_add_relaxed_sys_v4_f32(mc));
#endif
}
int main() { return 0; }
""")
    cmd = [str(NVCC), "-c", *gencode_flags("sm_80"), *gencode_flags(ARCH), "-I",
           str(INCLUDE_DIR), "-Xcompiler", "-Wall,-Wextra", "-o", str(tmp_path / "host.o"),
           str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not (proc.stdout + proc.stderr).strip(), proc.stdout + proc.stderr


# Forms that must not assemble. Each snippet is a well-formed kernel apart
# from the one bad PTX instruction; `reason` must appear in ptxas' message,
# so the failure is for that instruction and not something else.
BAD_FORMS = {
    "ld_weak_with_scope": ("ld.weak.gpu.global.u32 %0, [%1];",
                           r"Modifier '\.weak' cannot be combined with modifier '\.gpu'"),
    "atom_load": ("atom.acquire.gpu.global.load.u32 %0, [%1];", r"Unknown modifier '\.load'"),
}


@pytest.mark.compile
@pytest.mark.parametrize("form", sorted(BAD_FORMS))
def test_bad_form_is_rejected(tmp_path, form):
    ptx, reason = BAD_FORMS[form]
    src = tmp_path / f"{form}.cu"
    src.write_text(
        '#include <stdint.h>\n'
        'extern "C" __global__ void k(const uint32_t* p, uint32_t* out) {\n'
        f'  uint32_t v;\n  asm volatile("{ptx}" : "=r"(v) : "l"(p) : "memory");\n'
        '  *out = v;\n}\n'
    )
    proc = nvcc_cubin(src, tmp_path / f"{form}.cubin")
    assert proc.returncode != 0, f"{ptx!r} assembled, but must not"
    assert "ptxas" in proc.stderr and re.search(reason, proc.stderr), proc.stderr
