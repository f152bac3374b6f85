"""The CPU verifier of plans: every schedule executes the plan's shares as the generated
kernel would, checking outputs, writes, call boundaries and waits. See tsgen/plan/__init__.py;
`tsgen verify` over spec files (which loads specs, a layer above plan/) is tsgen/plan_jobs.py."""

from __future__ import annotations

import random
from collections import Counter
from typing import Iterable

from .ir import MAX_ALSO, MAX_SIGNALS, MAX_SRCS, MAX_WAITS, CommPlan, Slice

# ---------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------


def default_schedules(world: int) -> int:
    """Random interleavings verified per plan unless told otherwise: fewer at the larger
    world sizes, whose plans have many more shares."""
    return 100 if world <= 4 else 24


# The fixed sweeps: the priority order of the actors, as a sort key on (rank, block),
# block -1 standing for the rank between two calls.
_SWEEPS = {"rank_first": lambda rb: rb, "rank_last": lambda rb: (-rb[0], rb[1]),
           "block_reverse": lambda rb: (-rb[1], rb[0])}


def schedule_orders(schedules: int) -> list[str]:
    """How each schedule of a verification picks the next block to move: `schedules`
    random ones (schedule i draws from its own seed), then the three fixed sweeps."""
    return ["random"] * schedules + list(_SWEEPS)


class _Values:
    """Values as numbers. A value is a multiset of contributions (rank, buffer, unit,
    piece), kept as a Counter; equal values get the same number and sums are memoised,
    so the simulator adds and compares ints."""

    def __init__(self) -> None:
        self.counters: list[Counter] = []
        self._ids: dict[frozenset, int] = {}
        self._sums: dict[tuple[int, ...], int] = {}

    def of(self, value: Counter) -> int:
        key = frozenset(value.items())
        if key not in self._ids:
            self._ids[key] = len(self.counters)
            self.counters.append(value)
        return self._ids[key]

    def sum(self, ids: tuple[int, ...]) -> int:
        if len(ids) == 1:
            return ids[0]
        total = self._sums.get(ids)
        if total is None:
            value: Counter = Counter()
            for i in ids:
                value.update(self.counters[i])
            total = self._sums[ids] = self.of(value)
        return total


class _Tables:
    """A plan with its names turned into list indices for the simulator's hot path.

    Actors: block b of rank r is actor r * nblocks + b; rank r between two calls is
    actor world * nblocks + r. Steps of all ranks are numbered rank by rank (g);
    signal counters (rank, name, index) and memory cells (rank, slice) get numbers
    in order of first mention."""

    def __init__(self, plan: CommPlan):
        self.plan = plan
        self.values = _Values()
        self.garbage = self.values.of(Counter({("garbage",): 1}))
        self.signal_ids: dict[tuple[int, str, int], int] = {}
        self.signal_rank: list[int] = []  # whose call the wait target counts in
        self.signal_per: list[int] = []  # adds per call
        self.cell_ids: dict[tuple[int, Slice], int] = {}
        self.cell_key: list[tuple[int, Slice]] = []
        self.cell_input: list[bool] = []  # reads as the call's input, whatever was written
        self.cell_inout: list[bool] = []  # reads as the call's input until written
        self.cell_once: list[bool] = []  # output or inout: written at most once per call
        self.cell_fresh: list[int] = []  # value of the input it holds
        self.fresh_cells: list[list[int]] = [[] for _ in range(plan.world)]  # new at each call of the rank
        self.step_key: list[tuple[int, int]] = []  # g -> (rank, step index)
        self.step_data: list[bool] = []  # copy or reduce
        self.step_srcs: list[tuple[tuple[int, int], ...]] = []  # (rank, cell)
        self.step_dsts: list[tuple[tuple[int, int], ...]] = []  # (rank, cell): dst, then also
        self.step_waits: list[tuple[tuple[int, int], ...]] = []  # (signal, adds per call)
        self.step_signals: list[tuple[int, ...]] = []
        first_step = []
        for r, rp in enumerate(plan.ranks):
            first_step.append(len(self.step_key))
            for i, st in enumerate(rp.steps):
                self.step_key.append((r, i))
                self.step_data.append(st.op in ("copy", "reduce"))
                self.step_srcs.append(tuple((q, self._cell(q, sl)) for q, sl in st.srcs))
                dsts = ((st.dst,) + st.also) if st.dst else ()
                self.step_dsts.append(tuple((q, self._cell(q, sl)) for q, sl in dsts))
                self.step_waits.append(tuple((self._signal(r, n, j), plan.wait_target(r, n, j)) for n, j in st.waits))
                self.step_signals.append(tuple(self._signal(s.rank, s.name, s.index) for s in st.signals))
        for rank, sl in plan.expected:
            self._cell(rank, sl)
        for key in plan.per_call:
            self._signal(*key)
        # per block actor, its shares in order: (g, (share, shares))
        self.shares = [[(first_step[r] + sh.step, (sh.share, sh.shares)) for sh in shares]
                       for r, rp in enumerate(plan.ranks) for shares in rp.blocks]
        blocks, actors = plan.world * plan.nblocks, plan.world * plan.nblocks + plan.world
        rank_block = [divmod(a, plan.nblocks) if a < blocks else (a - blocks, -1) for a in range(actors)]
        self.sweep_place: dict[str, list[int]] = {}  # per fixed sweep, each actor's place in its order
        for order, key in _SWEEPS.items():
            place = [0] * actors
            for i, a in enumerate(sorted(range(actors), key=lambda a: key(rank_block[a]))):
                place[a] = i
            self.sweep_place[order] = place

    def _signal(self, rank: int, name: str, index: int) -> int:
        key = (rank, name, index)
        if key not in self.signal_ids:
            self.signal_ids[key] = len(self.signal_rank)
            self.signal_rank.append(rank)
            self.signal_per.append(self.plan.wait_target(rank, name, index))
        return self.signal_ids[key]

    def _cell(self, rank: int, sl: Slice) -> int:
        key = (rank, sl)
        if key not in self.cell_ids:
            c = self.cell_ids[key] = len(self.cell_key)
            role = self.plan.buffers[sl.buffer]
            self.cell_key.append(key)
            self.cell_input.append(role == "input")
            self.cell_inout.append(role == "inout")
            self.cell_once.append(role in ("output", "inout"))
            self.cell_fresh.append(self.values.of(Counter({(rank, sl.buffer, sl.unit, sl.piece): 1})))
            if role in ("input", "inout"):
                self.fresh_cells[rank].append(c)
        return self.cell_ids[key]


