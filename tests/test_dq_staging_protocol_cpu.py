"""The attention backward's dQ staging protocol (templates/include/tsgen/attention_bwd_wgmma.cuh: consume()'s staging,
write_dq, the named barriers DQ_FREE + w and DQ_STAGED + w of 160 threads, Layout::DQ_STAGES), every interleaving
of one CTA's three parties explored: the two consumer warpgroups, the writer warp, and the bulk-copy unit that
finishes the reductions' reads in order. A named barrier counts warps: a warpgroup's 128 threads are 4, the writer
warp 1, and a barrier of 160 threads completes at 5 whether or not anyone waits on it; an arrival past that
completes the phase early and carries the rest into the next one (the overflow this model flags). The protocol as
built must never overflow a barrier, leave an arrival unsynced, deadlock, or let a warpgroup store into a buffer
that a reduction is still reading, for walks of 0 to 5 steps and one or two buffers a warpgroup; its broken forms
must each fail. The writer's program is write_dq's statements in their order (header_protocol checks them, and the
consumers' side, against the header), its waits the header's expressions."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT

HEADER = (ROOT / "templates" / "include" / "tsgen" / "attention_bwd_wgmma.cuh").read_text()
WARPS = {"DS": 8, "FREE": 5, "STAGED": 5}  # DS_READY: both warpgroups (256 threads); the others 160
# the buffer counts a warpgroup the header builds: one (the 128-row step, or every step before DQ_STAGES), and two
# where Layout::DQ_STAGES gives them (64-row steps with the writer warp)
STAGES = (1, 2) if re.search(r"static constexpr \w+ DQ_STAGES\b", HEADER) else (1,)


# write_dq's protocol statements, in order, as the model's writer program assumes them: return before anything when
# the walk is empty; one arrival on each DQ_FREE before the first step; a step: sync on each warpgroup's DQ_STAGED,
# the reduction(s); after the walk's last step, leave; else wait and free warpgroup 0's buffer, then 1's; at the end
# every reduction complete. (WAIT: the two waits' expressions, evaluated by header_protocol.)
WRITER_STATEMENTS = ["return if done", "arrive FREE 0", "arrive FREE 1", "loop", "sync STAGED 0", "sync STAGED 1",
                     "reduce", "break if done", "WAIT", "arrive FREE 0", "WAIT", "arrive FREE 1", "wait all"]
STATEMENT = re.compile(r"named_barrier_(?P<kind>sync|arrive)_imm<DQ_(?P<bar>FREE|STAGED)(?P<plus> \+ 1)?>|"
                       r"(?P<reduce>bulk_reduce_add_f32)|bulk_wait_group_read<(?P<wait>.+?)>\(\)|"
                       r"if \(w\.done\(\)\) (?P<done>break|return);|"
                       r"(?P<loop>for \(uint32_t step = 0;; \+\+step\)|while \(true\))|(?P<all>bulk_wait_group_all)\(\)")
PLAIN = {"reduce": "reduce", "wait": "WAIT", "loop": "loop", "all": "wait all"}  # the statements without operands


def statement(m: re.Match) -> str:
    """One of WRITER_STATEMENTS from a STATEMENT match."""
    g = m.groupdict()
    if g["kind"]:
        return f"{g['kind']} {g['bar']} {1 if g['plus'] else 0}"
    if g["done"]:
        return f"{g['done']} if done"
    return next(text for group, text in PLAIN.items() if g[group])


def function_body(name: str) -> str:
    body = HEADER[HEADER.index(f"static __device__ __forceinline__ void {name}("):]
    return body[:body.index("\n}\n")]


def header_protocol() -> dict:
    """The protocol as the header writes it: write_dq's statements in order (they must be WRITER_STATEMENTS, the
    waits' expressions returned as functions of DQ_STAGES), the consumers' side in consume() and consume_tall()
    (the DQ_FREE sync before every step's staging stores, unconditionally, then the proxy fence, then the
    DQ_STAGED arrival), and the barriers' size (160 threads: 5 warps)."""
    found = list(STATEMENT.finditer(function_body("write_dq")))
    got, waits = [statement(m) for m in found], [m["wait"] for m in found if m["wait"]]
    # a step's reductions of one warpgroup are one bulk group whatever their number (params.step_rows 80's two runs
    # are a second call in the source, beside the 64-row one): one "reduce" for the model
    got = [s for i, s in enumerate(got) if not (s == "reduce" and i > 0 and got[i - 1] == "reduce")]
    assert got == WRITER_STATEMENTS, got
    consumer = (r"staging_free_wait\(cw\);[^\n]*\n(?:\s*//[^\n]*\n)*\s*each_staged_pair\(staging, row, lane, \[&\]"
                r"\(uint32_t at, int i\) \{ st_shared_v2_f32\(at, dq\[i\], dq\[i \+ 1\]\); \}\);\s*"
                r"fence_proxy_async_shared_cta\(\);[^\n]*\n(?:\s*//[^\n]*\n)*\s*(?:if constexpr \(L::DQ_WRITER\) \{\s*)?"
                r"staged_arrive\(cw\);")
    assert re.search(r"\n +if constexpr \(L::DQ_WRITER\) staging_free_wait\(cw\);", function_body("consume"))
    assert re.search(r"\n    staging_free_wait\(cw\);", function_body("consume_tall"))
    for name in ("consume", "consume_tall"):
        assert re.search(consumer, function_body(name)), f"{name}: DQ_FREE sync, staging stores, fence, DQ_STAGED"
    # consume()'s 80-row steps (WIDE): the same order around their transposed staging
    wide = (r"staging_free_wait\(cw\);[^\n]*\n\s*stage_dq_t\([^;]*\);\s*fence_proxy_async_shared_cta\(\);[^\n]*\n"
            r"\s*staged_arrive\(cw\);")
    assert re.search(wide, function_body("consume")), "consume (WIDE): DQ_FREE sync, staging stores, fence, DQ_STAGED"
    assert "constexpr uint32_t WRITER_BAR = 160;" in HEADER and 160 == 32 * WARPS["FREE"] == 32 * WARPS["STAGED"]
    return {"waits": [lambda stages, e=e: eval(e.replace("L::DQ_STAGES", str(stages))) for e in waits]}  # noqa: S307


