"""The plan IR: Slice, SignalRef, Step, Share, RankPlan, CommPlan, `schedule`, and the
limits of the C tables (the renderer writes them into templates/include/tsgen/plan.cuh's
#defines: tsgen.plan.lower.C_DEFINES). See tsgen/plan/__init__.py."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

MAX_SRCS = 8
MAX_WAITS = 8
MAX_SIGNALS = 8
MAX_ALSO = 7


@dataclass(frozen=True, order=True)
class Slice:
    buffer: str
    unit: int = 0
    piece: int = 0
    pieces: int = 1

    def __str__(self) -> str:
        p = f"[{self.piece}/{self.pieces}]" if self.pieces > 1 else ""
        return f"{self.buffer}@{self.unit}{p}"


@dataclass(frozen=True)
class SignalRef:
    rank: int  # whose memory holds the counter
    name: str  # signal buffer
    index: int


@dataclass(frozen=True)
class Step:
    """One action of one rank, split evenly over `blocks` blocks.

    op: "copy" (dst = src), "reduce" (dst = sum of srcs, fp32 accumulation)
    or "none" (only waits and signals). Each block doing a share waits for
    `waits` (counters in this rank's memory) first, and raises each of
    `signals` by one after its share is written. `also` (reduce only): more
    destinations that get the same values as dst (a reduced part stored to
    every rank at once, instead of re-read and copied once per peer).
    """

    op: str
    dst: tuple[int, Slice] | None = None  # (rank whose memory is written, slice)
    also: tuple[tuple[int, Slice], ...] = ()  # further (rank, slice) written with dst's values
    srcs: tuple[tuple[int, Slice], ...] = ()
    waits: tuple[tuple[str, int], ...] = ()
    signals: tuple[SignalRef, ...] = ()
    blocks: int = 1
    note: str = ""
    lane: str | None = None  # steps of one lane run in order on the same blocks (a pipeline)


@dataclass(frozen=True)
class Share:
    step: int  # index into the rank's steps
    share: int  # which share of the step this block does
    shares: int


@dataclass
class RankPlan:
    steps: list[Step]
    blocks: list[list[Share]] = field(default_factory=list)  # per block, in order


@dataclass
class CommPlan:
    """Everything a collective does at one world size."""

    world: int
    nblocks: int
    ranks: list[RankPlan]
    buffers: dict[str, str]  # name -> role: input | output | scratch | inout
    signals: dict[str, int]  # name -> number of u64 counters per rank
    expected: dict[tuple[int, Slice], Counter]  # (rank, output slice) -> contributions
    per_call: dict[tuple[int, str, int], int] = field(default_factory=dict)

    def wait_target(self, rank: int, name: str, index: int) -> int:
        return self.per_call.get((rank, name, index), 0)


def schedule(world: int, nblocks: int | None, steps_per_rank: list[list[Step]], **kw) -> CommPlan:
    """Assign shares of steps to blocks and count the adds each signal receives per call.

    nblocks None: as many blocks as the widest rank's groups need (copy-engine plans,
    whose "blocks" are streams).
    Steps are grouped: the steps of one lane form a group (they run in order on
    the same blocks, so piece i+1 of a pipeline starts after piece i); every
    other step is a group of its own. Groups take consecutive blocks in order
    of first appearance, wrapping around when the grid is smaller than the work."""
    if nblocks is None:
        nblocks = max(sum(max(steps[i].blocks for i in g) for g in _groups(steps).values())
                      for steps in steps_per_rank)
    ranks = []
    for steps in steps_per_rank:
        groups = _groups(steps)
        blocks: list[list[Share]] = [[] for _ in range(nblocks)]
        base = 0
        for members in groups.values():
            width = max(steps[i].blocks for i in members)
            for i in members:
                for s in range(steps[i].blocks):
                    blocks[(base + s) % nblocks].append(Share(i, s, steps[i].blocks))
            base += width
        ranks.append(RankPlan(steps, blocks))
    plan = CommPlan(world=world, nblocks=nblocks, ranks=ranks, **kw)
    per_call: Counter = Counter()
    for rp in ranks:
        for step in rp.steps:
            for sig in step.signals:
                per_call[(sig.rank, sig.name, sig.index)] += step.blocks
    plan.per_call = dict(per_call)
    return plan


def _groups(steps: list[Step]) -> dict[object, list[int]]:
    """Step indices by group: one group per lane, every other step alone, in order."""
    groups: dict[object, list[int]] = {}
    for i, step in enumerate(steps):
        groups.setdefault(step.lane if step.lane is not None else ("step", i), []).append(i)
    return groups


