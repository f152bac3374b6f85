"""Every performance figure in the README and docs/ comes from a results file (issue 29, item 5):
what counts as a figure, what backs it, the markers, the links, incomplete runs in the index, and
the warning when no GPU test run has seen the newest device code (`tsgen results --check`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from tsgen.bench.figures import MAX_UNBACKED, check_figures, check_links, markdown_files
from tsgen.bench.index import BEGIN, END, gate_warning, latest_md, readme_block

RUN = "results/collectives/big/2026-11-20-aaaaaaa.md"


def _results(tmp: Path, rows: list[tuple[str, float, float]] | None = None, stopped: str | None = None) -> Path:
    """results/collectives/big/2026-11-20-aaaaaaa.{json,md}: rows (label, time us, busbw GB/s)."""
    rows = rows or [("ag", 2674.5, 301.1), ("ag_ring", 2199.5, 366.1)]
    folder = tmp / "results" / "collectives" / "big"
    folder.mkdir(parents=True)
    meta = {"date": "2026-11-20T10:00:00Z", "commit": "aaaaaaa", "command": "tsgen bench --suite big"}
    errors = []
    if stopped:
        meta["stopped"] = stopped
        errors = [f"incomplete run: {stopped}"]
    data = [{"impl": "tsgen", "label": label, "op": "allgather", "group": "g", "size": 1 << 30, "size_unit": "bytes",
             "time_us": us, "busbw_GBps": bw, "ratios": {"nccl": 1.096}} for label, us, bw in rows]
    (folder / "2026-11-20-aaaaaaa.json").write_text(json.dumps({"meta": meta, "rows": data, "errors": errors}))
    (folder / "2026-11-20-aaaaaaa.md").write_text("| impl | time us | busbw |\n|---|---|---|\n"
                                                  + "".join(f"| {r[0]} | {r[1]} | {r[2]} |\n" for r in rows))
    return tmp / "results"


def _check(tmp: Path, text: str, name: str = "README.md"):
    doc = tmp / name
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return check_figures([doc], tmp, tmp / "results")


def _problems(tmp: Path, text: str) -> list[str]:
    return _check(tmp, text).problems


@pytest.fixture
def results(tmp_path):
    return _results(tmp_path)


def test_a_figure_must_be_in_a_results_file_its_section_cites(tmp_path, results):
    cited = f"## Large\n\nallgather_ring 366 GB/s at 1 GiB, 2199.5 us (`{RUN}`).\n"
    assert _problems(tmp_path, cited) == []
    wrong = _problems(tmp_path, cited.replace("366 GB/s", "367 GB/s"))
    assert len(wrong) == 1 and wrong[0].startswith("README.md:3: '367 GB/s': 367 not in the results files its section "
                                                   "cites (collectives/big/2026-11-20-aaaaaaa.json"), wrong
    uncited = _problems(tmp_path, "## Large\n\nallgather_ring 366 GB/s at 1 GiB.\n")
    assert uncited == ["README.md:3: '366 GB/s': no results file is cited in its section"]
    # another section's citation backs nothing here; a lab log cited instead backs nothing either
    assert _problems(tmp_path, f"## A\n\n(`{RUN}`)\n\n## B\n\n366 GB/s (docs/lab/bench.md).\n") == [
        "README.md:7: '366 GB/s': no results file is cited in its section"]


@pytest.mark.parametrize("text, backed", [
    ("1.10x NCCL", True),  # 1.096 rounds to 1.10
    ("1.09x NCCL", False),  # ... not to 1.09
    ("1.10 / 1.09x NCCL", False),  # every number of a list
    ("0.5 to 2.6 ms", False),
    ("2.1995 ms per call", True),  # us in the file, ms in the text
    ("36.61 % of the link's bandwidth", False),
    ("~370 GB/s", True),  # 366.1 within 2 %
    ("~380 GB/s", False),
    ("under 3 % overhead", True),  # a bound: not looked up
    ("within ±5 % of the peak", True),
    ("a prediction of 450 GB/s", True),
    ("`--sizes 64K:1G:4` at 999 GB/s in code: `999 GB/s`", False),  # the first 999 is prose
    ("4 x H200 and 8 × H100, a 128 × 256 tile, 2 x hidden bytes", True),  # no ratios
    ("3.0 of NCCL's busbw", False),  # a ratio written without x
    ("about 85 % of the suite ran", True),  # a share of tests, not of speed
    ("85 % faster", False),
])
def test_what_counts_and_what_backs_it(tmp_path, results, text, backed):
    problems = _problems(tmp_path, f"# T\n\n{text} (`{RUN}`).\n")
    assert (problems == []) == backed, problems


def test_markers_predictions_code_and_generated_tables(tmp_path, results):
    text = "\n".join([
        "# Doc", "",
        "FA3 reaches 648 TFLOP/s on an H100 [anchor: the FlashAttention-3 paper].", "",
        "Compute-bound by 15x [computed: 2.2 TFLOP over 537 MB at the datasheet rates].", "",
        "Prediction: 500 GB/s. If it holds, 1.5x NCCL.", "",
        "Predictions for the run:", "", "- 4.2 us per call", "- 1.7x torch", "",
        "```", "tsgen: 777 GB/s", "```", "",
        "<!-- 888 GB/s -->", "",
        BEGIN, "| impl | busbw GB/s |", "|---|---|", "| x | 999.9 |", END, "",
        "The log said 123 GB/s [not backed by a file: the run's log, not kept].", "",
        "The table below is the log's [not backed by a file: copied from a log]:", "",
        "| variant | time us | busbw |", "|---|---|---|", "| a | 12.5 | 77.7 |", "",
    ])
    report = _check(tmp_path, text)
    assert report.problems == [] and report.checked == 0
    assert report.unbacked == ["README.md:26: [not backed by a file: the run's log, not kept] (1 figure(s))",
                               "README.md:28: [not backed by a file: copied from a log] (2 figure(s))"]
    # without the marker, the table's cells under unit headers are figures like any other
    bare = text.replace(" [not backed by a file: copied from a log]", "")
    assert [p.split(": ", 1)[1] for p in _problems(tmp_path, bare)] == [
        "'12.5 (time us)': no results file is cited in its section", "'77.7 (busbw)': no results file is cited in "
        "its section"]


def test_a_heading_marker_covers_its_sections_and_markers_stay_rare(tmp_path, results):
    doc = "# Notes [not backed by a file: before results/ existed]\n\n1 GB/s\n\n## Sub\n\n2 GB/s\n\n# Next\n\n3 GB/s\n"
    report = _check(tmp_path, doc)
    assert report.problems == ["README.md:11: '3 GB/s': no results file is cited in its section"]
    assert report.unbacked == ["README.md:1: section 'Notes' and the sections under it [not backed by a file: before "
                               "results/ existed] (2 figure(s))"]
    many = "".join(f"## S{i}\n\n{i} GB/s [not backed by a file: log {i}].\n\n" for i in range(MAX_UNBACKED + 1))
    problems = _problems(tmp_path, many)
    assert problems == [f"{MAX_UNBACKED + 1} markers '[not backed by a file: ...]' (at most {MAX_UNBACKED}): a figure "
                        "without a file goes, or its file is added to results/"]


def test_a_cited_path_that_moved_to_the_archive_is_a_problem(tmp_path, results):
    archived = results / "archive" / "collectives" / "big"
    archived.mkdir(parents=True)
    for f in (results / "collectives" / "big").iterdir():
        f.rename(archived / f.name)
    problems = _problems(tmp_path, f"# T\n\n366 GB/s (`{RUN}`).\n")
    assert problems == [f"README.md:3: cites {RUN}, which is not under results/ (moved to results/archive/?)"]
    assert _problems(tmp_path, "# T\n\n366 GB/s (results/archive/collectives/big/2026-11-20-aaaaaaa.{json,md}).\n") == []


def test_a_figure_from_an_incomplete_run_says_so_and_the_index_marks_the_run(tmp_path):
    """A suite stopped part way is indexed (its finished entries usable, marked incomplete), not refused."""
    results = _results(tmp_path, stopped="stopped (SIGTERM) after 4 of 6 entries: the rest were not run")
    assert _problems(tmp_path, f"# T\n\n366 GB/s (`{RUN}`), an incomplete run.\n") == []
    problems = _problems(tmp_path, f"# T\n\n366 GB/s (`{RUN}`).\n")
    assert problems == ["README.md:3: '366 GB/s': only in an incomplete run (collectives/big/2026-11-20-aaaaaaa.json): "
                        "say so in its sentence"]
    latest = latest_md(results)
    assert "**Incomplete run**: stopped (SIGTERM) after 4 of 6 entries" in latest and "| tsgen ag_ring | 1G |" in latest
    assert "Errors (no rows)" not in latest
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "big.yaml").write_text("description: d\nentries: [{spec: specs/allgather.yaml}]\nreadme: {title: Big}\n")
    assert "incomplete run: stopped (SIGTERM) after 4 of 6 entries" in readme_block(results, suites)


def test_results_check_fails_on_a_figure_without_its_file(tmp_path, results):
    (tmp_path / "suites").mkdir()
    readme, docs = tmp_path / "README.md", tmp_path / "docs"
    readme.write_text(f"# x\n\n{BEGIN}\n{END}\n\n## Speed\n\n366 GB/s (`{RUN}`).\n")
    (docs / "lab").mkdir(parents=True)
    (docs / "lab" / "log.md").write_text("# Log\n\n400 GB/s at 1 GiB, the best run.\n")
    args = ["--results", str(results), "--readme", str(readme), "--suites", str(tmp_path / "suites"), "--docs", str(docs)]
    assert run_cli("results", *args).code == 0  # writes latest.md
    r = run_cli("results", *args, "--check")
    assert r.code == 1 and "'400 GB/s': no results file is cited in its section" in r.stderr, r
    assert "1 problem(s) with the figures and links above" in r.stderr
    (docs / "lab" / "log.md").write_text(f"# Log\n\n366 GB/s at 1 GiB (`{RUN}`); [broken](nowhere.md).\n")
    r = run_cli("results", *args, "--check")
    assert r.code == 1 and "log.md:3: link to nowhere.md, which does not exist" in r.stderr, r
    (docs / "lab" / "log.md").write_text(f"# Log\n\n366 GB/s at 1 GiB (`{RUN}`, [the run]({'../../' + RUN})).\n")
    assert run_cli("results", *args, "--check").code == 0


def test_every_relative_link_in_the_readme_and_docs_resolves():
    docs = markdown_files(ROOT / "README.md", ROOT / "docs")
    assert len(docs) > 10
    assert check_links(docs, ROOT) == []


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _device_code_repo(tmp_path: Path) -> tuple[Path, str]:
    """A git repository whose one commit changed templates/ (device code): (its root, the short hash)."""
    repo = tmp_path / "repo"
    (repo / "templates").mkdir(parents=True)
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    (repo / "templates" / "a.cuh").write_text("1\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "device code")
    return repo, _git(repo, "rev-parse", "--short", "HEAD")


def test_results_check_warns_when_no_gpu_run_saw_the_newest_device_code(tmp_path):
    repo, first = _device_code_repo(tmp_path)
    tests = repo / "results" / "tests" / "nvidia-h100"
    tests.mkdir(parents=True)
    (tests / f"2026-11-26-{first}.json").write_text(json.dumps({"meta": {"date": "2026-11-26"}, "summary": {}}))
    (repo / "README.md").write_text("# r\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "a gate run of the device code, a README")
    assert gate_warning(repo / "results") is None
    (repo / "templates" / "a.cuh").write_text("2\n")
    _git(repo, "commit", "-qam", "device code changed")
    warning = gate_warning(repo / "results")
    assert warning and f"tests/nvidia-h100/2026-11-26-{first}" in warning and "device code changed" in warning
    assert "run tools/gpu_gate.sh" in warning
    (repo / "suites").mkdir()
    args = ["--results", str(repo / "results"), "--readme", str(repo / "README.md"), "--suites",
            str(repo / "suites"), "--docs", str(repo / "docs")]
    assert run_cli("results", *args).code == 0
    r = run_cli("results", *args, "--check")
    assert r.code == 0 and "tsgen: warning: no GPU test run in results/tests/" in r.stderr, r  # a warning, not a failure
    second = _git(repo, "rev-parse", "--short", "HEAD")
    (tests / f"2026-11-27-{second}-dirty.json").write_text(json.dumps(
        {"meta": {"date": "2026-11-27"}, "summary": {"suite": {"passed": 9, "failed": 2}}}))
    warning = gate_warning(repo / "results")  # a run of the change that failed is no gate passed
    assert warning and f"2026-11-27-{second}-dirty: 2 failed" in warning and "has not passed" in warning
    (tests / f"2026-11-28-{second}.json").write_text(json.dumps(
        {"meta": {"date": "2026-11-28"}, "summary": {"suite": {"passed": 11, "failed": 0}}}))
    assert gate_warning(repo / "results") is None


def test_headings_count_and_paths_inside_other_paths_are_no_citations(tmp_path, results):
    assert _problems(tmp_path, f"## Run 1: 999 GB/s\n\n(`{RUN}`)\n") == [
        "README.md:1: '999 GB/s': 999 not in the results files its section cites (collectives/big/2026-11-20-aaaaaaa.json, "
        "collectives/big/2026-11-20-aaaaaaa.md)"]
    assert _problems(tmp_path, "# T\n\nThe gate writes `$OUT/results/tests/k/x.md` and ~/results/old.md.\n") == []


def test_a_gate_run_in_parts_passes_once_every_part_of_one_commit_has(tmp_path):
    repo, head = _device_code_repo(tmp_path)
    tests = repo / "results" / "tests" / "nvidia-h200"
    tests.mkdir(parents=True)
    passed = {"summary": {"suite": {"passed": 5, "failed": 0}}}
    (tests / f"2026-11-27-{head}-part1of2.json").write_text(json.dumps({"meta": {"date": "2026-11-27"}, **passed}))
    warning = gate_warning(repo / "results")
    assert warning and f"at {head}" in warning and "part(s) 2 have no passing record" in warning, warning
    (tests / f"2026-11-27-{head}-part2of2.json").write_text(json.dumps(
        {"meta": {"date": "2026-11-27"}, "summary": {"suite": {"passed": 4, "failed": 1}}}))
    warning = gate_warning(repo / "results")  # a failed part is no part passed
    assert warning and f"{head}-part2of2: 1 failed" in warning, warning
    (tests / f"2026-11-27-{head}-part2of2.json").write_text(json.dumps({"meta": {"date": "2026-11-27"}, **passed}))
    assert gate_warning(repo / "results") is None
