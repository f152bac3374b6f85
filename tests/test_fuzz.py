"""Property-based fuzzing of `tsgen build` over mutated shipped specs (hypothesis).

Every case is a shipped spec mutated as text (nasty characters, tags, aliases, brackets,
values at and past their bounds, names that are keywords or declared names) or as data
(a field set to any value, removed or added), under a file and folder name that may hold
newlines, CRs, trigraphs or any Unicode. Whatever the case, `tsgen build` exits 0 or 2,
without a traceback; on 2 every problem line is `FILE:LINE:COL: field: message` and nothing
is written; on 0 `--check` is clean, and a few of the valid cases go through nvcc's front
end. A second property: no description and no file or folder name changes what remains of
a source once its comments are stripped as a C preprocessor strips them, with and without
trigraphs. A third (issue 30): a whole number of a shipped spec written in a form only YAML 1.1
reads (040, 1:04, 1_0, 0b11), as a float (64.0) or as a bool is refused at its line, never read
as some number. Cases: TSGEN_FUZZ_EXAMPLES (default 1000, a quarter as many for the injection
property and a fifth for the numbers); the run is derandomized, so CI sees the same cases every
time (TSGEN_FUZZ_RANDOM=1 draws new ones). They are `slow`: CI runs them, the inner loop does not.
The build and injection fuzzers run a quarter of their cases by default ([quarter]) and all of them
under `-m exhaustive` ([whole]: the GPU gate runs it, tests/conftest.py)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ccode import code_without_comments  # noqa: E402
from conftest import ROOT, SPECS, exhaustive, run_cli  # noqa: E402
from test_hardening import DECLARED, KEYWORDS, RESERVED, needs_nvcc, nvcc_front_end  # noqa: E402
from tsgen.errors import one_line  # noqa: E402

EXAMPLES = int(os.environ.get("TSGEN_FUZZ_EXAMPLES", "1000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("TSGEN_FUZZ_RANDOM"),
                database=None, suppress_health_check=list(HealthCheck))
# The divisor of a fuzzer's count: a quarter of the cases by default, all of them under -m exhaustive.
SHARES = [pytest.param(4, id="quarter"), exhaustive(1, id="whole")]


def run_fuzzer(prop, strategies, examples: int):
    """Property `prop` (a plain function) under FUZZ with `examples` cases drawn from `strategies`."""
    settings(FUZZ, max_examples=max(1, examples))(given(*strategies)(prop))()

NASTY = ["\x00", "\x01", "\x1b", "\x7f", "\ufffe", "\t", "\r", "\r\n", "\u2028", "\x85", "\ufeff", ": ", "- ",
         "[", "]", "{", "}", "&a ", "*a", "!!int ", "!!float ", "!!bool ", "!!timestamp ", "!!binary ", "!!str ",
         "!!map ", "!!seq ", "!!python/object/apply:os.system ", "!foo ", "? ", "|", ">-", "'", '"', "#", "---\n",
         "...\n", "%YAML 1.1\n", "<<: *a\n", "\\", "??/", "*/", "/*", "//", "\n__global__ void x() {}\n", "é",
         "日本", "😀", "9" * 60, "-1", "1e999", ".nan", "~", "null", "0x10", "0o17", "1_000", "2020-01-01", "=",
         "[" * 40, "a: " * 40,
         # what YAML 1.1 reads as numbers and YAML 1.2 does not (or reads otherwise); non-finite floats; bools
         "040", "0777", "1:04", "1_0_", "0b11", "1_000.5", "1:30.5", ".inf", "-.inf", ".NaN", "1.0e+999", "2.0",
         "true", "yes", "on", "off"]
INTS = [0, 1, 2, 3, 4, 7, 8, 9, 15, 16, 31, 32, 33, 63, 64, 65, 127, 128, 255, 256, 511, 512, 513, 1023, 1024,
        1025, 4096, 65536, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, 1 << 32, (1 << 63) - 1, 1 << 63, 1 << 64, -1,
        -(1 << 63)]
NAMES = st.one_of(st.sampled_from(KEYWORDS + DECLARED + RESERVED + ["count", "rank", "run", "x", "a" * 65]),
                  st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,66}", fullmatch=True), st.text(max_size=12))
VALUES = st.one_of(st.sampled_from(INTS), st.integers(), st.floats(), st.booleans(), st.none(), NAMES,
                   st.sampled_from([float("inf"), float("-inf"), float("nan"), 64.0, 2.0, True, False]),
                   st.text(max_size=30), st.lists(st.sampled_from(INTS[:12]), max_size=9),
                   st.dictionaries(st.sampled_from(["a", "m", "n", "k", "size", "along", "blocks"]),
                                   st.sampled_from(INTS[:12]), max_size=3))
# file and folder names: anything a Linux file name can be (not '/' or NUL, at most 255 bytes)
FILE_NAMES = st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)),
                     min_size=1, max_size=40).filter(lambda s: s not in (".", "..") and len(s.encode()) < 240)


def _leaves(data, path=()):
    """Every (path, value) in a spec's data, mappings and lists included."""
    yield path, data
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _leaves(v, path + (i,))


