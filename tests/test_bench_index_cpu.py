"""Suites as data, results as an index: suite parsing, a suite run writing the index layout,
`tsgen results` (archive, results/latest.md, the README's tables, --check), the migrated files,
and the one place that sets the no-multicast environment."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from bench_fakes import install
from conftest import ROOT, run_cli
from tsgen.bench.index import BEGIN, END, latest_md, readme_block, scan, tables_file, update_readme
from tsgen.bench.legacy import normalize
from tsgen.bench.runner import SHARED_NOTE
from tsgen.bench.suites import list_suites, load_suite
from tsgen.errors import SpecError


def test_every_suite_parses():
    names = [p.stem for p in sorted((ROOT / "suites").glob("*.yaml"))]
    assert {"gemm", "allgather-gemm-w4", "gemm-rs-w4", "grid-w4", "large-w4", "small-allreduce-w4",
            "collectives-w4", "primitives-w2", "shared-smoke"} <= set(names)
    for name in names:
        suite = load_suite(name)
        assert suite.entries and suite.model.description
    assert dict(list_suites())["gemm"].startswith("gemm")
    assert load_suite("shared-smoke").model.share_gpus and load_suite("shared-smoke").model.readme is None


def test_suite_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("description: x\nentries:\n  - {spec: specs/nope.yaml}\n  - {spec: specs/allgather.yaml, sizes: 1Q}\n"
                   "  - {spec: specs/allgather.yaml, variant: {launch: {blocks: 0}}}\n")
    with pytest.raises(SpecError) as e:
        load_suite(str(bad))
    text = "\n".join(e.value.problems)
    assert "entries.0.spec: specs/nope.yaml does not exist" in text and "entries.1.sizes" in text
    assert "entries.2.variant" in text and "launch.blocks" in text
    (tmp_path / "typo.yaml").write_text("description: x\nentries: [{spec: specs/allgather.yaml}]\nsizez: 1M\n")
    with pytest.raises(SpecError, match="sizez"):
        load_suite(str(tmp_path / "typo.yaml"))
    with pytest.raises(SpecError, match="no such suite"):
        load_suite("no-such-suite")
    assert run_cli("bench", "--suite", "no-such-suite").code == 2


def test_suite_run_writes_the_index_layout(monkeypatch, tmp_path):
    install(monkeypatch)
    monkeypatch.setenv("TSGEN_COMMIT", "abc1234")
    suite = tmp_path / "mini.yaml"
    suite.write_text("description: two collectives\ngpus: 2\nsizes: 64K\niters: 2\nreps: 2\nentries:\n"
                     "  - spec: specs/allgather.yaml\n"
                     "  - {spec: specs/allgather.yaml, label: allgather_b8, variant: {name: allgather_b8, "
                     "params: {blocks_per_peer: 8}, launch: {blocks: 33}}}\n  - spec: specs/all_reduce_one_shot.yaml\n")
    r = run_cli("bench", "--suite", str(suite), "--results", str(tmp_path / "results"), "--no-baselines")
    assert r.code == 0, r
    files = sorted(p.relative_to(tmp_path / "results").as_posix() for p in (tmp_path / "results").rglob("*.*"))
    assert len(files) == 2 and re.fullmatch(r"collectives/mini/\d{4}-\d\d-\d\d-abc1234\.json", files[0])
    data = json.loads((tmp_path / "results" / files[0]).read_text())
    meta = data["meta"]
    assert meta["commit"] == "abc1234" and meta["suite"] == str(suite) and meta["command"].startswith("tsgen")
    assert meta["device"]["name"] == "NVIDIA H100 80GB HBM3" and {"cupy", "torch", "driver", "cuda_runtime"} <= set(meta)
    assert meta["ceilings"]["model"] == "H100 SXM" and meta["ceilings"]["sources"]["nvlink"]
    assert {row["label"] for row in data["rows"]} == {"allgather", "allgather_b8", "all_reduce_one_shot"}
    md = (tmp_path / "results" / files[1]).read_text()
    assert "| tsgen allgather_b8 | 64K |" in md and "commit abc1234" in md
    r = run_cli("bench", "--suite", str(suite), "--results", str(tmp_path / "results"), "--no-baselines")
    assert r.code == 0 and len(list((tmp_path / "results" / "collectives" / "mini").glob("*.json"))) == 2  # -2


def _result(folder: Path, stem: str, date: str, us: float):
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"impl": "tsgen", "label": "ag", "op": "allgather", "group": "g", "size": 1 << 30, "size_unit": "bytes",
             "time_us": us, "busbw_GBps": 1e6 / us}]
    (folder / f"{stem}.json").write_text(json.dumps({"meta": {"date": date, "commit": stem[11:], "command": "tsgen x"},
                                                     "rows": rows, "errors": []}))
    (folder / f"{stem}.md").write_text("table\n")


def test_results_index(tmp_path):
    res, suites = tmp_path / "results", tmp_path / "suites"
    _result(res / "allgather" / "big", "2026-11-20-aaaaaaa", "2026-11-20T10:00:00Z", 10.0)
    _result(res / "allgather" / "big", "2026-11-22-bbbbbbb", "2026-11-22T10:00:00Z", 8.0)
    suites.mkdir()
    (suites / "big.yaml").write_text("description: d\nentries: [{spec: specs/allgather.yaml}]\n"
                                     "readme: {title: Big allgather, sizes: [1G]}\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    args = ["--results", str(res), "--readme", str(readme), "--suites", str(suites)]
    assert run_cli("results", *args, "--check").code == 1
    r = run_cli("results", *args)
    assert r.code == 0 and "archived" in r.stdout, r
    assert (res / "archive" / "allgather" / "big" / "2026-11-20-aaaaaaa.json").exists()
    assert [x.stem for x in scan(res)[("allgather", "big")]] == ["2026-11-22-bbbbbbb"]
    latest = (res / "latest.md").read_text()
    assert "## allgather / big" in latest and "2026-11-22, commit bbbbbbb;" in latest and "| tsgen ag | 1G |" in latest
    text = readme.read_text()
    assert "**Big allgather**" in text and "old" not in text and text.endswith("after\n")
    assert run_cli("results", *args, "--check").code == 0
    readme.write_text(text.replace("Big allgather", "Bigger"))
    assert run_cli("results", *args, "--check").code == 1


def test_runs_of_one_day_are_ordered_by_the_time_they_record(tmp_path):
    """Two runs of one day: the later one is the newest whatever the commit hashes' order (a gate
    result of 23:00 at 8f624e1 was once archived under one of the morning at b8bdba7)."""
    res = tmp_path / "results"
    _result(res / "tests" / "gate", "2026-11-26-b8bdba7", "2026-11-26T09:00:00Z", 1.0)
    _result(res / "tests" / "gate", "2026-11-26-8f624e1", "2026-11-26T23:00:47Z", 1.0)
    assert [x.stem for x in scan(res)[("tests", "gate")]] == ["2026-11-26-b8bdba7", "2026-11-26-8f624e1"]


def test_the_tables_live_where_their_markers_are(tmp_path):
    """The generated tables go to the file under docs/ that has the markers (docs/benchmarks.md),
    the README untouched, each run linked relative to that file; without markers anywhere, to
    the README."""
    res, suites, docs = tmp_path / "results", tmp_path / "suites", tmp_path / "docs"
    _result(res / "allgather" / "big", "2026-11-22-bbbbbbb", "2026-11-22T10:00:00Z", 8.0)
    suites.mkdir()
    docs.mkdir()
    (suites / "big.yaml").write_text("description: d\nentries: [{spec: specs/allgather.yaml}]\n"
                                     "readme: {title: Big allgather, sizes: [1G]}\n")
    readme, bench = tmp_path / "README.md", docs / "benchmarks.md"
    readme.write_text("# x\n\nthe door\n")
    bench.write_text(f"# b\n\n{BEGIN}\nold\n{END}\n")
    args = ["--results", str(res), "--readme", str(readme), "--suites", str(suites), "--docs", str(docs)]
    assert tables_file(readme, docs) == bench
    assert run_cli("results", *args).code == 0
    assert readme.read_text() == "# x\n\nthe door\n"
    text = bench.read_text()
    assert "**Big allgather**" in text and "old" not in text
    assert "[results/allgather/big/2026-11-22-bbbbbbb.json](../results/allgather/big/2026-11-22-bbbbbbb.json)" in text
    assert run_cli("results", *args, "--check").code == 0
    bench.write_text("# b\n")
    assert tables_file(readme, docs) == readme


def test_a_page_that_quotes_the_markers_holds_no_tables(tmp_path):
    """Only the markers on lines of their own make the block: a page (sorted before the tables'
    page) that names them in its prose is neither chosen nor rewritten; two blocks are an error."""
    from tsgen.errors import RuntimeSetupError

    docs = tmp_path / "docs"
    docs.mkdir()
    readme, bench, guide = tmp_path / "README.md", docs / "benchmarks.md", docs / "a_guide.md"
    readme.write_text("# x\n")
    bench.write_text(f"# b\n\n{BEGIN}\nold\n{END}\n")
    quoting = f"The tables sit between `{BEGIN}` and `{END}`; edit nothing there.\n"
    guide.write_text(quoting)
    assert tables_file(readme, docs) == bench
    assert update_readme(guide, f"{BEGIN}\nnew\n{END}").startswith(quoting)  # no block: appended, prose kept
    assert update_readme(bench, f"{BEGIN}\nnew\n{END}") == f"# b\n\n{BEGIN}\nnew\n{END}\n"
    guide.write_text(f"{BEGIN}\n{END}\n")
    with pytest.raises(RuntimeSetupError, match="a_guide.md, .*benchmarks.md|benchmarks.md, .*a_guide.md"):
        tables_file(readme, docs)


def test_repository_results_index_is_current():
    r = run_cli("results", "--check")
    assert r.code == 0, r
    assert sorted(p.name for p in ROOT.glob("results/*") if p.is_file()) == ["README.md", "latest.md"]


def test_migrated_results_keep_their_rows():
    """The newest file of every benchmark suite (from before the index) reads as rows with ratios;
    a suite of ranks sharing one GPU reads as rows without any (its timings compare nothing), and
    so does a run whose command says --no-baselines (tsgen variants timed against each other) or
    whose only other rows are tsgen's own phases and ceilings (its baselines not timed: the .md's
    notes say why; moe-w2-fp8 at 7ff7e31 ran without DeepEP's wheel)."""
    for (top, suite), runs in scan(ROOT / "results").items():
        if top == "tests":
            continue
        meta, rows = normalize(json.loads(runs[-1].json.read_text()))
        assert rows and meta.get("command"), (top, suite)
        tsgen = [r for r in rows if r["impl"] == "tsgen"]
        shared = [r for r in tsgen if SHARED_NOTE in (r.get("note") or "")]
        compared = any(r["impl"] != "tsgen" and not r["impl"].startswith("tsgen ") and "ceiling" not in r["impl"]
                       for r in rows)
        alone = shared == tsgen or "--no-baselines" in meta["command"] or not compared
        assert tsgen and alone != any(r.get("ratios") for r in tsgen), (top, suite)
    assert "## gemm / gemm" in latest_md(ROOT / "results")
    assert "gemm against cuBLAS" in readme_block(ROOT / "results", ROOT / "suites")


