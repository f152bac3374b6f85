"""The hand-written CUDA library, templates/include/tsgen/ (docs/design/headers.md): each
header has its include guard and includes what it uses, so it compiles alone; the one-file
form (tsgen.headers.amalgamate) inlines each header once, after the headers it includes."""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import ROOT, compile_test, exhaustive, missing_tool, representative, run_cli
from tsgen.headers import amalgamate, closure, header_names, include_dir, include_flags, includes, library_digest
from tsgen.toolchain import NVCC_FLAGS, find_cuobjdump, find_device_lib, find_nvcc, gencode_flags

HEADERS = header_names()
NO_NVCC = missing_tool(find_nvcc)
NO_NVSHMEM = missing_tool(lambda: find_device_lib("nvshmem"))
NO_CUOBJDUMP = missing_tool(find_cuobjdump)
needs_nvcc = compile_test(NO_NVCC and f"nvcc not found: {NO_NVCC}")
needs_sass = compile_test((NO_NVCC or NO_CUOBJDUMP) and f"needs nvcc and cuobjdump: {NO_NVCC or NO_CUOBJDUMP}")


def test_the_library_is_every_header_under_include_tsgen():
    assert include_dir() == ROOT / "templates" / "include"
    assert len(HEADERS) == 15 and "tsgen/ptx.cuh" in HEADERS and "tsgen/plan.cuh" in HEADERS
    assert sorted(p.name for p in include_dir().iterdir()) == ["tsgen"]  # no header outside the layout


@pytest.mark.parametrize("name", HEADERS)
def test_header_has_its_guard_and_includes_only_library_headers(name):
    """`#ifndef TSGEN_<NAME>_CUH` / `#define` first (after the opening comment), `#endif  // ...`
    last; every `#include "..."` names a header of the library."""
    lines = (include_dir() / name).read_text().rstrip("\n").split("\n")
    code = [line for line in lines if not line.startswith("//")]
    guard = "TSGEN_" + name.removeprefix("tsgen/").removesuffix(".cuh").upper() + "_CUH"
    assert code[:2] == [f"#ifndef {guard}", f"#define {guard}"], name
    assert lines[-1] == f"#endif  // {guard}", name
    quoted = re.findall(r'^#include "([^"]+)"', "\n".join(lines), re.M)
    assert set(quoted) <= set(HEADERS) and name not in quoted, (name, quoted)


# By default the base (ptx), the one most sources include after it (plan) and the two of the longest chains
# (cp: attention, fused, gemm; attention_bwd_wgmma: attention, attention_bwd); every other header is `exhaustive`.
ALONE_KEEP = ("tsgen/ptx.cuh", "tsgen/plan.cuh", "tsgen/cp.cuh", "tsgen/attention_bwd_wgmma.cuh")


