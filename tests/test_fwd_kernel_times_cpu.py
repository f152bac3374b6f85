"""tools/fwd_kernel_times.py's summary of CUPTI records (no GPU): the main kernel is the name with the most time,
its median duration, the span a call and the idle gaps between kernels."""

from pathlib import Path

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_summary_of_two_blocks():
    kt = load_script(ROOT / "tools" / "fwd_kernel_times.py")
    # two blocks of 2 calls: each call a short memset-like kernel, then the main kernel; records out of order
    blocks = [
        [("main", 12.0, 112.0), ("fill", 0.0, 2.0), ("fill", 113.0, 115.0), ("main", 116.0, 216.0)],
        [("fill", 300.0, 302.0), ("main", 303.0, 413.0), ("fill", 414.0, 416.0), ("main", 420.0, 530.0)],
    ]
    s = kt.summarize(blocks, calls=2)
    assert s["main_kernel"] == "main"
    assert s["kernels_per_call"] == 2
    assert s["kernel_us"] == 105.0  # the main kernel's durations 100, 100, 110, 110
    assert s["spans_us"] == [108.0, 115.0]  # (216 - 0) / 2, (530 - 300) / 2
    assert s["span_us"] == 111.5
    # gaps: 10, 1, 1 in the first block; 1, 1, 4 in the second
    assert s["gap_us"] == 1.0
