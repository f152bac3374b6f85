"""Plans and their CPU verifier: every shipped collective verifies at world sizes
2..8, each a variant of the shipped spec (the plan sweep, marked `plans`, one plan per
test; `tsgen verify specs` checks the world sizes each spec is compiled for), and broken
plans (a signal, a wait or a chunk offset changed) fail, so the verifier is load-bearing.
Straight-line code of small plans makes exactly the share calls the verified tables list."""

import dataclasses
import re

import pytest

from conftest import ROOT, exhaustive

from tsgen.errors import SpecError
from tsgen.ops import get_family
from tsgen.plan.ir import SignalRef
from tsgen.plan.lower import c_tables, straight_line_groups
from tsgen.plan.verifier import default_schedules, schedule_orders, verify
from tsgen.plan_jobs import job_plan, plan_jobs
from tsgen.render import render
from tsgen.shipped import shipped
from tsgen.spec import load_spec, spec_variant

# the shipped specs built from plans, loaded once (tsgen.shipped caches them)
LOADED = {l.path: l for l in shipped(multimem=False) if hasattr(get_family(l.model.op), "comm_plan")}
COLLECTIVES = sorted(LOADED)


def _plan(spec_path, w):
    spec = spec_variant(load_spec(spec_path), {"world_sizes": [w]}).model
    return get_family(spec.op).comm_plan(spec, w)


def test_some_collectives_ship():
    assert {LOADED[s].model.op for s in COLLECTIVES} == {
        "allgather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast"}


# The world sizes every run verifies: the smallest, the smallest odd one, the largest (a power of two);
# 4 to 7 are `exhaustive` (the GPU gate runs them): 88 of the sweep's 148 s on 2 cores (2026-11-27).
SWEEP_WORLDS = (2, 3, 8)
# At world 8 (24 random schedules and the 3 fixed sweeps, 31 of the 55 s that worlds 2, 3 and 8 take alone on
# this 2-core machine, 2026-11-28) every run checks the plan's static problems and runs the fixed sweeps; its
# random schedules are `exhaustive`: the random interleavings are what worlds 2 and 3 run 100 of.
SPLIT_WORLDS = (8,)


def _sweep_cases():
    """(spec, w, trials) for every collective at worlds 2..8: "all" schedules, or at SPLIT_WORLDS the
    "sweeps" (by default) and the "random" ones (`exhaustive`), which together are what "all" runs."""
    for s in COLLECTIVES:
        for w in range(2, 9):
            if w not in SWEEP_WORLDS:
                yield exhaustive(s, w, "all")
            elif w in SPLIT_WORLDS:
                yield pytest.param(s, w, "sweeps")
                yield exhaustive(s, w, "random")
            else:
                yield pytest.param(s, w, "all")


def _trials(w: int, which: str) -> range | None:
    """The schedule indices (verify's `trials`) of `which`: None for all of them, else the random ones
    (the first default_schedules(w)) or the fixed sweeps after them (tsgen.plan.verifier.schedule_orders)."""
    random_ones = default_schedules(w)
    return {"all": None, "random": range(random_ones),
            "sweeps": range(random_ones, len(schedule_orders(random_ones)))}[which]


@pytest.mark.plans
@pytest.mark.parametrize("spec,w,trials", list(_sweep_cases()),
                         ids=lambda x: str(x.stem) if hasattr(x, "stem") else str(x))
def test_shipped_plans_verify(spec, w, trials):
    """The plan of `spec` at world size `w`, built here (not at collection: the inner loop
    deselects the sweep) as `tsgen verify` builds it (plan_jobs, job_plan), verified under the
    schedules `trials` names (_trials). Worlds 4-7 and world 8's random schedules are `exhaustive`."""
    try:
        plan = job_plan(spec, w)
    except SpecError as e:  # the family does not plan this world size: plan_jobs skips it too
        pytest.skip(e.problems[0])
    assert verify(plan, schedules=default_schedules(w), trials=_trials(w, trials)) == []


def test_the_world_8_cases_together_run_every_schedule():
    """The "sweeps" and "random" picks are disjoint and together every schedule verify runs by default."""
    w = SPLIT_WORLDS[0]
    picked = [*_trials(w, "random"), *_trials(w, "sweeps")]
    assert picked == list(range(len(schedule_orders(default_schedules(w)))))
    assert {schedule_orders(default_schedules(w))[i] for i in _trials(w, "sweeps")} == {
        "rank_first", "rank_last", "block_reverse"}