def programs(steps: int, stages: int, *, waits=(None, None), arrive_first=True, free_after_first=True,
             skip_sync_before=0):
    """The ops of consumers 0, 1 and the writer for a walk of `steps` steps (tuples: sync / arrive (barrier, warps),
    store / issue (warpgroup, buffer), waitread (groups left reading)). skip_sync_before: the consumers' DQ_FREE
    sync left out before that step, arrive_first / free_after_first: the writer's arrivals before the first step and
    after it (broken forms); waits: the writer's two waits."""
    consumers = []
    for w in range(2):
        ops = []
        for s in range(steps):
            ops.append(("sync", "DS", 4))
            if s >= skip_sync_before:
                ops.append(("sync", ("FREE", w), 4))
            ops += [("store", w, s % stages), ("arrive", ("STAGED", w), 4)]
        consumers.append(ops)
    writer = []
    if steps and arrive_first:
        writer += [("arrive", ("FREE", 0), 1), ("arrive", ("FREE", 1), 1)]
    for s in range(steps):
        for w in range(2):
            writer += [("sync", ("STAGED", w), 1), ("issue", w, s % stages)]
        if s == steps - 1:
            break
        if not free_after_first and s == 0:
            continue
        writer += [("waitread", waits[0]), ("arrive", ("FREE", 0), 1), ("waitread", waits[1]), ("arrive", ("FREE", 1), 1)]
    return consumers + [writer]