@st.composite
def data_mutation(draw, text: str) -> str:
    """The spec as data with one field set to any value, removed or added; dumped as YAML."""
    try:
        data = yaml.safe_load(text)
    except Exception:  # noqa: BLE001 -- mutated text PyYAML itself cannot read (IndexError on `!!int _`)
        data = None
    paths = [p for p, _ in _leaves(data) if p] if isinstance(data, dict) else []
    if not paths:
        return draw(text_mutation(text))
    path = draw(st.sampled_from(paths))
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    how = draw(st.sampled_from(["set", "set", "set", "remove", "add"]))
    if how == "remove":
        del parent[path[-1]]
    elif how == "add" and isinstance(parent, dict):
        parent[draw(st.sampled_from(["extra", "colour", "blocks", "1", "name"]))] = draw(VALUES)
    else:
        parent[path[-1]] = draw(NAMES if path == ("name",) else VALUES)
    return yaml.safe_dump(data, allow_unicode=draw(st.booleans()), sort_keys=draw(st.booleans()))


@st.composite
def text_mutation(draw, text: str) -> str:
    """The spec's text with a nasty snippet inserted, a slice cut, a line doubled or a value replaced."""
    lines = text.splitlines(keepends=True)
    how = draw(st.sampled_from(["insert", "cut", "double", "value", "value"]))
    if how == "insert":
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.one_of(st.sampled_from(NASTY), st.text(max_size=8))) + text[at:]
    if how == "cut":
        at = draw(st.integers(0, len(text)))
        return text[:at] + text[at + draw(st.integers(1, 40)):]
    i = draw(st.integers(0, len(lines) - 1))
    if how == "double":
        return "".join(lines[:i + 1] + lines[i:])
    m = re.match(r"(\s*[\w]+:\s*)(.*)", lines[i])
    if not m:
        return text
    new = draw(st.one_of(st.sampled_from(NASTY), st.builds(str, st.sampled_from(INTS)),
                         st.builds(lambda v: json.dumps(v, ensure_ascii=False), VALUES)))
    lines[i] = m[1] + new + "\n"
    return "".join(lines)


@st.composite
def fuzzed_case(draw):
    spec = draw(st.sampled_from(SPECS))
    text = spec.read_text()
    for _ in range(draw(st.integers(1, 3))):
        text = draw(st.one_of(text_mutation(text), data_mutation(text)))
    folder = draw(st.one_of(st.just("specs"), FILE_NAMES))
    name = draw(st.one_of(st.just(spec.name), FILE_NAMES.map(lambda s: s + ".yaml")))
    return folder, name, text


PROBLEM = re.compile(r"(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): (?P<field>[^\n]+?): (?P<msg>[^\n]+)\Z")
STATS = {"cases": 0, "valid": 0, "invalid": 0, "yaml11": 0}


def build_case(root: Path, folder: str, name: str, text: str):
    spec = root / folder / name
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(text, encoding="utf-8", errors="surrogatepass")
    out = root / "out"
    r = run_cli("build", spec, "-o", out)  # an unexpected exception propagates: the test fails
    assert r.code in (0, 2), r
    assert "Traceback" not in r.stderr, r
    return spec, out, r


