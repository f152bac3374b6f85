"""The hand-written CUDA library, templates/include/tsgen/ (docs/design/headers.md): each
header has its include guard and includes what it uses, so it compiles alone; the one-file
form (tsgen.headers.amalgamate) inlines each header once, after the headers it includes."""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import ROOT, compile_test, missing_tool
from tsgen.headers import amalgamate, closure, header_names, include_dir, include_flags, library_digest
from tsgen.toolchain import NVCC_FLAGS, find_device_lib, find_nvcc, gencode_flags

HEADERS = header_names()
NO_NVCC = missing_tool(find_nvcc)
NO_NVSHMEM = missing_tool(lambda: find_device_lib("nvshmem"))
needs_nvcc = compile_test(NO_NVCC and f"nvcc not found: {NO_NVCC}")


def test_the_library_is_every_header_under_include_tsgen():
    assert include_dir() == ROOT / "templates" / "include"
    assert len(HEADERS) == 13 and "tsgen/ptx.cuh" in HEADERS and "tsgen/plan.cuh" in HEADERS
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


@needs_nvcc
@pytest.mark.parametrize("name", HEADERS)
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
