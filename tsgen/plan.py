"""Communication plans as data, and their CPU verifier.

A collective's plan says, for every rank, what each block of the kernel
does, in order: wait for signals, copy or reduce one slice of memory (its
share of a step), raise signals. The generated kernel is an interpreter of
exactly this table (rendered as a __constant__ array), or for a small plan
straight-line code making the same share calls, and `tsgen verify`
executes the same table on the CPU under many interleavings of ranks and
blocks, so what is verified is what runs.

Memory is named by Slice: a buffer, an offset in units of the run-time
`count`, and a piece of that unit (a unit split into `pieces` parts with
16-byte aligned boundaries). Signals are u64 counters that only grow: a
wait in call `epoch` waits until the counter reaches epoch x (the number of
adds the counter receives per call), which the plan computes, so every
wait is matched by construction and nothing is reset between calls.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

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


# ---------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------


@dataclass
class _Cell:
    value: Counter | None = None
    call: int = -1  # call (1-based) that last wrote it
    writes: int = 0  # writes during that call


class _Sim:
    """One execution of `calls` back-to-back calls on every rank."""

    def __init__(self, plan: CommPlan, calls: int):
        self.plan, self.calls = plan, calls
        self.call = [0] * plan.world  # call each rank is in (0 = not started)
        self.done = [False] * plan.world
        self.pos = [[0] * plan.nblocks for _ in range(plan.world)]  # next share per block
        self.phase = [[0] * plan.nblocks for _ in range(plan.world)]  # 0 wait, 1 op+signal
        self.signals: Counter = Counter()
        self.mem: dict[tuple[int, Slice], _Cell] = {}
        self.shares_done: Counter = Counter()  # (rank, step, call) -> shares written
        self.partial: dict[tuple[int, int, int], Counter] = {}  # value read by the first share
        # (rank, slice) -> (call, {(share, shares) written}, value): share-level writes
        self.share_cells: dict[tuple[int, Slice], tuple[int, set, Counter]] = {}
        self.errors: list[str] = []
        self.total = [sum(len(b) for b in rp.blocks) for rp in plan.ranks]
        self.remaining = [0] * plan.world
        # (rank, block) with work left in the current call; (rank, -1) = rank between calls
        self._waits: dict[tuple[int, int], list] = {}
        self.active: list[tuple[int, int]] = [(r, -1) for r in range(plan.world)]
        self.where: dict[tuple[int, int], int] = {a: i for i, a in enumerate(self.active)}

    def _activate(self, item: tuple[int, int]) -> None:
        self.where[item] = len(self.active)
        self.active.append(item)

    def _deactivate(self, item: tuple[int, int]) -> None:
        i = self.where.pop(item)
        last = self.active.pop()
        if i < len(self.active):
            self.active[i] = last
            self.where[last] = i

    # -- memory -------------------------------------------------------------
    def _start_call(self, r: int) -> None:
        self.call[r] += 1
        # a new call brings new inputs: forget what this rank's input buffers held
        fresh = {n for n, role in self.plan.buffers.items() if role in ("input", "inout")}
        for key in [k for k in self.mem if k[0] == r and k[1].buffer in fresh]:
            del self.mem[key]
        self.pos[r] = [0] * self.plan.nblocks
        self.phase[r] = [0] * self.plan.nblocks
        self.remaining[r] = self.total[r]

    def _read(self, reader: int, rank: int, sl: Slice, what: str, share: Share | None = None) -> Counter:
        role = self.plan.buffers[sl.buffer]
        k = self.call[reader]
        self._check_window(reader, rank, f"reads {sl}", what)
        # A share may read the same share of a slice (same element range) as soon as
        # that share is written, before the rest of the slice is.
        part = self.share_cells.get((rank, sl))
        if share is not None and part and part[0] == k and (share.share, share.shares) in part[1]:
            return part[2]
        if role in ("input",) or (role == "inout" and (rank, sl) not in self.mem):
            return Counter({(rank, sl.buffer, sl.unit, sl.piece): 1})
        cell = self.mem.get((rank, sl))
        if cell is None or cell.call != k:
            self.errors.append(f"call {k}: rank {reader} reads {sl} of rank {rank} before it was written this call ({what})")
            return Counter({("garbage",): 1})
        return cell.value

    def _write(self, writer: int, rank: int, sl: Slice, value: Counter, what: str) -> None:
        k = self.call[writer]
        self._check_window(writer, rank, f"writes {sl}", what,
                           ": it may overwrite data not yet consumed, or land after the kernel returned")
        cell = self.mem.setdefault((rank, sl), _Cell())
        if cell.call == k:
            cell.writes += 1
            if self.plan.buffers[sl.buffer] in ("output", "inout"):
                self.errors.append(f"call {k}: {sl} of rank {rank} written twice ({what})")
        else:
            cell.call, cell.writes = k, 1
        cell.value = value

    def _check_window(self, actor: int, rank: int, action: str, what: str, why: str = "") -> None:
        """Memory of `rank` may be touched only while `rank` is inside the actor's call."""
        k = self.call[actor]
        if self.call[rank] == k and not self._finished_call(rank):
            return
        state = f"past call {self.call[rank]}" if self._finished_call(rank) else f"in call {self.call[rank]}"
        self.errors.append(f"call {k}: rank {actor} {action} of rank {rank} while rank {rank} is {state}{why} ({what})")

    def _finished_call(self, r: int) -> bool:
        return self.remaining[r] == 0

    # -- execution ----------------------------------------------------------
    def candidates(self) -> list[tuple[int, int]]:
        """(rank, block) pairs with work left, ready or not (kept up to date by advance)."""
        return self.active

    def is_ready(self, r: int, b: int) -> bool:
        return b == -1 or self._ready(r, b)

    def _ready(self, r: int, b: int) -> bool:
        if self.phase[r][b] == 1:
            return True
        share = self.plan.ranks[r].blocks[b][self.pos[r][b]]
        waits = self._waits.get((r, share.step))
        if waits is None:
            step = self.plan.ranks[r].steps[share.step]
            waits = self._waits[(r, share.step)] = [((r, n, i), self.plan.wait_target(r, n, i)) for n, i in step.waits]
        k = self.call[r]
        signals = self.signals
        for key, per in waits:
            if signals[key] < k * per:
                return False
        return True

    def advance(self, r: int, b: int) -> None:
        if b == -1:
            self._deactivate((r, -1))
            if self.call[r] == self.calls:
                self.done[r] = True
            else:
                self._start_call(r)
                for blk, shares in enumerate(self.plan.ranks[r].blocks):
                    if shares:
                        self._activate((r, blk))
                if self.remaining[r] == 0:
                    self._activate((r, -1))
            return
        share = self.plan.ranks[r].blocks[b][self.pos[r][b]]
        step = self.plan.ranks[r].steps[share.step]
        if self.phase[r][b] == 0:  # waits passed
            self.phase[r][b] = 1
            return
        what = f"rank {r} block {b} step {share.step} ({step.note or step.op})"
        if step.op in ("copy", "reduce"):
            total: Counter = Counter()
            for rank, sl in step.srcs:
                total.update(self._read(r, rank, sl, what, share))
            # Shares of one step write disjoint parts of the slice: model the slice as
            # written when its last share lands, with what every share read agreeing.
            key = (r, share.step, self.call[r])
            first = self.partial.setdefault(key, total)
            if first != total:
                self.errors.append(f"call {self.call[r]}: shares of {what} read different data")
            self.shares_done[key] += 1
            for dst_rank, dst in (step.dst,) + step.also:
                part = self.share_cells.get((dst_rank, dst))
                if part is None or part[0] != self.call[r]:
                    part = self.share_cells[(dst_rank, dst)] = (self.call[r], set(), total)
                part[1].add((share.share, share.shares))
                if self.shares_done[key] == share.shares:
                    self._write(r, dst_rank, dst, total, what)
        for sig in step.signals:
            self.signals[(sig.rank, sig.name, sig.index)] += 1
        self.phase[r][b] = 0
        self.pos[r][b] += 1
        self.remaining[r] -= 1
        if self.pos[r][b] == len(self.plan.ranks[r].blocks[b]):
            self._deactivate((r, b))
            if self.remaining[r] == 0:
                self._activate((r, -1))

    def stuck_report(self) -> str:
        lines = []
        for r in range(self.plan.world):
            for b in range(self.plan.nblocks):
                shares = self.plan.ranks[r].blocks[b]
                if self.done[r] or self.pos[r][b] >= len(shares):
                    continue
                step = self.plan.ranks[r].steps[shares[self.pos[r][b]].step]
                k = self.call[r]
                for n, i in step.waits:
                    need = k * self.plan.wait_target(r, n, i)
                    if self.signals[(r, n, i)] < need:
                        lines.append(f"rank {r} block {b} (call {k}) waits for {n}[{i}] >= {need}, "
                                     f"has {self.signals[(r, n, i)]}")
        return "\n".join(lines[:16])


