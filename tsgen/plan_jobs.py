"""`tsgen verify` over spec files: every plan of the specs under some paths, at their world
sizes or given ones, verified on the CPU (tsgen.plan.verifier.verify) in a pool of processes.
It loads specs, so it sits above tsgen.spec; tsgen/plan/ itself imports nothing of tsgen above
it (tests/test_layers.py)."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Iterator

from .errors import CheckFailed, SpecError, TsgenError
from .ops import OpFamily, families, get_family
from .plan.ir import CommPlan
from .plan.verifier import default_schedules, schedule_orders, verify
from .spec import LoadedSpec, load_spec, spec_files, spec_variant

# ---------------------------------------------------------------------------
# `tsgen verify`: the plans of many specs and world sizes, verified in a pool of processes.
#
# Each plan's schedules are cut into chunks of CHUNK; the pool runs chunks of all plans at
# once, and the results come back per plan in the order the plans were listed, whatever the
# order the chunks finish in. Every schedule stands alone (verify), so a plan's problems are
# those of its first chunk that has any: the same as one process running its schedules in order.
# ---------------------------------------------------------------------------

CHUNK = 8  # schedules a worker verifies per task


@dataclass(frozen=True)
class PlanJob:
    """The plan of spec `path` at `world` size, verified under `schedules` random
    interleavings (plus the fixed ones); `skip` says why it is not verified. world None:
    the whole spec is skipped."""

    name: str
    path: Path
    world: int | None
    schedules: int = 0
    skip: str | None = None

    @property
    def label(self) -> str:
        return self.name if self.world is None else f"{self.name} world {self.world}"


def _has_plans(family: OpFamily) -> bool:
    """The family's ops are built from comm plans (the collectives)."""
    return hasattr(family, "comm_plan")


def _planned_specs(paths: Iterable[Path]) -> Iterator[tuple[Path, LoadedSpec, OpFamily]]:
    """(path, loaded spec, family) of each spec under `paths` whose op is built from a comm plan."""
    for path in spec_files(list(paths)):
        loaded = load_spec(path)
        family = get_family(loaded.model.op)
        if _has_plans(family):
            yield path, loaded, family


def plan_jobs(paths: Iterable[Path], worlds: Iterable[int] | None = None,
              schedules: int | None = None) -> list[PlanJob]:
    """Every collective plan of the specs under `paths`, in order: at each spec's own world
    sizes (worlds None), or at each of `worlds`, built as a variant of the spec (skipped where
    the family does not plan that world size). schedules None: default_schedules(world)."""
    jobs = []
    for path, loaded, family in _planned_specs(paths):
        if family.is_multimem(loaded.model):
            jobs.append(PlanJob(loaded.name, path, None, skip="multimem variant: no plan to verify, compiled only"))
            continue
        for w in loaded.model.world_sizes if worlds is None else worlds:
            try:
                spec_variant(loaded, {"world_sizes": [w]})
                skip = None
            except SpecError as e:  # the family does not plan this world size
                skip = e.problems[0]
            jobs.append(PlanJob(loaded.name, path, w, default_schedules(w) if schedules is None else schedules,
                                skip=skip))
    return jobs


def not_compiled_for(paths: Iterable[Path], worlds: Iterable[int]) -> list[str]:
    """`tsgen verify --world`: a line for each collective spec under `paths` that is not
    compiled for every one of `worlds` (its world_sizes), saying which."""
    worlds = list(worlds)
    problems = []
    for path, loaded, _ in _planned_specs(paths):
        compiled = loaded.model.world_sizes
        if missing := [w for w in worlds if w not in compiled]:
            problems.append(f"{path}: compiled for world sizes {list(compiled)}, not {', '.join(map(str, missing))}")
    return problems


@lru_cache(maxsize=4)  # a worker mostly gets consecutive chunks of one plan
def job_plan(path: Path, world: int) -> CommPlan:
    spec = spec_variant(load_spec(path), {"world_sizes": [world]}).model
    return get_family(spec.op).comm_plan(spec, world)


def _verify_chunk(path: Path, world: int, schedules: int, seed: int, first: int, stop: int) -> list[str]:
    return verify(job_plan(path, world), schedules=schedules, seed=seed, trials=range(first, stop))


def _chunks(job: PlanJob, seed: int) -> list[tuple]:
    n = len(schedule_orders(job.schedules))
    return [(job.path, job.world, job.schedules, seed, lo, min(lo + CHUNK, n)) for lo in range(0, n, CHUNK)]


def verify_jobs(jobs: list[PlanJob], seed: int = 0, processes: int = 1) -> Iterator[tuple[PlanJob, list[str]]]:
    """Each job with its problems ([] = verified, or skipped), in the order of `jobs`.
    processes > 1: a pool of that many processes verifies chunks of every job at once."""
    todo = [(job, [] if job.skip else _chunks(job, seed)) for job in jobs]
    if processes <= 1:
        for job, chunks in todo:
            yield job, next((p for c in chunks if (p := _verify_chunk(*c))), [])
        return
    pool = ProcessPoolExecutor(processes)
    try:
        submitted = [(job, [pool.submit(_verify_chunk, *c) for c in chunks]) for job, chunks in todo]
        for job, futures in submitted:
            yield job, next((p for f in futures if (p := f.result())), [])
    finally:
        pool.shutdown(cancel_futures=True)


def verify_specs(paths: list[Path], sizes: list[int] | None, schedules: int | None, seed: int, processes: int,
                 echo: Callable[[str], None]) -> int:
    """`tsgen verify`: every plan of the specs under `paths` at each world size in `sizes`
    (None: each spec's own world sizes), one line each through `echo`, in spec order; the
    number of plans verified. TsgenError (exit 2) when `sizes` holds a world size a spec is not
    compiled for, or when there is no plan to verify; CheckFailed when any plan fails."""
    if sizes is not None and (refused := not_compiled_for(paths, sizes)):
        raise TsgenError(f"--world {','.join(map(str, sizes))}: not every spec is compiled for it (without --world, "
                         "each spec is verified at its own world sizes):\n  " + "\n  ".join(refused))
    failed = checked = 0
    for job, problems in verify_jobs(plan_jobs(paths, sizes, schedules), seed, processes):
        if job.skip:
            echo(f"{job.label}: skipped ({job.skip})")
            continue
        checked += 1
        if problems:
            failed += 1
            echo(f"{job.label}: FAIL")
            for p in problems[:8]:
                echo("    " + p.replace("\n", "\n    "))
        else:
            echo(f"{job.label}: ok ({job.schedules + 3} schedules x 2 calls)")
    if failed:
        raise CheckFailed(f"{failed} of {checked} plans failed verification")
    if not checked:
        planned = ", ".join(f.kind for f in families() if _has_plans(f))
        raise TsgenError(f"no plan to verify in {' '.join(map(str, paths))}: only collectives built from a "
                         f"comm plan ({planned}) have one, and their multimem variants do not")
    return checked