@pytest.mark.plans
def test_the_plan_sweep_is_every_collective_at_every_world_size():
    jobs = plan_jobs([ROOT / "specs"], range(2, 9))
    multimem = "multimem variant: no plan to verify, compiled only"
    assert [(j.name, j.skip) for j in jobs if j.world is None] == [
        ("all_reduce_multimem", multimem), ("allgather_multimem", multimem)]
    assert sorted({j.path for j in jobs if j.world}) == COLLECTIVES
    assert all(j.schedules == default_schedules(j.world) for j in jobs if j.world)


def test_schedules_stand_alone():
    """Schedule i is the same in a short run and a long one, and chunks of schedules find
    what one run finds: the problems of the first schedule that has any."""
    plan = _plan("specs/allgather.yaml", 3)
    i = _first_copy(plan, 1)
    st = plan.ranks[1].steps[i]
    plan.ranks[1].steps[i] = dataclasses.replace(st, dst=(st.dst[0], dataclasses.replace(st.dst[1], unit=0)))
    whole = verify(plan, schedules=10)
    assert whole and whole[0].startswith("[random schedule 0] ")
    assert verify(plan, schedules=10, trials=range(1, 13)) and verify(plan, schedules=4, trials=[0]) == whole

    def sweeps(n):  # what the three fixed sweeps find, without the "[order schedule i]" prefix
        return [p.split("] ", 1)[1] for p in verify(plan, schedules=n, trials=range(n, n + 3))]

    assert sweeps(10) == sweeps(2) != []


def _first_copy(plan, rank):
    return next(i for i, s in enumerate(plan.ranks[rank].steps) if s.op == "copy" and s.dst[0] != rank)


def test_wrong_chunk_offset_fails():
    plan = _plan("specs/allgather.yaml", 3)
    i = _first_copy(plan, 1)
    st = plan.ranks[1].steps[i]
    plan.ranks[1].steps[i] = dataclasses.replace(st, dst=(st.dst[0], dataclasses.replace(st.dst[1], unit=0)))
    problems = verify(plan, schedules=10)
    assert problems and any("written twice" in p or "expected" in p or "never written" in p for p in problems), problems


def test_missing_wait_for_peer_entry_fails():
    """Without the entry wait, a push can land in a peer still in the previous call."""
    plan = _plan("specs/reduce_scatter.yaml", 3)
    for r in range(3):
        plan.ranks[r].steps = [dataclasses.replace(s, waits=tuple(w for w in s.waits if w[0] != "entry"))
                               if s.op == "copy" else s for s in plan.ranks[r].steps]
        # keep the entry signals awaited by something so only the race remains
        plan.ranks[r].steps.append(dataclasses.replace(plan.ranks[r].steps[-1], op="none", dst=None, srcs=(),
                                   waits=tuple(("entry", q) for q in range(3) if q != r), signals=()))
    from tsgen.plan.ir import schedule

    plan = schedule(3, plan.nblocks, [rp.steps for rp in plan.ranks], buffers=plan.buffers,
                    signals=plan.signals, expected=plan.expected)
    problems = verify(plan, schedules=200)
    assert problems and any("while rank" in p for p in problems), problems


def test_wrong_signal_index_fails():
    plan = _plan("specs/allgather.yaml", 4)
    i = _first_copy(plan, 2)
    st = plan.ranks[2].steps[i]
    bad = SignalRef(st.signals[0].rank, st.signals[0].name, (st.signals[0].index + 1) % 4)
    plan.ranks[2].steps[i] = dataclasses.replace(st, signals=(bad,))
    from tsgen.plan.ir import schedule

    plan = schedule(4, plan.nblocks, [rp.steps for rp in plan.ranks], buffers=plan.buffers,
                    signals=plan.signals, expected=plan.expected)
    assert verify(plan, schedules=20)


def test_reduce_missing_source_fails():
    plan = _plan("specs/all_reduce_one_shot.yaml", 3)
    i = next(i for i, s in enumerate(plan.ranks[0].steps) if s.op == "reduce")
    st = plan.ranks[0].steps[i]
    plan.ranks[0].steps[i] = dataclasses.replace(st, srcs=st.srcs[:-1])
    problems = verify(plan, schedules=5)
    assert problems and any("expected" in p for p in problems), problems


