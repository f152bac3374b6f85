"""Spec loading: shipped specs load; every kind of bad spec is reported as
``FILE:LINE:COL: field: message`` by load_spec and by `tsgen build` (exit 2,
the lines on stderr, nothing written)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import ROOT, SPECS, run_cli
from tsgen.errors import SpecError, ToolchainError
from tsgen.ops import family_names, get_family
from tsgen.spec import load_spec, spec_variant

HEAD = "# yaml-language-server: $schema=../schema/tsgen.schema.json\n"
OPS = ", ".join(family_names())
NOT_IDENT = "is not a C identifier (letters, digits and '_', not starting with a digit)"


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_shipped_spec_loads(path):
    spec = load_spec(path)
    assert spec.name == path.stem
    assert spec.model.op in family_names()
    assert list(spec.model.world_sizes) == sorted(spec.model.world_sizes)
    least = get_family(spec.model.op).min_world  # 1: a gemm or an attention runs on one GPU
    assert all(least <= w <= 8 for w in spec.model.world_sizes)


def test_good_spec_loads_with_defaults(tmp_path):
    p = tmp_path / "good.yaml"
    p.write_text(HEAD + "name: t1\nop: put_block\nworld_sizes: 3\nlaunch:\n  blocks: 8\n")
    m = load_spec(p).model
    assert (m.name, m.op, list(m.world_sizes)) == ("t1", "put_block", [3])
    assert (m.launch.blocks, m.launch.threads, m.launch.unroll) == (8, 512, 4)
    assert (m.params.shift, m.sync.timeout_ms) == (1, 10000)


# (id, spec text after the schema comment line, problem lines without the "bad.yaml:" prefix)
BAD = [
    ("unknown_key_top",
     "name: t1\nop: put_block\nworld_sizes: [2, 3]\ncolour: blue\n",
     ["5:1: colour: unknown key"]),
    ("unknown_key_launch",
     "name: t1\nop: put_block\nworld_sizes: [2, 3]\nlaunch:\n  blocks: 8\n  thread: 64\n",
     ["7:3: launch.thread: unknown key"]),
    ("blocks_string",
     'name: t1\nop: put_block\nworld_sizes: [2, 3]\nlaunch:\n  blocks: "64"\n',
     ["6:3: launch.blocks: Input should be a valid integer"]),
    ("blocks_float",
     "name: t1\nop: put_block\nworld_sizes: [2]\nlaunch:\n  blocks: 64.0\n",
     ["6:3: launch.blocks: Input should be a valid integer"]),
    ("blocks_bool",
     "name: t1\nop: put_block\nworld_sizes: [2]\nlaunch:\n  blocks: true\n",
     ["6:3: launch.blocks: Input should be a valid integer"]),
    ("threads_33",
     "name: t1\nop: put_block\nworld_sizes: [2]\nlaunch:\n  threads: 33\n",
     ["6:3: launch.threads: Input should be a multiple of 32"]),
    ("blocks_0",
     "name: t1\nop: put_block\nworld_sizes: [2]\nlaunch:\n  blocks: 0\n",
     ["6:3: launch.blocks: Input should be greater than or equal to 1"]),
    ("world_size_1",
     "name: t1\nop: put_block\nworld_sizes: [1]\n",
     ["4:15: world_sizes[0]: Input should be greater than or equal to 2"]),
    ("world_size_9",
     "name: t1\nop: put_block\nworld_sizes: [2, 9]\n",
     ["4:18: world_sizes[1]: Input should be less than or equal to 8"]),
    ("world_size_repeated",
     "name: t1\nop: put_block\nworld_sizes: [2, 2]\n",
     ["4:1: world_sizes: world sizes [2, 2] repeat a value"]),
    # a missing field points at the mapping it belongs in (line 2: after the comment)
    ("missing_world_sizes",
     "name: t1\nop: put_block\n",
     ["2:1: world_sizes: Field required"]),
    ("missing_op",
     "name: t1\nworld_sizes: [2]\n",
     [f"2:1: op: missing; one of: {OPS}"]),
    ("yaml_syntax",
     "name: t1\nop: [put_block\nworld_sizes: [2]\n",
     ["4:12: <yaml>: YAML syntax error: expected ',' or ']', but got ':'"]),
    ("yaml_tab",
     "name: t1\nop: put_block\nworld_sizes: [2]\n\tlaunch: 1\n",
     ["5:1: <yaml>: YAML syntax error: found character '\\t' that cannot start any token"]),
    ("two_documents",
     "name: t1\nop: put_block\nworld_sizes: [2]\n---\nname: t2\n",
     ["5:1: <yaml>: YAML syntax error: but found another document"]),
    ("a_list",
     "- name: t1\n- op: put_block\n",
     ["1:1: <spec>: a spec is a YAML mapping of fields"]),
    ("a_string",
     "just words\n",
     ["1:1: <spec>: a spec is a YAML mapping of fields"]),
    ("only_comments",
     "",
     ["1:1: <spec>: a spec is a YAML mapping of fields"]),
    ("duplicate_key",
     "name: t1\nop: put_block\nworld_sizes: [2]\nname: t2\n",
     ["5:1: name: duplicate key"]),
    ("duplicate_key_nested",
     "name: t1\nop: put_block\nworld_sizes: [2]\nlaunch:\n  blocks: 8\n  blocks: 16\n",
     ["7:3: launch.blocks: duplicate key"]),
    ("unknown_op",
     "name: t1\nop: teleport\nworld_sizes: [2]\n",
     [f"3:1: op: unknown op 'teleport'; one of: {OPS}"]),
    ("name_injection",
     'name: "x(); system(\\"rm\\"); //"\nop: put_block\nworld_sizes: [2]\n',
     [f"2:1: name: 'x(); system(\"rm\"); //' {NOT_IDENT}"]),
    ("name_digit_first",
     "name: 9abc\nop: put_block\nworld_sizes: [2]\n",
     [f"2:1: name: '9abc' {NOT_IDENT}"]),
    ("name_keyword",
     "name: int\nop: put_block\nworld_sizes: [2]\n",
     ["2:1: name: 'int' is a C/C++ keyword"]),
    ("name_reserved",
     "name: __t1\nop: put_block\nworld_sizes: [2]\n",
     ["2:1: name: '__t1': names may not start with '_' or exceed 64 characters"]),
    ("shift_multiple_of_world",
     "name: t1\nop: put_block\nworld_sizes: [2, 4]\nparams:\n  shift: 2\n",
     ["6:3: params.shift: shift 2 makes every rank its own peer at world size 2"]),
    ("shift_multiple_of_two_worlds",
     "name: t1\nop: barrier_all\nworld_sizes: [2, 3, 4]\nparams:\n  shift: 4\n",
     ["6:3: params.shift: shift 4 makes every rank its own peer at world size 2, 4"]),
    ("weak_with_scope",
     "name: t1\nop: remote_st\nworld_sizes: [2]\nparams:\n  semantics: weak\n  scope: sys\n",
     ["7:3: params.scope: weak accesses take no scope; remove `scope`"]),
    ("relaxed_without_scope",
     "name: t1\nop: remote_st\nworld_sizes: [2]\nparams:\n  semantics: relaxed\n  width: 64\n",
     ["6:3: params.scope: relaxed accesses need a scope: cta, gpu or sys"]),
    ("store_with_acquire",
     "name: t1\nop: remote_st\nworld_sizes: [2]\nparams:\n  semantics: acquire\n  scope: sys\n",
     ["6:3: params.semantics: Input should be 'weak', 'volatile', 'relaxed' or 'release'"]),
    ("signal_wait_one_block",
     "name: t1\nop: signal_wait\nworld_sizes: [2]\nlaunch:\n  blocks: 1\n",
     ["6:3: launch.blocks: signal_wait needs >= 2 blocks (one producer, consumers)"]),
    ("plan_code_unknown",
     "name: t1\nop: allgather\nworld_sizes: [2]\nlaunch:\n  plan_code: straight\n",
     ["6:3: launch.plan_code: Input should be 'auto' or 'tables'"]),
    ("plan_code_not_a_collective",
     "name: t1\nop: put_block\nworld_sizes: [2]\nlaunch:\n  plan_code: tables\n",
     ["6:3: launch.plan_code: unknown key"]),
    ("every_problem_listed",
     "name: t1\nop: put_block\nworld_sizes: [2]\nlaunch:\n  threads: 33\n  unroll: 0\nextra: 1\n",
     ["6:3: launch.threads: Input should be a multiple of 32",
      "7:3: launch.unroll: Input should be greater than or equal to 1",
      "8:1: extra: unknown key"]),
    # an empty value is null (used to crash re-parsing the scalar)
    ("empty_value",
     "name: t1\nop: put_block\nworld_sizes: [2]\nlaunch:\n",
     ["5:1: launch: Input should be a valid dictionary or instance of Launch"]),
    # tags the safe loader does not construct (used to crash with a traceback)
    ("unsafe_tag",
     "name: !!python/name:os.system t1\nop: put_block\nworld_sizes: [2]\n",
     ["2:7: <yaml>: YAML value not allowed: could not determine a constructor for the tag "
      "'tag:yaml.org,2002:python/name:os.system'"]),
    ("unknown_tag",
     "name: t1\nop: put_block\nworld_sizes: !sizes [2]\n",
     ["4:14: <yaml>: YAML value not allowed: could not determine a constructor for the tag '!sizes'"]),
    # a list as a key (used to crash: unhashable)
    ("complex_key",
     "name: t1\nop: put_block\nworld_sizes: [2]\n? [a, b]\n: x\n",
     ["5:3: <spec>: keys must be plain names, not lists or mappings"]),
]


def _problems(exc: SpecError, file: str) -> list[str]:
    prefix = f"{file}:"
    assert all(line.startswith(prefix) for line in exc.problems), exc.problems
    return [line[len(prefix):] for line in exc.problems]


@pytest.mark.parametrize("text,expected", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_spec_load_spec(tmp_path, text, expected):
    p = tmp_path / "bad.yaml"
    p.write_text(HEAD + text)
    with pytest.raises(SpecError) as e:
        load_spec(p, display_path="bad.yaml")
    assert _problems(e.value, "bad.yaml") == expected
    assert e.value.exit_code == 2


@pytest.mark.parametrize("text,expected", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_spec_cli(tmp_path, monkeypatch, text, expected):
    monkeypatch.chdir(tmp_path)
    Path("bad.yaml").write_text(HEAD + text)
    r = run_cli("build", "bad.yaml", "-o", "out")
    assert r.code == 2, r
    n = len(expected)
    assert r.stderr.splitlines() == [f"bad.yaml:{line}" for line in expected] + [
        f"tsgen: {n} problem{'s' if n > 1 else ''} in the specs; nothing was written"
    ], r
    assert r.stdout == ""
    assert not Path("out").exists(), "a bad spec must leave nothing half-written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_missing_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError) as e:
        load_spec("nope.yaml")
    assert e.value.problems == ["nope.yaml:1:1: <file>: no such file"]
    r = run_cli("build", "nope.yaml", "-o", "out")
    assert r.code == 2, r
    assert r.stderr.splitlines()[0] == "nope.yaml:1:1: <file>: no such file"
    assert not Path("out").exists()


def test_unreadable_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("dir.yaml").mkdir()
    Path("latin1.yaml").write_bytes(HEAD.encode() + b"name: t\xe9\n")
    for name, problem in [("dir.yaml", "dir.yaml:1:1: <file>: cannot read: is a directory"),
                          ("latin1.yaml", "latin1.yaml:2:8: <file>: not UTF-8 text: byte 0xe9")]:
        with pytest.raises(SpecError) as e:
            load_spec(name)
        assert e.value.problems == [problem]


def test_bad_name_never_reaches_generated_code(tmp_path, monkeypatch):
    """A name that would inject C is refused before any rendering; the output folder,
    even one that already holds files, is left as it was."""
    monkeypatch.chdir(tmp_path)
    out = Path("out")
    out.mkdir()
    (out / "keep.cu").write_text("// mine\n")
    Path("bad.yaml").write_text(HEAD + 'name: "x(); system(\\"rm\\"); //"\nop: put_block\nworld_sizes: [2]\n')
    r = run_cli("build", "bad.yaml", "-o", "out")
    assert r.code == 2, r
    assert sorted(p.name for p in out.iterdir()) == ["keep.cu"]
    for f in tmp_path.rglob("*"):
        if f.is_file() and f.name != "bad.yaml":
            assert "system(" not in f.read_text()


def _copy_specs(dst: Path, names: list[str]) -> Path:
    dst.mkdir()
    for n in names:
        shutil.copy(ROOT / "specs" / f"{n}.yaml", dst / f"{n}.yaml")
    return dst


def test_one_bad_spec_writes_nothing_for_the_good_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    specs = _copy_specs(tmp_path / "specs", ["put_block", "get_warp", "barrier_all"])
    (specs / "zz_bad.yaml").write_text(HEAD + "name: zz_bad\nop: put_block\nworld_sizes: [2]\nlaunch:\n  blocks: 0\n")
    r = run_cli("build", "specs", "-o", "out")
    assert r.code == 2, r
    assert r.stderr.splitlines()[0] == "specs/zz_bad.yaml:6:3: launch.blocks: Input should be greater than or equal to 1"
    assert not Path("out").exists()

    # an existing output folder keeps its files byte for byte, with their times
    (specs / "zz_bad.yaml").unlink()
    assert run_cli("build", "specs", "-o", "out").code == 0
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in Path("out").iterdir()}
    assert len(before) == 6
    (specs / "put_block.yaml").write_text((specs / "put_block.yaml").read_text().replace("blocks: 64", "blocks: 16"))
    (specs / "zz_bad.yaml").write_text(HEAD + "name: zz_bad\nop: nope\nworld_sizes: [2]\n")
    r = run_cli("build", "specs", "-o", "out")
    assert r.code == 2, r
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in Path("out").iterdir()} == before


def test_problems_of_several_specs_all_reported(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "a.yaml").write_text(HEAD + "name: a\nop: put_block\nworld_sizes: [2]\nbogus: 1\n")
    (specs / "b.yaml").write_text(HEAD + "name: b\nop: put_block\nworld_sizes: [1]\n")
    r = run_cli("build", "specs", "-o", "out")
    assert r.code == 2, r
    assert r.stderr.splitlines() == [
        "specs/a.yaml:5:1: bogus: unknown key",
        "specs/b.yaml:4:15: world_sizes[0]: Input should be greater than or equal to 2",
        "tsgen: 2 problems in the specs; nothing was written",
    ]


def test_two_specs_with_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    specs = tmp_path / "specs"
    specs.mkdir()
    for f in ("a.yaml", "b.yaml"):
        (specs / f).write_text(HEAD + "name: same\nop: put_block\nworld_sizes: [2]\n")
    r = run_cli("build", "specs", "-o", "out")
    assert r.code == 2, r
    assert ("specs/b.yaml:1:1: name: 'same' is also the name of specs/a.yaml; "
            "names are output file names and must be unique") in r.stderr.splitlines()
    assert not Path("out").exists()


def test_empty_spec_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("specs").mkdir()
    r = run_cli("build", "specs", "-o", "out")
    assert r.code == 2, r
    assert r.stderr.splitlines()[0] == "specs:1:1: <file>: no spec files (*.yaml) found"


# ---------------------------------------------------------------------------
# Free text in the description stays inside // comments
# ---------------------------------------------------------------------------

EVIL = 'a */ b /* c\\n#include <evil>\\nnon-ASCII: \\u00e9\\u00fc \\u65e5\\r#define X 1\\u2028int y;\\nends with \\\\'


def test_description_stays_in_comments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("specs").mkdir()
    Path("specs/evil.yaml").write_text(
        HEAD + f'name: evil\nop: put_block\nworld_sizes: [2]\ndescription: "{EVIL}"\n'
    )
    spec = load_spec("specs/evil.yaml")
    assert "#include <evil>" in spec.model.description and spec.model.description.endswith("\\")
    r = run_cli("build", "specs", "-o", "out")
    assert r.code == 0, r
    source = Path("out/evil.cu").read_text(encoding="utf-8")
    assert source.isascii()
    lines = source.splitlines()
    first_code = lines.index("#include <cuda_runtime.h>")
    banner = lines[:first_code]
    assert all(line.startswith("//") for line in banner), banner
    assert not any(line.endswith("\\") for line in banner), "a trailing backslash splices the next line"
    # each piece of the text is its own comment line, sanitized
    for want in ["// a */ b /* c", "// #include <evil>", "// non-ASCII: ?? ?", "// #define X 1",
                 "// int y;", "// ends with /"]:
        assert want in banner, (want, banner)
    # and appears nowhere else in the file
    for line in lines[first_code:]:
        assert "evil>" not in line and "define X" not in line
    manifest = Path("out/evil.json").read_text()
    assert "evil>" not in manifest


@pytest.mark.compile
def test_description_source_compiles(tmp_path, monkeypatch):
    from tsgen.toolchain import compile_source, find_nvcc

    try:
        find_nvcc()
    except ToolchainError as e:
        pytest.skip(f"nvcc not found: {e}")
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    Path("specs").mkdir()
    Path("specs/evil.yaml").write_text(
        HEAD + f'name: evil\nop: put_block\nworld_sizes: [2]\ndescription: "{EVIL}"\n'
    )
    assert run_cli("build", "specs", "-o", "out").code == 0
    res = compile_source("out/evil.cu")
    assert set(res.report) >= {"evil_w2"}


# ---------------------------------------------------------------------------
# variants (spec_variant: the one way to make a spec with some fields changed)
# ---------------------------------------------------------------------------


def test_variant_is_deterministic_and_its_banner_says_so():
    from tsgen.render import render

    loaded = load_spec(ROOT / "specs" / "allgather.yaml")
    v = spec_variant(loaded, {"launch": {"blocks": 16}})
    assert v == spec_variant(loaded, {"launch": {"blocks": 16}}) and v.sha256 != loaded.sha256
    assert v.name == loaded.name and v.changes == ("launch.blocks = 16",) and loaded.changes == ()
    again = spec_variant(v, {"world_sizes": [2]})
    assert again.changes == ("launch.blocks = 16", "world_sizes = [2]")
    assert again.text.endswith("# variant: launch.blocks = 16\n\n# variant: world_sizes = [2]\n")
    assert spec_variant(loaded, {"name": "allgather_b16"}).name == "allgather_b16"

    def banner(x):
        return render(x, base=ROOT).source.split("DO NOT EDIT")[0]

    assert f"// spec sha256 {again.sha256}\n// variant: launch.blocks = 16\n// variant: world_sizes = [2]\n" in banner(again)
    assert "variant" not in banner(loaded)


def test_variant_problems_read_like_the_loaders():
    loaded = load_spec(ROOT / "specs" / "allgather.yaml")
    with pytest.raises(SpecError) as e:
        spec_variant(loaded, {"launch": {"threads": 33}, "bogus": 1})
    assert sorted(e.value.problems) == [
        f"{loaded.path}:1:1: bogus: unknown key (in the variant bogus = 1, launch.threads = 33)",
        f"{loaded.path}:1:1: launch.threads: Input should be a multiple of 32 (in the variant bogus = 1, launch.threads = 33)",
    ]


def test_every_family_has_one_category_and_sweep():
    """tsgen.ops.families selects by the attributes each family states once (tsgen/ops/base.py)."""
    from tsgen.ops import families
    from tsgen.ops.base import CATEGORIES, GPU_SWEEPS

    by_category = [f.kind for c in CATEGORIES for f in families(category=c)]
    assert sorted(by_category) == family_names()
    assert sorted(f.kind for s in GPU_SWEEPS for f in families(gpu_sweep=s)) == family_names()
    assert [f.kind for f in families(gpu_sweep=None)] == ["cp_attention", "gemm"]
    with pytest.raises(ValueError, match="category 'collectives': one of primitive, collective"):
        families(category="collectives")


def test_shipped_specs_select_by_family_attributes():
    from tsgen.shipped import shipped, shipped_specs

    assert shipped_specs() == SPECS
    assert [p.stem for p in shipped_specs(multimem=True)] == ["all_reduce_multimem", "allgather_multimem"]
    for loaded in shipped(transport="copy_engine"):
        assert loaded.model.params.transport == "copy_engine"
    assert shipped_specs(category="collective", op="gemm") == []
    assert {load_spec(p).model.op for p in shipped_specs(category="compute")} == {"gemm", "attention", "attention_backward"}
