"""The SM clock of every GPU a bench times, read from NVML while it times (`tsgen bench --sm-clocks`).

Why: an H200 runs attention at its power limit (docs/design/cp_attention.md, "The clock beside the rate":
689-693 W, the SM clock moving between 1.45 and 1.98 GHz with what runs), so two kernels timed in the same
rounds can differ by their clock as well as by their cycles. With the clocks on, every sample of the
timing core (timing.Sampler) also gets the median SM clock of the GPU of its slowest rank over the sample's
window, and the rows carry it (`sm_mhz` per sample, `sm_mhz_median`): a ratio of times that follows the
ratio of clocks is power, one that does not is cycles.

A thread reads each GPU's SM clock (nvmlDeviceGetClockInfo, NVML_CLOCK_SM) every PERIOD_S seconds; GPUs
are named by PCI bus id (NVML's indices follow neither CUDA_VISIBLE_DEVICES nor CUDA's device order).
Only this process's samplers see it (the baselines timed in worker processes get no clock). Off by
default: the thread shares the interpreter with the host that enqueues eager calls.
"""

from __future__ import annotations

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
    second on these GPUs); `window` / `power_window` give a device's median over a perf_counter interval.
    `reader(bus_id) -> (read() -> MHz, or (MHz, W))` replaces NVML (the CPU tests' fake)."""

    def __init__(self, bus_ids: dict[int, str], period: float = PERIOD_S,
                 reader: Callable[[str], Callable[[], object]] | None = None, power: bool = False):
        self._shutdown = None
        if reader is None:
            reader, self._shutdown = _nvml_reader(power)
        try:
            self.read = {dev: reader(bus) for dev, bus in bus_ids.items()}
        except BaseException:
            self.close()
            raise
        self.period, self.rows, self._stop = period, [], threading.Event()
        self._thread = threading.Thread(target=self._run, name="tsgen-sm-clocks", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            for dev, read in self.read.items():
                got = read()
                mhz, watts = got if isinstance(got, tuple) else (got, None)
                self.rows.append((t, dev, mhz, watts))
            time.sleep(self.period)

    def start(self) -> "SmClocks":
        self._thread.start()
        return self

    def close(self) -> None:
        if getattr(self, "_thread", None) is not None and self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        if self._shutdown is not None:
            self._shutdown()
            self._shutdown = None

    def window(self, device: int, t0: float, t1: float) -> float | None:
        """The median SM clock (MHz) of `device` over [t0, t1] (perf_counter); None without a reading there."""
        return self._median(device, t0, t1, 2)

    def power_window(self, device: int, t0: float, t1: float) -> float | None:
        """The median power (W) of `device` over [t0, t1]; None without a reading (or without `power`)."""
        return self._median(device, t0, t1, 3)

    def samples(self, device: int, t0: float, t1: float) -> int:
        return sum(1 for row in list(self.rows) if row[1] == device and t0 <= row[0] <= t1)

    def _median(self, device: int, t0: float, t1: float, field: int) -> float | None:
        got = [row[field] for row in list(self.rows) if row[1] == device and t0 <= row[0] <= t1
               and row[field] is not None]
        return float(statistics.median(got)) if got else None


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
