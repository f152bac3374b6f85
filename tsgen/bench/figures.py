"""Every performance figure in README.md and docs/ comes from a results file (`tsgen results --check`).

**A performance figure** is a number, or a list or range of numbers (`303 / 341 / 351`,
`0.89-1.03`, `337 / 352 vs 245 / 268`), written directly before a unit of speed or time: TFLOP/s
(TFLOPS, GFLOP/s), TB/s, GB/s, MB/s, us (µs), ms, a ratio `x` (`×`) or a percentage `%` in a
sentence that speaks of speed or time (faster, cost, peak, busbw, us, ...: a share of the tests run
or of the bytes written is no figure), in prose and headings. A ratio is a number with a decimal
point or an `x` right after the number (`1.18x`, `2.0-2.4x`, `4x`; not `4 x H200`, `128 × 256` or
`2 x hidden`), or decimals before "of NCCL", "of cuBLAS", "of the peak" and the like. In a table, a bare number in a column whose header names
one of these units (`time us`, `busbw`, `TFLOP/s`, `vs NCCL`, `ratio`, `%`) is one too. Not
figures: anything in code (fenced blocks, `inline code`), HTML comments, link targets, and the
generated tables between the tsgen-results markers (docs/benchmarks.md) (`tsgen results` writes them from the
files and `--check` compares them).

**Backed** means: every number of the figure is in a results file that the figure's section
(its heading to the next heading) cites, as `results/...` (a file: that run's files; a folder:
every file under it and under results/archive/ at the same place) or as a dated file name
(`2026-11-21-exp_bulk_put_w4.md`). "In the file" means a number in its text that rounds to the
figure as written (`1.096` backs `1.10`, not `1.09`), also after a factor of 1000 (us / ms,
GB/s / TB/s) or 100 (a fraction as a percentage), signs ignored. A figure after `~`, `about`,
`around`, `roughly`, `near(ly)`, `close to`, `some` may be 2 % off; one after `under`, `below`, `over`,
`above`, `at most`, `at least`, `up to`, `within`, `<`, `>`, `≤`, `≥`, `±` is a bound, and is not
looked up. A figure found only in the files of a run stopped part way must have "incomplete" in
its sentence. Citations of docs/lab/ back nothing: a lab log repeats files, it is not one. A cited
`results/...` path that is not there (moved to results/archive/) is a problem of its own, and so
is a relative link that leads nowhere (check_links).

**Exempt**, each visibly in the text:
- `[anchor: SOURCE]` in a sentence: its figures are another project's published numbers or a
  datasheet's.
- `[computed: HOW]` in a sentence: its figures are not measurements but arithmetic (a FLOP count
  over a datasheet rate, an estimate from measured numbers), a model the code computes, or a
  setting the code fixes; HOW says which.
- `[not backed by a file: WHY]` in a sentence: its figures are measurements that have no file (a
  number read off a log that was not kept). `--check` lists every such marker with the figures
  it covers, and fails when there are more than MAX_UNBACKED of them: they must stay rare.
- Any marker in a heading covers its section and the sections under it; at the end of the
  paragraph right above a table, the table.
- A prediction: a paragraph or sentence that starts with "Predict" (and the list right after a
  sentence "Predictions ...:"), or a figure right after "prediction" / "predicted": the lab
  logs' figures written before a run.

docs/lab/ (the dated lab log) is checked like the rest: an entry names the results file of each
number it reports; what a run printed but did not keep is marked as not backed by a file. An
entry is not rewritten afterwards; adding the file a figure came from, or the marker, is not a
rewrite.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .index import BEGIN, END, evidence, incomplete

MAX_UNBACKED = 12  # markers "[not backed by a file: ...]" in README.md and docs/, all together
NOT_BACKED = "not backed by a file"

_NUM = r"[+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_SEP = r"\s*(?:/|–|—|-|\bto\b|\band\b|\bor\b|\bvs\.?|\bagainst\b)\s*"
_UNIT = r"TFLOP/s|TFLOPS|GFLOP/s|TB/s|GB/s|MB/s|µs|μs|us|ms|%|x|×"
FIGURE = re.compile(rf"(?<![\w.,/−+-])(?P<nums>{_NUM}(?:{_SEP}{_NUM})*)(?P<space>\s?)(?P<unit>{_UNIT})(?![\w/])")
NUMBER = re.compile(_NUM)
# a ratio written without x: "1.03 / 0.96 of NCCL's busbw", "0.925 of memcpyPeer"
_BASELINES = (r"NCCL|cuBLAS|cudaMemcpyPeer|memcpyPeer|PyTorch|torch|SDPA|cuDNN|FA[23]|FlashAttention|DeepEP|symm-mem"
              r"|the p2p|the plain|(?:the )?peak|(?:the )?ideal|(?:the )?ceiling")
RATIO_OF = re.compile(rf"(?<![\w.,/−+-])(?P<nums>{_NUM}(?:{_SEP}{_NUM})*)\s+of\s+(?:{_BASELINES})\b")
_NOT_A_RATIO_AFTER = re.compile(r"\s*(?:\d|[A-Z]+\d|GPUs?\b|ranks?\b|nodes?\b|links?\b)")
_APPROX = re.compile(r"(?:~|≈|\babout|\baround|\broughly|\bnearly|\bnear|\bclose to|\balmost|\bsome"
                     r"|\bapproximately)\s*$", re.I)
_BOUND = re.compile(r"(?:\bunder|\bbelow|\bover|\babove|\bat most|\bat least|\bup to|\bwithin|\bless than|\bmore than"
                    r"|<|>|≤|≥|<=|>=|±|\+-|\+/-)\s*$", re.I)
_PERF_WORDS = re.compile(r"faster|slower|speed|throughput|bandwidth|busbw|algbw|latency|FLOP|[GMT]B/s|µs|\bus\b"
                         r"|\bms\b|cost|overhead|peak|ceiling|ideal|utili[sz]|active|DRAM|\bL2\b|HBM|clock|efficien"
                         r"|\btim(?:e|es|ing)\b|noise|spread|\bvs\b|against", re.I)
_PREDICTED = re.compile(r"\bpredict(?:ion|ed)s?\b[^.]{0,6}$", re.I)
MARKER = re.compile(r"\[(anchor|computed|not backed by a file):\s*([^\]]+)\]", re.I)
_CITATION = re.compile(r"(?<![\w$/.-])(?:\.\./)*results/[\w./*-]*(?:\{[\w,]+\})?|\b\d{4}-\d\d-\d\d-[\w.-]+\.(?:jsonl|json|md|txt)\b")
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)  # a code span may go on over a line break
_HEADING = re.compile(r"^(#{1,6})\s")
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(*`\"])")
_HEADER_UNITS = [(re.compile(r"TFLOP", re.I), "TFLOP/s"), (re.compile(r"GB/s|busbw|algbw", re.I), "GB/s"),
                 (re.compile(r"\bms\b"), "ms"), (re.compile(r"\b(?:us|µs)\b|time", re.I), "us"),
                 (re.compile(r"%"), "%"), (re.compile(r"\bvs\b|ratio|×|\bx\b", re.I), "x")]
_FACTORS = {"us": (1, 1e3, 1e-3), "µs": (1, 1e3, 1e-3), "μs": (1, 1e3, 1e-3), "ms": (1, 1e3, 1e-3),
            "TB/s": (1, 1e3, 1e-3), "GB/s": (1, 1e3, 1e-3), "MB/s": (1, 1e3, 1e-3),
            "TFLOP/s": (1, 1e3, 1e-3), "TFLOPS": (1, 1e3, 1e-3), "GFLOP/s": (1, 1e3, 1e-3), "%": (1, 100)}


@dataclass
class Figure:
    path: Path
    line: int
    text: str  # as written, numbers and unit
    numbers: list[str]
    unit: str
    qualifier: str | None = None  # "approx", "bound", "prediction" (_qualifier)


@dataclass
class Sentence:
    text: str  # without code, comments and link targets
    line: int
    figures: list[Figure] = field(default_factory=list)
    table: bool = False  # a table row
    prediction: bool = False  # written before the run it predicts


@dataclass
class Section:
    path: Path
    heading: str
    level: int
    citations: list[tuple[str, int]] = field(default_factory=list)  # (as written, line)
    sentences: list[Sentence] = field(default_factory=list)
    marker: tuple[str, str] | None = None  # a marker in the heading: (kind, why)


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)  # each "FILE:LINE: ..."
    unbacked: list[str] = field(default_factory=list)  # each marker "[not backed by a file]" and what it covers
    checked: int = 0  # figures found backed by a file
    exempt: int = 0  # anchors, predictions, bounds, figures under a not-backed marker


# ---------------------------------------------------------------------------
# Reading Markdown: sections of sentences, their citations and figures
# ---------------------------------------------------------------------------


def _prose(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, text) of the lines that are prose: no fenced code, HTML comments or the
    generated block (docs/benchmarks.md)."""
    out, fence, comment, generated = [], None, False, False
    for i, line in enumerate(lines, 1):
        stripped = line.strip()
        if generated:
            generated = END not in line
            continue
        if BEGIN in line:
            generated = END not in line
            continue
        if fence:
            if stripped.startswith(fence):
                fence = None
            continue
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            continue
        if comment:
            comment = "-->" not in line
            line = line.split("-->", 1)[1] if not comment else ""
        while "<!--" in line:
            head, rest = line.split("<!--", 1)
            if "-->" in rest:
                line = head + rest.split("-->", 1)[1]
            else:
                line, comment = head, True
        out.append((i, line))
    return out


