"""Benchmark suites as data: `tsgen bench --suite NAME` runs suites/NAME.yaml.

A suite is a named list of specs x variants x sizes (what the retired device scripts ran;
their commands live in the results they produced):

    description: collectives against NCCL at 256 MiB and 1 GiB, world 4
    gpus: 4                      # default world size of the entries
    sizes: 256M,1G               # default sizes (else each op's own)
    share_gpus: false            # true: ranks share the visible GPUs (timings not comparable)
    entries:
      - spec: specs/allgather.yaml
      - spec: specs/all_reduce_one_shot.yaml
        label: all_reduce_one_shot_b8     # the name in the tables (default: the spec's name)
        variant: {params: {blocks_per_peer: 8}, launch: {blocks: 9}}   # spec fields changed
        sizes: 64K,1M                     # this entry's own sizes
    readme:                      # rows of the performance tables of docs/benchmarks.md (tsgen/bench/index.py)
      title: Collectives at world 4 against NCCL
      sizes: [256M, 1G]
    baselines: [nccl]            # only these of the op's baselines (default: all of them)
    baselines_per_entry: false   # true: every entry times its baselines, also where an earlier entry
                                 # of its group did (variants of one shape, each in its own interleaved rounds)

Entries run in order; consecutive entries of one world size share one World; the baselines
of a group of rows (same op, dtype, world, sizes) are timed once, unless baselines_per_entry. Results go to
RESULTS/<op or family>/<suite>/<date>-<commit>.{json,md} (tsgen/bench/results.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml
from pydantic import Field, ValidationError

from ..errors import SpecError
from ..spec import LoadedSpec, load_spec, spec_variant
from ..spec_types import StrictModel
from .sizes import parse_sizes

SUITES_DIR = Path("suites")


class EntryModel(StrictModel):
    spec: str = Field(description="spec file, relative to the repository root")
    label: str | None = Field(None, description="name of the entry's rows (default: the spec's name)")
    gpus: int | None = Field(None, ge=1, le=64, description="world size (default: the suite's)")
    sizes: str | int | list[str | int] | None = Field(None, description="sizes (default: the suite's, else the op's)")
    variant: dict = Field(default_factory=dict, description="spec fields to change, nested")
    patterns: list[str] | None = Field(None, description="copies: pair and/or ring")
    ideal_of: list[str] | None = Field(None, description="labels of entries this one is the ideal of: their tsgen "
                                       "rows get a ratio 'vs ideal' = their TFLOP/s per GPU / this entry's, same size")
    ideal_peers_busy: bool = Field(False, description="with ideal_of: the named entries also time this ideal on "
                                   "rank 0's GPU while their other GPUs run it too, a second 'vs ideal' ratio "
                                   "(LABEL, peers busy)")


class ReadmeModel(StrictModel):
    title: str
    sizes: list[str | int] | None = None
    labels: list[str] | None = None


class SuiteModel(StrictModel):
    description: str
    gpus: int | None = Field(None, ge=1, le=64)
    sizes: str | int | list[str | int] | None = None
    share_gpus: bool = False
    iters: int = Field(20, ge=1)
    reps: int = Field(7, ge=1)
    entries: list[EntryModel] = Field(min_length=1)
    readme: ReadmeModel | None = None
    baselines: list[str] | None = Field(None, min_length=1, description="names of the op's baselines to time "
                                        "(its conventions' Baseline.name); default: all of them")
    baselines_per_entry: bool = Field(False, description="every entry times its baselines, also where an earlier "
                                      "entry of its group (same op, dtype, world and shape) did: variants of one "
                                      "shape, each paired round by round with the baselines (interleaved ops)")


@dataclass
class Entry:
    spec: Path
    gpus: int | None = None
    sizes: object = None
    label: str | None = None
    variant: dict = field(default_factory=dict)
    patterns: tuple[str, ...] | None = None
    ideal_of: tuple[str, ...] = ()
    ideal_peers_busy: bool = False
    loaded_spec: LoadedSpec | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        """Its rows' label (what ideal_of names): the suite's label, else the spec's name."""
        return self.label or self.loaded.model.name

    @property
    def loaded(self) -> LoadedSpec:
        """The spec with the entry's variant, loaded (and its plans built) once for the whole
        run: the suite's check, the progress count, the world sizes and the timing all read it."""
        if self.loaded_spec is None:
            self.loaded_spec = spec_variant(load_spec(self.spec), self.variant)
        return self.loaded_spec