def test_no_multicast_environment_is_set_in_one_place():
    from tsgen.bench.workers import child_env
    from tsgen.env import NO_MULTICAST
    from tsgen.launch import rank_env

    sets = re.compile(r"NCCL_NVLS_ENABLE(\"\s*:\s*\"|=)")  # "NCCL_NVLS_ENABLE": "0" or NCCL_NVLS_ENABLE=0
    named = [p.relative_to(ROOT).as_posix() for p in list(ROOT.glob("tsgen/**/*.py")) + list(ROOT.glob("tools/*"))
             + [ROOT / "tests" / "conftest.py"] if p.is_file() and sets.search(p.read_text(errors="replace"))]
    assert named == ["tsgen/env.py"], named
    base = {"NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}
    for env in (rank_env(0, 2, 1234, base), child_env(base)):
        assert {k: env[k] for k in NO_MULTICAST} == NO_MULTICAST


def test_retired_tools_are_gone():
    for name in ("gpu_gemm.py", "gpu_fused.py", "bench_collectives.py", "bench_primitives.py", "gpu_run2.sh",
                 "gpu_run8.sh"):
        assert not (ROOT / "tools" / name).exists(), name
    assert shutil.which("bash") is None or "tsgen bench --suite" in (ROOT / "tools" / "gpu_check.sh").read_text()


def test_the_parts_of_the_newest_gate_run_stay_together_when_older_runs_are_archived(tmp_path):
    from tsgen.bench.index import archive_superseded, superseded

    tests = tmp_path / "tests" / "nvidia-h200"
    tests.mkdir(parents=True)
    for stem in ("2026-11-26-aaaaaaa", "2026-11-27-bbbbbbb-part1of2", "2026-11-27-bbbbbbb-part2of2"):
        (tests / f"{stem}.json").write_text(json.dumps({"meta": {"date": stem[:10]}, "summary": {}}))
    assert [run.stem for runs in scan(tmp_path).values() for run in superseded(runs)] == ["2026-11-26-aaaaaaa"]
    moved = archive_superseded(tmp_path)
    assert [dest.name for _, dest in moved] == ["2026-11-26-aaaaaaa.json"]
    assert not [run for runs in scan(tmp_path).values() for run in superseded(runs)]  # what --check asks
    assert sorted(p.name for p in tests.iterdir()) == ["2026-11-27-bbbbbbb-part1of2.json",
                                                       "2026-11-27-bbbbbbb-part2of2.json"]
