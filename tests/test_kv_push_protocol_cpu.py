"""params.kv_push's cross-rank protocol as a model (docs/design/cp_attention.md; templates/include/tsgen/attention_bwd.cuh
KvPush): interleavings of the ranks' streams that the protocol allows (200 random ones, and for each rank a greedy
one that runs it as far ahead as the waits let it and a lagging one that holds it back) must give every owner's sum
the partials of its own call; and each piece of the protocol, removed, must let some schedule give a wrong sum. The GPU checks (tests/
torch_checks.py --cp) run the kernels with two of these controls under a lag; the parity's and the count's
controls exist only here (a sender a call ahead of its owner at the moment the owner reads is a schedule a lag
rarely makes).

A rank's call e, in its stream's order (the kernels of tsgen::attention_bwd, the entry <kernel>_backward_push):
  MAIN    the main kernel: its partials of every other rank's keys into that owner's receive area, slot
          (parity of e, push_sender(rank, owner)), and its own into its own output; reads e = calls + 1
  SIGNAL  push_signal: arrived[owner][rank] += 1 at every other rank (after MAIN: the kernel boundary and the
          fence order the stores before it)
  WAIT    push_wait: until arrived[rank][s] >= e for every other rank s
  REDUCE  push_reduce: the partials of every other rank from (parity of e, its slot), then calls += 1
Stream order makes call e + 1's MAIN follow call e's REDUCE on the same rank. Stores are modelled as landing at
MAIN (what SIGNAL's fence guarantees by the time a peer can see the count)."""

from __future__ import annotations

import random

import pytest

CALLS = 5


def push_sender(sender: int, owner: int) -> int:
    """The header's push_sender (tests/test_kv_push_cpu.py checks the header's against this layout)."""
    return sender if sender < owner else sender - 1


def run(world: int, pick, *, parity: bool = True, wait: bool = True, signal_first: bool = False,
        count_slack: int = 0) -> list[str]:
    """One schedule of CALLS calls on every rank; `pick(enabled)` chooses the next rank to step among those whose
    next operation may run. Returns the wrong sums seen (empty: every sum right). The keywords remove a piece of
    the protocol: parity (one slot a sender, not two), wait (push_wait), signal_first (push_signal before the main
    kernel: control 2 of the entry), count_slack (push_wait satisfied that many signals early)."""
    order = ["SIGNAL", "MAIN", "WAIT", "REDUCE"] if signal_first else ["MAIN", "SIGNAL", "WAIT", "REDUCE"]
    if not wait:
        order.remove("WAIT")
    slots = {(o, p, s): None for o in range(world) for p in range(2) for s in range(world - 1)}
    arrived = [[0] * world for _ in range(world)]  # arrived[owner][sender]
    calls = [0] * world
    step = [0] * world  # index into the flattened (call, operation) sequence of each rank
    wrong: list[str] = []

    def current(r):
        return divmod(step[r], len(order))

    def enabled(r) -> bool:
        call, op = current(r)
        if call >= CALLS:
            return False
        if order[op] == "WAIT":
            e = calls[r] + 1
            return all(arrived[r][s] >= e - count_slack for s in range(world) if s != r)
        return True

    while True:
        ready = [r for r in range(world) if enabled(r)]
        if not ready:
            break
        r = pick(ready, step)
        call, op = current(r)
        e = calls[r] + 1
        assert e == call + 1, "the epoch a call reads is its own (stream order)"
        what = order[op]
        if what == "MAIN":
            for o in range(world):
                if o != r:
                    slots[(o, e % 2 if parity else 0, push_sender(r, o))] = (r, e)
        elif what == "SIGNAL":
            for o in range(world):
                if o != r:
                    arrived[o][r] += 1
        elif what == "REDUCE":
            for s in range(world):
                if s != r:
                    got = slots[(r, e % 2 if parity else 0, push_sender(s, r))]
                    if got != (s, e):
                        wrong.append(f"rank {r} call {e}: rank {s}'s partial was {got}")
            calls[r] += 1
        step[r] += 1
    unfinished = [r for r in range(world) if current(r)[0] < CALLS]
    assert not unfinished, f"deadlock: ranks {unfinished} never finished (steps {step})"
    return wrong


def random_pick(seed: int):
    rng = random.Random(seed)
    return lambda ready, step: rng.choice(ready)


def greedy_pick(ahead: int):
    """Run rank `ahead` whenever it may run, the others in turn otherwise: the schedule in which one sender gets as
    far ahead of its owners as the protocol lets it."""
    turn = [0]

    def pick(ready, step):
        if ahead in ready:
            return ahead
        turn[0] += 1
        return ready[turn[0] % len(ready)]
    return pick


def lagging_pick(lagger: int):
    """Run every rank but `lagger` whenever one may run: `lagger` starts last and stays behind (one rank late; the
    GPU checks' lag makes every rank but 0 late)."""
    def pick(ready, step):
        others = [r for r in ready if r != lagger]
        return min(others, key=lambda r: step[r]) if others else lagger
    return pick


def schedules(world: int):
    yield from (random_pick(seed) for seed in range(200))
    yield from (greedy_pick(r) for r in range(world))
    yield from (lagging_pick(r) for r in range(world))


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_protocol_sums_are_right_in_every_schedule(world):
    """The protocol as built: no schedule gives a wrong sum or a deadlock, at W 2, 3, 4, 8."""
    for i, pick in enumerate(schedules(world)):
        assert run(world, pick) == [], f"schedule {i}"


CONTROLS = {
    "one slot a sender (no parity)": dict(parity=False),
    "no wait (control 1)": dict(wait=False),
    "signal before the stores (control 2)": dict(signal_first=True),
    "the wait one signal early": dict(count_slack=1),
}


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("control", list(CONTROLS))
def test_each_piece_removed_gives_a_wrong_sum(world, control):
    """Negative controls: with any one piece of the protocol removed, the greedy schedule (one rank as far ahead as
    it may run) gives a wrong sum at some owner for some choice of that rank, and so do some of the random
    schedules."""
    kw = CONTROLS[control]
    greedy = [run(world, greedy_pick(r), **kw) for r in range(world)]
    assert any(greedy), f"{control}: no greedy schedule caught it"
    caught = sum(bool(run(world, random_pick(seed), **kw)) for seed in range(200))
    assert caught > 0, f"{control}: no random schedule of 200 caught it"
