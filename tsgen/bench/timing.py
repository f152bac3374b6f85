"""The timing core: one way to time anything `tsgen bench` times, tsgen's kernels and every
baseline alike.

`time_calls` takes a function that enqueues call i on given ranks' streams and returns the
median time per call over `reps` samples of `calls` back-to-back calls, after `warmup`
calls. Each sample records a start and an end event on every rank's stream -- the stream
the calls themselves run on, for every launch path: kernels, host launchers (which join
their side streams back into it), copy-engine steps, torch ops on an ExternalStream of it --
and takes the slowest rank (max over processes too). Calls replay as a CUDA graph per rank
where capture works (else eagerly, with a note); an untimed call before each sample lines
the ranks up on the device, so host skew stays out.

Three checks make a timing that brackets nothing an error instead of a number
(`Timing.problems`; tsgen/bench/ceilings.py adds the ceilings):
  witness  a "done" event is recorded on the work stream after the calls and before the end
           event; once the end event has completed, so must it. If not, the events are not on
           the stream the calls run on (the bug of gpu_gemm.py before this bench: events on
           the legacy stream, the calls on a non-blocking one, 113.9x cuBLAS).
  region   a sample shorter than one kernel launch per call timed no kernel (a skipped launch).
  counter  modules advance a device call counter once per call: after the timing, it must have
           advanced by exactly the calls enqueued.

Interleaved rounds (`time_interleaved`): tsgen and its in-process baselines, each a Sampler of
the same core, take one sample each per round, in a balanced order (`round_order`: every place
and every predecessor alike over a cycle); a ratio is the median over rounds of the two samples
of the same round (`paired_ratio`), with its spread.

The device is reached through a small clock interface: CupyClock (a tsgen World), TorchClock
(baseline workers), HostClock (CPU dry runs), and the tests' fakes.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

# No kernel call takes less than this on a GPU: a CUDA graph of back-to-back EMPTY one-block
# kernels ran at 0.61 us per kernel on an H200 (results/archive/2026-11-21-exp_sync_latency_w4.md),
# and every tsgen call does more. A sample this short per call timed no kernel at all.
MIN_CALL_US = 0.3


@dataclass
class Timing:
    samples_us: list[float]  # time per call of each sample (slowest rank)
    calls: int  # calls per sample
    mode: str  # graph | eager
    note: str | None = None
    problems: list[str] = field(default_factory=list)
    round_set: int | None = None  # timed by time_interleaved call number round_set: sample i from its round i
    sm_mhz: list[float | None] = field(default_factory=list)  # per sample, the slowest rank's GPU's SM clock (clocks.py)
    sm_readings: list[int] = field(default_factory=list)  # per sample, the NVML readings behind sm_mhz

    @property
    def median_us(self) -> float:
        return float(statistics.median(self.samples_us))

    @property
    def spread_pct(self) -> float:
        """(slowest - fastest sample) / median, in percent."""
        return 100.0 * (max(self.samples_us) - min(self.samples_us)) / self.median_us if self.median_us else 0.0

    def fields(self) -> dict:
        return {"time_us": self.median_us, "time_us_min": min(self.samples_us), "time_us_max": max(self.samples_us),
                "spread_pct": self.spread_pct, "calls": self.calls, "reps": len(self.samples_us), "mode": self.mode,
                **({"round_set": self.round_set, "samples_us": list(self.samples_us)} if self.round_set else {}),
                **self.clock_fields()}

    def clock_fields(self) -> dict:
        """sm_mhz (per sample) and sm_mhz_median, where the SM clocks were read (tsgen bench --sm-clocks)."""
        got = [m for m in self.sm_mhz if m is not None]
        return {"sm_mhz": list(self.sm_mhz), "sm_readings": list(self.sm_readings),
                "sm_mhz_median": float(statistics.median(got))} if got else {}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class Sampler:
    """One implementation's steps in the timing core: `prepare` (warm-up, `after_warmup`, the
    CUDA graph's capture and upload), `sample` (one sample: events around `calls` back-to-back
    calls, the witness and region checks, the slowest rank), `finish` (the call counter's check,
    the Timing). `time_calls` runs them for one implementation; `time_interleaved` for several
    in rounds. Arguments as `time_calls`, and settle: untimed calls enqueued just before each
    sample's start event, so that the GPU's clock at the start is this implementation's own and
    not the one the previous implementation (say a low-power baseline) left behind."""

    def __init__(self, clock, ranks: Sequence[int], streams, enqueue: Callable[[int, list[int]], None], *,
                 calls: int, warmup: int = 3, graphs: bool = True, lineup: bool = False,
                 before_sample: Callable[[], None] | None = None, after_warmup: Callable[[], None] | None = None,
                 event_streams=None, counter: Callable[[int], int] | None = None, label: str = "",
                 settle: int = 0):
        self.clock, self.ranks, self.streams, self._enqueue = clock, list(ranks), streams, enqueue
        self.settle = settle
        self.calls, self.warmup, self.graphs, self.lineup, self.label = calls, warmup, graphs, lineup, label
        self.before_sample, self.after_warmup, self.counter = before_sample, after_warmup, counter
        self.ev_streams = event_streams or streams
        self.enqueued = {r: 0 for r in self.ranks}
        self.problems: list[str] = []
        self.samples: list[float] = []
        self.sm_mhz: list[float | None] = []  # where the SM clocks are open (clocks.active) and the clock knows devices
        self.sm_readings: list[int] = []  # the readings behind each of them
        self.windows: list[tuple[float, float, int]] = []  # per sample: host perf_counter window, slowest rank
        self.mode, self.note, self.graph, self.before = "eager", None, {}, {}

    def _run(self, i: int, rs: list[int]) -> None:
        self._enqueue(i, rs)
        for r in rs:
            self.enqueued[r] += 1

    def prepare(self) -> None:
        clock, ranks, streams = self.clock, self.ranks, self.streams
        clock.synchronize()
        self.before = {r: self.counter(r) for r in ranks} if self.counter else {}
        for i in range(self.warmup):
            self._run(i, ranks)
        clock.synchronize()
        if self.after_warmup is not None:
            self.after_warmup()
            clock.synchronize()
        if self.graphs:
            err = None
            try:
                for r in ranks:
                    self.graph[r] = clock.capture(r, streams[r],
                                                  lambda r=r: [self._enqueue(i, [r]) for i in range(self.calls)])
            except Exception as e:  # noqa: BLE001 - an op (or library) that cannot be captured: eager
                err = _first_line(e)
            bad = clock.agree(f"{self.label}: capture", err)
            if bad:
                self.graph, self.note = {}, f"graph capture failed, timed eagerly: {bad}"
            else:
                self.mode = "graph"
                for r in ranks:  # upload, untimed
                    clock.replay(self.graph[r], streams[r])
                    self.enqueued[r] += self.calls
            clock.synchronize()

    def sample(self) -> float:
        clock, ranks, streams, calls, problems = self.clock, self.ranks, self.streams, self.calls, self.problems
        clock.synchronize()
        if self.before_sample is not None:
            self.before_sample()
        if self.lineup:
            self._run(0, ranks)
        for i in range(self.settle):  # untimed, back to back with the sample: it starts under its own load
            self._run(i, ranks)
        t0 = time.perf_counter()  # the SM clocks' window (clocks.py): from before the start events
        start = {r: clock.record(r, self.ev_streams[r]) for r in ranks}
        if self.graph:
            for r in ranks:
                clock.replay(self.graph[r], streams[r])
                self.enqueued[r] += calls
        else:
            for i in range(calls):
                self._run(i, ranks)
        done = {r: clock.record(r, streams[r]) for r in ranks}
        end = {r: clock.record(r, self.ev_streams[r]) for r in ranks}
        for r in ranks:
            clock.wait(end[r])
            if not clock.done(done[r]) and not problems:
                problems.append(
                    f"{self.label}: rank {r}'s end event completed while the calls it should follow were still "
                    "running: the events are not on the stream the calls run on, so the timing brackets nothing")
        clock.synchronize()
        t1 = time.perf_counter()
        per_rank = {r: clock.elapsed_ms(start[r], end[r]) for r in ranks}
        region_us = max(per_rank.values()) * 1e3
        self.windows.append((t0, t1, max(per_rank, key=per_rank.get)))
        self._read_clock()
        if region_us < MIN_CALL_US * calls and not any("shorter than" in p for p in problems):
            problems.append(f"{self.label}: {region_us:.2f} us for {calls} calls is shorter than one kernel launch "
                            f"per call ({MIN_CALL_US} us): no kernel ran inside the timed region (a skipped launch?)")
        value = clock.max_over_processes(f"{self.label}: sample {len(self.samples)}", region_us / calls)
        self.samples.append(value)
        return value

    def _read_clock(self) -> None:
        """Where the SM clocks are open and the clock names each rank's device: the slowest rank's GPU's median
        SM clock over the last sample's window (from before its start events to the synchronize after it)."""
        from . import clocks

        t0, t1, slowest = self.windows[-1]

        sm, device_of = clocks.active(), getattr(self.clock, "device_of", None)
        world = getattr(self.clock, "world", None)
        elsewhere = (world is not None and len(self.ranks) != world.size) or getattr(self.clock, "dist", None) is not None
        if sm is None or device_of is None or elsewhere:
            return  # off, a clock that names no devices, or ranks in other processes (the slowest may be theirs)
        device = device_of(slowest)
        self.sm_mhz.append(sm.window(device, t0, t1))
        self.sm_readings.append(sm.samples(device, t0, t1))

    def finish(self) -> Timing:
        self.clock.synchronize()
        if self.counter:
            for r in self.ranks:
                got = self.counter(r) - self.before[r]
                if got != self.enqueued[r]:
                    self.problems.append(f"{self.label}: rank {r}'s device call counter advanced by {got}, but "
                                         f"{self.enqueued[r]} calls were enqueued: some launches did not happen")
        return Timing(self.samples, self.calls, self.mode, self.note, self.problems, sm_mhz=list(self.sm_mhz),
                      sm_readings=list(self.sm_readings))


