"""tsgen bench --sm-clocks on the CPU (tsgen/bench/clocks.py): the NVML thread's window, the timing core's
per-sample clock of the slowest rank's GPU, the rows' fields and the table's column, the CLI's fallback
without NVML. The thread reads a fake clock here; on a GPU, NVML (docs/design/cp_attention.md, "The clock
beside the rate", is where the clock was first read beside a bench)."""

from __future__ import annotations

import time

import pytest

from tsgen.bench import clocks
from tsgen.bench.report import text_table
from tsgen.bench.timing import Timing, time_calls


def test_window_is_the_median_of_the_readings_inside_it():
    c = clocks.SmClocks({0: "bus0", 1: "bus1"}, reader=lambda bus: (lambda: 0.0))
    for dev, t, got in [(0, 1.0, 1500.0), (0, 2.0, (1600.0, 680.0)), (1, 2.5, 900.0), (0, 3.0, (1700.0, 700.0)),
                        (0, 9.0, (100.0, 1.0))]:
        c.add(dev, t, got)
    assert c.window(0, 1.5, 3.0) == pytest.approx(1650.0)  # 1600, 1700: device 1's and the later reading left out
    assert c.power_window(0, 1.5, 3.0) == pytest.approx(690.0) and c.samples(0, 1.5, 3.0) == 2
    assert c.window(1, 0.0, 10.0) == pytest.approx(900.0) and c.power_window(1, 0.0, 10.0) is None
    assert c.window(0, 4.0, 5.0) is None and c.samples(0, 4.0, 5.0) == 0


def test_old_readings_are_dropped():
    c = clocks.SmClocks({0: "bus0"}, reader=lambda bus: (lambda: 0.0), keep_s=10.0)
    for i in range(4096):  # one reading a second
        c.add(0, float(i), 1000.0 + i)
    assert c.samples(0, 0.0, 5000.0) < 1024 + 11  # at most a prune's worth beyond the last 10 s
    assert c.window(0, 4090.0, 4095.0) == pytest.approx(1000.0 + 4092.5)


def test_a_failing_reading_is_counted_and_the_thread_goes_on():
    n = {"calls": 0}

    def flaky():
        n["calls"] += 1
        if n["calls"] % 2:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return 1600.0

    with clocks.sm_clocks({0: "b0"}, reader=lambda bus: flaky) as c:
        t0 = time.perf_counter()
        time.sleep(0.05)
        t1 = time.perf_counter()
    assert c.failures > 0 and c.window(0, t0, t1) == 1600.0


def test_an_error_in_the_run_still_stops_the_thread():
    with pytest.raises(ValueError):
        with clocks.sm_clocks({0: "b0"}, reader=lambda bus: (lambda: 1500.0)) as c:
            raise ValueError("the bench failed")
    assert clocks.active() is None and not c._thread.is_alive()


def test_the_thread_reads_each_device_by_bus_id_and_stops():
    asked = []

    def reader(bus):
        asked.append(bus)
        return lambda: 1980.0 if bus == "b1" else 1500.0

    with clocks.sm_clocks({0: "b0", 1: "b1"}, reader=reader) as c:
        assert clocks.active() is c
        with pytest.raises(RuntimeError, match="already open"):
            with clocks.sm_clocks({0: "b0"}, reader=reader):
                pass
        t0 = time.perf_counter()
        time.sleep(0.05)
        t1 = time.perf_counter()
    assert clocks.active() is None and not c._thread.is_alive()
    assert sorted(asked) == ["b0", "b1"]
    assert c.window(0, t0, t1) == 1500.0 and c.window(1, t0, t1) == 1980.0


class TwoGpus:
    """Two ranks on GPUs 5 and 7; rank 1's calls take twice rank 0's (it is the slowest); each call 10 us."""

    def __init__(self):
        self.t = {0: 0.0, 1: 0.0}

    def device_of(self, rank):
        return {0: 5, 1: 7}[rank]

    def record(self, rank, stream):
        return self.t[rank]

    def wait(self, ev):
        pass

    def done(self, ev):
        return True

    def elapsed_ms(self, a, b):
        return (b - a) / 1e3

    def synchronize(self):
        """Returns once the clocks (where open) have a reading of every GPU newer than the call: the sample's
        window holds one whatever the machine's load."""
        sm, now = clocks.active(), time.perf_counter()
        deadline = now + 5.0
        while sm is not None and time.perf_counter() < deadline and \
                not all(sm.samples(d, now, float("inf")) for d in sm.read):
            time.sleep(0.001)

    def max_over_processes(self, label, v):
        return v

    def agree(self, label, err):
        return err


def enqueue_on(clock):
    def enqueue(i, ranks):
        for r in ranks:
            clock.t[r] += 10.0 * (1 + r)
    return enqueue


