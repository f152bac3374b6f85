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

The device is reached through a small clock interface: CupyClock (a tsgen World), TorchClock
(baseline workers), HostClock (CPU dry runs), and the tests' fakes.
"""

from __future__ import annotations

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

    @property
    def median_us(self) -> float:
        return float(statistics.median(self.samples_us))

    @property
    def spread_pct(self) -> float:
        """(slowest - fastest sample) / median, in percent."""
        return 100.0 * (max(self.samples_us) - min(self.samples_us)) / self.median_us if self.median_us else 0.0

    def fields(self) -> dict:
        return {"time_us": self.median_us, "time_us_min": min(self.samples_us), "time_us_max": max(self.samples_us),
                "spread_pct": self.spread_pct, "calls": self.calls, "reps": len(self.samples_us), "mode": self.mode}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def time_calls(clock, ranks: Sequence[int], streams, enqueue: Callable[[int, list[int]], None], *,
               calls: int, reps: int = 7, warmup: int = 3, graphs: bool = True, lineup: bool = False,
               before_sample: Callable[[], None] | None = None, after_warmup: Callable[[], None] | None = None,
               event_streams=None,
               counter: Callable[[int], int] | None = None, label: str = "") -> Timing:
    """Median time per call of `enqueue(i, ranks)` (call i on `ranks`, each on streams[rank]).

    lineup: one untimed call on every rank before each sample (ops whose ranks wait for each
    other). before_sample: anything else to do then (baseline workers: a barrier). after_warmup:
    runs once between the warm-up and the timed calls (the bench poisons outputs there, so
    the check after the timing sees what the timed calls wrote). event_streams:
    where the events go (default `streams`; the negative control passes others). counter(rank):
    the device's call count of rank, checked against the calls enqueued."""
    ranks = list(ranks)
    enqueued = {r: 0 for r in ranks}

    def run(i: int, rs: list[int]) -> None:
        enqueue(i, rs)
        for r in rs:
            enqueued[r] += 1

    problems: list[str] = []
    clock.synchronize()
    before = {r: counter(r) for r in ranks} if counter else {}
    for i in range(warmup):
        run(i, ranks)
    clock.synchronize()
    if after_warmup is not None:
        after_warmup()
        clock.synchronize()
    mode, note, graph = "eager", None, {}
    if graphs:
        err = None
        try:
            for r in ranks:
                graph[r] = clock.capture(r, streams[r], lambda r=r: [enqueue(i, [r]) for i in range(calls)])
        except Exception as e:  # noqa: BLE001 - an op (or library) that cannot be captured: eager
            err = _first_line(e)
        bad = clock.agree(f"{label}: capture", err)
        if bad:
            graph, note = {}, f"graph capture failed, timed eagerly: {bad}"
        else:
            mode = "graph"
            for r in ranks:  # upload, untimed
                clock.replay(graph[r], streams[r])
                enqueued[r] += calls
        clock.synchronize()
    ev_streams = event_streams or streams
    samples: list[float] = []
    for rep in range(reps):
        clock.synchronize()
        if before_sample is not None:
            before_sample()
        if lineup:
            run(0, ranks)
        start = {r: clock.record(r, ev_streams[r]) for r in ranks}
        if graph:
            for r in ranks:
                clock.replay(graph[r], streams[r])
                enqueued[r] += calls
        else:
            for i in range(calls):
                run(i, ranks)
        done = {r: clock.record(r, streams[r]) for r in ranks}
        end = {r: clock.record(r, ev_streams[r]) for r in ranks}
        for r in ranks:
            clock.wait(end[r])
            if not clock.done(done[r]) and not problems:
                problems.append(
                    f"{label}: rank {r}'s end event completed while the calls it should follow were still running: "
                    "the events are not on the stream the calls run on, so the timing brackets nothing")
        clock.synchronize()
        region_us = max(clock.elapsed_ms(start[r], end[r]) for r in ranks) * 1e3
        if region_us < MIN_CALL_US * calls and not any("shorter than" in p for p in problems):
            problems.append(f"{label}: {region_us:.2f} us for {calls} calls is shorter than one kernel launch per "
                            f"call ({MIN_CALL_US} us): no kernel ran inside the timed region (a skipped launch?)")
        samples.append(clock.max_over_processes(f"{label}: sample {rep}", region_us / calls))
    clock.synchronize()
    if counter:
        for r in ranks:
            got = counter(r) - before[r]
            if got != enqueued[r]:
                problems.append(f"{label}: rank {r}'s device call counter advanced by {got}, but {enqueued[r]} "
                                "calls were enqueued: some launches did not happen")
    return Timing(samples, calls, mode, note, problems)


# ---------------------------------------------------------------------------
# clocks
# ---------------------------------------------------------------------------


class CupyClock:
    """A tsgen World's devices through CuPy; several processes meet in the World's store."""

    def __init__(self, world):
        self.world, self.cp = world, world.cp

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
