"""The SM clock of every GPU a bench times, read from NVML while it times (`tsgen bench --sm-clocks`).

Why: an H200 runs attention at its power limit (docs/design/cp_attention.md, "The clock beside the rate":
689-693 W, the SM clock moving between 1.45 and 1.98 GHz with what runs), so two kernels timed in the same
rounds can differ by their clock as well as by their cycles. With the clocks on, every sample of the
timing core (timing.Sampler) also gets the median SM clock of the GPU of its slowest rank over the sample's
window, and the rows carry it (`sm_mhz` per sample, `sm_readings` how many readings each had,
`sm_mhz_median`): a ratio of times that follows the ratio of clocks is power, one that does not is cycles.
A sample shorter than a few readings (about 2 ms each) may have none (None); the window runs from before the
sample's start events to after its synchronize, so it also holds what was still running from before them
(the untimed line-up or settle calls) and the gap after.

A thread reads each GPU's SM clock (nvmlDeviceGetClockInfo, NVML_CLOCK_SM) every PERIOD_S seconds; GPUs
are named by PCI bus id (NVML's indices follow neither CUDA_VISIBLE_DEVICES nor CUDA's device order).
Only samplers whose every rank is in this process read it (the baselines timed in worker processes,
and the one-process-per-rank backends, get no clock). Off by default: the thread shares the interpreter
with the host that enqueues eager calls.
"""

from __future__ import annotations

import bisect
import statistics
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

PERIOD_S = 0.002

_active: "SmClocks | None" = None


class SmClocks:
    """NVML's SM clock of each device (CUDA ordinal -> PCI bus id) every `period` s, in a thread, and with
    `power` its instantaneous power (NVML_FI_DEV_POWER_INSTANT; nvmlDeviceGetPowerUsage averages over a
    second on these GPUs); `window` / `power_window` give a device's median over a perf_counter interval,
    `samples` how many readings it had. Each reading is stamped when it is taken; readings older than
    `keep_s` are dropped (a window is one sample: seconds at most). A reading that fails is counted
    (`failures`) and skipped, the thread goes on. `reader(bus_id) -> (read() -> MHz, or (MHz, W))` replaces
    NVML (the CPU tests' fake)."""

    def __init__(self, bus_ids: dict[int, str], period: float = PERIOD_S,
                 reader: Callable[[str], Callable[[], object]] | None = None, power: bool = False,
                 keep_s: float = 300.0):
        self._shutdown = None
        if reader is None:
            reader, self._shutdown = _nvml_reader(power)
        try:
            self.read = {dev: reader(bus) for dev, bus in bus_ids.items()}
        except BaseException:
            self.close()
            raise
        self.period, self.keep_s, self.failures = period, keep_s, 0
        self._times: dict[int, list[float]] = {dev: [] for dev in self.read}
        self._values: dict[int, list[tuple]] = {dev: [] for dev in self.read}
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="tsgen-sm-clocks", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for dev, read in self.read.items():
                try:
                    got = read()
                except Exception:  # noqa: BLE001 - an NVML error on one reading: counted, the rest go on
                    self.failures += 1
                    continue
                self.add(dev, time.perf_counter(), got)
            time.sleep(self.period)

    def add(self, dev: int, t: float, got) -> None:
        """One reading of `dev` at perf_counter `t`: MHz, or (MHz, W or None)."""
        mhz, watts = got if isinstance(got, tuple) else (got, None)
        with self._lock:
            times, values = self._times[dev], self._values[dev]
            times.append(t)
            values.append((mhz, watts))
            if len(times) % 1024 == 0:  # drop what no window can ask for any more
                old = bisect.bisect_left(times, t - self.keep_s)
                del times[:old], values[:old]

    def start(self) -> "SmClocks":
        self._thread.start()
        return self

    def close(self) -> None:
        if getattr(self, "_thread", None) is not None and self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        if self._shutdown is not None:
            shutdown, self._shutdown = self._shutdown, None
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - a failed NVML shutdown must not replace the run's own outcome
                pass

    def _in(self, device: int, t0: float, t1: float) -> list[tuple]:
        with self._lock:
            times = self._times.get(device, [])
            return self._values[device][bisect.bisect_left(times, t0):bisect.bisect_right(times, t1)] \
                if times else []

    def window(self, device: int, t0: float, t1: float) -> float | None:
        """The median SM clock (MHz) of `device` over [t0, t1] (perf_counter); None without a reading there."""
        got = [mhz for mhz, _ in self._in(device, t0, t1) if mhz is not None]
        return float(statistics.median(got)) if got else None

    def power_window(self, device: int, t0: float, t1: float) -> float | None:
        """The median power (W) of `device` over [t0, t1]; None without a reading (or without `power`)."""
        got = [w for _, w in self._in(device, t0, t1) if w is not None]
        return float(statistics.median(got)) if got else None

    def samples(self, device: int, t0: float, t1: float) -> int:
        return len(self._in(device, t0, t1))


def _nvml_reader(power: bool = False):
    import pynvml

    pynvml.nvmlInit()

    def reader(bus: str):
        h = pynvml.nvmlDeviceGetHandleByPciBusId(bus)

        def mhz() -> float:
            return float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))

        def both() -> tuple:
            v = pynvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_POWER_INSTANT])[0]
            return mhz(), (v.value.uiVal / 1000.0 if v.nvmlReturn == pynvml.NVML_SUCCESS else None)

        return both if power else mhz

    return reader, pynvml.nvmlShutdown


def active() -> SmClocks | None:
    """The clocks the samplers of this process read, where `tsgen bench --sm-clocks` opened them."""
    return _active


@contextmanager
def sm_clocks(bus_ids: dict[int, str], reader=None) -> Iterator[SmClocks]:
    """Open the clocks of these devices for the samplers of this process (one at a time)."""
    global _active
    if _active is not None:
        raise RuntimeError("the SM clocks are already open")
    clocks = SmClocks(bus_ids, reader=reader).start()
    _active = clocks
    try:
        yield clocks
    finally:
        _active = None
        clocks.close()


def visible_bus_ids() -> dict[int, str]:
    """CUDA ordinal -> PCI bus id of every device this process sees (CuPy's runtime)."""
    import cupy

    rt = cupy.cuda.runtime
    return {d: rt.deviceGetPCIBusId(d) for d in range(rt.getDeviceCount())}
