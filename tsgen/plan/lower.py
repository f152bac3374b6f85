"""The C lowering of plans: table rows for templates/ops/plan_tables.cu.j2, small plans as
straight-line share groups, and copy-engine stream programs. See tsgen/plan/__init__.py."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from .ir import MAX_ALSO, MAX_SIGNALS, MAX_SRCS, MAX_WAITS, CommPlan, Share, Slice, Step

# The limits of the C tables, emitted from the IR's constants: a generated source `#define`s each
# before it includes the header, whose own `#ifndef` defaults a header used alone keeps
# (tests/test_plan.py checks they agree).
C_DEFINES: dict[str, dict[str, int]] = {
    "tsgen/plan.cuh": {"TSGEN_MAX_SRCS": MAX_SRCS, "TSGEN_MAX_WAITS": MAX_WAITS,
                       "TSGEN_MAX_SIGNALS": MAX_SIGNALS, "TSGEN_MAX_ALSO": MAX_ALSO},
}


# The layouts of the table structs, (C type, field) in declaration order. The initializers below
# are built from them (c_init), share_runs' tuples follow share_run, and every render checks that
# the header declares exactly these fields (header_defines -> check_structs): the Python rows and
# the C structs cannot drift apart unnoticed.
C_STRUCTS: dict[str, dict[str, tuple[tuple[str, str], ...]]] = {
    "tsgen/plan.cuh": {
        "slice": (("int8_t", "rank"), ("uint8_t", "buf"), ("uint8_t", "read_only"), ("uint8_t", "pieces"),
                  ("uint16_t", "unit"), ("uint16_t", "piece")),
        "step_wait": (("uint8_t", "buf"), ("uint8_t", "pad"), ("uint16_t", "index"), ("uint32_t", "per_call")),
        "step_signal": (("int8_t", "rank"), ("uint8_t", "buf"), ("uint16_t", "index")),
        "step": (("uint8_t", "op"), ("uint8_t", "nsrc"), ("uint8_t", "nwait"), ("uint8_t", "nsignal"),
                 ("uint8_t", "nalso"), ("slice", "dst"), ("slice", "src[TSGEN_MAX_SRCS]"),
                 ("slice", "also[TSGEN_MAX_ALSO]"), ("step_wait", "wait[TSGEN_MAX_WAITS]"),
                 ("step_signal", "signal[TSGEN_MAX_SIGNALS]")),
        "share": (("uint16_t", "step"), ("uint16_t", "share"), ("uint16_t", "shares")),
        "share_run": (("uint16_t", "step"), ("uint16_t", "share"), ("uint16_t", "shares"), ("uint16_t", "n"),
                      ("int16_t", "dstep"), ("int16_t", "dshare"), ("uint16_t", "reps"), ("int16_t", "rstep"),
                      ("int16_t", "rshare")),
    },
}


@functools.cache  # c_init asks for every table row: a full build made 250,000 calls
def field_names(struct: str, header: str = "tsgen/plan.cuh") -> tuple[str, ...]:
    """The fields of tsgen::`struct` in declaration order (array extents dropped)."""
    return tuple(re.sub(r"\[.*", "", name) for _, name in C_STRUCTS[header][struct])


def c_init(struct: str, **fields) -> str:
    """The `{...}` initializer of a tsgen::`struct`, its fields in declaration order; every field
    must be given, and no other."""
    names = field_names(struct)
    if set(fields) != set(names):
        raise ValueError(f"tsgen::{struct} has the fields {', '.join(names)}; got {', '.join(fields)}")
    return "{" + ", ".join(str(fields[n]) for n in names) + "}"


def declared_structs(text: str) -> dict[str, tuple[tuple[str, str], ...]]:
    """`struct NAME { TYPE FIELD; ... };` of a header, (type, field) in order (comments dropped,
    `TYPE a, b;` split); template structs and those with member functions are left out."""
    out = {}
    for m in re.finditer(r"^struct (\w+) \{\n(.*?)^\};", text, flags=re.M | re.S):
        body = re.sub(r"//[^\n]*", "", m.group(2))
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            ctype, names = decl.split(None, 1)
            fields += [(ctype, n.strip()) for n in names.split(",")]
        out[m.group(1)] = tuple(fields)
    return out


def check_structs(header: str, text: str) -> None:
    """ValueError naming the struct unless `text` declares C_STRUCTS[header]'s structs exactly."""
    if header not in C_STRUCTS:
        return
    declared = declared_structs(text)
    for name, fields in C_STRUCTS[header].items():
        if declared.get(name) != fields:
            have = ", ".join(" ".join(f) for f in declared.get(name, ())) or "no such struct"
            want = ", ".join(" ".join(f) for f in fields)
            raise ValueError(f"templates/include/{header}: struct {name} declares {have}; tsgen.plan.lower "
                             f"writes its rows as {want}")