def verify(plan: CommPlan, schedules: int = 200, calls: int = 2, seed: int = 0) -> list[str]:
    """Run the plan under many interleavings; return problems ([] = proven for these)."""
    problems: list[str] = []
    # Static checks: every wait has adds; every signal raised is awaited.
    waited = {(r, n, i) for r, rp in enumerate(plan.ranks) for s in rp.steps for n, i in s.waits}
    for r, n, i in sorted(waited):
        if plan.wait_target(r, n, i) == 0:
            problems.append(f"rank {r} waits for {n}[{i}] but no step ever raises it")
    for key in sorted(plan.per_call):
        if key not in waited:
            problems.append(f"signal {key[1]}[{key[2]}] of rank {key[0]} is raised but never awaited")
    for r, rp in enumerate(plan.ranks):
        for s in rp.steps:
            if (len(s.srcs) > MAX_SRCS or len(s.waits) > MAX_WAITS or len(s.signals) > MAX_SIGNALS
                    or len(s.also) > MAX_ALSO):
                problems.append(f"rank {r}: step {s.note} exceeds the table limits")
            if s.also and s.op != "reduce":
                problems.append(f"rank {r}: step {s.note}: only a reduce stores to extra destinations")
            if s.also and any((sl.pieces, sl.piece) != (s.dst[1].pieces, s.dst[1].piece) for _, sl in s.also):
                problems.append(f"rank {r}: step {s.note}: every destination must be the same piece as dst")
    pieces: dict[str, int] = {}
    for rp in plan.ranks:
        for s in rp.steps:
            for _, sl in ([s.dst] if s.dst else []) + list(s.also) + list(s.srcs):
                if pieces.setdefault(sl.buffer, sl.pieces) != sl.pieces:
                    problems.append(f"buffer {sl.buffer} is cut into {pieces[sl.buffer]} and {sl.pieces} pieces")
    if problems:
        return problems

    rng = random.Random(seed)
    orders = ["random"] * schedules + ["rank_first", "rank_last", "block_reverse"]
    for trial, order in enumerate(orders):
        sim = _Sim(plan, calls)
        steps = 0
        while True:
            if order == "random":
                # Uniform among ready blocks: a few random probes, then a full scan.
                cands = sim.candidates()
                pick = None
                for _ in range(8):
                    if not cands:
                        break
                    c = cands[rng.randrange(len(cands))]
                    if sim.is_ready(*c):
                        pick = c
                        break
                if pick is None:
                    ready = [c for c in cands if sim.is_ready(*c)]
                    if not ready:
                        break
                    pick = rng.choice(ready)
                sim.advance(*pick)
                steps += 1
                if sim.errors:
                    break
                continue
            key = {"rank_first": lambda x: x, "rank_last": lambda x: (-x[0], x[1]),
                   "block_reverse": lambda x: (-x[1], x[0])}[order]
            # Sweep in priority order: each block in turn runs as far as it can
            # before the next one moves; repeat while anything moved.
            moved = False
            for pick in sorted(sim.candidates(), key=key):
                while pick in sim.where and sim.is_ready(*pick) and not sim.errors:
                    sim.advance(*pick)
                    moved = True
                    if pick[1] == -1:
                        break
            if not moved or sim.errors:
                break
            steps += 1
            if sim.errors:
                break
        if sim.errors:
            problems += [f"[{order} schedule {trial}] {e}" for e in sim.errors[:5]]
            break
        if not all(sim.done):
            problems.append(f"[{order} schedule {trial}] deadlock: no block can proceed\n" + sim.stuck_report())
            break
        # Outputs: each written exactly once per call with the expected value.
        for (rank, sl), want in plan.expected.items():
            cell = sim.mem.get((rank, sl))
            if cell is None or cell.call != calls:
                problems.append(f"[{order} schedule {trial}] {sl} of rank {rank} never written in call {calls}")
            elif cell.value != want:
                problems.append(
                    f"[{order} schedule {trial}] {sl} of rank {rank} = {_fmt(cell.value)}, expected {_fmt(want)}"
                )
        for (rank, n, i), per in plan.per_call.items():
            if sim.signals[(rank, n, i)] != calls * per:
                problems.append(f"signal {n}[{i}] of rank {rank} reached {sim.signals[(rank, n, i)]}, not {calls * per}")
        if problems:
            break
    return problems


