"""tools/ab_tree.py: another commit's tsgen and templates build a kernel beside this checkout's (impl base of
tools/gpu_attention_bwd.py), in a process of its own that imports the tree's tsgen, never this one's."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import compile_test, load_script, missing_tool
from tsgen.toolchain import find_cuobjdump, find_nvcc

ROOT = Path(__file__).resolve().parents[1]
SPEC = "specs/attention_backward_hd128.yaml"


def copy_tree(dest: Path) -> Path:
    for d in ("tsgen", "templates", "specs"):
        shutil.copytree(ROOT / d, dest / d, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_the_tree_renders_with_its_own_tsgen_and_templates(tmp_path, monkeypatch):
    """A marker put into the tree's module template shows in what it renders, and the child says it imported the
    tree's tsgen; this checkout's rendering of the same spec has no marker."""
    ab = load_script(ROOT / "tools" / "ab_tree.py")
    tree = copy_tree(tmp_path / "tree")
    j2 = tree / "templates" / "module.cu.j2"
    j2.write_text("{#- a comment Jinja drops -#}\n// AB-TREE-MARKER\n" + j2.read_text())
    monkeypatch.chdir(tmp_path)  # a relative output folder is the caller's, not the tree's
    out = ab.build(tree, SPEC, {"name": "abt", "params": {"causal": True}}, Path("gen"), render_only=True)
    assert Path(out["manifest"]).is_file() and Path(out["manifest"]).parent == tmp_path / "gen"
    assert Path(out["tsgen"]).resolve().is_relative_to(tree.resolve()), out
    assert out["library"] is None and out["commit"] is None  # a copy: no COMMIT file
    source = (tmp_path / "gen" / "abt.cu").read_text()
    assert "AB-TREE-MARKER" in source and "constexpr int CAUSAL = 1;" in source  # the changes applied
    assert json.loads((tmp_path / "gen" / "abt.json").read_text())["name"] == "abt"
    from tsgen.render import render
    from tsgen.spec import load_spec, spec_variant

    mine = render(spec_variant(load_spec(ROOT / SPEC), {"name": "abt"})).files()["abt.cu"]
    assert "AB-TREE-MARKER" not in mine


def test_a_tree_without_tsgen_is_refused(tmp_path):
    ab = load_script(ROOT / "tools" / "ab_tree.py")
    with pytest.raises(FileNotFoundError, match="no tsgen/ here"):
        ab.build(tmp_path, SPEC, {}, tmp_path / "gen")


@pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None, reason="not a git checkout")
def test_make_archives_a_commit(tmp_path):
    ab = load_script(ROOT / "tools" / "ab_tree.py")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    tree = ab.make("HEAD", dest=tmp_path / "t")
    assert (tree / "COMMIT").read_text().strip() == head and not (tmp_path / "t.part").exists()
    assert ab.make("HEAD", dest=tmp_path / "t") == tree  # whole already: kept
    (tree / "COMMIT").unlink()  # as an interrupted extraction leaves it
    with pytest.raises(FileExistsError, match="not a whole tree"):
        ab.make("HEAD", dest=tmp_path / "t")
    assert (tree / "tsgen" / "__init__.py").is_file() and (tree / "templates" / "module.cu.j2").is_file()
    assert (tree / SPEC).is_file() and not (tree / "tests").exists()


def test_the_bwd_tool_builds_impl_base_from_the_tree(tmp_path, monkeypatch):
    """--impl base needs --base-tree; with it, impl base is the shipped impl's changes built by the tree (the
    report names the tree's commit)."""
    tool = load_script(ROOT / "tools" / "gpu_attention_bwd.py")
    monkeypatch.setattr(tool.sys, "argv", ["gpu_attention_bwd.py", str(tmp_path), "--impl", "shipped,base"])
    with pytest.raises(SystemExit):
        tool.main()
    import ab_tree

    calls = []
    monkeypatch.setattr(ab_tree, "build", lambda tree, spec, changes, gen: calls.append((tree, spec, changes, gen))
                        or {"manifest": "m", "library": "l", "softmax_scale": None, "commit": "c0ffee"})
    monkeypatch.setattr(tool, "BASE_TREE", tmp_path)
    assert tool.build(tmp_path, "hd64_causal_kv32", "base")["commit"] == "c0ffee"
    ((tree, spec, changes, gen),) = calls
    assert tree == tmp_path and spec == SPEC and gen == tmp_path / "build" / "base"
    assert changes["name"] == "attbwd_hd64_causal_kv32_base" and changes["params"]["head_dim"] == 64
    assert {k: changes["params"][k] for k in tool.impl_changes("shipped", 64)["params"]} == \
        tool.impl_changes("shipped", 64)["params"]
    text = tool.markdown({"device": "d", "date": "t", "command": "c", "checks": {}, "base": "commit c0ffee"})
    assert "backward spec of commit c0ffee" in text


