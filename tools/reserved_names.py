"""Find every name a spec may not take because a generated source already declares it.

A spec's `name` becomes `namespace NAME` at file scope of its source, next to
everything the source includes (CUDA runtime, fp16/bf16, stdio, cuda.h, NVSHMEM,
<atomic>, ...) and everything the inlined tsgen headers declare. This script asks
nvcc: for one shipped spec per op template it appends `namespace X { }` for every
identifier of the preprocessed source to the generated file and runs nvcc's front
end (-cuda, no code generation); each "has already been declared" error is a name
the spec validator must refuse. Object-like macros are refused as they are. The tsgen
headers declare everything inside namespace tsgen, so of theirs only `tsgen` is at file
scope (and refused by its prefix anyway).

    python tools/reserved_names.py           # rewrite tsgen/header_names.py
    python tools/reserved_names.py --check   # exit 1 listing names the validator accepts but nvcc refuses

tests/test_hardening.py runs the check on three of the templates (every include set).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tsgen.ops import get_family  # noqa: E402
from tsgen.render import render  # noqa: E402
from tsgen.spec import load_spec  # noqa: E402
from tsgen.spec_types import name_problem  # noqa: E402
from tsgen.toolchain import find_device_lib, find_nvcc, gencode_flags, nvcc_version  # noqa: E402

_DECLARED = re.compile(r'error: "([A-Za-z_]\w*)" has already been declared in the current scope')


def representatives(only: list[str] | None = None) -> list[Path]:
    """One shipped spec per op template (or the named specs)."""
    if only:
        return [ROOT / "specs" / f"{n}.yaml" for n in only]
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = load_spec(path).model
        seen.setdefault(get_family(spec.op).template_for(spec), path)
    return list(seen.values())


def clashes(spec_path: Path) -> tuple[set[str], set[str]]:
    """(names declared at file scope and namespaces, object-like macros) of the spec's generated source."""
    nvcc = str(find_nvcc())
    rendered = render(load_spec(spec_path), base=ROOT)
    flags = ["-std=c++17", "-x", "cu", *gencode_flags("sm_90a")]
    if rendered.abi.family.device_libs(rendered.abi.spec):
        flags.append(f"-I{find_device_lib('nvshmem').include}")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cu"
        src.write_text(rendered.source)
        run = lambda *args: subprocess.run([nvcc, *flags, *args], capture_output=True, text=True, timeout=600)  # noqa: E731
        macros_text = run("-E", "-Xcompiler", "-dM", "-o", "-", str(src)).stdout
        macros = set(re.findall(r"^#define ([A-Za-z_]\w*)(?=\s|$)", macros_text, re.M))
        body = re.sub(r"^#.*$", "", run("-E", "-o", "-", str(src)).stdout, flags=re.M)
        own = re.compile(re.escape(rendered.name) + r"_w\d")  # the module's own kernels
        candidates = sorted(n for n in set(re.findall(r"\b[A-Za-z_]\w*\b", body)) - macros
                            if not own.match(n) and name_problem(n, header_names=False) is None)
        src.write_text(rendered.source + "".join(f"namespace {n} {{ }}\n" for n in candidates))
        out = run("-cuda", "-Xcudafe", "--error_limit=1000000", "-o", "/dev/null", str(src))
        declared = set(_DECLARED.findall(out.stdout + out.stderr))
    # reopening a namespace is no error, so those come from the text (std, nv, ...), but for the
    # ones nested in namespace tsgen (tsgen::ptx, ...) or in the op's own: a spec's name, at file
    # scope, never meets them
    nested = nested_namespaces(body, {"tsgen", rendered.name})
    return declared | set(re.findall(r"\bnamespace\s+([A-Za-z_]\w*)", body)) - nested - {rendered.name}, macros


_LITERAL = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'')
_NS_TOKEN = re.compile(r"\bnamespace\s+([A-Za-z_]\w*)(?:\s*::\s*\w+)*\s*([{=])|\x01|[{}]")


def nested_namespaces(body: str, owners: set[str]) -> set[str]:
    """Namespaces (and aliases) of preprocessed C++ declared only inside the file-scope
    namespaces `owners`, never elsewhere.
    Braces in string and character literals (asm templates) do not count; extern "C" { }
    blocks keep file scope."""
    text = _LITERAL.sub(" ", re.sub(r'extern\s*"C(?:\+\+)?"\s*\{', "\x01", body))
    inside, outside, stack = set(), set(), []
    for m in _NS_TOKEN.finditer(text):
        if m.group(1):
            scopes = [s for s in stack if s != "extern"]
            (inside if scopes and scopes[0].split()[-1] in owners else outside).add(m.group(1))
            if m.group(2) == "{":
                stack.append("namespace " + m.group(1))
        elif m.group(0) == "\x01":
            stack.append("extern")
        elif m.group(0) == "{":
            stack.append("brace")
        elif stack:
            stack.pop()
    return inside - outside - owners


def main(argv: list[str]) -> int:
    check = "--check" in argv
    names: set[str] = set()
    for path in representatives([a for a in argv if not a.startswith("--")] or None):
        declared, macros = clashes(path)
        names |= {n for n in declared | macros if name_problem(n, header_names=False) is None}
        print(f"{path.name}: {len(declared)} declared, {len(macros)} macros", file=sys.stderr)
    if check:
        missed = sorted(n for n in names if name_problem(n) is None)
        for n in missed:
            print(f"accepted but declared by the generated source: {n}")
        return 1 if missed else 0
    words = sorted(names)
    lines, line = [], ""
    for w in words:
        if len(line) + len(w) + 1 > 96:
            lines.append(line)
            line = ""
        line += (" " if line else "") + w
    lines.append(line)
    text = (
        '"""Names the generated sources declare at file scope (functions, types, variables and\n'
        "object-like macros of the CUDA, C and NVSHMEM headers they include): a spec's name may\n"
        "not be one. Written by tools/reserved_names.py with "
        f"{nvcc_version(find_nvcc())}; do not edit.\"\"\"\n\n"
        'HEADER_NAMES = frozenset("""\n' + "\n".join(lines) + '\n""".split())\n'
    )
    (ROOT / "tsgen" / "header_names.py").write_text(text)
    print(f"tsgen/header_names.py: {len(words)} names", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
