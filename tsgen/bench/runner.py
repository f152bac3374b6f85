"""`tsgen bench SPEC`: time any op against its baselines, with numbers that cannot lie.

For one spec, in one World across all sizes: for each size (and pattern, for copies) the
op's conventions (family.bench) give the case -- count, FLOPs and bytes per GPU per call.
Buffer sets rotate so that the sets together exceed 2x the L2; inputs are loaded (NumPy
where the outputs are checked against the reference, random on the GPU otherwise); the
timing core (timing.py) warms up, poisons the outputs, times `reps` samples of back-to-back
calls with events on the streams the calls run on (CUDA graphs where the op allows); then
the timed outputs are checked once: against the NumPy reference, or on sampled rows for the
GEMMs, and no output may still hold the poison. A result that fails a check -- its events
bracket nothing, its region is shorter than a kernel launch, the device counted fewer calls,
it is faster than the ceilings allow (ceilings.py), or its output is wrong -- becomes an
error with a message, never a row. In-process baselines are timed in the same World right
after each size, or, where the op's conventions say `interleave`, in the same rounds as tsgen
(one sample of each per round, in a balanced order; ratios paired round by round, with their
spread); multi-process ones (NCCL, torch) after all sizes, one process per GPU.

Ranks sharing a GPU (`share_gpus`) run the same code path, but their timings say nothing
about the op: rows carry SHARED_NOTE, no baseline is timed and no ratio is written.
`control` ("skip-launch", "other-stream") breaks the timing on purpose: the negative
controls that prove the guard (tsgen bench --negative-control).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np

from ..errors import RuntimeSetupError
from ..harness import poison_byte, render_to_cache, shared_gpu_variant, wrong_elements
from ..ops import get_family
from ..ops.conventions import BenchCase
from ..spec import LoadedSpec, load_spec, spec_variant
from .attention_baselines import same_kernel_pair
from .baselines import Measured, check_baselines, run_in_process, run_multiprocess
from .ceilings import ceilings_for, fraction_of_ceiling, guard
from .results import device_of
from .sizes import calls_per_sample, human, parse_sizes, rotation_slots
from .timing import CupyClock, Sampler, Timing, paired_ratio, time_interleaved

# Ranks sharing a GPU compete for its SMs, its L2 and its copy engines, and their "peer"
# traffic never leaves the GPU: such timings say nothing about the op. They are printed (the
# bench and its checks still run) but carry no ratio, no baseline, and go into no README table.
SHARED_NOTE = "shared GPU: not comparable"
CONTROLS = ("skip-launch", "other-stream")
POISON_CALL = 3  # outputs hold harness.poison_byte(3) = 0xFF bytes between warm-up and timing
MAX_REL_ERR = 1e-2  # GEMMs' sampled rows: bf16 operands land between 1e-3 and 1e-2
MAX_SETS = 32  # buffer sets one size rotates over


@dataclass
class Step:
    """One size (and pattern) of one spec in a World: what the timings and baselines need."""

    world: Any
    module: Any
    spec: Any
    family: Any
    case: BenchCase
    pattern: str
    ranks: list[int]
    sets: list[Any]
    iters: int
    reps: int
    warmup: int
    name: str  # the spec's name, or its label in a suite
    label: str  # name, size and pattern
    host: dict | None = None  # the host inputs of set 0 the reference check uses (set by tsgen's timing)

    @property
    def conv(self):
        return self.family.bench

    def poison(self, names) -> None:
        """Every set's outputs `names` on every rank filled with the poison the check looks for."""
        w = self.world
        for b in self.sets:
            for r in w.ranks:
                with w.cp.cuda.Device(w.devices[r]):
                    for name in names:
                        b.array(name, r).view(np.uint8)[...] = poison_byte(POISON_CALL)

    def check(self, what: str) -> tuple[dict, list[str]]:
        """The timed outputs of set 0 against the reference of the host inputs (see _check), for a
        part of the call timed after tsgen's (`what`: whose, in the messages)."""
        return _check(self, self.host, False, what)


@dataclass
class Outcome:
    spec: str
    op: str
    rows: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    device: dict = field(default_factory=dict)
    ceilings: dict = field(default_factory=dict)
    shared: bool = False