def header_defines(header: str, text: str) -> dict[str, int]:
    """The `#define`s a generated source sets from Python before it includes templates/include/
    `header` (C_DEFINES), after checking the header's text: its table structs against C_STRUCTS,
    and one default `#define NAME <number>` of each (a vendored header alone keeps those); ValueError
    otherwise."""
    check_structs(header, text)
    defines = C_DEFINES.get(header, {})
    for name in defines:
        n = len(re.findall(rf"^#define {name} \d+$", text, flags=re.M))
        if n != 1:
            raise ValueError(f"templates/include/{header}: no single `#define {name} <number>` line, the "
                             f"default of the value tsgen.plan sets (found {n})")
    return dict(defines)

# ---------------------------------------------------------------------------
# Rendering the plan as C tables (used by templates/ops/collective.cu.j2)
# ---------------------------------------------------------------------------

_OPS = {"none": "TSGEN_OP_NONE", "copy": "TSGEN_OP_COPY", "reduce": "TSGEN_OP_REDUCE"}


def c_slice(plan: CommPlan, buffer_index: dict[str, int], rank_slice: tuple[int, Slice] | None) -> str:
    """Initializer of a tsgen::slice."""
    if rank_slice is None:
        return c_init("slice", rank=0, buf=0, read_only=0, pieces=1, unit=0, piece=0)
    rank, s = rank_slice
    ro = 1 if plan.buffers.get(s.buffer) == "input" else 0
    return c_init("slice", rank=rank, buf=buffer_index[s.buffer], read_only=ro, pieces=s.pieces, unit=s.unit,
                  piece=s.piece)


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
            waits = ", ".join(c_init("step_wait", buf=buffer_index[n], pad=0, index=idx,
                                     per_call=plan.wait_target(r, n, idx)) for n, idx in st.waits)
            sigs = ", ".join(c_init("step_signal", rank=g.rank, buf=buffer_index[g.name], index=g.index)
                             for g in st.signals)
            also = ", ".join(sl(x) for x in st.also)
            what = _describe(r, st)
            steps.append((c_init("step", op=_OPS[st.op], nsrc=len(st.srcs), nwait=len(st.waits),
                                 nsignal=len(st.signals), nalso=len(st.also), dst=sl(st.dst), src=f"{{{srcs}}}",
                                 also=f"{{{also}}}", wait=f"{{{waits}}}", signal=f"{{{sigs}}}"),
                          f"rank {r} step {i}: {what}"))
        row = []
        for b, lst in enumerate(blocks):
            row.append(nshares)
            entries = [c_init("share", step=sh.step, share=sh.share, shares=sh.shares) for sh in lst]
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


def share_runs(plan, hoist_opening: bool = False) -> list[list[tuple[int, ...]]]:
    """The share table (every rank's blocks' shares, in table order) run-length encoded twice,
    per rank: runs (step, share, shares, n, dstep, dshare, reps, rstep, rshare) that stand for
    the entries {step + m*rstep + k*dstep, share + m*rshare + k*dshare, shares}, m = 0..reps-1
    (outer), k = 0..n-1 (tsgen::share_run in tsgen/plan.cuh; the device table is expanded
    from them at compile time, entry for entry the table c_tables lists). A block's shares (the
    ring: steps 1, 2, 3, .. of one share) and consecutive blocks (share 0, 1, 2, .. of one
    step) each make one inner run; consecutive inner runs alike but for a constant shift of
    their first entry (block after block of the same steps) make one outer run."""
    out = []
    for blocks in block_shares(plan, hoist_opening):
        runs: list[list[int]] = []
        for sh in (sh for lst in blocks for sh in lst):
            if runs:
                step, share, shares, n, dstep, dshare = runs[-1]
                if shares == sh.shares and n == 1 and abs(sh.step - step) < 2**15 and abs(sh.share - share) < 2**15:
                    runs[-1][3:] = [2, sh.step - step, sh.share - share]
                    continue
                if shares == sh.shares and n > 1 and (sh.step, sh.share) == (step + n * dstep, share + n * dshare):
                    runs[-1][3] += 1
                    continue
            runs.append([sh.step, sh.share, sh.shares, 1, 0, 0])
        outer: list[list[int]] = []
        for r in runs:
            if outer:
                step, share, shares, n, dstep, dshare, reps, rstep, rshare = outer[-1]
                shift = (r[0] - step, r[1] - share)
                if r[2:] == [shares, n, dstep, dshare] and all(abs(x) < 2**15 for x in shift):
                    if reps == 1:
                        outer[-1][6:] = [2, *shift]
                        continue
                    if (r[0], r[1]) == (step + reps * rstep, share + reps * rshare):
                        outer[-1][6] += 1
                        continue
            outer.append(r + [1, 0, 0])
        out.append([tuple(r) for r in outer])
    return out