def test_the_ab_script_names_what_the_tool_takes():
    """tools/gpu_bwd_ab.sh (a device call): bash accepts it; its default rows are bench rows of the tool, its
    tool arguments ones the tool's parser knows (a typo there would cost a device call)."""
    tool = load_script(ROOT / "tools" / "gpu_attention_bwd.py")
    path = ROOT / "tools" / "gpu_bwd_ab.sh"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    text = path.read_text()
    rows = re.search(r"ROWS=\$\{ROWS:-(\S+)\}", text).group(1).split(",")
    assert all(v in tool.BENCH_VARIANTS and int(n) in tool.BENCH_SEQS for v, n in (r.split(":") for r in rows)), rows
    source = (ROOT / "tools" / "gpu_attention_bwd.py").read_text()
    for flag in ("--base-tree", "--impl", "--rounds", "--bench-shapes"):
        assert flag in text and f'"{flag}"' in source, flag
    impls = re.search(r'--impl "\$\{IMPLS:-(\S+)\}"', text).group(1).split(",")  # the default impls
    assert impls == ["base", "shipped"]
    assert all(i in tool.IMPLS or tool.base_of(i) for i in impls), impls
    assert all(tool.base_of(i) in tool.IMPLS for i in tool.BASE_IMPLS), "every base_X names an impl of this checkout"


@compile_test(missing_tool(find_nvcc) and f"nvcc not found: {missing_tool(find_nvcc)}")
def test_the_tree_compiles_its_own_library(tmp_path, monkeypatch):
    """The child compiles too (the host-launcher library, into the compile cache): a tree whose header differs
    by one comment gets a library of its own, never this checkout's build of the same spec from the cache."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    ab = load_script(ROOT / "tools" / "ab_tree.py")
    tree = copy_tree(tmp_path / "tree")
    sync = tree / "templates" / "include" / "tsgen" / "sync.cuh"
    sync.write_text(sync.read_text() + "\n// the tree's own header\n")
    spec = "specs/simple_shift.yaml"
    theirs = ab.build(tree, spec, {"name": "abt"}, tmp_path / "gen_tree")
    from tsgen.spec import load_spec, spec_variant
    from tsgen.toolchain import compile_source
    from conftest import rendered_source

    (tmp_path / "gen_mine").mkdir()
    mine = compile_source(rendered_source(spec_variant(load_spec(ROOT / spec), {"name": "abt"}), tmp_path / "gen_mine"),
                          mode="shared").output
    assert Path(theirs["library"]).is_file() and Path(mine).is_file()
    assert Path(theirs["library"]).resolve() != Path(mine).resolve(), "one library for two trees' headers"


NO_SASS = missing_tool(find_nvcc) or missing_tool(find_cuobjdump)


@compile_test(NO_SASS and f"needs nvcc and cuobjdump: {NO_SASS}")
def test_sass_compare_sees_a_header_change_and_only_that(tmp_path, capsys):
    """`sass TREE SOURCE`: a source whose headers are the tree's too is identical; after a header of the tree
    changes what the kernel computes, it differs (exit 1), with both instruction counts."""
    ab = load_script(ROOT / "tools" / "ab_tree.py")
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "templates", tree / "templates")
    src = tmp_path / "k.cu"
    src.write_text('#include "tsgen/gemm.cuh"\n'
                   "__global__ void k(unsigned long long* out, unsigned a) {\n"
                   "  *out = tsgen::gemm::sw128_descriptor(a, 16, 1024);\n}\n")
    assert ab.sass_compare(tree, [src]) == 0
    assert "k.cu: identical" in capsys.readouterr().out
    header = tree / "templates" / "include" / "tsgen" / "gemm.cuh"
    text = header.read_text()
    assert "(1ull << 62)" in text
    header.write_text(text.replace("(1ull << 62)", "(1ull << 63)", 1))
    assert ab.sass_compare(tree, [src]) == 1
    assert re.search(r"k\.cu: DIFFERS: \d+ -> \d+ instructions", capsys.readouterr().out)