def test_the_world_8_sweeps_alone_catch_a_wrong_offset_and_a_missing_source():
    """What the default run verifies at world 8 (the fixed sweeps, _trials "sweeps") still fails a broken plan."""
    sweeps = _trials(8, "sweeps")
    plan = _plan("specs/allgather.yaml", 8)
    i = _first_copy(plan, 1)
    st = plan.ranks[1].steps[i]
    plan.ranks[1].steps[i] = dataclasses.replace(st, dst=(st.dst[0], dataclasses.replace(st.dst[1], unit=0)))
    problems = verify(plan, schedules=default_schedules(8), trials=sweeps)
    assert problems and "written twice" in problems[0], problems
    plan = _plan("specs/all_reduce_one_shot.yaml", 8)
    i = next(i for i, s in enumerate(plan.ranks[0].steps) if s.op == "reduce")
    plan.ranks[0].steps[i] = dataclasses.replace(plan.ranks[0].steps[i], srcs=plan.ranks[0].steps[i].srcs[:-1])
    problems = verify(plan, schedules=default_schedules(8), trials=sweeps)
    assert problems and "expected" in problems[0], problems


def test_deadlock_is_reported():
    """A wait on a counter nobody raises in time (every rank waits before it signals)."""
    plan = _plan("specs/allgather.yaml", 2)
    for r in range(2):
        steps = plan.ranks[r].steps
        steps[0] = dataclasses.replace(steps[0], waits=(("arrive", 1 - r),))
    from tsgen.plan.ir import schedule

    plan = schedule(2, 1, [rp.steps for rp in plan.ranks], buffers=plan.buffers,
                    signals=plan.signals, expected=plan.expected)
    problems = verify(plan, schedules=3)
    assert problems and any("deadlock" in p for p in problems), problems


def test_verify_cli_exit_codes(tmp_path):
    from conftest import run_cli

    ok = run_cli("verify", "specs/allgather.yaml", "--world", "2,3", "--schedules", "3")
    assert ok.code == 0, ok.stdout + ok.stderr
    assert "allgather world 3: ok" in ok.stdout
    bad = run_cli("verify", "specs/allgather.yaml", "--world", "9")
    assert bad.code == 2


def test_verify_checks_the_worlds_the_spec_is_compiled_for():
    """Without --world, each spec at its own world_sizes (was: 2..8 whatever they were)."""
    from conftest import run_cli

    r = run_cli("verify", "specs/allgather.yaml", "--schedules", "1")
    assert r.code == 0, r
    assert [line.split(":")[0] for line in r.stdout.splitlines()] == [
        "allgather world 2", "allgather world 3", "allgather world 4", "allgather world 8", "tsgen"], r


def test_verify_refuses_worlds_the_spec_is_not_compiled_for():
    """A world size no kernel of the spec is compiled for is refused, naming the spec and its sizes
    (was: verified as if it were, exit 0)."""
    from conftest import run_cli

    r = run_cli("verify", "specs/allgather.yaml", "specs/broadcast.yaml", "--world", "4..6")
    assert r.code == 2 and r.stdout == "", r
    assert r.stderr.splitlines() == [
        "tsgen: --world 4,5,6: not every spec is compiled for it (without --world, each spec is verified at "
        "its own world sizes):",
        "  specs/allgather.yaml: compiled for world sizes [2, 3, 4, 8], not 5, 6",
        "  specs/broadcast.yaml: compiled for world sizes [2, 3, 4, 8], not 5, 6"], r


@pytest.mark.parametrize("spec", ["put_block", "allgather_multimem"])
def test_verify_of_a_spec_without_plans_says_so(spec):
    """A spec with no comm plan (another op, a multimem variant): exit 2 and why (was: "0 plans
    verified", exit 0)."""
    from conftest import run_cli

    r = run_cli("verify", f"specs/{spec}.yaml")
    assert r.code == 2, r
    assert r.stderr.startswith(f"tsgen: no plan to verify in specs/{spec}.yaml: only collectives built from a "
                               "comm plan (all_reduce, all_to_all, allgather, broadcast, reduce_scatter) have one"), r