def time_calls(clock, ranks: Sequence[int], streams, enqueue: Callable[[int, list[int]], None], *,
               calls: int, reps: int = 7, warmup: int = 3, graphs: bool = True, lineup: bool = False,
               before_sample: Callable[[], None] | None = None, after_warmup: Callable[[], None] | None = None,
               event_streams=None,
               counter: Callable[[int], int] | None = None, label: str = "", settle: int = 0) -> Timing:
    """Median time per call of `enqueue(i, ranks)` (call i on `ranks`, each on streams[rank]).

    lineup: one untimed call on every rank before each sample (ops whose ranks wait for each
    other). before_sample: anything else to do then (baseline workers: a barrier). after_warmup:
    runs once between the warm-up and the timed calls (the bench poisons outputs there, so
    the check after the timing sees what the timed calls wrote). event_streams:
    where the events go (default `streams`; the negative control passes others). counter(rank):
    the device's call count of rank, checked against the calls enqueued. settle: untimed calls
    before each sample (Sampler)."""
    s = Sampler(clock, ranks, streams, enqueue, calls=calls, warmup=warmup, graphs=graphs, lineup=lineup,
                before_sample=before_sample, after_warmup=after_warmup, event_streams=event_streams,
                counter=counter, label=label, settle=settle)
    s.prepare()
    for _ in range(reps):
        s.sample()
    return s.finish()