def _fmt(value: Iterable) -> str:
    return "{" + ", ".join(f"r{k[0]}:{k[1]}@{k[2]}.{k[3]}" if len(k) == 4 else str(k) for k in sorted(value, key=str)) + "}"


# ---------------------------------------------------------------------------
# Rendering the plan as C tables (used by templates/ops/collective.cu.j2)
# ---------------------------------------------------------------------------

_OPS = {"none": "TSGEN_OP_NONE", "copy": "TSGEN_OP_COPY", "reduce": "TSGEN_OP_REDUCE"}


def c_slice(plan: CommPlan, buffer_index: dict[str, int], rank_slice: tuple[int, Slice] | None) -> str:
    """Initializer of a tsgen_slice."""
    if rank_slice is None:
        return "{0, 0, 0, 1, 0, 0}"
    rank, s = rank_slice
    ro = 1 if plan.buffers.get(s.buffer) == "input" else 0
    return f"{{{rank}, {buffer_index[s.buffer]}, {ro}, {s.pieces}, {s.unit}, {s.piece}}}"


SHARES_PER_LINE = 8


def opening_signal(plan: CommPlan, r: int) -> tuple[str, int, int] | None:
    """(signal name, index, peer mask) when rank r's block 0 opens with a step that only
    signals (no op, no waits, one block): the same counter raised once at each of some
    peers -- every collective's entry step. Such a step can be rendered as straight code
    at kernel start instead of a table walk (the plan and its verification are unchanged:
    it is the first thing block 0 does either way). None otherwise."""
    blocks = plan.ranks[r].blocks
    if not blocks or not blocks[0]:
        return None
    st = plan.ranks[r].steps[blocks[0][0].step]
    if st.op != "none" or st.waits or st.blocks != 1 or not st.signals:
        return None
    names = {(g.name, g.index) for g in st.signals}
    targets = [g.rank for g in st.signals]
    if len(names) != 1 or r in targets or len(set(targets)) != len(targets):
        return None
    (name, index), = names
    return name, index, sum(1 << q for q in targets)