def _blocks(prose: list[tuple[int, str]]):
    """Headings and blocks (a paragraph, a list item with its continuation lines, a table), in order:
    ("heading", level, line, text) and ("block", kind, line, [lines])."""
    block, kind = [], None

    def flush():
        nonlocal block, kind
        if block:
            yield ("block", kind, block[0][0], block)
        block, kind = [], None

    for i, line in prose:
        stripped = line.strip()
        if not stripped:
            yield from flush()
            continue
        m = _HEADING.match(line)
        if m:
            yield from flush()
            yield ("heading", len(m.group(1)), i, line[m.end():])
            continue
        is_table = stripped.startswith("|")
        if (is_table and kind != "table") or (not is_table and kind == "table") or (
                not is_table and _LIST_ITEM.match(line)):
            yield from flush()
        kind = kind or ("table" if is_table else "text")
        block.append((i, line))
    yield from flush()


def _plain(text: str) -> str:
    """Text without code spans and link targets (a link's words stay), every other character where it
    was (blanks in place of what went)."""
    text = _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return _LINK.sub(lambda m: m.group(2) + " " * (len(m.group(0)) - len(m.group(2))), text)


def _qualifier(before: str) -> str | None:
    """What the words right before a figure make of it: "approx", "bound", "prediction" or None."""
    if _PREDICTED.search(before):
        return "prediction"
    return "approx" if _APPROX.search(before) else "bound" if _BOUND.search(before) else None