def test_verify_cli_jobs_keep_the_order():
    """Chunks of schedules run in a pool of processes; the lines come in the order of the
    specs asked for and of the world sizes (sorted), the same as from one process."""
    from conftest import run_cli

    args = ("verify", "specs/broadcast.yaml", "specs/allgather.yaml", "--world", "3,2", "--schedules", "9")
    pooled, alone = run_cli(*args, "--jobs", "3"), run_cli(*args, "--jobs", "1")
    assert pooled.code == alone.code == 0, pooled
    assert pooled.stdout == alone.stdout
    assert pooled.stdout.splitlines() == [f"{name} world {w}: ok (12 schedules x 2 calls)" for name in
                                          ("broadcast", "allgather") for w in (2, 3)] + ["tsgen: 4 plans verified"]


@pytest.mark.parametrize("spec,w,mask_of", [
    ("specs/allgather.yaml", 4, lambda r: 0xF & ~(1 << r)),           # entry to every peer
    ("specs/all_reduce_ring.yaml", 3, lambda r: 1 << ((r - 1) % 3)),  # only the left neighbour writes into us
])
def test_opening_signal_hoisted(spec, w, mask_of):
    """Each rank's entry step leaves block 0's share list when hoisted and comes back as
    (buffer index, counter index, peer mask): what plan<W>::open raises at kernel start."""
    from tsgen.plan.lower import opening_signal

    plan = _plan(spec, w)
    index = {n: i for i, n in enumerate(["calls", *plan.buffers, *plan.signals])}
    plain, hoisted = c_tables(plan, index), c_tables(plan, index, hoist_opening=True)
    assert plain["opening"] == [None] * w
    for r in range(w):
        name, counter, mask = opening_signal(plan, r)
        assert (name, counter, mask) == ("entry", r, mask_of(r))
        assert hoisted["opening"][r] == (index["entry"], r, mask_of(r))
    assert hoisted["nshares"] == plain["nshares"] - w
    assert hoisted["steps"] == plain["steps"]  # the steps (and the verified plan) are unchanged


def test_opening_signal_needs_a_signal_only_first_share():
    from tsgen.plan.lower import opening_signal

    plan = _plan("specs/allgather.yaml", 2)
    st = plan.ranks[0].steps[plan.ranks[0].blocks[0][0].step]
    plan.ranks[0].steps[plan.ranks[0].blocks[0][0].step] = dataclasses.replace(st, waits=(("entry", 1),))
    assert opening_signal(plan, 0) is None and opening_signal(plan, 1) is not None


def test_missing_extra_destination_fails():
    """two_shot_pull stores each reduced share to every rank at once (`also`): drop one
    destination and a peer's output is never written -- verify must say so."""
    plan = _plan("specs/all_reduce_two_shot_pull.yaml", 4)
    i = next(i for i, s in enumerate(plan.ranks[1].steps) if s.also)
    st = plan.ranks[1].steps[i]
    plan.ranks[1].steps[i] = dataclasses.replace(st, also=st.also[:-1])
    problems = verify(plan, schedules=5)
    assert problems and any("never written" in p for p in problems), problems


def test_extra_destinations_only_on_reduce_steps():
    plan = _plan("specs/allgather.yaml", 2)
    i = _first_copy(plan, 0)
    st = plan.ranks[0].steps[i]
    plan.ranks[0].steps[i] = dataclasses.replace(st, also=(st.dst,))
    assert any("only a reduce stores to extra destinations" in p for p in verify(plan, schedules=2))


def _table_shares(plan, hoist):
    """Per rank, per block, the (step, share, shares) entries the C tables give it."""
    index = {n: i for i, n in enumerate(["calls", *plan.buffers, *plan.signals])}
    t = c_tables(plan, index, hoist_opening=hoist)
    flat = [tuple(map(int, e)) for _, lines in t["shares"] for line in lines
            for e in re.findall(r"\{(\d+), (\d+), (\d+)\}", line)]
    return [[flat[row[b]:row[b + 1]] for b in range(plan.nblocks)] for row in t["first"]]


def _expand(groups, nblocks):
    """Per block, the (step, share, shares) calls a rank's straight-line code makes."""
    blocks = [[] for _ in range(nblocks)]
    for g in groups:
        for b in range(g.lo, g.hi):
            assert not blocks[b], f"block {b} is in two groups"
            blocks[b] = [(sh.step, sh.share + b - g.lo, sh.shares) for sh in g.shares]
    return blocks


@pytest.mark.parametrize("hoist", [False, True], ids=["plain", "hoisted"])
@pytest.mark.parametrize("spec,w", [(s, w) for s in COLLECTIVES for w in LOADED[s].model.world_sizes],
                         ids=lambda x: x.stem if hasattr(x, "stem") else f"w{x}")
