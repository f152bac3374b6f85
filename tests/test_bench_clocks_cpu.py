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
    c = clocks.SmClocks({0: "bus0"}, reader=lambda bus: (lambda: 0.0))
    c.rows = [(1.0, 0, 1500.0, None), (2.0, 0, 1600.0, 680.0), (3.0, 0, 1700.0, 700.0), (2.5, 1, 900.0, None),
              (9.0, 0, 100.0, 1.0)]
    assert c.window(0, 1.5, 3.0) == pytest.approx(1650.0)  # 1600, 1700: device 1's and the later reading left out
    assert c.power_window(0, 1.5, 3.0) == pytest.approx(690.0) and c.samples(0, 1.5, 3.0) == 2
    assert c.window(1, 0.0, 10.0) == pytest.approx(900.0) and c.power_window(1, 0.0, 10.0) is None
    assert c.window(0, 4.0, 5.0) is None


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
        time.sleep(0.01)  # the sample's window holds readings

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
    fields = t.fields()
    assert fields["sm_mhz"] == [1550.0] * 4 and fields["sm_mhz_median"] == 1550.0


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