def _openings(plan: CommPlan, hoist_opening: bool) -> list[tuple[str, int, int] | None]:
    """Per rank, the opening signal rendered as code (see opening_signal), or None: hoisted
    only when asked and every opening raises a counter of the same signal buffer."""
    opens = [opening_signal(plan, r) if hoist_opening else None for r in range(plan.world)]
    return [None] * plan.world if len({o[0] for o in opens if o}) > 1 else opens


def block_shares(plan: CommPlan, hoist_opening: bool = False) -> list[list[list[Share]]]:
    """Per rank, per block, the shares the kernel runs through its tables or straight-line
    code: the plan's, less block 0's opening signal where that is hoisted into code."""
    opens = _openings(plan, hoist_opening)
    return [[lst[1:] if b == 0 and opens[r] else list(lst) for b, lst in enumerate(rp.blocks)]
            for r, rp in enumerate(plan.ranks)]


def c_tables(plan: CommPlan, buffer_index: dict[str, int], hoist_opening: bool = False) -> dict:
    """Initializer text of the step / share / block tables: one commented line per step;
    the shares of each block under one comment, SHARES_PER_LINE {step, share, shares}
    entries a line (a ring plan has tens of thousands). `nshares` counts the entries.
    hoist_opening: each rank's opening signal (see opening_signal) leaves block 0's share
    list; `opening` then has, per rank, (buffer index, counter index, peer mask) or None."""

    def sl(rank_slice: tuple[int, Slice] | None) -> str:
        return c_slice(plan, buffer_index, rank_slice)

    steps, step_base, shares, first = [], [], [], []
    nshares = 0
    for r, (rp, blocks) in enumerate(zip(plan.ranks, block_shares(plan, hoist_opening))):
        step_base.append(len(steps))
        for i, st in enumerate(rp.steps):
            srcs = ", ".join(sl(x) for x in st.srcs)
            waits = ", ".join(f"{{{buffer_index[n]}, 0, {idx}, {plan.wait_target(r, n, idx)}}}" for n, idx in st.waits)
            sigs = ", ".join(f"{{{g.rank}, {buffer_index[g.name]}, {g.index}}}" for g in st.signals)
            also = ", ".join(sl(x) for x in st.also)
            what = _describe(r, st)
            steps.append((f"{{{_OPS[st.op]}, {len(st.srcs)}, {len(st.waits)}, {len(st.signals)}, {len(st.also)}, "
                          f"{sl(st.dst)}, {{{srcs}}}, {{{also}}}, {{{waits}}}, {{{sigs}}}}}",
                          f"rank {r} step {i}: {what}"))
        row = []
        for b, lst in enumerate(blocks):
            row.append(nshares)
            entries = [f"{{{sh.step}, {sh.share}, {sh.shares}}}" for sh in lst]
            lines = [", ".join(entries[i:i + SHARES_PER_LINE]) for i in range(0, len(entries), SHARES_PER_LINE)]
            if lines:
                shares.append((f"rank {r} block {b}: shares {nshares}..{nshares + len(lst) - 1} ({{step, share, of}})",
                               lines))
            nshares += len(lst)
        row.append(nshares)
        first.append(row)
    opening = [None if o is None else (buffer_index[o[0]], o[1], o[2]) for o in _openings(plan, hoist_opening)]
    return {"steps": steps, "step_base": step_base, "shares": shares, "nshares": nshares, "first": first,
            "opening": opening}