def _figures_in(text: str) -> list[tuple[str, list[str], str, str | None]]:
    """(text, numbers, unit, qualifier) of each figure in a sentence."""
    out = []
    speaks_of_speed = bool(_PERF_WORDS.search(text))
    for m in FIGURE.finditer(text):
        unit, nums = m.group("unit"), m.group("nums")
        numbers = NUMBER.findall(nums)
        if unit == "%" and not speaks_of_speed:
            continue  # a share of something else: tests run, bytes, SMs
        if unit in ("x", "×"):
            after = text[m.end():]
            decimal = any("." in n for n in numbers)
            if _NOT_A_RATIO_AFTER.match(after) or (m.group("space") and not decimal):
                continue  # 4 x H200, 128 × 256, 2 x hidden: not ratios
        before = text[max(0, m.start() - 16):m.start()]
        qualifier = _qualifier(before)
        out.append((m.group(0), numbers, unit, qualifier))
    taken = [m.span() for m in FIGURE.finditer(text)]
    for m in RATIO_OF.finditer(text):
        numbers = NUMBER.findall(m.group("nums"))
        if any("." in n for n in numbers) and not any(a < m.end() and m.start() < b for a, b in taken):
            out.append((m.group(0), numbers, "x", _qualifier(text[max(0, m.start() - 16):m.start()])))
    return out