@dataclass
class Suite:
    name: str
    path: Path | None
    model: SuiteModel
    entries: list[Entry]


def suite_path(name: str, suites_dir: Path = SUITES_DIR) -> Path:
    p = Path(name)
    return p if p.suffix in (".yaml", ".yml") else Path(suites_dir) / f"{name}.yaml"


def load_suite(name: str, suites_dir: Path = SUITES_DIR) -> Suite:
    """Parse and check suites/NAME.yaml (or a path): every spec exists, every size parses.
    Problems raise SpecError (`FILE: field: what is wrong`)."""
    path = suite_path(name, suites_dir)
    if not path.exists():
        known = sorted(p.stem for p in Path(suites_dir).glob("*.yaml"))
        raise SpecError([f"{path}: no such suite (suites: {', '.join(known) or 'none'})"])
    try:
        model = SuiteModel.model_validate(yaml.safe_load(path.read_text()))
    except yaml.YAMLError as e:
        raise SpecError([f"{path}: {e}"]) from None
    except ValidationError as e:
        raise SpecError([f"{path}: {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]) from None
    problems, entries, names = [], [], set()  # names: the entries' row labels (ideal_of refers to them)
    for i, e in enumerate(model.entries):
        loaded = None
        where = f"{path}: entries.{i}"
        sizes = e.sizes if e.sizes is not None else model.sizes
        try:
            if sizes is not None:
                parse_sizes(sizes)
        except ValueError as err:
            problems.append(f"{where}.sizes: {err}")
        if not Path(e.spec).exists():
            problems.append(f"{where}.spec: {e.spec} does not exist")
        else:
            try:  # a variant validated as a shipped spec is
                loaded = spec_variant(load_spec(e.spec), e.variant)
                names.add(e.label or loaded.model.name)
            except SpecError as err:
                problems += [f"{where}.{'variant' if e.variant else 'spec'}: {p}" for p in err.problems]
        if loaded is not None and model.baselines is not None:
            from ..ops import get_family

            known = [b.name for b in get_family(loaded.model.op).bench.baselines]
            problems += [f"{path}: baselines: {b!r} is not a baseline of op {loaded.model.op} "
                         f"({', '.join(known) or 'it has none'})" for b in model.baselines if b not in known]
        entries.append(Entry(Path(e.spec), e.gpus or model.gpus, sizes, e.label, e.variant,
                             tuple(e.patterns) if e.patterns else None, tuple(e.ideal_of or ()),
                             e.ideal_peers_busy, loaded))
    named: dict[str, int] = {}  # entry label -> the ideal entry that names it (one each: runner.Ideal)
    for i, e in enumerate(entries):
        problems += [f"{path}: entries.{i}.ideal_of: no entry is labelled {n!r} (entries: {', '.join(sorted(names))})"
                     for n in e.ideal_of if n not in names]
        problems += [f"{path}: entries.{i}.ideal_of: {n!r} already has an ideal (entries.{named[n]}); an entry is "
                     "timed against one" for n in e.ideal_of if n in named]
        named.update({n: i for n in e.ideal_of if n not in named})
        if e.ideal_peers_busy and not e.ideal_of:
            problems.append(f"{path}: entries.{i}.ideal_peers_busy: set without ideal_of (no entry times it)")
    if problems:
        raise SpecError(problems)
    return Suite(path.stem, path, model, entries)


def list_suites(suites_dir: Path = SUITES_DIR) -> list[tuple[str, str]]:
    out = []
    for p in sorted(Path(suites_dir).glob("*.yaml")):
        try:
            out.append((p.stem, yaml.safe_load(p.read_text()).get("description", "")))
        except (yaml.YAMLError, AttributeError):
            out.append((p.stem, "(unreadable)"))
    return out


def add_ideal_ratios(entries: list[Entry], outcomes: list) -> None:
    """ratios["ideal: LABEL"] on the tsgen rows of the entries an ideal entry names (ideal_of):
    their TFLOP/s per GPU over the ideal's at the same size (cp_attention against the single-GPU
    attention kernel of the same shape: ring-flash-attention's "% of ideal"). Where the entry timed the
    ideal in its own rounds (runner.Ideal, runner.add_ratios), that paired ratio stays: this one, from
    two medians timed apart, is only the fallback."""
    from .runner import SHARED_NOTE, ideal_key

    by_name = {o.spec: o for o in outcomes}
    for e, o in zip(entries, outcomes):
        ideal = {r["size"]: r for r in o.rows if r["impl"] == "tsgen" and r.get("TFLOPs")}
        for name in e.ideal_of:
            for r in by_name[name].rows if name in by_name else []:
                best = ideal.get(r["size"])
                if r["impl"] == "tsgen" and r.get("TFLOPs") and best and not r.get("note", "").startswith(SHARED_NOTE):
                    r.setdefault("ratios", {}).setdefault(ideal_key(o.spec), r["TFLOPs"] / best["TFLOPs"])


class Stopped(BaseException):
    """A signal (SIGTERM) stopped a suite: run_entries keeps the entries it finished. A
    BaseException, as KeyboardInterrupt is, so that no `except Exception` on the way (a
    baseline's error handling, a timing's) turns it into one failed measurement and goes on."""


def stop_on_signals() -> None:
    """Turn SIGTERM (a time limit's `timeout`, a job scheduler) into Stopped, as Ctrl-C is
    KeyboardInterrupt: a suite stopped part way still writes the entries it finished."""
    import signal

    def stop(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)


def run_entries(entries: list[Entry], *, iters: int = 20, reps: int = 7, warmup: int = 3, backend: str = "single",
                share_gpus: bool | None = None, baselines: bool = True, control: str | None = None,
                arch: str = "sm_90a", echo: Callable[[str], None] = print,
                progress: Callable[[str], None] | None = None, only_baselines: tuple[str, ...] | None = None,
                baselines_per_entry: bool = False):
    """Run entries in order, one World per run of consecutive entries with the same world size.
    Returns (outcomes, the environment of the last World). Stopped by a signal (Stopped, or
    KeyboardInterrupt) part way: the outcomes of the entries finished, and env["stopped"] says
    after how many of them and why. only_baselines, baselines_per_entry: the suite's baselines
    and baselines_per_entry."""
    from ..ops import get_family
    from ..runtime import World
    from ..runtime.backends import world_size
    from .runner import IdealOf, add_ratios, baseline_group, bench_spec
    from .results import environment

    planned = []
    for e in entries:
        loaded = e.loaded
        gpus = e.gpus
        if backend != "single":
            gpus = world_size(backend, gpus)
        elif gpus is None and len(loaded.model.world_sizes) == 1:
            gpus = loaded.model.world_sizes[0]
        if gpus is None:
            raise SpecError([f"{e.spec}: a world size is needed (--gpus, or gpus: in the suite): the spec runs at "
                             f"{list(loaded.model.world_sizes)}"])
        group = baseline_group(loaded.model, get_family(loaded.model.op), gpus)
        planned.append((e, gpus, (group, e.patterns)))  # a group's baselines: timed with its first entry's sizes
    # an entry an ideal entry names (ideal_of) times that ideal in its own rounds too (runner.Ideal)
    ideal_for = {name: IdealOf(e.name, e.loaded, e.ideal_peers_busy) for e in entries for name in e.ideal_of}
    outcomes, env, timed = [], {}, set()
    try:
        for gpus, group in itertools.groupby(planned, key=lambda p: p[1]):
            with World(gpus, backend=backend, share_gpus=share_gpus) as world:
                seen = (env.get("device") or {}).get("gpus", 0)
                env = environment(world)
                if "device" in env:  # the suite's largest world: a mixed suite ends with its 1-GPU entries
                    env["device"]["gpus"] = max(env["device"]["gpus"], seen)
                for e, _, key in group:
                    out = bench_spec(e.loaded, gpus, e.sizes, label=e.label, iters=iters, reps=reps,
                                     warmup=warmup, patterns=e.patterns, backend=backend, share_gpus=share_gpus,
                                     baselines=baselines and (baselines_per_entry or key not in timed), arch=arch,
                                     echo=echo, progress=progress, control=control, world=world,
                                     only_baselines=only_baselines,
                                     ideal=ideal_for.get(e.name) if baselines else None)
                    timed.add(key)
                    outcomes.append(out)
    except (Stopped, KeyboardInterrupt) as why:
        env = dict(env, stopped=f"stopped ({why or 'interrupted'}) after {len(outcomes)} of {len(planned)} entries: "
                                f"the rest were not run")
        echo(f"tsgen bench: {env['stopped']}")
    rows = [r for o in outcomes for r in o.rows]
    add_ratios(rows)
    add_ideal_ratios(entries, outcomes)
    return outcomes, env