def _describe(r: int, st: Step) -> str:
    parts = [st.note or st.op]
    if st.waits:
        parts.append("wait " + ", ".join(f"{n}[{i}]" for n, i in st.waits))
    if st.op != "none":
        srcs = " + ".join(f"r{q}:{s}" for q, s in st.srcs)
        dsts = " = ".join(f"r{q}:{sl}" for q, sl in (st.dst,) + st.also)
        parts.append(f"{dsts} = {srcs}")
    if st.signals:
        parts.append("signal " + ", ".join(f"r{g.rank}:{g.name}[{g.index}]" for g in st.signals))
    if st.blocks > 1:
        parts.append(f"{st.blocks} blocks")
    return "; ".join(parts)


# ---------------------------------------------------------------------------
# Small plans as straight-line code (plan<W>::run in templates/ops/plan_tables.cu.j2)
# ---------------------------------------------------------------------------

# A plan runs as straight-line code (launch.plan_code: auto) when that code makes at most
# this many share calls over all ranks. Each call inlines a copy or reduce loop (world-size-4
# reduce_scatter: 40 calls, 16k SASS instructions against the interpreter's 1.7k), so this
# bounds the kernel's size and compile time. Shipped specs: one_shot, two_shot_pull and
# broadcast push take at most 24 calls at any world size; the allgather / all_to_all /
# reduce_scatter push plans 28 to 40 at world size 4 and 80 to 160 at 8; the ring plans and
# the 8-piece pipelines (all_reduce two_shot, reduce_scatter_large) fold their thousands of
# shares into 32 to 50 calls at world size 2 (broadcast ring also at 3), 66 or more beyond.
STRAIGHT_LINE_MAX_CALLS = 64


