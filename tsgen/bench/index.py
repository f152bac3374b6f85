"""The results index: results/<dir>/<suite>/<date>-<commit>.{json,md}, newest file per suite.

`tsgen results` (cli.py) keeps it: it moves every file of a suite's folder but the newest run
to results/archive/<dir>/<suite>/, writes results/latest.md (per suite: its newest result,
date, commit, device, command and table), and rewrites the block between
`<!-- tsgen-results:begin -->` and `<!-- tsgen-results:end -->` (in docs/benchmarks.md: the file
tables_file finds) with one table per suite whose
suites/NAME.yaml has a `readme:` section (its sizes and labels), tsgen's rows with their
ratios. `--check` writes nothing and fails when latest.md or the README block is stale.
Files written before this bench keep their content; legacy.py reads their rows.

A run stopped part way (its suite's time limit: meta `stopped`, an "incomplete run" error) is
indexed like any other: its finished entries are rows, and latest.md and the README say
"incomplete" beside them. `evidence` lists every file a figure in the README or docs/ may cite
(tsgen/bench/figures.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from .legacy import normalize
from .report import markdown_table
from .sizes import parse_sizes

BEGIN, END = "<!-- tsgen-results:begin -->", "<!-- tsgen-results:end -->"
# <date>-<commit>[-n] (the n-th run of the day), or <date>-<commit>-partKofN (part K of a GPU gate run over N calls)
_STEM = re.compile(r"^(\d{4}-\d{2}-\d{2})-([0-9a-f]{7,40}(?:-dirty)?|unknown)(?:-(\d+)|-part(\d+)of(\d+))?$")


@dataclass
class Result:
    folder: Path  # results/<dir>/<suite>
    stem: str  # <date>-<commit>[-n]
    files: list[Path]

    @property
    def dir(self) -> str:
        return self.folder.parent.name

    @property
    def suite(self) -> str:
        return self.folder.name

    @property
    def json(self) -> Path | None:
        return next((f for f in self.files if f.suffix == ".json"), None)

    @property
    def md(self) -> Path | None:
        return next((f for f in self.files if f.suffix == ".md"), None)

    def data(self):
        return json.loads(self.json.read_text()) if self.json else None

    @property
    def incomplete(self) -> str | None:
        """Why the run stopped before its last entry (a suite's time limit), or None."""
        return incomplete(self.data())

    def order(self) -> tuple:
        """Runs sort by date, then by the time the file records, then by the -n suffix."""
        m = _STEM.match(self.stem)
        data = self.data() if self.json else None
        meta = (data.get("meta") if isinstance(data, dict) else None) or (data if isinstance(data, dict) else {})
        when = str(meta.get("date", "")) if isinstance(meta, dict) else ""
        return (m.group(1) if m else self.stem, when, int(m.group(3) or 1) if m else 0)


INCOMPLETE = "incomplete run: "  # the error a stopped suite records (tsgen/bench/cli.py)


def incomplete(data) -> str | None:
    """Why a result file's run stopped part way (meta `stopped`, or its "incomplete run" error),
    or None for a run that finished."""
    if not isinstance(data, dict):
        return None
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    if meta.get("stopped"):
        return str(meta["stopped"])
    errors = data.get("errors") if isinstance(data.get("errors"), list) else []
    return next((str(e)[len(INCOMPLETE):] for e in errors if str(e).startswith(INCOMPLETE)), None)


EVIDENCE_SUFFIXES = (".json", ".jsonl", ".md", ".txt")


def evidence(results: Path) -> list[Path]:
    """Every measured file under results/: the runs of every suite (the newest and the archived,
    finished or incomplete), results/tests/, and the files kept from before this index
    (results/archive/, results/<op>/*). Not README.md files (prose about the files) nor
    latest.md (the newest runs again)."""
    return sorted(p for p in Path(results).rglob("*") if p.is_file() and p.suffix in EVIDENCE_SUFFIXES
                  and p.name != "README.md" and p != Path(results) / "latest.md")


def scan(results: Path) -> dict[tuple[str, str], list[Result]]:
    """Every run of every suite, oldest first (results/archive is not part of the index)."""
    out: dict[tuple[str, str], list[Result]] = {}
    for folder in sorted(p for p in Path(results).glob("*/*") if p.is_dir() and p.parts[-2] != "archive"):
        runs: dict[str, list[Path]] = {}
        for f in sorted(folder.iterdir()):
            if f.is_file() and _STEM.match(f.stem):
                runs.setdefault(f.stem, []).append(f)
        if runs:
            found = [Result(folder, stem, files) for stem, files in runs.items()]
            out[(folder.parent.name, folder.name)] = sorted(found, key=Result.order)
    return out


def _gate_run(run: Result) -> str:
    """The run a result file belongs to: its stem, or for part K of N of a gate its date, commit and N."""
    m = _STEM.match(run.stem)
    return f"{m.group(1)}-{m.group(2)}-of{m.group(5)}" if m and m.group(4) else run.stem


def superseded(runs: list[Result]) -> list[Result]:
    """The runs of one suite (oldest first) that a newer run replaces: all but the newest run."""
    return [run for run in runs[:-1] if _gate_run(run) != _gate_run(runs[-1])]


def archive_superseded(results: Path) -> list[tuple[Path, Path]]:
    """Move all runs of each suite but the newest to results/archive/<dir>/<suite>/ (the parts of a
    GPU gate run over several calls are one run: the newest's other parts stay)."""
    moved = []
    for (top, suite), runs in scan(results).items():
        for run in superseded(runs):
            dest = Path(results) / "archive" / top / suite
            dest.mkdir(parents=True, exist_ok=True)
            for f in run.files:
                shutil.move(str(f), dest / f.name)
                moved.append((f, dest / f.name))
    return moved


def _provenance(run: Result, meta: dict) -> str:
    m = _STEM.match(run.stem)
    date, commit = (m.group(1), m.group(2)) if m else (run.stem, "?")
    recorded = isinstance(meta, dict) and (meta.get("commit") or any("commit" in x for x in meta.get("runs", [])))
    how = "" if recorded else " (the commit that added the file; the file records none)"
    dev = meta.get("device") if isinstance(meta, dict) else None
    if isinstance(dev, dict):
        dev = f"{dev.get('gpus', '?')} x {dev.get('name', '?')}"
    elif isinstance(dev, list):
        dev = ", ".join(dict.fromkeys(dev))
    return f"{date}, commit {commit}{how}; device: {dev or '?'}"


def _first_table(md: str) -> str:
    """The first Markdown table of a file (with the line above it), for files with no rows."""
    lines = md.splitlines()
    start = next((i for i, x in enumerate(lines) if x.startswith("|")), None)
    if start is None:
        return ""
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def latest_md(results: Path) -> str:
    results = Path(results)
    out = ["# Latest results", "",
           "Generated by `tsgen results` from the newest run of each suite (results/<op>/<suite>/"
           "<date>-<commit>.json); older runs are in results/archive/. Ratios: t_baseline / t_tsgen "
           "(> 1: tsgen faster), measured in the same run; \"vs ideal: X\": tsgen's FLOP rate per GPU over the "
           "single-GPU ideal X's. Do not edit by hand.", ""]
    for (top, suite), runs in sorted(scan(results).items()):
        run = runs[-1]
        data = run.data()
        meta, rows = normalize(data) if data is not None else ({}, [])
        rel = lambda p: p.relative_to(results).as_posix()  # noqa: E731
        out += [f"## {top} / {suite}", "", _provenance(run, meta) + ".",
                "Files: " + ", ".join(f"[{rel(f)}]({rel(f)})" for f in run.files) + "."]
        if isinstance(meta, dict) and meta.get("command"):
            out.append(f"Command: `{meta['command']}`.")
        if run.incomplete:
            out.append(f"**Incomplete run**: {run.incomplete}; the rows below are the entries it finished.")
        out.append("")
        table = markdown_table([r for r in rows if r.get("time_us")]) if rows else ""
        if not table and run.md:
            table = _first_table(run.md.read_text())
        out += [table or "(no table)", ""]
        errors = (data or {}).get("errors") if isinstance(data, dict) else None
        errors = [e for e in errors if not str(e).startswith(INCOMPLETE)] if isinstance(errors, list) else []
        if errors:
            out += ["Errors (no rows):", ""] + [f"- {e}" for e in errors] + [""]
    return "\n".join(out).rstrip() + "\n"


def readme_block(results: Path, suites_dir: Path, folder: Path | None = None) -> str:
    """The generated performance tables: suites with a `readme:` section, newest run, tsgen rows;
    each run's link relative to `folder`, the folder of the file that holds the block (default:
    the checkout, results/'s parent)."""
    index = scan(results)
    parts = [BEGIN, "<!-- generated by `tsgen results` from results/ (newest run of each suite); do not edit -->", ""]
    for path in sorted(Path(suites_dir).glob("*.yaml")):
        suite = yaml.safe_load(path.read_text()) or {}
        sel = suite.get("readme")
        runs = [rs[-1] for (top, name), rs in index.items() if name == path.stem]
        if not sel or not runs:
            continue
        sizes = set(parse_sizes([str(s) for s in sel["sizes"]])) if sel.get("sizes") else None
        for run in runs:
            meta, rows = normalize(run.data())
            keep = [r for r in rows if r.get("impl") == "tsgen" and r.get("time_us") and (sizes is None or r["size"] in sizes)
                    and (not sel.get("labels") or r.get("label") in sel["labels"])]
            if not keep:
                continue
            rel = run.json.relative_to(Path(results).parent).as_posix() if run.json else ""
            link = Path(os.path.relpath(run.json, folder)).as_posix() if run.json and folder is not None else rel
            stopped = f"; incomplete run: {run.incomplete}" if run.incomplete else ""
            parts += [f"**{sel['title']}** ({_provenance(run, meta)}{stopped}; [{rel}]({link}))", "",
                      markdown_table(keep).replace("### ", "Table: "), ""]
    parts.append(END)
    return "\n".join(parts)


# The generated block: the two markers each on a line of its own (a page that quotes a marker in
# its prose, `<!-- tsgen-results:begin -->` in backticks, holds no block).
_BLOCK = re.compile(rf"^{re.escape(BEGIN)}$.*?^{re.escape(END)}$", re.M | re.S)


def tables_file(readme: Path, docs: Path | None = None) -> Path:
    """The Markdown file that holds the generated tables: the one of the README and the files
    under `docs` (default: docs/ beside the README) with the tsgen-results block (_BLOCK); the
    README where none has it (update_readme then appends the block to it). RuntimeSetupError
    when several have one: which to write would be a guess."""
    from ..errors import RuntimeSetupError

    docs = Path(readme).parent / "docs" if docs is None else Path(docs)
    holders = [path for path in [Path(readme)] + sorted(docs.rglob("*.md") if docs.is_dir() else [])
               if path.is_file() and _BLOCK.search(path.read_text())]
    if len(holders) > 1:
        raise RuntimeSetupError(f"the generated tables' markers ({BEGIN} ... {END}) are in "
                                f"{', '.join(map(str, holders))}: the tables live in one file; remove the others' block")
    return holders[0] if holders else Path(readme)


def update_readme(readme: Path, block: str) -> str:
    """README text with its generated block (_BLOCK) replaced (appended where it has none)."""
    text = Path(readme).read_text()
    m = _BLOCK.search(text)
    if m:
        return text[:m.start()] + block + text[m.end():]
    return text.rstrip() + "\n\n" + block + "\n"


GATED = ("templates", "generated", "tsgen/runtime")  # the code a GPU run must have seen


def _git(root: Path, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None


def _failed_tests(run: Result) -> int:
    """How many tests of a GPU test run failed (its JSON's summary.suite.failed; 0 when it says nothing)."""
    try:
        data = json.loads((run.folder / f"{run.stem}.json").read_text())
        return int(((data.get("summary") or {}).get("suite") or {}).get("failed") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def gate_warning(results: Path) -> str | None:
    """A warning when no GPU test run in results/tests/ (tools/gpu_gate.sh, gpu_shared.sh,
    gpu_real.sh write them, named after the commit they ran) ran the newest commit that changed
    templates/, generated/ or tsgen/runtime/, or a later one (by git's history), or when every run that
    did had failed tests; None when one did and passed, or when git cannot tell (no repository, no
    such commit)."""
    results = Path(results).resolve()
    top = _git(results, "rev-parse", "--show-toplevel")
    if top is None or top.returncode:
        return None
    root = Path(top.stdout.strip())
    last = _git(root, "log", "-1", "--format=%H %h %s", "--", *GATED)
    if last is None or last.returncode or not last.stdout.strip():
        return None
    full, short, subject = (last.stdout.strip().split(" ", 2) + ["", ""])[:3]
    runs = [run for (kind, _), found in scan(results).items() if kind == "tests" for run in found]
    failed_runs = []
    parts: dict[tuple[str, str, int], set[int]] = {}  # (folder, commit, N) -> the parts K that passed
    for run in runs:
        m = _STEM.match(run.stem)
        if m and m.group(2) != "unknown":
            ran = _git(root, "merge-base", "--is-ancestor", full, m.group(2).removesuffix("-dirty"))
            if ran is not None and ran.returncode == 0:  # the run's commit has that change
                failed = _failed_tests(run)
                where = f"{run.folder.relative_to(results).as_posix()}/{run.stem}"
                if failed:
                    failed_runs.append(f"{where}: {failed} failed")
                elif m.group(4):  # one part of a gate split over calls: passed once all of its parts have
                    k, n = int(m.group(4)), int(m.group(5))
                    done = parts.setdefault((run.folder.as_posix(), m.group(2), n), set())
                    done.add(k)
                    if done >= set(range(1, n + 1)):
                        return None
                else:
                    return None
    if failed_runs:
        return (f"every GPU test run in results/tests/ that ran {short} ({subject[:60]}) or a later commit had "
                f"failures ({'; '.join(failed_runs)}): the gate has not passed; run tools/gpu_gate.sh on a GPU")
    if parts:
        (folder, commit, n), done = next(iter(parts.items()))
        missing = ", ".join(str(k) for k in range(1, n + 1) if k not in done)
        return (f"the GPU gate at {commit} ({Path(folder).name}) ran in {n} parts and part(s) {missing} have no "
                f"passing record: run PART=K/{n} tools/gpu_gate.sh for them")
    newest = max(runs, key=Result.order, default=None)
    where = f"the newest: {newest.folder.relative_to(results).as_posix()}/{newest.stem}" if newest else "there is none"
    return (f"no GPU test run in results/tests/ ({where}) ran {short} ({subject[:60]}), which changed templates/, "
            "generated/ or tsgen/runtime/, or a later commit: run tools/gpu_gate.sh on a GPU")

