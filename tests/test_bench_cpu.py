"""CPU-side pieces of `tsgen bench`: size conversion, the table, the plot."""

import pytest

from conftest import ROOT

from tsgen.bench import collective_table, per_rank_count, plot_busbw

ROWS = [
    {"backend": "tsgen", "op": "all_reduce", "bytes": 65536, "time_us": 10.0, "algbw_GBps": 6.6, "busbw_GBps": 9.8, "wrong": 0},
    {"backend": "nccl", "op": "all_reduce", "bytes": 65536, "time_us": 16.0, "algbw_GBps": 4.1, "busbw_GBps": 6.1},
    {"backend": "symm_mem_one_shot", "op": "all_reduce", "bytes": 65536, "time_us": 8.0, "algbw_GBps": 8.2,
     "busbw_GBps": 12.3},
    {"backend": "tsgen", "op": "all_reduce", "bytes": 1 << 30, "time_us": 5000.0, "algbw_GBps": 214.7,
     "busbw_GBps": 322.1, "wrong": None},
]


@pytest.mark.parametrize("op,nbytes,world,count", [
    ("allgather", 1 << 20, 4, (1 << 20) // 2 // 4),       # bytes = output of world chunks
    ("reduce_scatter", 1 << 20, 4, (1 << 20) // 2 // 4),  # bytes = input of world chunks
    ("all_to_all", 1 << 20, 4, (1 << 20) // 2 // 4),  # bytes = each rank's buffer; count per peer
    ("all_reduce", 1 << 20, 4, (1 << 20) // 2),
    ("broadcast", 1 << 20, 2, (1 << 20) // 2),
])
def test_per_rank_count(op, nbytes, world, count):
    assert per_rank_count(op, nbytes, "bfloat16", world) == count


def test_table_has_ratio_per_baseline_and_wrong_column():
    text = collective_table(ROWS)
    lines = text.splitlines()
    assert "nccl" in lines[0] and "symm_mem_one_shot" in lines[0] and "#wrong" in lines[0]
    row64k = next(l for l in lines if l.strip().startswith("64K"))
    assert "1.61" in row64k  # 9.8 / 6.1
    assert "0.80" in row64k  # 9.8 / 12.3
    row1g = next(l for l in lines if l.strip().startswith("1G"))
    assert " - " in row1g  # not checked at 1 GiB, and no baseline rows


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "busbw.png"
    plot_busbw(ROWS, out)
    assert out.stat().st_size > 1000


@pytest.mark.parametrize("spec", ["all_to_all_v", "gemm_bf16", "allgather_gemm"])
def test_bench_refuses_ops_without_an_nccl_counterpart(spec):
    from tsgen.bench import bench_collective
    from tsgen.errors import RuntimeSetupError

    with pytest.raises(RuntimeSetupError, match="tsgen bench times"):
        bench_collective(ROOT / "specs" / f"{spec}.yaml", 2, [1 << 20])