@needs_nvcc
@pytest.mark.parametrize("name", representative(HEADERS, ALONE_KEEP))
def test_header_compiles_alone(tmp_path, name):
    """A translation unit of one line, `#include "tsgen/X.cuh"`, compiles for sm_90a with tsgen's
    own flags (warnings are errors): the header includes everything it uses. The macros a
    generated source defines before its includes (TSGEN_TIMEOUT_NS, the plan's limits) have
    defaults; tsgen/nvshmem.cuh needs NVSHMEM's headers."""
    flags = [f for f in NVCC_FLAGS if f not in ("-Xptxas", "-v")] + include_flags()
    if name == "tsgen/nvshmem.cuh":
        if NO_NVSHMEM:
            pytest.skip(f"tsgen/nvshmem.cuh includes <nvshmem.h>: {NO_NVSHMEM}")
        flags += [f"-I{find_device_lib('nvshmem').include}", "-rdc=true"]
    tu = tmp_path / "one.cu"
    tu.write_text(f'#include "{name}"\n')
    proc = subprocess.run([str(find_nvcc()), "-c", *gencode_flags("sm_90a"), *flags, "-o", str(tmp_path / "one.o"),
                           str(tu)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def _library(root, **headers):
    """A library folder under `root`: tsgen/NAME.cuh holding each text."""
    (root / "tsgen").mkdir(parents=True)
    for name, text in headers.items():
        (root / "tsgen" / f"{name}.cuh").write_text(text)
    return root


def test_amalgamate_inlines_each_header_once_after_those_it_includes(tmp_path):
    root = _library(tmp_path, a='// a\n#include "tsgen/b.cuh"\nint a;\n', b="int b;\n",
                    c='#include "tsgen/a.cuh"\n#include "tsgen/b.cuh"\nint c;\n')
    text = '// top\n#include <stdint.h>\n#include "tsgen/c.cuh"\n#include "tsgen/b.cuh"\nint main;\n'
    one = amalgamate(text, root)
    inlined = re.findall(r"^// Inlined from templates/include/(\S+)$", one, re.M)
    assert inlined == ["tsgen/b.cuh", "tsgen/a.cuh", "tsgen/c.cuh"] == closure(text, root)
    code = [line for line in one.split("\n") if line and not line.startswith("//")]
    assert code == ["#include <stdint.h>", "int b;", "int a;", "int c;", "int main;"]
    assert not re.search(r'^#include "', one, re.M)  # every later include is a comment now
    assert amalgamate(text, root) == one  # deterministic
    assert amalgamate("int x;\n", root) == "int x;\n"  # nothing to inline: the text as it was


def test_amalgamate_refuses_a_cycle_and_a_missing_header(tmp_path):
    root = _library(tmp_path, a='#include "tsgen/b.cuh"\n', b='#include "tsgen/a.cuh"\n')
    with pytest.raises(ValueError, match=r"tsgen/a.cuh: includes itself back \(tsgen/a.cuh -> tsgen/b.cuh -> tsgen/a.cuh\)"):
        amalgamate('#include "tsgen/a.cuh"\n', root)
    with pytest.raises(ValueError, match='#include "tsgen/zz.cuh": no such header'):
        amalgamate('#include "tsgen/zz.cuh"\n', root)


def test_library_digest_covers_exactly_the_headers_a_source_includes(tmp_path):
    """The compile cache's key: a change to a header a source includes (directly or through
    another) changes its digest; a change to any other header does not."""
    root = _library(tmp_path, a='#include "tsgen/b.cuh"\n', b="int b;\n", c="int c;\n")
    text = '#include "tsgen/a.cuh"\n'
    before = library_digest(text, root)
    (root / "tsgen" / "c.cuh").write_text("int c2;\n")
    assert library_digest(text, root) == before
    (root / "tsgen" / "b.cuh").write_text("int b2;\n")
    assert library_digest(text, root) != before
    assert library_digest("int x;\n", root) != before



@pytest.mark.parametrize("spelling", ['#include "tsgen/b.cuh"  // the tables', '  #include "tsgen/b.cuh"',
                                      '# include "tsgen/b.cuh"', '#include "tsgen/b.cuh" /* why */'])
def test_every_spelling_of_an_include_reaches_the_digest_and_the_one_file_form(tmp_path, spelling):
    """nvcc includes the header however the line is spelled: the cache key must change with it, and
    the one-file form must inline it (else a header edit reuses a stale binary, and the vendored
    file still needs the include path)."""
    root = _library(tmp_path, a=spelling + "\nint a;\n", b="int b;\n")
    text = '#include "tsgen/a.cuh"\n'
    assert closure(text, root) == ["tsgen/b.cuh", "tsgen/a.cuh"]
    before = library_digest(text, root)
    (root / "tsgen" / "b.cuh").write_text("int b2;\n")
    assert library_digest(text, root) != before
    code = [line for line in amalgamate(text, root).split("\n") if line and not line.startswith("//")]
    assert code == ["int b2;", "int a;"]

# ---------------------------------------------------------------------------
# Thin generated sources and the one-file form (docs/design/headers.md)
# ---------------------------------------------------------------------------

GENERATED = sorted((ROOT / "generated").glob("*.cu"))
SPEC_NAMES = sorted(p.stem for p in (ROOT / "specs").glob("*.yaml"))


def _one_per_include_list(names: list[str]) -> list:
    """`names`, each a pytest case: the first of each list of library headers a generated source
    includes (in its order) runs by default, the others are `exhaustive` (the amalgamation inlines
    what those lines name: specs with the same list are inlined alike)."""
    seen, cases = set(), []
    for name in names:
        source = ROOT / "generated" / f"{name}.cu"
        key = tuple(re.findall(r'^#include "([^"]+)"', source.read_text(), re.M)) if source.is_file() else name
        cases.append(name if key not in seen else exhaustive(name, id=name))
        seen.add(key)
    return cases


def _amalgamated(name: str) -> str:
    from tsgen.render import render
    from tsgen.spec import load_spec

    return render(load_spec(ROOT / "specs" / f"{name}.yaml"), ROOT, amalgamated=True).source


def test_generated_sources_include_the_library_and_hold_none_of_it():
    """generated/NAME.cu includes library headers and inlines none: no header's guard or first
    line is in it. The folder stays under 5 MiB (it was 11 MB with the headers pasted in)."""
    firsts = {name: (include_dir() / name).read_text().split("\n", 1)[0] for name in HEADERS}
    for path in GENERATED:
        text = path.read_text()
        assert includes(text) and set(includes(text)) <= set(HEADERS), path.name
        assert "#define TSGEN_PTX_CUH" not in text and "// Inlined from" not in text, path.name
        assert not [n for n, first in firsts.items() if first in text], path.name
    assert sum(p.stat().st_size for p in (ROOT / "generated").iterdir()) <= 5 * 2**20
    # issue 32: the op, not the library, is what a reader meets (plan tables and straight-line code dense)
    assert len((ROOT / "generated" / "allgather.cu").read_text().splitlines()) <= 400


def test_a_header_change_rewrites_no_generated_file(tmp_path, monkeypatch):
    """Every shipped spec renders to the same generated/ with a changed copy of the library (a
    line added to every header): the sources include the headers, so a header fix rewrites no
    generated file. The one-file form does change (it inlines the copy)."""
    import shutil

    from tsgen import headers, render as render_module
    from tsgen.build import render_all

    templates = tmp_path / "templates"
    shutil.copytree(headers.templates_dir(), templates)
    for name in HEADERS:
        path = templates / "include" / name
        path.write_text(path.read_text().replace("namespace tsgen {", "namespace tsgen {\nconstexpr int changed = 1;", 1))
    monkeypatch.setattr(headers, "templates_dir", lambda: templates)
    monkeypatch.setattr(render_module, "templates_dir", lambda: templates)
    render_module.environment.cache_clear()
    try:
        rendered = render_all([ROOT / "specs"], ROOT / "generated")
        assert len(rendered) == len(GENERATED)
        for r in rendered:
            for file, text in r.files().items():
                assert text == (ROOT / "generated" / file).read_text(), file
        assert "constexpr int changed = 1;" in _amalgamated("put_block")
    finally:
        render_module.environment.cache_clear()



def test_build_amalgamate_writes_the_one_file_form(tmp_path):
    """`tsgen build --amalgamate` writes the one-file form with its manifest, byte-identical again
    (a second build writes nothing, --check passes); the thin build of the same spec differs."""
    spec = ROOT / "specs" / "moe.yaml"
    r = run_cli("build", "--amalgamate", spec, "-o", tmp_path / "one")
    assert r.code == 0, r.stderr
    one = (tmp_path / "one" / "moe.cu").read_text()
    assert not includes(one) and one.count("// Inlined from templates/include/tsgen/moe.cuh") == 1
    assert run_cli("build", spec, "-o", tmp_path / "thin").code == 0
    assert (tmp_path / "one" / "moe.json").read_text() == (tmp_path / "thin" / "moe.json").read_text()
    again = run_cli("build", "--amalgamate", spec, "-o", tmp_path / "one")
    assert again.code == 0 and "0 file(s) written" in again.stdout, again.stdout
    assert run_cli("build", "--amalgamate", "--check", spec, "-o", tmp_path / "one").code == 0
    assert run_cli("build", "--check", spec, "-o", tmp_path / "one").code == 1  # the thin form is another file
    assert run_cli("build", "--amalgamate", "--check", spec, "-o", tmp_path / "thin").code == 1
    assert "--amalgamate" in run_cli("build", "--help").stdout


def test_negative_controls_edit_the_one_file_form():
    """A GPU negative control (tests/test_gpu.py) edits the rendered source through
    harness._mutated, which edits its one-file form: an edit of the library's code (put_block's
    tail loop is in tsgen/copy.cuh, not in the thin source) still reaches what is compiled."""
    import test_gpu as gpu
    from tsgen.harness import _mutated, render_to_cache
    from tsgen.spec import load_spec

    for spec, (old, new) in gpu.NEGATIVE_CONTROLS.items():
        cached = render_to_cache(load_spec(ROOT / "specs" / f"{spec}.yaml"))
        edited = _mutated(cached.source, lambda text: text.replace(old, new)).read_text()
        assert new in edited and old not in edited and not includes(edited), spec
    old, _ = gpu.NEGATIVE_CONTROLS["put_block"]
    assert old not in (ROOT / "generated" / "put_block.cu").read_text()


# Op templates whose host code (launcher, prepare) is a C++ template of the library; moe.cu.j2
# still holds its own (issue 32).
HOST_IN_LIBRARY = ["allgather_gemm.cu.j2", "cp_attention.cu.j2", "gemm_reduce_scatter.cu.j2", "grid_gemm.cu.j2",
                   "ce_collective.cu.j2", "../module.cu.j2"]


@pytest.mark.parametrize("template", HOST_IN_LIBRARY)
def test_host_code_lives_in_the_library(template):
    """The template keeps what the spec decides (the op's constants, its kernels' composition and
    the extern "C" entry points) and calls no CUDA runtime function: its launcher and prepare are
    instances of the library's (tsgen::cp::launch, tsgen::fused::allgather_gemm_launch, ...)."""
    text = (ROOT / "templates" / "ops" / template).read_text()
    assert not re.findall(r"\bcuda[A-Z]\w*\(", text), template
    assert "_TRY(" not in text and "<<<" not in text, template

def test_side_streams_are_made_in_one_place():
    """Every launcher's side streams and events ("lanes": tsgen/ce.cuh, fused.cuh, grid.cuh) are
    made by tsgen::make_lanes (tsgen/sync.cuh), which destroys what it made when a creation
    fails; no other header creates a stream or an event."""
    makers = {name for name in HEADERS
              if re.search(r"\bcuda(StreamCreate|EventCreate)\w*\(", (include_dir() / name).read_text())}
    assert makers == {"tsgen/sync.cuh"}
    for name in ("tsgen/ce.cuh", "tsgen/fused.cuh", "tsgen/grid.cuh"):
        assert "tsgen::make_lanes(" in (include_dir() / name).read_text(), name


def _preprocessed(source, tmp_path) -> list[str]:
    """nvcc -E of `source` (tsgen's flags and include path), without line markers and blank lines."""
    from tsgen.manifest import Manifest

    libs = Manifest.load(ROOT / "generated" / f"{source.stem}.json").device_libs
    flags = [f"-I{find_device_lib(n).include}" for n in libs]
    out = tmp_path / f"{source.parent.name}-{source.stem}.ii"
    proc = subprocess.run([str(find_nvcc()), "-E", *gencode_flags("sm_90a"), "-std=c++17", *include_flags(), *flags,
                           "-o", str(out), str(source)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return [line for line in out.read_text().split("\n")
            if line.strip() and not re.match(r"#(line)? \d+", line)]


@needs_nvcc
@pytest.mark.parametrize("name", _one_per_include_list(SPEC_NAMES))
def test_thin_and_one_file_forms_preprocess_alike(tmp_path, name):
    """generated/NAME.cu and its one-file form (`tsgen build --amalgamate`) are the same C++ after
    the preprocessor (line markers left out): the same code, whichever form is compiled. By default
    one spec per list of included headers; the rest are `exhaustive`."""
    from tsgen.manifest import Manifest

    if Manifest.load(ROOT / "generated" / f"{name}.json").device_libs and NO_NVSHMEM:
        pytest.skip(f"includes <nvshmem.h>: {NO_NVSHMEM}")
    (tmp_path / "one").mkdir()
    one = tmp_path / "one" / f"{name}.cu"
    one.write_text(_amalgamated(name))
    assert _preprocessed(ROOT / "generated" / f"{name}.cu", tmp_path) == _preprocessed(one, tmp_path)


def _sass_text(binary) -> dict[str, list[str]]:
    """Function name -> its SASS instructions (cuobjdump), in order: the `.text` of each."""
    from tsgen.toolchain import dump_sass

    out: dict[str, list[str]] = {}
    current = None
    for line in dump_sass(binary).splitlines():
        if m := re.search(r"Function : (\S+)", line):
            current = out.setdefault(m.group(1), [])
        elif current is not None and (m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)):
            current.append(m.group(1))
    return out


# Representative specs: a plan interpreter with straight-line code (allgather), copy-engine host code
# (all_reduce_two_shot_ce), a host-launch module with prepares (moe), the GEMM (gemm_bf16). By default the GEMM
# only (test_thin_and_one_file_forms_preprocess_alike compares one spec per list of headers); the rest `exhaustive`.
SASS_SPECS = ["allgather", "all_reduce_two_shot_ce", "moe", "gemm_bf16"]


@needs_sass
@pytest.mark.parametrize("name", representative(SASS_SPECS, ("gemm_bf16",)))
def test_thin_and_one_file_forms_compile_to_the_same_sass(tmp_path, name):
    """The thin source and the one-file form, each compiled as the runtime loads it, give the
    same SASS, function by function (the thin one is in the cache `tsgen build --compile` fills)."""
    from tsgen.manifest import Manifest
    from tsgen.toolchain import compile_for

    manifest = Manifest.load(ROOT / "generated" / f"{name}.json")
    one = tmp_path / f"{name}.cu"
    one.write_text(_amalgamated(name))
    thin = _sass_text(compile_for(manifest, ROOT / "generated" / f"{name}.cu").output)
    assert thin and any(thin.values())
    assert _sass_text(compile_for(manifest, one).output) == thin


PER_DEVICE = r"""
#include "tsgen/sync.cuh"
#include <stdio.h>
static int calls = 0;
static cudaError_t value(int device, int* out, cudaError_t fail = cudaSuccess) {
  static tsgen::PerDevice<int> kept;
  return kept.get(device, out, [&](int* v) { ++calls; *v = 100 + device; return fail; });
}
int main() {
  int x = 0;
  // an error is not kept: the next call computes again
  if (value(3, &x, cudaErrorInvalidValue) != cudaErrorInvalidValue || calls != 1) return 1;
  if (value(3, &x) != cudaSuccess || x != 103 || calls != 2) return 2;
  if (value(3, &x) != cudaSuccess || x != 103 || calls != 2) return 3;  // kept
  if (value(4, &x) != cudaSuccess || x != 104 || calls != 3) return 4;  // per device
  if (value(70, &x) != cudaSuccess || value(70, &x) != cudaSuccess || x != 170 || calls != 5) return 5;  // past 64
  if (value(-1, &x) != cudaSuccess || value(-1, &x) != cudaSuccess || x != 99 || calls != 7) return 6;
  puts("ok");
  return 0;
}
"""


@needs_nvcc
def test_per_device_keeps_a_value_once_worked_out(tmp_path):
    """tsgen::PerDevice (tsgen/sync.cuh), host code only (no GPU): a value is computed once per device and
    kept; an error is not kept; devices past the first 64, and negative ids, are computed at every call."""
    src = tmp_path / "per_device.cu"
    src.write_text(PER_DEVICE)
    flags = [f for f in NVCC_FLAGS if f not in ("-Xptxas", "-v")] + include_flags()
    exe = tmp_path / "per_device"
    proc = subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *flags, "-o", str(exe), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stdout, run.stderr)