class _Sim:
    """One execution of `calls` back-to-back calls on every rank.

    `ready` lists the actors that can move now, kept up to date as they move: a block
    whose next share waits for a counter short of its target sits on that counter's
    waiter list until the counter gets there (all waiters of a counter are blocks of
    the rank that owns it, in its current call, so they share the target)."""

    def __init__(self, tables: _Tables, calls: int):
        plan = tables.plan
        self.t, self.calls = tables, calls
        self.nblocks = plan.nblocks
        self.rank_actor = plan.world * plan.nblocks  # actor number of rank 0 between calls
        actors = self.rank_actor + plan.world
        self.call = [0] * plan.world  # call each rank is in (0 = not started)
        self.done = [False] * plan.world
        self.total = [sum(len(b) for b in rp.blocks) for rp in plan.ranks]
        self.remaining = [0] * plan.world  # shares left in the current call
        self.pos = [0] * self.rank_actor  # per block: next share
        self.phase = [0] * self.rank_actor  # per block: 0 waits next, 1 op + signals next
        self.signals = [0] * len(tables.signal_rank)
        self.waiters: list[list[int]] = [[] for _ in tables.signal_rank]
        cells = len(tables.cell_key)
        self.mem_call = [-1] * cells  # call that last wrote it (-1: not written since its inputs were new)
        self.mem_value: list[int | None] = [None] * cells
        # share-level writes: a share may read the same share of a slice as soon as that
        # share is written, before the rest of the slice is
        self.share_call = [-1] * cells
        self.share_set: list[set] = [set() for _ in range(cells)]
        self.share_value = [0] * cells
        # per step: the call whose shares are under way, what its first share read, shares written
        steps = len(tables.step_key)
        self.step_call = [-1] * steps
        self.step_first = [0] * steps
        self.step_done = [0] * steps
        self.errors: list[str] = []
        self.active = [False] * actors  # has work left in the current call, ready or not
        self.ready: list[int] = []
        self.where = [-1] * actors  # index in `ready`, -1 when not ready
        for r in range(plan.world):
            self._activate(self.rank_actor + r)

    # -- the ready set ------------------------------------------------------
    def _set_ready(self, a: int) -> None:
        if self.where[a] < 0:
            self.where[a] = len(self.ready)
            self.ready.append(a)

    def _unset_ready(self, a: int) -> None:
        i = self.where[a]
        if i >= 0:
            last = self.ready.pop()
            if last != a:
                self.ready[i] = last
                self.where[last] = i
            self.where[a] = -1

    def _activate(self, a: int) -> None:
        self.active[a] = True
        if a >= self.rank_actor:
            self._set_ready(a)
        else:
            self._arm(a)

    def _deactivate(self, a: int) -> None:
        self.active[a] = False
        self._unset_ready(a)

    def _arm(self, a: int) -> None:
        """Block a is about to wait for its next share's signals: ready, or a waiter."""
        g = self.t.shares[a][self.pos[a]][0]
        k = self.call[a // self.nblocks]
        signals = self.signals
        for sid, per in self.t.step_waits[g]:
            if signals[sid] < k * per:
                self._unset_ready(a)
                self.waiters[sid].append(a)
                return
        self._set_ready(a)

    def _raise(self, sid: int) -> None:
        self.signals[sid] += 1
        waiting = self.waiters[sid]
        if waiting and self.signals[sid] >= self.call[self.t.signal_rank[sid]] * self.t.signal_per[sid]:
            self.waiters[sid] = []
            for a in waiting:
                self._arm(a)

    # -- execution ----------------------------------------------------------
    def advance(self, a: int) -> None:
        """Move ready actor a one step: a rank starts its next call (or is done); a
        block passes its waits, or does its share's op and raises its signals."""
        if a >= self.rank_actor:
            self._next_call(a - self.rank_actor)
            return
        if self.phase[a] == 0:  # waits passed
            self.phase[a] = 1
            return
        t = self.t
        r = a // self.nblocks
        g, share = t.shares[a][self.pos[a]]
        if t.step_data[g]:
            self._run_share(r, a, g, share)
        for sid in t.step_signals[g]:
            self._raise(sid)
        self.phase[a] = 0
        self.pos[a] += 1
        self.remaining[r] -= 1
        if self.pos[a] < len(t.shares[a]):
            self._arm(a)
            return
        self._deactivate(a)
        if self.remaining[r] == 0:
            self._activate(self.rank_actor + r)

    def _next_call(self, r: int) -> None:
        self._deactivate(self.rank_actor + r)
        if self.call[r] == self.calls:
            self.done[r] = True
            return
        self.call[r] += 1
        # a new call brings new inputs: forget what this rank's input buffers held
        for c in self.t.fresh_cells[r]:
            self.mem_call[c], self.mem_value[c] = -1, None
        self.remaining[r] = self.total[r]
        for a in range(r * self.nblocks, (r + 1) * self.nblocks):
            self.pos[a] = self.phase[a] = 0
            if self.t.shares[a]:
                self._activate(a)
        if self.remaining[r] == 0:
            self._activate(self.rank_actor + r)

    def _run_share(self, r: int, a: int, g: int, share: tuple[int, int]) -> None:
        """Read the step's sources, and write its destinations once its last share is done.
        Shares of one step write disjoint parts of a slice: the slice counts as written
        when the last share lands, with what every share read agreeing."""
        t, k = self.t, self.call[r]
        srcs = t.step_srcs[g]
        if len(srcs) == 1:  # a copy: what it reads (values.sum of one value is that value)
            total = self._read(r, a, g, *srcs[0], share)
        else:
            total = t.values.sum(tuple(self._read(r, a, g, q, c, share) for q, c in srcs))
        if self.step_call[g] != k:
            self.step_call[g], self.step_first[g], self.step_done[g] = k, total, 0
        elif self.step_first[g] != total:
            self.errors.append(f"call {k}: shares of {self._what(a, g)} read different data")
        self.step_done[g] += 1
        last = self.step_done[g] == share[1]
        for q, c in t.step_dsts[g]:
            if self.share_call[c] != k:
                self.share_call[c], self.share_value[c] = k, total
                self.share_set[c] = set()
            self.share_set[c].add(share)
            if last:
                self._write(r, a, g, q, c, total)

    def _read(self, r: int, a: int, g: int, q: int, c: int, share: tuple[int, int]) -> int:
        t, k = self.t, self.call[r]
        if self.call[q] != k or self.remaining[q] == 0:
            self._outside_call(r, a, g, q, f"reads {t.cell_key[c][1]}")
        if self.share_call[c] == k and share in self.share_set[c]:
            return self.share_value[c]
        value = self.mem_value[c]
        if t.cell_input[c] or (t.cell_inout[c] and value is None):
            return t.cell_fresh[c]
        if value is None or self.mem_call[c] != k:
            self.errors.append(f"call {k}: rank {r} reads {t.cell_key[c][1]} of rank {q} before it was written "
                               f"this call ({self._what(a, g)})")
            return t.garbage
        return value

    def _write(self, r: int, a: int, g: int, q: int, c: int, value: int) -> None:
        t, k = self.t, self.call[r]
        if self.call[q] != k or self.remaining[q] == 0:
            self._outside_call(r, a, g, q, f"writes {t.cell_key[c][1]}",
                               ": it may overwrite data not yet consumed, or land after the kernel returned")
        if self.mem_call[c] == k and t.cell_once[c]:
            self.errors.append(f"call {k}: {t.cell_key[c][1]} of rank {q} written twice ({self._what(a, g)})")
        self.mem_call[c], self.mem_value[c] = k, value

    def _outside_call(self, r: int, a: int, g: int, q: int, action: str, why: str = "") -> None:
        """Memory of rank q may be touched only while q is inside the actor's call."""
        state = f"past call {self.call[q]}" if self.remaining[q] == 0 else f"in call {self.call[q]}"
        self.errors.append(f"call {self.call[r]}: rank {r} {action} of rank {q} while rank {q} is {state}{why} "
                           f"({self._what(a, g)})")

    def _what(self, a: int, g: int) -> str:
        r, i = self.t.step_key[g]
        step = self.t.plan.ranks[r].steps[i]
        return f"rank {r} block {a % self.nblocks} step {i} ({step.note or step.op})"

    def run_random(self, rng: random.Random) -> None:
        """Move a ready actor drawn uniformly at random until none is ready or an error."""
        ready, errors, advance, bits = self.ready, self.errors, self.advance, rng.getrandbits
        while ready and not errors:
            # rng.randrange(len(ready)) written out, the same draws: this loop is the verifier's time
            n = len(ready)
            k = n.bit_length()
            i = bits(k)
            while i >= n:
                i = bits(k)
            advance(ready[i])

    def run_sweeps(self, order: str) -> None:
        """Sweep the actors in a fixed priority order: each in turn moves as far as it can
        before the next one moves (a rank starting a call moves once); repeat while
        anything moved."""
        place = self.t.sweep_place[order]
        moved = True
        while moved and not self.errors:
            moved = False
            for a in sorted((a for a, on in enumerate(self.active) if on), key=place.__getitem__):
                while self.where[a] >= 0 and not self.errors:
                    self.advance(a)
                    moved = True
                    if a >= self.rank_actor:
                        break

    def stuck_report(self) -> str:
        lines = []
        plan = self.t.plan
        for r in range(plan.world):
            for b in range(plan.nblocks):
                a = r * plan.nblocks + b
                if self.done[r] or self.pos[a] >= len(self.t.shares[a]):
                    continue
                step = plan.ranks[r].steps[plan.ranks[r].blocks[b][self.pos[a]].step]
                k = self.call[r]
                for n, i in step.waits:
                    need = k * plan.wait_target(r, n, i)
                    have = self.signals[self.t.signal_ids[(r, n, i)]]
                    if have < need:
                        lines.append(f"rank {r} block {b} (call {k}) waits for {n}[{i}] >= {need}, has {have}")
        return "\n".join(lines[:16])

    def outcome(self, plan: CommPlan) -> list[str]:
        """Problems with the finished execution: errors, deadlock, wrong outputs or signals."""
        if self.errors:
            return self.errors[:5]
        if not all(self.done):
            return ["deadlock: no block can proceed\n" + self.stuck_report()]
        problems = []
        t = self.t
        # Outputs: each written exactly once per call with the expected value.
        for (rank, sl), want in plan.expected.items():
            c = t.cell_ids[(rank, sl)]
            if self.mem_value[c] is None or self.mem_call[c] != self.calls:
                problems.append(f"{sl} of rank {rank} never written in call {self.calls}")
            elif t.values.counters[self.mem_value[c]] != want:
                problems.append(f"{sl} of rank {rank} = {_fmt(t.values.counters[self.mem_value[c]])}, "
                                f"expected {_fmt(want)}")
        for (rank, n, i), per in plan.per_call.items():
            have = self.signals[t.signal_ids[(rank, n, i)]]
            if have != self.calls * per:
                problems.append(f"signal {n}[{i}] of rank {rank} reached {have}, not {self.calls * per}")
        return problems


def _static_problems(plan: CommPlan) -> list[str]:
    """Every wait has adds; every signal raised is awaited; steps fit the C tables."""
    problems: list[str] = []
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
    return problems


def verify(plan: CommPlan, schedules: int = 200, calls: int = 2, seed: int = 0,
           trials: Iterable[int] | None = None) -> list[str]:
    """Run the plan under many interleavings; return problems ([] = proven for these).

    The interleavings are schedule_orders(schedules); `trials` picks some of them by
    index (default all). Each schedule stands alone (random schedule i draws from the
    seed "seed:i"), so disjoint picks can run in parallel and together find what one
    run finds: the problems of the first schedule that has any."""
    problems = _static_problems(plan)
    if problems:
        return problems
    tables = _Tables(plan)
    orders = schedule_orders(schedules)
    for trial in range(len(orders)) if trials is None else trials:
        order = orders[trial]
        sim = _Sim(tables, calls)
        if order == "random":
            sim.run_random(random.Random(f"{seed}:{trial}"))
        else:
            sim.run_sweeps(order)
        problems = sim.outcome(plan)
        if problems:
            return [f"[{order} schedule {trial}] {p}" for p in problems]
    return []


def _fmt(value: Iterable) -> str:
    return "{" + ", ".join(f"r{k[0]}:{k[1]}@{k[2]}.{k[3]}" if len(k) == 4 else str(k) for k in sorted(value, key=str)) + "}"