def test_straight_line_groups_are_the_tables(spec, w, hoist):
    """Straight-line code makes, in every block of every rank, exactly the share calls
    the tables list for that block: the same steps, shares and order."""
    plan = job_plan(spec, w)  # cached: the plain and hoisted tests of (spec, w) read one plan
    groups, calls = straight_line_groups(plan, hoist_opening=hoist)
    assert [_expand(g, plan.nblocks) for g in groups] == _table_shares(plan, hoist)
    assert calls == sum(len(g.shares) for rank in groups for g in rank)


@pytest.mark.parametrize("hoist", [False, True], ids=["plain", "hoisted"])
@pytest.mark.parametrize("spec,w", [(s, w) for s in COLLECTIVES for w in LOADED[s].model.world_sizes],
                         ids=lambda x: x.stem if hasattr(x, "stem") else f"w{x}")
def test_share_runs_expand_to_the_table(spec, w, hoist):
    """The run-length encoded share table the source writes (plan.lower.share_runs, expanded by
    tsgen::expand_shares at compile time) is, entry for entry, the table c_tables lists."""
    from tsgen.plan.lower import share_runs

    plan = job_plan(spec, w)  # cached: the plain and hoisted tests of (spec, w) read one plan
    runs = share_runs(plan, hoist_opening=hoist)
    expanded = [(step + m * rstep + k * dstep, share + m * rshare + k * dshare, shares)
                for rank in runs for step, share, shares, n, dstep, dshare, reps, rstep, rshare in rank
                for m in range(reps) for k in range(n)]
    table = [e for rank in _table_shares(plan, hoist) for block in rank for e in block]
    assert expanded == table
    assert [sum(run[3] * run[6] for run in r) for r in runs] == [sum(map(len, rank)) for rank in _table_shares(plan, hoist)]
    assert all(0 <= x < 2**16 for r in runs for run in r for x in (*run[:4], run[6]))
    assert all(-2**15 <= x < 2**15 for r in runs for run in r for x in (*run[4:6], *run[7:]))


def test_straight_line_groups_merge_blocks():
    """one_shot at world size 4: per rank, blocks 1..32 run shares 0..31 of the reduce (one
    group, one call) and block 33 the final wait; block 0 only opens (hoisted)."""
    groups, calls = straight_line_groups(_plan("specs/all_reduce_one_shot.yaml", 4), hoist_opening=True)
    assert calls == 8
    for rank in groups:
        assert [(g.lo, g.hi, [(sh.step, sh.share, sh.shares) for sh in g.shares]) for g in rank] == [
            (1, 33, [(1, 0, 32)]), (33, 34, [(2, 0, 1)])]


def _straight_worlds(name):
    """World sizes with straight-line code; their kernels, and only theirs, are compiled for
    one block per SM (min_blocks)."""
    spec = load_spec(ROOT / "specs" / f"{name}.yaml").model
    family = get_family(spec.op)
    worlds = sorted(family.template_vars(spec)["straight_line"])
    assert [k.world_size for k in family.abi(spec).kernels if k.min_blocks == 1] == worlds
    return worlds


@pytest.mark.parametrize("name,worlds", [
    ("all_reduce_one_shot", [2, 3, 4, 8]), ("all_reduce_two_shot_pull", [2, 3, 4, 8]), ("broadcast", [2, 3, 4, 8]),
    ("allgather", [2, 3, 4]), ("all_to_all", [2, 3, 4]), ("reduce_scatter", [2, 3, 4]),
    ("all_reduce_ring", [2]), ("allgather_ring", [2]), ("all_reduce_two_shot", [2]),
    ("allgather_ce", []), ("allgather_nvshmem", []),  # the other executors keep the tables
])
def test_which_shipped_plans_are_straight_line(name, worlds):
    """STRAIGHT_LINE_MAX_CALLS at work: the shipped world sizes that get straight-line code."""
    assert _straight_worlds(name) == worlds