def fuzz_build(case):
    folder, name, text = case
    STATS["cases"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        spec, out, r = build_case(Path(tmp), folder, name, text)
        if r.code == 2:
            STATS["invalid"] += 1
            *problems, summary = r.stderr.splitlines()
            assert problems and re.fullmatch(r"tsgen: \d+ problems? in the specs; nothing was written", summary), r
            for line in problems:
                m = PROBLEM.fullmatch(line)
                assert m and m["file"] == one_line(str(spec)) and int(m["line"]) >= 1 and int(m["col"]) >= 1, r
            assert r.stdout == "" and not out.exists(), "a bad spec wrote something"
            return
        STATS["valid"] += 1
        written = sorted(p.name for p in out.iterdir())
        assert len(written) == 2 and written[0].endswith(".cu") and written[1] == written[0][:-3] + ".json"
        assert run_cli("build", spec, "-o", out, "--check").code == 0
        source = (out / written[0]).read_text()
        banner = source[:source.index("#include")].splitlines()
        assert source.isascii() and all(line.startswith("//") for line in banner)


@pytest.mark.slow
@pytest.mark.parametrize("share", SHARES)
def test_fuzz_build(share):
    STATS.update(cases=0, valid=0, invalid=0)
    run_fuzzer(fuzz_build, [fuzzed_case()], EXAMPLES // share)
    print(f"\nfuzz: {STATS['cases']} cases, {STATS['valid']} valid, {STATS['invalid']} refused")
    assert STATS["valid"] >= EXAMPLES // share // 10 and STATS["invalid"] >= EXAMPLES // share // 10, STATS


# ---------------------------------------------------------------------------
# Whole numbers in a form only YAML 1.1 reads, as floats or as bools: refused at their line
# ---------------------------------------------------------------------------

INT_LINE = re.compile(r"^(?P<head>\s*[\w]+:\s*)(?P<value>\d+)\s*$", re.M)


def yaml11_forms(v: int) -> list[str]:
    """`v` written as only YAML 1.1 reads it (leading-zero octal, '_'-separated, binary, base 60),
    and as a float and as bools."""
    digits = str(v)
    forms = [f"0{v:o}", f"{digits}_", f"{digits[0]}_{digits[1:]}" if v >= 10 else f"{v}_0", f"0b{v:b}", f"{v}.0",
             "true", "false", "yes"]
    if v >= 60:
        forms.append(f"{v // 60}:{v % 60:02d}")
    return forms


@st.composite
def yaml11_case(draw):
    spec = draw(st.sampled_from(SPECS))
    text = spec.read_text()
    lines = list(INT_LINE.finditer(text))
    assume(lines)
    m = draw(st.sampled_from(lines))
    form = draw(st.sampled_from(yaml11_forms(int(m["value"]))))
    line = text.count("\n", 0, m.start()) + 1
    return text[:m.start("value")] + form + text[m.end("value"):], line, form


@settings(FUZZ, max_examples=EXAMPLES // 5)
@given(yaml11_case())
def fuzz_yaml11(case):
    text, line, form = case
    STATS["yaml11"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        spec, out, r = build_case(Path(tmp), "specs", "x.yaml", text)
    assert r.code == 2, (form, r)
    problems = r.stderr.splitlines()[:-1]
    assert any(PROBLEM.fullmatch(p)["line"] == str(line) for p in problems), (form, line, r)


@pytest.mark.slow
def test_yaml11_numbers_floats_and_bools_for_whole_numbers_are_refused():
    fuzz_yaml11()
    print(f"\nfuzz: {STATS['yaml11']} whole numbers in YAML 1.1-only forms, as floats or as bools, all refused")
    assert STATS["yaml11"] >= EXAMPLES // 10, STATS


# ---------------------------------------------------------------------------
# A handful of valid mutated cases through nvcc's front end
# ---------------------------------------------------------------------------


@st.composite
def plausible_case(draw):
    """A shipped spec with a new name, description and one number halved or doubled: mostly valid."""
    spec = draw(st.sampled_from(SPECS))
    data = yaml.safe_load(spec.read_text())
    data["name"] = draw(st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True))
    data["description"] = draw(st.text(max_size=80))
    numbers = [p for p, v in _leaves(data) if type(v) is int and p[0] != "test"]
    path = draw(st.sampled_from(numbers))
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = draw(st.sampled_from([parent[path[-1]] * 2, parent[path[-1]] // 2 or 1]))
    return "specs", "x.yaml", yaml.safe_dump(data, allow_unicode=True)


@pytest.mark.compile
@needs_nvcc
@settings(max_examples=5, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(plausible_case())
def test_fuzzed_valid_specs_compile(case):
    with tempfile.TemporaryDirectory() as tmp:
        spec, out, r = build_case(Path(tmp), *case)
        assume(r.code == 0)
        (source,) = out.glob("*.cu")
        proc = nvcc_front_end(source)
        assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------------------
# Injection: no description and no file or folder name reaches the code
# ---------------------------------------------------------------------------

BASELINE = {(spec, t): code_without_comments((ROOT / "generated" / f"{spec}.cu").read_text(), t)
            for spec in ("put_block", "all_reduce_two_shot_ce") for t in (False, True)}
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)


@pytest.mark.slow
@pytest.mark.parametrize("share", SHARES)
def test_no_spec_input_reaches_the_code(share):
    run_fuzzer(no_spec_input_reaches_the_code,
               [st.sampled_from(["put_block", "all_reduce_two_shot_ce"]), FILE_NAMES, FILE_NAMES,
                st.one_of(TEXT, st.lists(st.sampled_from(NASTY), max_size=8).map("".join))], EXAMPLES // 4 // share)


def no_spec_input_reaches_the_code(spec, folder, name, description):
    data = yaml.safe_load((ROOT / "specs" / f"{spec}.yaml").read_text())
    data["description"] = description[:2000]
    with tempfile.TemporaryDirectory() as tmp:
        path, out, r = build_case(Path(tmp), folder, name + ".yaml", yaml.safe_dump(data, allow_unicode=True))
        assert r.code == 0, r
        source = (out / f"{spec}.cu").read_text()
    for trigraphs in (False, True):
        assert code_without_comments(source, trigraphs) == BASELINE[spec, trigraphs]
