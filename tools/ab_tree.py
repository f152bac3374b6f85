"""Another commit's tsgen beside this checkout's, for A/B runs of a kernel in one device call.

  here:    python tools/ab_tree.py make REV            writes .ab/REV7/ (git-ignored, never committed): REV's
                                                       tsgen/, templates/ and specs/ (git archive) and COMMIT
  device:  (carry ".ab/REV7") the tools build from it: tools/gpu_attention_bwd.py --base-tree .ab/REV7
           --impl shipped,base (impl "base": the same spec changes rendered and compiled by that tree's
           tsgen and templates; the compile cache keys on the headers' contents, so the two never share a
           library)
  here:    python tools/ab_tree.py sass TREE [SOURCE.cu ...]
                                                       each source (default: generated/*.cu) compiled against
                                                       this checkout's headers and TREE's, SASS compared: a
                                                       header change that should not touch a kernel, or that
                                                       should give one already measured, is checked here
                                                       before any GPU runs (prints one line a source; exit 1
                                                       when any differs; a source that needs more than the
                                                       headers, NVSHMEM's, is named and not compared)
  child:   python tools/ab_tree.py build TREE SPEC CHANGES GEN [--render-only]
                                                       in a fresh process whose tsgen is TREE's: load TREE/SPEC,
                                                       apply CHANGES (JSON), render into GEN, compile the
                                                       host-launcher library; prints one line
                                                       "BUILT {manifest, library, softmax_scale, tsgen}"

Why a tree and not a spec parameter: a change inside a header (an instruction order, a load moved) has no
parameter, and two runs on two machines compare worse than one run of both (docs/design/attention.md, the
LSE2 loads moved ahead of the wait: decided across two runs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE_DIRS = ("tsgen", "templates", "specs")


def make(rev: str, dest: Path | None = None) -> Path:
    """DEST (default .ab/<short rev>/) from `git archive` of REV's TREE_DIRS, with COMMIT (the full hash)."""
    full = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                          capture_output=True, text=True, check=True).stdout.strip()
    tree = Path(dest or ROOT / ".ab" / full[:7])
    if tree.exists():  # made before: only if whole (COMMIT is written last) and of this commit
        commit = tree / "COMMIT"
        if commit.is_file() and commit.read_text().strip() == full:
            return tree
        raise FileExistsError(f"{tree} exists but is not a whole tree of {full}: remove it first")
    part = tree.with_name(tree.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", full, *TREE_DIRS], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(part)], input=archive.stdout, check=True)
    (part / "COMMIT").write_text(full + "\n")
    part.rename(tree)  # whole or absent
    return tree


def tree_problem(tree: Path) -> str | None:
    """Why TREE cannot build (no tsgen/ in it), or None: the tools' --base-tree check and build's."""
    if not (Path(tree) / "tsgen" / "__init__.py").is_file():
        return f"{tree}: no tsgen/ here (make one with: python tools/ab_tree.py make REV)"
    return None


def build(tree: Path, spec: str, changes: dict, gen: Path, *, render_only: bool = False,
          timeout: float = 600) -> dict:
    """Spec `spec` (relative to the tree) with `changes`, rendered and compiled by TREE's tsgen in a child process
    (this process has imported the checkout's): {"manifest", "library", "softmax_scale", "tsgen", "commit"}.
    What the child runs is this checkout's _child against the tree's API (load_spec, spec_variant, render,
    compile_source): a tree too old for those, or whose spec schema lacks a key of `changes`, fails with its
    error in the RuntimeError."""
    tree, gen = Path(tree).resolve(), Path(gen).resolve()  # the child runs in the tree: no relative paths
    if problem := tree_problem(tree):
        raise FileNotFoundError(problem)
    cmd = [sys.executable, str(Path(__file__).resolve()), "build", str(tree), spec, json.dumps(changes), str(gen)]
    p = subprocess.run(cmd + (["--render-only"] if render_only else []), capture_output=True, text=True,
                       timeout=timeout, cwd=tree, env={**os.environ, "PYTHONPATH": os.pathsep.join(  # the tree first,
                           [str(tree)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])})  # then the rest
    for line in p.stdout.splitlines():
        if line.startswith("BUILT "):
            out = json.loads(line[6:])
            commit = tree / "COMMIT"
            out["commit"] = commit.read_text().strip() if commit.is_file() else None
            return out
    raise RuntimeError(f"the build in {tree} failed (exit {p.returncode}): {(p.stderr or p.stdout)[-3000:]}")


def _child(tree: str, spec: str, changes: str, gen: str, render_only: bool) -> int:
    sys.path.insert(0, tree)
    import tsgen
    from tsgen.render import render, write_if_different
    from tsgen.spec import load_spec, spec_variant

    where = Path(tsgen.__file__).resolve()
    if Path(tree).resolve() not in where.parents:
        raise SystemExit(f"imported tsgen from {where}, not from {tree}")
    loaded = spec_variant(load_spec(Path(tree) / spec), json.loads(changes))
    rendered = render(loaded, base=Path(tree))
    out = Path(gen)
    for file, text in rendered.files().items():
        write_if_different(out / file, text)
    lib = None
    if not render_only:
        from tsgen.toolchain import compile_source

        lib = str(compile_source(out / f"{rendered.name}.cu", mode="shared").output)
    print("BUILT " + json.dumps({"manifest": str(out / f"{rendered.name}.json"), "library": lib,
                                 "softmax_scale": getattr(loaded.model.params, "softmax_scale", None),  # attention's
                                 "tsgen": str(where)}))
    return 0


def sass_of(source: Path, include: Path, out: Path) -> list[str]:
    """The SASS instructions of SOURCE compiled for sm_90a against the headers under INCLUDE (addresses and
    encodings dropped, so that two builds compare line by line)."""
    if str(ROOT) not in sys.path:  # this checkout's toolchain (the module itself imports no tsgen: _child's must be the tree's)
        sys.path.insert(0, str(ROOT))
    from tsgen.toolchain import dump_sass, find_nvcc, gencode_flags

    subprocess.run([str(find_nvcc()), "-cubin", *gencode_flags("sm_90a"), "-O3", "-std=c++17", "-w", f"-I{include}",
                    "-o", str(out), str(source)], check=True, capture_output=True)
    text = dump_sass(out)
    return [re.sub(r"\s*/\*[^*]*\*/\s*", " ", line).strip() for line in text.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]


def sass_compare(tree: Path, sources: list[Path]) -> int:
    """For each source: "identical", or both instruction counts and the differing lines (difflib)."""
    import difflib
    import tempfile

    differ = 0
    with tempfile.TemporaryDirectory() as tmp:
        for src in sources:
            try:
                here = sass_of(src, ROOT / "templates" / "include", Path(tmp) / "here.cubin")
                there = sass_of(src, Path(tree) / "templates" / "include", Path(tmp) / "there.cubin")
            except subprocess.CalledProcessError as e:  # a source that needs more (NVSHMEM's headers, -rdc)
                error = next((l for l in e.stderr.decode(errors="replace").splitlines() if "error" in l), "")
                print(f"{src.name}: not compared: nvcc failed on it alone ({error.strip()[:160]})")
                continue
            if here == there:
                print(f"{src.name}: identical ({len(here)} instructions)")
                continue
            differ += 1
            changed = sum(1 for d in difflib.ndiff(there, here) if d[:1] in "+-")
            print(f"{src.name}: DIFFERS: {len(there)} -> {len(here)} instructions, {changed} lines changed")
    return 1 if differ else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["sass"] and len(argv) >= 2:
        sources = [Path(a) for a in argv[2:]] or sorted((ROOT / "generated").glob("*.cu"))
        return sass_compare(Path(argv[1]), sources)
    if argv[:1] == ["make"] and len(argv) == 2:
        print(make(argv[1]).relative_to(ROOT))
        return 0
    if argv[:1] == ["build"] and len(argv) in (5, 6):
        return _child(*argv[1:5], render_only=argv[5:] == ["--render-only"])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