ROUND_ORDERS = ("balanced", "rotate")


def round_order(names: Sequence[str], r: int, order: str = "balanced") -> list[str]:
    """Who is timed when in round r. "rotate": the names rotated by r, so each takes every place in
    turn, but each always follows the same neighbour (a low-power baseline listed before another lends
    it a cooler, faster-clocked GPU in every round). "balanced" (the default): a Williams design, rows
    of a Latin square in which, over a full cycle (n rounds for n names, 2n for odd n), each name takes
    every place equally often and follows every other name equally often."""
    names = list(names)
    n = len(names)
    if n < 2:
        return names
    if order == "rotate":
        k = r % n
        return names[k:] + names[:k]
    if order != "balanced":
        raise ValueError(f"round order {order!r}: one of {', '.join(ROUND_ORDERS)}")
    base, lo, hi = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: successive differences all distinct mod n
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    row = [names[(i + r) % n] for i in base]
    return row[::-1] if n % 2 and (r // n) % 2 else row  # odd n: the mirrored rows balance the neighbours


_ROUND_SETS = itertools.count(1)  # which time_interleaved call a Timing came from (rows pair only within one)


def time_interleaved(samplers: dict[str, Sampler], rounds: int, order: str = "balanced") -> dict[str, Timing]:
    """Several implementations timed in interleaved rounds (ABAB...): each is prepared (warm-up,
    capture), then round r takes one sample of each, in `round_order(names, r, order)`, so that a
    clock or thermal drift over the run falls on all of them alike. Sample i of every Timing
    comes from round i, and every Timing carries the same `round_set` (the call's number in this
process): `paired_ratio` compares them round by round."""
    for s in samplers.values():
        s.prepare()
    for r in range(rounds):
        for name in round_order(list(samplers), r, order):
            samplers[name].sample()
    out = {name: s.finish() for name, s in samplers.items()}
    if len(out) > 1:  # alone, it is a plain time_calls
        number = next(_ROUND_SETS)
        for t in out.values():
            t.round_set = number
    return out


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile q in [0, 1] of xs (numpy's default method)."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def paired_ratio(baseline_us: Sequence[float], tsgen_us: Sequence[float]) -> dict:
    """The ratio of two implementations timed in the same rounds: per round r, baseline sample r /
    tsgen sample r (> 1: tsgen faster); the median over rounds with its spread (min, quartiles,
    max). Samples of different rounds are never compared: a drift that slows one round slows
    both of its samples and cancels. ValueError when the two were not timed in the same rounds."""
    if len(baseline_us) != len(tsgen_us) or not tsgen_us:
        raise ValueError(f"paired ratio: {len(baseline_us)} baseline samples and {len(tsgen_us)} tsgen samples: "
                         "not timed in the same rounds")
    per_round = [b / t for b, t in zip(baseline_us, tsgen_us)]
    return {"ratio": float(statistics.median(per_round)), "min": min(per_round), "q1": quantile(per_round, 0.25),
            "q3": quantile(per_round, 0.75), "max": max(per_round), "rounds": len(per_round)}


# ---------------------------------------------------------------------------
# clocks
# ---------------------------------------------------------------------------


class CupyClock:
    """A tsgen World's devices through CuPy; several processes meet in the World's store."""

    def __init__(self, world):
        self.world, self.cp = world, world.cp

    def device_of(self, rank: int) -> int:
        """The CUDA ordinal of rank's GPU (the SM clocks' key, clocks.py)."""
        return self.world.devices[rank]

    def record(self, rank: int, stream) -> Any:
        with self.cp.cuda.Device(self.world.devices[rank]):
            ev = self.cp.cuda.Event()
            ev.record(stream)
        return ev

    def wait(self, ev) -> None:
        ev.synchronize()

    def done(self, ev) -> bool:
        return bool(ev.done)

    def elapsed_ms(self, a, b) -> float:
        return float(self.cp.cuda.get_elapsed_time(a, b))

    def capture(self, rank: int, stream, fn: Callable[[], Any]):
        with self.cp.cuda.Device(self.world.devices[rank]):
            stream.begin_capture()
            try:
                fn()
            except BaseException:
                try:
                    stream.end_capture()
                except Exception:  # noqa: BLE001 - the capture is already invalid
                    pass
                raise
            return stream.end_capture()

    def replay(self, graph, stream) -> None:
        graph.launch(stream)

    def synchronize(self) -> None:
        self.world.synchronize()

    def max_over_processes(self, label: str, value: float) -> float:
        return max(self.world.exchange(label, value))

    def agree(self, label: str, err: str | None) -> str | None:
        """Every process learns whether any failed a step: the first error, or None."""
        return next((e for e in self.world.exchange(label, err) if e), None)


class TorchClock:
    """One rank of a torch.distributed group (a baseline worker) on its current device."""

    def __init__(self, torch, dist=None, device=None):
        self.torch, self.dist, self.device = torch, dist, device

    def record(self, rank, stream):
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def wait(self, ev) -> None:
        ev.synchronize()

    def done(self, ev) -> bool:
        return bool(ev.query())

    def elapsed_ms(self, a, b) -> float:
        return float(a.elapsed_time(b))

    def capture(self, rank, stream, fn):
        torch = self.torch
        g = torch.cuda.CUDAGraph()
        try:
            cm = torch.cuda.graph(g, capture_error_mode="thread_local")
        except TypeError:  # older torch
            cm = torch.cuda.graph(g)
        with cm:
            fn()
        return g

    def replay(self, graph, stream) -> None:
        with self.torch.cuda.stream(stream):
            graph.replay()

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def device_of(self, rank) -> int:
        """The CUDA ordinal whose SM clock (clocks.py) a sample reads: this process's current device (a clock
        with `dist` gets none: the slowest rank may be in another process)."""
        return self.torch.cuda.current_device()

    def max_over_processes(self, label, value: float) -> float:
        if self.dist is None:
            return value
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def agree(self, label, err):
        if self.dist is None:
            return err
        got = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(got, err)
        return next((f"rank {r}: {e}" for r, e in enumerate(got) if e), None)


class HostClock(TorchClock):
    """CPU dry runs (gloo, CPU tensors): host timestamps; nothing to capture."""

    def record(self, rank, stream):
        return time.perf_counter()

    def wait(self, ev) -> None:
        pass

    def done(self, ev) -> bool:
        return True

    def elapsed_ms(self, a, b) -> float:
        return (b - a) * 1e3

    def capture(self, rank, stream, fn):
        raise RuntimeError("no CUDA graphs on the CPU")

    def synchronize(self) -> None:
        pass