def test_plan_code_tables_renders_no_straight_line_code():
    """launch.plan_code: tables (the A/B baseline) keeps every world size on the table
    interpreter, with its share and block tables; straight-line world sizes keep only the
    step table (the code names its entries), and it is the same either way."""
    loaded = load_spec(ROOT / "specs" / "all_reduce_one_shot.yaml")
    forced = spec_variant(loaded, {"launch": {"plan_code": "tables"}})
    auto, tables = render(loaded).source, render(forced).source
    assert "if constexpr (WORLD == 2 || WORLD == 3 || WORLD == 4 || WORLD == 8)" in auto
    for w in (2, 3, 4, 8):
        assert f"TSGEN_RUN_SHARE(steps_w{w}[" in auto
        assert f"static __device__ const tsgen::share_table<" in tables and f" shares_w{w} =" in tables
        assert f" shares_w{w} =" not in auto and f"first_w{w}[" not in auto
        assert _step_table(auto, w) == _step_table(tables, w)
    assert "TSGEN_RUN_SHARE(" not in tables and "::template run<T, UNROLL>" not in tables


def _step_table(source, w):
    """World size w's step table and step bases, as the source writes them."""
    start = source.index(f"static __device__ const tsgen::step steps_w{w}[]")
    return source[start:source.index("\n", source.index(f"step_base_w{w}[", start))]


def test_more_than_512_threads_keep_the_tables():
    """With 1024 threads ptxas caps a thread at 64 registers, fewer than straight-line
    reductions keep in flight: such specs run the table interpreter."""
    wide = spec_variant(load_spec(ROOT / "specs" / "all_reduce_one_shot.yaml"), {"launch": {"threads": 1024}})
    spec = wide.model
    assert spec.launch.threads == 1024
    assert get_family(spec.op).template_vars(spec)["straight_line"] == {}
    assert "::template run<T, UNROLL>" not in render(wide).source


def test_table_limits_are_emitted_from_the_ir():
    """The limits of a plan's table rows (tsgen.plan.ir) are `#define`d by every rendered source
    before it includes templates/include/tsgen/plan.cuh (tsgen.plan.lower.C_DEFINES); the header's
    own defaults, which it keeps when used alone, agree with them; a header without one is refused."""
    from tsgen.plan import ir
    from tsgen.plan.lower import C_DEFINES, header_defines

    limits = {f"TSGEN_{k}": getattr(ir, k) for k in ("MAX_SRCS", "MAX_WAITS", "MAX_SIGNALS", "MAX_ALSO")}
    assert C_DEFINES["tsgen/plan.cuh"] == limits
    header = (ROOT / "templates/include/tsgen/plan.cuh").read_text()
    assert {k: int(v) for k, v in re.findall(r"^#define (TSGEN_MAX_\w+) (\d+)$", header, re.M)} == limits
    assert header_defines("tsgen/plan.cuh", header) == limits
    source = render(load_spec(ROOT / "specs" / "all_reduce_one_shot.yaml")).source
    defines = "".join(f"#define {k} {v}\n" for k, v in limits.items())
    assert defines in source
    with pytest.raises(ValueError, match="no single `#define TSGEN_MAX_ALSO <number>` line"):
        header_defines("tsgen/plan.cuh", header.replace("#define TSGEN_MAX_ALSO 7", ""))

def test_table_structs_are_declared_as_python_writes_their_rows():
    """tsgen/plan.cuh's table structs field by field as tsgen.plan.lower writes the rows; a header
    that declares one otherwise (two fields swapped) is refused at render time, naming it."""
    from tsgen.plan.lower import C_STRUCTS, c_init, check_structs, declared_structs, field_names, header_defines

    text = (ROOT / "templates" / "include" / "tsgen/plan.cuh").read_text()
    declared = declared_structs(text)
    for name, fields in C_STRUCTS["tsgen/plan.cuh"].items():
        assert declared[name] == fields, name
    check_structs("tsgen/plan.cuh", text)
    swapped = text.replace("  uint16_t unit;\n  uint16_t piece;", "  uint16_t piece;\n  uint16_t unit;")
    assert swapped != text
    with pytest.raises(ValueError, match="struct slice declares .*uint16_t piece, uint16_t unit"):
        header_defines("tsgen/plan.cuh", swapped)
    assert c_init("share", shares=3, step=1, share=2) == "{1, 2, 3}"
    with pytest.raises(ValueError, match="tsgen::share has the fields step, share, shares"):
        c_init("share", step=1, share=2)
    # share_runs' tuples (step, share, shares, n, dstep, dshare, reps, rstep, rshare) follow tsgen::share_run
    assert field_names("share_run") == ("step", "share", "shares", "n", "dstep", "dshare", "reps", "rstep", "rshare")