def metrics(case: BenchCase, time_us: float) -> dict:
    """Bandwidths and FLOP rate of one call of `case` taking `time_us`."""
    out: dict = {}
    if time_us <= 0:
        return out
    if case.bw_bytes:
        out["algbw_GBps"] = case.bw_bytes / time_us / 1e3
        out["busbw_GBps"] = out["algbw_GBps"] * case.busbw_factor
    if case.flops:
        out["TFLOPs"] = case.flops / time_us / 1e6
    return out


def _dtype(spec) -> str:
    return getattr(spec, "dtype", "uint8")  # barriers and signals have none


def size_unit(family) -> str:
    unit = family.bench.size_unit
    return family.count_unit if unit == "count" else unit


def bench_spec(spec_path, gpus: int | None = None, sizes=None, *, variant: dict | None = None,
               label: str | None = None, iters: int = 20, reps: int = 7, warmup: int = 3,
               patterns: tuple[str, ...] | None = None, backend: str = "single", share_gpus: bool | None = None,
               baselines: bool = True, arch: str = "sm_90a", echo: Callable[[str], None] = print,
               progress: Callable[[str], None] | None = None, control: str | None = None, world=None,
               only_baselines: tuple[str, ...] | None = None, ideal: "IdealOf | None" = None) -> Outcome:
    """Time `spec_path` (with `variant` merged in; or a LoadedSpec, loaded once by the caller) at
    `sizes` (default: the op's) against its baselines (`only_baselines`: those of these names);
    errors instead of rows for every result that fails a check. `ideal` (IdealOf): a
    single-GPU spec of the same work over the whole size (a suite's `ideal_of` entry), timed in tsgen's
    own rounds on rank 0's GPU (`Ideal`): tsgen's rows get ratios[ideal_key(label)] paired round by round
    (and, with peers_busy, a second fraction against the ideal timed while the other GPUs run it too).
    The ideal is timed whatever `baselines` says (run_entries passes it only where baselines are
    timed), and not on shared GPUs, under a negative control, or where this process lacks a rank."""
    from ..runtime import World
    from ..runtime.backends import world_size

    if control is not None and control not in CONTROLS:
        raise RuntimeSetupError(f"negative control {control!r}: choose {', '.join(CONTROLS)}")
    loaded = spec_path if isinstance(spec_path, LoadedSpec) else load_spec(spec_path)
    if variant:
        loaded = spec_variant(loaded, variant)
    spec, family = loaded.model, get_family(loaded.model.op)
    conv = family.bench
    check_baselines(conv.baselines)
    chosen = tuple(b for b in conv.baselines if only_baselines is None or b.name in only_baselines)
    if world is not None:
        gpus = world.size
    elif backend == "single" and gpus is None:
        if len(spec.world_sizes) != 1:
            raise RuntimeSetupError(f"{loaded.path}: --gpus N is needed (the spec runs at world sizes "
                                    f"{list(spec.world_sizes)})")
        gpus = spec.world_sizes[0]
    else:
        gpus = world_size(backend, gpus)
    size_list = parse_sizes(sizes if sizes is not None else (conv.default_sizes or str(spec.test.count)))
    name = label or spec.name
    out = Outcome(name, spec.op)
    own = world is None
    with (World(gpus, backend=backend, share_gpus=share_gpus) if own else contextlib.nullcontext(world)) as w:
        loaded = shared_gpu_variant(loaded, w, echo)
        spec = loaded.model
        cached = render_to_cache(loaded)
        module = w.load(cached.manifest, arch=arch, source=cached.source)
        dev = device_of(w)
        ceil = ceilings_for(dev)
        out.shared = w.shared
        out.device = {"name": dev.name, "sms": dev.sms, "clock_mhz": dev.clock_khz // 1000, "l2_bytes": dev.l2_bytes}
        out.ceilings = ceil.as_dict()
        in_process = baselines and not w.shared and control is None
        # the ideal's World (one GPU, rank 0's) and module live as long as the sizes' timings
        timed_ideal = ideal is not None and not w.shared and control is None
        with (Ideal(ideal, w, arch) if timed_ideal else contextlib.nullcontext()) as ideal_run:
            if ideal_run is not None:
                out.notes += [n for n in (ideal_run.skipped, ideal_run.note) if n]
            for size in size_list:
                case = conv.case(family, spec, w.size, size)
                for pattern in patterns or conv.patterns:
                    ranks = [0] if pattern == "pair" else list(w.ranks)
                    if pattern == "pair" and len(w.ranks) != w.size:
                        continue  # one process per GPU: every process must time the same things (their store)
                    sets = _alloc_sets(module, case, dev.l2_bytes)
                    try:
                        step = Step(w, module, spec, family, case, pattern, ranks, sets, iters, reps, warmup, name,
                                    f"{name} {human(size)}{'' if pattern == 'all' else ' ' + pattern}")
                        # interleaved: the baselines are prepared first and timed in the same rounds as tsgen
                        rivals = run_in_process(chosen, step) if in_process and conv.interleave else []
                        if ideal_run is not None and not ideal_run.skipped:
                            rivals += ideal_run.rivals(step, dev.l2_bytes)
                        row, problems = _time_tsgen(step, control, ceil, dev, rivals)
                        _report(out, row, problems, echo)
                        later = run_in_process(chosen, step) if in_process and not conv.interleave else []
                        for m in rivals + later:
                            if m.timing is None:
                                out.notes.append(f"{m.impl} at {human(size)}: not timed: {m.skipped}")
                                continue
                            _report(out, *_baseline_row(m, step.case, spec, family, w, ceil, dev, pattern), echo)
                    finally:
                        for b in sets:
                            b.free()
                if progress is not None:
                    progress(f"{name} {human(size)}")
        if w.shared:
            out.notes.append(f"{SHARED_NOTE}: no baselines timed, no ratios")
        elif not baselines or control is not None:
            out.notes.append("baselines not timed (--no-baselines)" if control is None else "negative control")
        elif backend != "single":
            out.notes.append(f"--backend {backend}: tsgen alone (the baselines start their own processes)")
        elif any(not b.in_process for b in chosen):
            echo(f"baselines: {', '.join(b.name for b in chosen if not b.in_process)}, one process per GPU ...")
            for m in run_multiprocess(chosen, family, spec, w.size, size_list, iters, reps, warmup):
                if m.timing is None:
                    out.notes.append(f"{m.impl} at {human(m.size)}: not timed: {m.skipped}")
                    continue
                case = conv.case(family, spec, w.size, m.size)
                _report(out, *_baseline_row(m, case, spec, family, w, ceil, dev, ""), echo)
    add_ratios(out.rows)
    return out


def _alloc_sets(module, case: BenchCase, l2_bytes: int) -> list:
    probe = module.alloc(case.count)
    n = rotation_slots(probe.heap_bytes, probe.heap_bytes, l2_bytes, most=MAX_SETS)
    return [probe] + [module.alloc(case.count) for _ in range(n - 1)]


def _report(out: Outcome, row: dict | None, problems: list[str], echo) -> None:
    for p in problems:
        echo(f"ERROR: {p}")
    out.errors += problems
    if row is not None:
        out.rows.append(row)
        metric = next((f"{k.split('_')[0]} {row[k]:.1f} {'TFLOP/s' if k == 'TFLOPs' else 'GB/s'}"
                       for k in ("TFLOPs", "busbw_GBps", "algbw_GBps") if row.get(k)), "")
        echo(f"{row['impl'][:36]:36s} {row.get('label', '')[:28]:28s} {human(row['size']):>6s} "
             f"{row.get('pattern', ''):4s} {row['time_us']:10.1f} us +-{row['spread_pct']:4.1f}%  {metric}"
             + (f"  [{row['note']}]" if row.get("note") else ""))


# ---------------------------------------------------------------------------
# tsgen's timing and its checks
# ---------------------------------------------------------------------------


def _time_tsgen(step: Step, control: str | None, ceil, dev,
                rivals: list[Measured] = ()) -> tuple[dict | None, list[str]]:
    """tsgen's timing and checks; with `rivals` (baselines holding a prepared Sampler), all of them
    timed in interleaved rounds (timing.time_interleaved), each rival's Timing set on it, and the
    problems of its own check (Measured.after) added to that Timing's."""
    w = step.world
    sampler, host, in_place = _sampler(step, control)
    rivals = [m for m in rivals if m.sampler is not None]
    timings = time_interleaved({"tsgen": sampler, **{m.impl: m.sampler for m in rivals}}, step.reps)
    for m in rivals:
        m.timing = timings[m.impl]
        if m.after is not None:
            m.timing.problems += m.after()
    timing = timings["tsgen"]
    checked, problems = _check(step, host, in_place)
    problems = timing.problems + problems
    problems += guard(f"tsgen {step.label}", timing.median_us, step.case, ceil, _dtype(step.spec), w.colocated,
                      dev.l2_bytes)
    if problems:
        return None, problems
    row = _row("tsgen", timing, step.case, step.spec, step.family, w, step.pattern, label=step.name,
               sets=len(step.sets), **dict(step.case.fields), ceiling_frac=fraction_of_ceiling(timing.median_us, step.case, ceil, _dtype(step.spec),
                                                                w.colocated, dev.l2_bytes), **checked)
    return row, []


def presample_calls(lineup: bool, interleave: bool) -> int:
    """The untimed calls that tsgen's sample starts behind (Sampler's settle) where it has no lineup: one
    where the op's conventions interleave it with in-process baselines, whose samples each start behind
    one untimed call (baselines._candidates' lineup), so that neither side's first timed call waits for
    its own host-side launch on an idle GPU. Without it a single-GPU attention sample counted tsgen's
    launch path once per sample and the baselines' not (docs/design/attention.md, "Splitting the
    suite's path from the kernel")."""
    return 1 if interleave and not lineup else 0


def _sampler(step: Step, control: str | None, label: str = "tsgen", also: Callable[[int], None] | None = None,
             **sampler_args) -> tuple[Sampler, dict | None, bool]:
    """A tsgen kernel's Sampler with its inputs filled (its warm-up, and the poisoning of the outputs
    after it, run when the rounds prepare it), the host inputs its check compares with, and whether
    the op works in place. `also(i)`: other work enqueued before each of its calls (not timed);
    `sampler_args`: the Sampler's own (settle, before_sample)."""
    w, conv, sets = step.world, step.conv, step.sets
    host = step.host = _fill_inputs(step)
    in_place = any(s.role == "inout" for s in sets[0].slots)
    outputs = [s for s in sets[0].slots if s.role == "output"]
    launched = [0]

    def enqueue(i: int, ranks: list[int]) -> None:
        launched[0] += 1
        if control == "skip-launch" and launched[0] > step.warmup:
            return  # the negative control: only the warm-up calls launch
        if also is not None:
            also(i)
        step.module.launch(sets[i % len(sets)], ranks=ranks, streams=w.streams)

    def poison() -> None:
        step.poison([s.name for s in outputs])

    def counter(rank: int) -> int:
        with w.cp.cuda.Device(w.devices[rank]):
            return sum(int(b.array("calls", rank)[0:1].get()[0]) for b in sets)

    lineup = w.size > 1 and step.pattern != "pair"
    sampler_args.setdefault("settle", presample_calls(lineup, conv.interleave))
    sampler = Sampler(CupyClock(w), step.ranks, w.streams, enqueue, calls=calls_per_sample(step.iters, len(sets)),
                      warmup=step.warmup, graphs=conv.graphs,
                      lineup=lineup, after_warmup=None if in_place else poison,
                      event_streams=w.make_streams() if control == "other-stream" else None,
                      counter=counter if conv.counts_calls else None, label=f"{label} {step.label}",
                      **sampler_args)
    return sampler, host, in_place


def ideal_key(label: str) -> str:
    """The ratio key of an ideal entry's fraction on the rows of the entries it names (`ideal_of`)."""
    return f"ideal: {label}"


class IdealOf(NamedTuple):
    """What a suite entry names as its ideal (suites.run_entries): the ideal entry's label and spec, and
    whether to time it also with the peers busy (the entry's `ideal_peers_busy`)."""

    label: str
    loaded: LoadedSpec
    peers_busy: bool = False


class Ideal:
    """A suite's ideal entry timed in another entry's own rounds (`ideal_of`; cp_attention's: the
    single-GPU attention kernel over the whole sequence): its spec loaded once in a World of one
    GPU, rank 0's, beside the entry's World; per size its own buffers, inputs and check, and a
    Measured whose Sampler tsgen's rounds time (one sample of each per round). The row it becomes
    carries `ideal_label` and `ideal_scale` (tsgen's FLOPs per GPU over the ideal's), from which
    add_ratios pairs the fraction of the ideal round by round. `skipped`: why it cannot run here
    (then the suite's fraction falls back to the ideal entry's own median).
    `peers_busy`: a second Measured, the ideal on rank 0's GPU while every other GPU of the entry's
    World runs the same kernel on its own copy of the inputs at once (a World of one GPU each, not
    timed, outputs not checked): whether rank 0's GPU computes slower while its peers are busy too, as
    they are in the entry's own call (power and heat shared by the host's GPUs). Its fraction's key
    is ideal_key(label + PEERS_BUSY)."""

    PEERS_BUSY = ", peers busy"

    def __init__(self, of: IdealOf, world, arch: str):
        self.label, self.loaded, self.peers_busy = of
        self.entry_world, self.arch = world, arch
        self.world = self.module = None
        self.peers: list = []  # (World, module) of every other GPU of the entry's World (peers_busy)
        self.sets: list = []
        self.skipped: str | None = None
        self.note: str | None = None  # why the peers-busy ideal is not timed, where asked for
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Ideal":
        from ..runtime import World

        if self.entry_world.ranks[0] != 0 or len(self.entry_world.ranks) != self.entry_world.size:
            self.skipped = f"ideal {self.label}: not timed in the rounds (needs every rank in this process)"
            return self
        try:
            self.world = self._stack.enter_context(World(1, share_gpus=False))
            if self.world.devices[0] != self.entry_world.devices[0]:
                self.skipped = (f"ideal {self.label}: not timed in the rounds (its GPU {self.world.devices[0]} is "
                                f"not rank 0's, {self.entry_world.devices[0]})")
                return self
            cached = render_to_cache(self.loaded)
            self.module = self.world.load(cached.manifest, arch=self.arch, source=cached.source)
            if self.peers_busy:
                self._open_peers(cached)
        except BaseException:
            self._stack.close()  # the World opened above, closed before the error goes on
            raise
        return self

    def _open_peers(self, cached) -> None:
        """A World of one GPU on each other distinct GPU of the entry's World, the ideal loaded there.
        What cannot be (an op timed in CUDA graphs: a capture of GPU 0's stream would leave the peers
        idle in the timed replays; a peer that does not open) is a note, the lone ideal still timed."""
        from ..runtime import World
        from ..runtime.backends import SingleProcessBackend

        if get_family(self.loaded.model.op).bench.graphs:
            self.note = f"ideal {self.label}{self.PEERS_BUSY}: not timed (its op is timed in CUDA graphs)"
            return
        mine = self.world.devices[0]
        try:
            for dev in sorted(set(self.entry_world.devices.values()) - {mine}):
                backend = SingleProcessBackend(1, self.world.cp, devices=[dev])
                peer = self._stack.enter_context(World(1, backend=backend, share_gpus=False))
                self.peers.append((peer, peer.load(cached.manifest, arch=self.arch, source=cached.source)))
        except Exception as e:  # noqa: BLE001 - the lone ideal and the entry still run
            self.peers = []
            self.note = f"ideal {self.label}{self.PEERS_BUSY}: not timed: {type(e).__name__}: {e}"[:300]

    def _sync_peers(self) -> None:
        """Before each ideal sample: the peers' calls of the previous one done (GPU 0's clock waits only
        for GPU 0), so that no sample runs beside a peer's leftover."""
        for peer, _ in self.peers:
            peer.synchronize()

    def __exit__(self, *exc) -> None:
        try:
            self._free()
        finally:
            self._stack.__exit__(*exc)  # the World sees the error, if any (its cleanup keeps the first one)

    def _free(self) -> None:
        sets, self.sets = self.sets, []
        for b in sets:
            b.free()

    def rivals(self, step: Step, l2_bytes: int) -> list[Measured]:
        """The ideal at step's size, prepared for tsgen's rounds (step.name's), and with peers_busy the
        same with the other GPUs busy; their buffers live until the next size. A step or ideal without
        FLOPs has no fraction: a Measured that says so."""
        self._free()
        spec, family = self.loaded.model, get_family(self.loaded.model.op)
        case = family.bench.case(family, spec, 1, step.case.size)
        where = f"whole sequence, in {step.name}'s rounds"
        impl = f"tsgen {self.label} (1 GPU, {where}: the ideal)"
        if not (step.case.flops and case.flops):
            return [Measured(impl, step.case.size, None, skipped="no FLOP count on one side: no fraction of it")]
        out = [self._measured(impl, self.label, step, case, l2_bytes)]
        if self.peers:
            peer_sets = []
            for peer, module in self.peers:  # the load beside it: inputs filled, outputs never read
                sets = _alloc_sets(module, case, l2_bytes)
                self.sets += sets
                _fill_inputs(self._step(peer, module, sets, step, case, f"{self.label} (load)"))
                peer_sets.append((peer, module, sets))

            def also(i: int) -> None:  # the same call on every other GPU, enqueued first
                for peer, module, sets in peer_sets:
                    module.launch(sets[i % len(sets)], ranks=[0], streams=peer.streams)

            out.append(self._measured(f"tsgen {self.label} (1 GPU, {where}, the other GPUs running it too: the ideal)",
                                      self.label + self.PEERS_BUSY, step, case, l2_bytes, also))
        return out

    def _step(self, world, module, sets, step: Step, case: BenchCase, label: str) -> Step:
        """The ideal's Step on `world` (its own or a peer's) at step's size, iterations and label."""
        spec = self.loaded.model
        return Step(world, module, spec, get_family(spec.op), case, "all", [0], sets, step.iters, step.reps,
                    step.warmup, label, f"{label} {human(step.case.size)}")

    def _measured(self, impl: str, label: str, step: Step, case: BenchCase, l2_bytes: int,
                  also: Callable[[int], None] | None = None) -> Measured:
        """One ideal Measured: its own buffers, a Sampler for tsgen's rounds, its check after them."""
        sets = _alloc_sets(self.module, case, l2_bytes)
        self.sets += sets
        own = self._step(self.world, self.module, sets, step, case, label)
        # each sample after one untimed call (as tsgen's W > 1 lineup), the peers' leftovers done first
        sampler, host, in_place = _sampler(own, None, label="ideal", also=also, settle=1,
                                           before_sample=self._sync_peers if self.peers else None)
        # its own count (the row's default is tsgen's per-rank count)
        extra = {"ideal_label": label, "ideal_scale": step.case.flops / case.flops, "count": case.count}

        def after() -> list[str]:  # its check's fields go into its row, as tsgen's do
            checked, problems = _check(own, host, in_place, f"ideal {own.label}")
            extra.update(checked)
            return problems

        return Measured(impl, step.case.size, None, case=case, compare=False, role="ideal", sampler=sampler,
                        after=after, extra=extra)


def _row(impl: str, timing: Timing, case: BenchCase, spec, family, w, pattern: str, **extra) -> dict:
    row = {"impl": impl, "spec": spec.name, "op": spec.op, "dtype": _dtype(spec), "world": w.size,
           "group": baseline_group(spec, family, w.size), "size": case.size,
           "size_unit": size_unit(family), "count": case.count, **({"pattern": pattern} if pattern not in ("", "all") else {}),
           **timing.fields(), **metrics(case, timing.median_us)}
    row.update({k: v for k, v in extra.items() if v is not None})
    notes = [n for n in (timing.note, SHARED_NOTE if w.shared else None) if n]
    if notes:
        row["note"] = "; ".join(notes)
    return row


def _baseline_row(m: Measured, case: BenchCase, spec, family, w, ceil, dev, pattern: str):
    if m.timing is None:
        return None, []  # skipped: said in its worker's output
    own = m.case or case
    problems = list(m.timing.problems) + guard(m.impl, m.timing.median_us, own, ceil, _dtype(spec), 1, dev.l2_bytes)
    if m.extra.get("wrong") and m.after is None:  # a check run through `after` has said so in its problems
        problems.append(f"{m.impl} {human(m.size)}: {m.extra['wrong']} wrong elements in its checked call")
    if problems:
        return None, problems
    own = dataclasses.replace(own, size=m.size, count=case.count)
    row = _row(m.impl, m.timing, own, spec, family, w, m.pattern or pattern, baseline=True, compare=m.compare,
               role=m.role or None, **m.extra)
    return row, []


def baseline_group(spec, family, world: int) -> str:
    """Rows with the same group time the same work at the same size: op, dtype, world and what the
    conventions add (GEMMs: the compile-time N and K)."""
    return f"{spec.op}/{_dtype(spec)}/w{world}{family.bench.group_shape(spec)}"


# the ratio of a part of tsgen's call timed alone (a row with `phase`: moe's dispatch, combine)
PHASE_RATIO = "fastest baseline, same phase"


def add_ratios(rows: list[dict]) -> None:
    """ratios[baseline] = t_baseline / t_tsgen (> 1: tsgen faster) at the same size and pattern;
    with components (GEMM alone, communication alone), overlap = max(t_gemm, t_comm) / t; a part of
    tsgen's call timed alone (`phase`) against the fastest baseline row of the same phase, mode and
    payload (ratios[PHASE_RATIO], that row's impl in `phase_rival`)."""
    for r in rows:
        if not r.get("phase") or not r["impl"].startswith("tsgen ") or r.get("note", "").startswith(SHARED_NOTE):
            continue
        rivals = [b for b in rows if b.get("baseline") and not b["impl"].startswith("tsgen ")
                  and all(b.get(k) == r.get(k) for k in ("phase", "ep_mode", "payload", "size", "group"))]
        if rivals:
            best = min(rivals, key=lambda b: b["time_us"])
            r["ratios"], r["phase_rival"] = {PHASE_RATIO: best["time_us"] / r["time_us"]}, best["impl"]
    for r in rows:
        if r["impl"] != "tsgen" or r.get("note", "").startswith(SHARED_NOTE):
            continue
        same = [b for b in rows if b.get("baseline") and b["size"] == r["size"] and b.get("group") == r.get("group")
                and b.get("pattern", r.get("pattern")) == r.get("pattern")]
        ratios, spreads = {}, {}
        # a baseline timed in this row's own rounds wins over another row of the same impl (a suite's
        # baselines_per_entry times one per entry of a group)
        own = {b["impl"]: b for b in same if r.get("round_set") and r.get("round_set") == b.get("round_set")}
        for b in same:
            if not b.get("compare"):
                continue
            if r.get("round_set") and r.get("round_set") == b.get("round_set"):  # the same rounds: round by round
                paired = paired_ratio(b["samples_us"], r["samples_us"])
                ratios[b["impl"]], spreads[b["impl"]] = paired.pop("ratio"), paired
            elif b["impl"] not in own:
                ratios[b["impl"]] = b["time_us"] / r["time_us"]
        if ratios:
            r["ratios"] = ratios
        if spreads:
            r["ratio_spread"] = spreads
        pair = same_kernel_pair(own)
        if pair:  # two callers of one kernel in tsgen's rounds: the method's control (attention_baselines)
            a, b = (own[i] for i in pair)
            r["method_control"] = {"pair": list(pair), **paired_ratio(b["samples_us"], a["samples_us"])}
        for b in same:  # an ideal timed in these rounds: tsgen's FLOP rate over its, round by round
            if b.get("role") == "ideal" and r.get("round_set") and r.get("round_set") == b.get("round_set"):
                paired = paired_ratio([t * b["ideal_scale"] for t in b["samples_us"]], r["samples_us"])
                key = ideal_key(b["ideal_label"])
                r.setdefault("ratios", {})[key] = paired.pop("ratio")
                r.setdefault("ratio_spread", {})[key] = paired
        parts = {b.get("role"): b["time_us"] for b in same}
        if "gemm" in parts and "comm" in parts:
            for x in [r] + [b for b in same if b.get("compare")]:
                x["overlap"] = max(parts["gemm"], parts["comm"]) / x["time_us"]


def _fill_inputs(step: Step) -> dict | None:
    """Inputs of every set; the host copy of set 0's when the reference check will use it."""
    w, conv, spec, family, sets = step.world, step.conv, step.spec, step.family, step.sets
    slots = [s for s in sets[0].slots if s.role in ("input", "inout")]
    biggest = max((s.nbytes for s in slots), default=0)
    host = None
    if conv.check == "exact" and (biggest <= conv.check_up_to or not conv.fill_on_device):
        host = conv.bench_inputs(family, spec, w.size, step.case.count, np.random.default_rng(12345))
        _load(w, sets[0], host)
    else:
        fill_random(w, sets[0], roles=("input", "inout"))
    for b in sets[1:]:
        for r in w.ranks:
            with w.cp.cuda.Device(w.devices[r]):
                for s in slots:
                    b.array(s.name, r)[...] = sets[0].array(s.name, r)
    w.synchronize()
    return host


def _load(w, bufs, inputs: dict) -> None:
    for r in w.ranks:
        with w.cp.cuda.Device(w.devices[r]):
            for name, per_rank in inputs.items():
                arr = bufs.array(name, r)
                arr.set(np.ascontiguousarray(per_rank[r]).view(arr.dtype))


def fill_random(w, bufs, roles: tuple[str, ...] = ("input",)) -> None:
    """Every slot of `bufs` with one of `roles` on every rank: random data made on the rank's GPU (seeded
    1000 + rank, the bench's inputs; the tools that trace a call use the same)."""
    for r in w.ranks:
        with w.cp.cuda.Device(w.devices[r]):
            rs = w.cp.random.RandomState(1000 + r)
            for s in bufs.slots:
                if s.role in roles:
                    _random(w.cp, rs, bufs.array(s.name, r), s.dtype)


def _random(cp, rs, arr, dtype: str) -> None:
    """Random data of `dtype` into a CuPy array (bfloat16 as its bits): never zeros."""
    n = arr.size
    if dtype == "bfloat16":
        arr[...] = (rs.standard_normal(n, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    elif dtype in ("float16", "float32"):
        arr[...] = rs.standard_normal(n, dtype=cp.float32).astype(arr.dtype)
    elif dtype == "int32":
        arr[...] = rs.randint(-1000, 1000, n, dtype=cp.int32)
    else:
        arr[...] = rs.randint(0, 256, n).astype(arr.dtype)


def _check(step: Step, host: dict | None, in_place: bool, what: str | None = None) -> tuple[dict, list[str]]:
    """The one check of the timed outputs (`what`: whose, in the messages): fields for the row, and problems."""
    w, conv, spec, family, set0 = step.world, step.conv, step.spec, step.family, step.sets[0]
    what = what or f"tsgen {step.label}"
    outputs = [s for s in set0.slots if s.role in ("output", "inout")]
    poison = poison_byte(POISON_CALL)
    ranks = [r for r in conv.checked_ranks(family, spec, w.size, step.pattern) if r in w.ranks]

    def left() -> int:
        """Output elements whose every byte is still the poison (bytes: any value is data)."""
        n = 0
        for r in ranks:
            with w.cp.cuda.Device(w.devices[r]):
                for s in outputs:
                    arr = set0.array(s.name, r)
                    if arr.dtype.itemsize > 1:
                        words = arr.get().view(np.uint8).reshape(-1, arr.dtype.itemsize)
                        n += int((words == poison).all(axis=1).sum())
        return sum(w.exchange(f"{what}: poison left", n))

    if conv.check == "rows":
        if len(w.ranks) != w.size:
            return {"check": "not checked: sampled rows need every rank in this process"}, []

        def fetch(name, r, a, b):
            with w.cp.cuda.Device(w.devices[r]):
                return set0.array(name, r)[a:b].get()

        err, stale = conv.check_rows(family, spec, w.size, step.case.count, fetch), left()
        problems = []
        if not err <= MAX_REL_ERR:
            problems.append(f"{what}: the timed output is wrong: sampled rows of C have relative error {err:.2e} "
                            f"(at most {MAX_REL_ERR:g})")
        if stale:
            problems.append(f"{what}: {stale} output elements still hold the poison written before the timed "
                            "calls: they did not write them")
        return {"check": "sampled rows", "rel_err": err, "poison_left": stale}, problems
    if host is None:
        if in_place:
            return {"check": f"not checked: in-place op above {human(conv.check_up_to)}"}, []
        stale = left()
        problems = [f"{what}: {stale} output elements still hold the poison written before the timed calls"] if stale else []
        return {"check": "no output left poisoned (above the reference check's size)", "poison_left": stale}, problems
    desc = "every output against the NumPy reference"
    if in_place:  # the timed calls kept reducing their own results: one fresh call
        _load(w, set0, host)
        w.synchronize()
        step.module.launch(set0, ranks=step.ranks, streams=w.streams)
        w.synchronize()
        desc = "a fresh call after the timing (in-place op) against the NumPy reference"
    count = step.case.count
    expected = family.reference(spec, w.size, count, host)
    tol = family.tolerance(spec, w.size, count, host)
    call = POISON_CALL if family.poison_survives(spec) and not in_place else None
    wrong = 0
    for name, per_rank in expected.items():
        for r in ranks:
            with w.cp.cuda.Device(w.devices[r]):
                got = set0.array(name, r).get()
            bad = wrong_elements(got.view(per_rank[r].dtype), per_rank[r], None if tol is None else tol[name][r],
                                 None if tol is None else _dtype(spec), call)
            wrong += int(bad.size)
    wrong = sum(w.exchange(f"{what}: wrong", wrong))
    problems = [f"{what}: the timed output is wrong: {wrong} elements differ from the reference"] if wrong else []
    return {"check": desc, "wrong": wrong}, problems