def _header_unit(cell: str) -> str | None:
    return next((unit for pattern, unit in _HEADER_UNITS if pattern.search(cell)), None)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _bare_numbers(cell: str) -> list[str] | None:
    """The numbers of a cell that holds nothing else (a list or range of them), or None."""
    text = _plain(cell).strip().strip("*").strip()
    if not text or not re.fullmatch(rf"{_NUM}(?:{_SEP}{_NUM})*", text):
        return None
    return NUMBER.findall(text)


def read_sections(path: Path) -> list[Section]:
    """The sections of a Markdown file with their citations, sentences and figures."""
    lines = path.read_text(encoding="utf-8").splitlines()
    sections = [Section(path, "", 0)]
    pending_prediction = False  # a "Predictions ...:" sentence: the list after it is predictions too
    for item in _blocks(_prose(lines)):
        if item[0] == "heading":
            _, level, line, text = item
            section = Section(path, MARKER.sub("", text).strip(), level)
            marker = MARKER.search(text)
            if marker:
                section.marker = (marker.group(1).lower(), marker.group(2).strip())
            section.citations += [(c, line) for c in _CITATION.findall(text)]
            title = _plain(MARKER.sub("", text))
            section.sentences.append(Sentence(title, line, [Figure(path, line, *f) for f in _figures_in(title)]))
            sections.append(section)
            pending_prediction = False
            continue
        _, kind, first, block = item
        section = sections[-1]
        for i, text in block:
            section.citations += [(c, i) for c in _CITATION.findall(text)]
            section.citations += [(m.group(3), i) for m in _LINK.finditer(text)]
        if kind == "table":
            header = _cells(block[0][1])
            units = [_header_unit(h) for h in header]
            for i, row in block[2:] if len(block) > 1 and set(block[1][1].strip()) <= set("|-: ") else block:
                sentence = Sentence(_plain(row), i)
                cells = _cells(row)
                for col, cell in enumerate(cells):
                    inline = _figures_in(_plain(cell))
                    if inline:
                        sentence.figures += [Figure(path, i, *f) for f in inline]
                    elif col < len(units) and units[col] and (nums := _bare_numbers(cell)):
                        sentence.figures.append(Figure(path, i, f"{cell} ({header[col]})", nums, units[col]))
                sentence.table = True
                section.sentences.append(sentence)
            continue
        is_list = bool(_LIST_ITEM.match(block[0][1]))
        if not is_list:
            pending_prediction = False
        # sentences: split the block's text, keeping each sentence's first line number
        text, starts = "", []
        for i, line in block:
            starts.append((len(text), i))
            text += line + "\n"
        text = _plain(text).replace("\n", " ")
        pos = 0
        parts = _SENTENCE_END.split(text)
        block_predicts = _LIST_ITEM.sub("", text, count=1).lstrip("*_ ").lower().startswith("predict")
        for part in parts:
            at = text.find(part, pos)
            pos = at + len(part)
            line = max((i for offset, i in starts if offset <= at), default=first)
            body = _LIST_ITEM.sub("", part, count=1).lstrip("*_ ")
            sentence = Sentence(part, line)
            sentence.prediction = (body.lower().startswith("predict") or block_predicts
                                   or (is_list and pending_prediction))
            if body.lower().startswith("prediction") and part.rstrip().endswith(":"):
                pending_prediction = True
            sentence.figures = [Figure(path, line, *f) for f in _figures_in(part)]
            section.sentences.append(sentence)
    return sections


