"""`tsgen verify` over many specs and world sizes: which plans there are to verify,
and verifying them in a pool of processes.

Each plan's schedules are cut into chunks of CHUNK; the pool runs chunks of all
plans at once, and the results come back per plan in the order the plans were
listed, whatever the order the chunks finish in. Every schedule stands alone
(plan.verify), so a plan's problems are those of its first chunk that has any:
the same as one process running its schedules in order."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

from .ops import get_family
from .plan import CommPlan, default_schedules, schedule_orders, verify
from .spec import load_spec, spec_files

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


def plan_jobs(paths: Iterable[Path], worlds: Iterable[int], schedules: int | None = None) -> list[PlanJob]:
    """Every collective plan of the specs under `paths` at each world size, in order.
    schedules None: default_schedules(world)."""
    jobs = []
    for path in spec_files(list(paths)):
        loaded = load_spec(path)
        family = get_family(loaded.model.op)
        if not hasattr(family, "comm_plan"):
            continue
        if family.is_multimem(loaded.model):
            jobs.append(PlanJob(loaded.name, path, None, skip="multimem variant: no plan to verify, compiled only"))
            continue
        for w in worlds:
            problems = family.check(loaded.model.model_copy(update={"world_sizes": [w]}))
            jobs.append(PlanJob(loaded.name, path, w, default_schedules(w) if schedules is None else schedules,
                                skip=problems[0][1] if problems else None))
    return jobs


@lru_cache(maxsize=4)  # a worker mostly gets consecutive chunks of one plan
def job_plan(path: Path, world: int) -> CommPlan:
    spec = load_spec(path).model.model_copy(update={"world_sizes": [world]})
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