def explore(progs) -> set[str]:
    """Every interleaving of the three parties and the bulk unit (depth-first over the states): the problems."""
    def kind(bar):
        return bar if isinstance(bar, str) else bar[0]

    start = ((0, 0, 0), (), frozenset(), ())
    seen, todo, problems = set(), [start], set()
    while todo:
        state = todo.pop()
        if state in seen:
            continue
        seen.add(state)
        pcs, counts, waiting, reading = state
        counts = dict(counts)
        if all(pcs[a] >= len(progs[a]) for a in range(3)):
            if any(counts.values()):
                problems.add(f"arrivals never synced: {counts}")
            continue
        moves = []
        if reading:  # the bulk unit finishes the oldest read
            moves.append((pcs, tuple(sorted(counts.items(), key=str)), waiting, reading[1:]))
        for a in range(3):
            if pcs[a] >= len(progs[a]) or any(a == who for who, _ in waiting):
                continue
            op = progs[a][pcs[a]]
            new_counts, new_waiting, new_reading = dict(counts), set(waiting), reading
            if op[0] in ("sync", "arrive"):
                bar, n = op[1], counts.get(op[1], 0) + op[2]
                if n > WARPS[kind(bar)]:
                    problems.add(f"{bar} overflowed by party {a} at its op {pcs[a]}")
                    continue
                if n == WARPS[kind(bar)]:  # the phase completes: every waiter on it goes on
                    new_counts[bar] = 0
                    new_waiting = {(who, b) for who, b in new_waiting if b != bar}
                else:
                    new_counts[bar] = n
                    if op[0] == "sync":
                        new_waiting.add((a, bar))
            elif op[0] == "store" and (op[1], op[2]) in reading:
                problems.add(f"warpgroup {op[1]} stored into buffer {op[2]} while a reduction read it")
            elif op[0] == "issue":
                new_reading = reading + ((op[1], op[2]),)
            elif op[0] == "waitread" and len(reading) > op[1]:
                continue
            step = list(pcs)
            step[a] += 1
            moves.append((tuple(step), tuple(sorted(((k, v) for k, v in new_counts.items() if v), key=str)),
                          frozenset(new_waiting), new_reading))
        if not moves:
            problems.add(f"deadlock at {pcs}")
        todo += moves
    return problems


@pytest.mark.parametrize("stages", STAGES)
def test_the_headers_protocol_holds_in_every_interleaving(stages):
    """One buffer (the 128-row step) and two (DQ_STAGES, 64-row steps), walks of 0 to 5 steps: no overflow, no
    arrival left, no deadlock, no store into a buffer being read."""
    waits = tuple(f(stages) for f in header_protocol()["waits"])
    for steps in range(6):
        assert explore(programs(steps, stages, waits=waits)) == set(), (stages, steps)


@pytest.mark.parametrize("stages,broken,expect", [
    # the waits loosened by one (one buffer: 1, 0 -> 2, 1; two: 3, 2 -> 4, 3): a store into a buffer being read
    (2, {"waits": (4, 3)}, "stored into buffer"),
    (1, {"waits": (2, 1)}, "stored into buffer"),
    # warpgroup 1's buffer freed with its reduction (the newest group) perhaps still reading it
    (1, {"waits": (1, 1)}, "stored into buffer"),
    (2, {"waits": (3, 3)}, "stored into buffer"),
    # no arrival before the first step: the consumers' first sync waits forever
    (1, {"waits": (1, 0), "arrive_first": False}, "deadlock"),
    # i35dq2's first form: no sync before the first two steps, no arrival before them nor after step 0: a warpgroup
    # can arrive twice on DQ_STAGED before the writer syncs once
    (2, {"waits": (3, 2), "arrive_first": False, "free_after_first": False, "skip_sync_before": 2}, "STAGED"),
])
def test_broken_forms_fail(stages, broken, expect):
    """Negative controls: each broken form of the protocol fails in some interleaving of some walk of 2-4 steps."""
    found = set()
    for steps in range(2, 5):
        found |= explore(programs(steps, stages, **broken))
    assert found, f"{broken}: no interleaving failed"
    assert any(expect in p for p in found), found