# ---------------------------------------------------------------------------
# Looking the numbers up
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _numbers_of(path: Path) -> list[float]:
    """Every number in a results file's text, without its sign, sorted (a JSON's, a table's, a log's)."""
    text = path.read_text(errors="replace")
    return sorted({abs(float(n)) for n in re.findall(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", text)})


def _holds(path: Path, number: str, unit: str, approx: bool) -> bool:
    digits = number.replace(",", "").replace("−", "").lstrip("+")
    value = float(digits)
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    tol = 0.5 * 10 ** -decimals + 1e-9 * max(1.0, value)
    if approx:
        tol = max(tol, 0.02 * value)
    values = _numbers_of(path)
    for factor in _FACTORS.get(unit, (1,)):
        lo, hi = (value - tol) / factor, (value + tol) / factor
        i = bisect.bisect_left(values, lo)
        if i < len(values) and values[i] <= hi:
            return True
    return False


@functools.lru_cache(maxsize=None)
def _incomplete_file(path: Path) -> bool:
    """Whether a results file belongs to a run stopped part way (its own JSON, or its run's)."""
    for f in (path, path.with_suffix(".json")):
        if f.suffix == ".json" and f.is_file():
            try:
                return incomplete(json.loads(f.read_text())) is not None
            except (ValueError, UnicodeDecodeError):
                return False
    return False


class Evidence:
    """The files under results/ that a citation names."""

    def __init__(self, root: Path, results: Path):
        self.root, self.results = Path(root), Path(results)
        self.files = evidence(self.results)
        self.by_name: dict[str, list[Path]] = {}
        for f in self.files:
            self.by_name.setdefault(f.name, []).append(f)

    def resolve(self, citation: str) -> tuple[list[Path], bool]:
        """(the evidence files a citation names, whether the path exists at all)."""
        if "/" not in citation:  # a dated file name: any results file of that name (none: not a results file)
            return self.by_name.get(citation, []), True
        rel = re.sub(r"^(?:\.\./|\./)+", "", citation).split("#")[0].rstrip(".,;:")
        if not rel.startswith("results"):
            return [], True  # a link elsewhere: the link check's business
        braces = re.search(r"\{([\w,]+)\}$", rel)
        if braces:  # results/x/run.{json,md}: each of them
            found = [self.resolve(rel[:braces.start()] + ext) for ext in braces.group(1).split(",")]
            return [f for files, _ in found for f in files], all(exists for _, exists in found)
        rel = rel[len("results"):].strip("/")
        hits = sorted(self.results.glob(rel)) if any(c in rel for c in "*?[") else [self.results / rel]
        archived = [self.results / "archive" / h.relative_to(self.results) for h in hits
                    if self.results / "archive" not in h.parents]
        files, exists = [], False
        for p in hits + archived:
            if p.is_dir():
                exists = True
                files += [f for f in self.files if p in f.parents]
            elif p.is_file():
                exists = p in hits or exists
                files += [f for f in self.files if f.parent == p.parent and f.stem == p.stem]
        return files, exists


def _shown(path: Path, root: Path) -> str:
    """`path` relative to `root` where it is under it."""
    try:
        return path.resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(path)


def check_figures(paths: list[Path], root: Path, results: Path) -> Report:
    """Every performance figure of the Markdown files `paths` backed by a results file (see the
    module doc); `root` is the repository (paths are reported relative to it)."""
    report, evidence_files = Report(), Evidence(root, results)
    unbacked: list[list] = []  # [text, figures covered] per not-backed marker
    for path in paths:
        where = lambda line, path=path: f"{_shown(path, root)}:{line}"  # noqa: E731
        headings: list[tuple[int, tuple[str, str], int]] = []  # markers of the headings above: (level, marker, index)
        for section in read_sections(path):
            while headings and section.level and headings[-1][0] >= section.level:
                headings.pop()
            if section.marker:
                headings.append((section.level, section.marker, len(unbacked)))
                if section.marker[0] == NOT_BACKED:
                    first = section.sentences[0].line if section.sentences else 0
                    unbacked.append([f"{where(first)}: section '{section.heading}' and the sections under it "
                                     f"[{NOT_BACKED}: {' '.join(section.marker[1].split())}]", 0])
            files = _section_files(section, evidence_files, where, report)
            covered = _covered(section, where, unbacked)
            under = headings[-1] if headings else None
            if under and under[1][0] == NOT_BACKED:
                unbacked[under[2]][1] += sum(len(s.figures) for s in section.sentences)
            for k, s in enumerate(section.sentences):
                for fig in s.figures:
                    if under or k in covered or s.prediction or fig.qualifier in ("bound", "prediction"):
                        report.exempt += 1
                        continue
                    problem = _unbacked(fig, s, files, evidence_files.results)
                    if problem:
                        report.problems.append(f"{where(fig.line)}: {fig.text!r}: {problem}")
                    else:
                        report.checked += 1
    report.unbacked = [f"{text} ({n} figure(s))" for text, n in unbacked]
    if len(unbacked) > MAX_UNBACKED:
        report.problems.append(f"{len(unbacked)} markers '[{NOT_BACKED}: ...]' (at most {MAX_UNBACKED}): a figure "
                               "without a file goes, or its file is added to results/")
    return report


def _section_files(section: Section, evidence_files: Evidence, where, report: Report) -> list[Path]:
    """The results files a section cites; a cited path that is not there is a problem."""
    files: list[Path] = []
    for citation, line in dict.fromkeys(section.citations):
        found, exists = evidence_files.resolve(citation)
        if not exists:
            report.problems.append(f"{where(line)}: cites {citation}, which is not under results/ "
                                   "(moved to results/archive/?)")
        files += found
    return list(dict.fromkeys(files))


def _covered(section: Section, where, unbacked: list[list]) -> set[int]:
    """The sentences of a section that a marker covers: its own, and a table right after it.
    Each not-backed marker is added to `unbacked` with the figures it covers."""
    covered: set[int] = set()
    for k, s in enumerate(section.sentences):
        m = MARKER.search(s.text)
        if not m:
            continue
        j = k + 1
        while j < len(section.sentences) and section.sentences[j].table and not s.table:
            j += 1
        covered.update(range(k, j))
        if m.group(1).lower() == NOT_BACKED:
            unbacked.append([f"{where(s.line)}: [{NOT_BACKED}: {' '.join(m.group(2).split())}]",
                             sum(len(x.figures) for x in section.sentences[k:j])])
    return covered


def _unbacked(fig: Figure, sentence: Sentence, files: list[Path], results: Path) -> str | None:
    """Why `fig` is not backed by `files`, or None when it is."""
    approx = fig.qualifier == "approx"
    missing = [n for n in fig.numbers if not any(_holds(f, n, fig.unit, approx) for f in files)]
    if not files:
        return "no results file is cited in its section"
    if missing:
        shown = sorted({f.relative_to(results).as_posix() for f in files})
        return (f"{', '.join(missing)} not in the results files its section cites ({', '.join(shown[:4])}"
                f"{', ...' if len(shown) > 4 else ''})")
    backing = [f for f in files if all(_holds(f, n, fig.unit, approx) for n in fig.numbers)]
    if backing and all(_incomplete_file(f) for f in backing) and "incomplete" not in sentence.text.lower():
        return f"only in an incomplete run ({backing[0].relative_to(results).as_posix()}): say so in its sentence"
    return None


def check_links(paths: list[Path], root: Path) -> list[str]:
    """Every relative link of the Markdown files `paths` that names no file or folder:
    "FILE:LINE: link -> TARGET" (web links and in-page anchors are not checked)."""
    problems = []
    for path in paths:
        for line, text in _prose(path.read_text(encoding="utf-8").splitlines()):
            text = _CODE_SPAN.sub("", text)
            for m in _LINK.finditer(text):
                target = m.group(3).split("#")[0]
                if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                    continue
                if not (path.parent / target).exists():
                    problems.append(f"{_shown(path, root)}:{line}: link to {m.group(3)}, which does not exist")
    return problems


def markdown_files(readme: Path, docs: Path) -> list[Path]:
    """The README and every Markdown file under docs/ (those that exist)."""
    return ([Path(readme)] if Path(readme).is_file() else []) + sorted(Path(docs).rglob("*.md"))