def test_each_sample_takes_the_slowest_ranks_gpu_clock():
    clock = TwoGpus()
    with clocks.sm_clocks({5: "b5", 7: "b7"}, reader=lambda bus: (lambda: {"b5": 1700.0, "b7": 1550.0}[bus])):
        t = time_calls(clock, [0, 1], {0: "s0", 1: "s1"}, enqueue_on(clock), calls=3, reps=4, warmup=1, graphs=False)
    assert t.sm_mhz == [1550.0] * 4  # rank 1's GPU (7), the slower rank
    assert len(t.sm_readings) == 4 and all(n > 0 for n in t.sm_readings)
    fields = t.fields()
    assert fields["sm_mhz"] == [1550.0] * 4 and fields["sm_mhz_median"] == 1550.0
    assert fields["sm_readings"] == t.sm_readings


def test_no_clock_where_other_ranks_run_in_other_processes():
    """A sampler of one process's ranks of a larger world (one process per rank): its slowest rank may not be
    the world's, so it reads no clock."""
    clock = TwoGpus()
    clock.world = type("W", (), {"size": 2})()
    with clocks.sm_clocks({5: "b5", 7: "b7"}, reader=lambda bus: (lambda: 1700.0)):
        t = time_calls(clock, [0], {0: "s0"}, enqueue_on(clock), calls=3, reps=2, warmup=1, graphs=False)
        both = time_calls(clock, [0, 1], {0: "s0", 1: "s1"}, enqueue_on(clock), calls=3, reps=2, warmup=1,
                          graphs=False)
    assert t.sm_mhz == [] and both.sm_mhz == [1700.0, 1700.0]


def test_no_clock_fields_without_the_clocks_or_without_devices():
    clock = TwoGpus()
    t = time_calls(clock, [0, 1], {0: "s0", 1: "s1"}, enqueue_on(clock), calls=3, reps=2, warmup=1, graphs=False)
    assert t.sm_mhz == [] and "sm_mhz" not in t.fields()  # not opened
    del TwoGpus.device_of  # a clock that cannot name devices (a worker's torch clock) reads none
    try:
        with clocks.sm_clocks({5: "b5"}, reader=lambda bus: (lambda: 1700.0)):
            t = time_calls(clock, [0, 1], {0: "s0", 1: "s1"}, enqueue_on(clock), calls=3, reps=2, warmup=1,
                           graphs=False)
        assert t.sm_mhz == []
    finally:
        TwoGpus.device_of = lambda self, rank: {0: 5, 1: 7}[rank]
    assert "sm_mhz_median" not in Timing([10.0], 1, "eager", sm_mhz=[None]).fields()


def test_the_table_has_an_sm_mhz_column_only_where_a_row_has_a_clock():
    row = {"op": "attention", "impl": "tsgen", "label": "a", "size": 8192, "time_us": 1700.0, "spread_pct": 3.0,
           "TFLOPs": 650.0}
    assert "SM MHz" not in text_table([row])
    text = text_table([{**row, "sm_mhz_median": 1635.0}, {**row, "impl": "torch SDPA", "baseline": "sdpa"}])
    head = text.splitlines()[1]
    assert "SM MHz" in head
    assert "1635" in text.splitlines()[3] or "1635" in text.splitlines()[4]


def test_the_cli_runs_without_nvml_and_says_why(monkeypatch):
    from tsgen.bench import cli

    def no_nvml():
        raise ModuleNotFoundError("No module named 'pynvml'")

    monkeypatch.setattr(clocks, "visible_bus_ids", no_nvml)
    said = []
    with cli._clocks(True, said.append) as note:
        assert clocks.active() is None
    assert note.startswith("SM clocks not read (--sm-clocks): ModuleNotFoundError") and said
    with cli._clocks(False, said.append) as note:
        assert note is None


def test_a_torch_clock_names_its_device_and_one_with_dist_reads_no_clock():
    """TorchClock.device_of is the process's current device; a TorchClock of a torch.distributed group (a
    baseline worker) reads none: its slowest rank may be in another process."""
    from tsgen.bench.timing import TorchClock

    class Cuda:
        @staticmethod
        def current_device():
            return 5

    class Torch:
        cuda = Cuda

    clock = TwoGpus()
    clock.device_of = TorchClock(Torch).device_of
    with clocks.sm_clocks({5: "b5"}, reader=lambda bus: (lambda: 1700.0)):
        alone = time_calls(clock, [0], {0: "s0"}, enqueue_on(clock), calls=3, reps=2, warmup=1, graphs=False)
        clock.dist = object()
        grouped = time_calls(clock, [0], {0: "s0"}, enqueue_on(clock), calls=3, reps=2, warmup=1, graphs=False)
    assert alone.sm_mhz == [1700.0, 1700.0] and grouped.sm_mhz == []