@dataclass(frozen=True)
class ShareGroup:
    """Blocks lo..hi-1 of one rank that run the same steps the same way: block lo + i
    runs, in order, share sh.share + i of sh.shares of step sh.step for each sh in
    `shares` (block lo's list)."""

    lo: int
    hi: int
    shares: tuple[Share, ...]


def straight_line_groups(plan: CommPlan, hoist_opening: bool = False) -> tuple[list[list[ShareGroup]], int]:
    """Each rank's blocks as groups for straight-line code, and how many share calls that
    code makes (the groups' list lengths summed over all ranks). Consecutive blocks join a
    group when their share lists, as the tables hold them (block_shares), have the same
    length, steps and splits, and each entry's share is its block-lo share plus the
    distance from lo: one call site then serves every block of the group. Blocks with
    nothing to do are in no group."""
    groups, calls = [], 0
    for blocks in block_shares(plan, hoist_opening):
        mine = []
        b = 0
        while b < len(blocks):
            lo, first = b, blocks[b]
            b += 1
            while b < len(blocks) and _continues(first, blocks[b], b - lo):
                b += 1
            if first:
                mine.append(ShareGroup(lo, b, tuple(first)))
                calls += len(first)
        groups.append(mine)
    return groups, calls


def _continues(first: list[Share], shares: list[Share], i: int) -> bool:
    """`shares` is what a block i blocks after the one running `first` runs in its group."""
    return len(shares) == len(first) and all(
        (s.step, s.share, s.shares) == (f.step, f.share + i, f.shares) for s, f in zip(shares, first))


# ---------------------------------------------------------------------------
# Copy-engine plans: each block of the schedule is a stream
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamOp:
    """One thing the host launcher enqueues on a stream.

    kind "sync": a one-block kernel that raises the signals of step
    `signal_step` (a step whose op has just finished on this stream), then
    waits for the waits of step `wait_step` (the next step's); -1 = none.
    kind "copy": cudaMemcpyAsync of step `step`; kind "reduce": a kernel
    over the whole grid that computes step `step`.
    """

    kind: str
    step: int = -1
    signal_step: int = -1
    wait_step: int = -1


def stream_program(plan: CommPlan, rank: int) -> list[list[StreamOp]]:
    """What each stream of `rank` enqueues, in order: the plan's shares with every
    step's waits before its op and its signals after, adjacent signal/wait pairs
    merged into one sync kernel. Same order as the interpreter, so the verified
    plan is what runs."""
    steps = plan.ranks[rank].steps
    program = []
    for shares in plan.ranks[rank].blocks:
        ops: list[StreamOp] = []
        pending = -1  # step whose signals are still to be raised
        for sh in shares:
            if steps[sh.step].also:
                raise ValueError(f"rank {rank}: step {sh.step} has several destinations; the copy-engine "
                                 "transport copies to one")
            if sh.shares != 1:
                raise ValueError(f"rank {rank}: step {sh.step} is split over {sh.shares} streams; "
                                 "copy-engine steps are one transfer each")
            st = steps[sh.step]
            if st.waits or pending >= 0:
                ops.append(StreamOp("sync", signal_step=pending, wait_step=sh.step if st.waits else -1))
                pending = -1
            if st.op in ("copy", "reduce"):
                ops.append(StreamOp(st.op, step=sh.step))
            if st.signals:
                pending = sh.step
        if pending >= 0:
            ops.append(StreamOp("sync", signal_step=pending))
        program.append(ops)
    return program
