"""tsgen/ops/cp_schedule.py, the schedule model of cp_attention's causal time (issue 33): its
tile costs against a brute-force count of visible (query, key) blocks, its positions against
tsgen.ops.cp_attention's helpers, its grid simulation on equal items, and the effect the model
exists to show (the static stride's tail on zig-zag causal). No GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import ROOT, compile_test, missing_tool, rendered_source
from tsgen.ops import cp_schedule as cs
from tsgen.ops.attention import query_positions
from tsgen.ops.cp_attention import kv_chunk, positions, segments
from tsgen.spec import load_spec, spec_variant
from tsgen.toolchain import find_nvcc

needs_nvcc = compile_test(missing_tool(find_nvcc) and f"nvcc not found: {missing_tool(find_nvcc)}")

SHAPES = [  # seq, world, tile_m, tile_n (small: the brute force is a dense mask)
    (2048, 2, 128, 128), (4096, 4, 128, 128), (2000, 2, 128, 176), (3072, 8, 128, 64), (1000, 2, 128, 128),
]


@pytest.mark.parametrize("seq, world, tm, tn", SHAPES)
@pytest.mark.parametrize("zigzag", [True, False])
def test_causal_tile_cost_is_the_visible_key_blocks(seq, world, tm, tn, zigzag):
    """Every item's cost = the KV blocks holding a key some row of the tile sees (the kernel
    loads those and only those), counted from the dense causal mask."""
    shape = cs.Shape(seq=seq, world=world, heads=2, kv_heads=1, tile_m=tm, tile_n=tn, zigzag=zigzag)
    for rank in range(world):
        p = cs.cp_problem(shape, rank)
        q = positions("zigzag" if zigzag else "contiguous", world, shape.count, rank)
        keys = np.arange(p.kv_len)
        items = cs.kernel_items(p)
        assert len(items) == p.m_tiles * p.heads
        for it in items:
            rows = q[it.m * tm:min((it.m + 1) * tm, p.q_len)]
            seen = (keys[None, :] <= rows[:, None]).any(axis=0)
            blocks = {j // tn for j in np.nonzero(seen)[0]}
            assert (it.lo, it.hi) == (0, len(blocks)), (rank, it.m)
            assert blocks == set(range(len(blocks))), "visible blocks are a prefix (causal)"


GENERIC = [  # q_len, kv_len, q_offset, q_split, q_offset2, kv_offset: a second segment below the first too
    (600, 2400, 300, 300, 1800, 0), (1000, 3000, 2000, 200, 0, 0), (700, 1000, 500, 700, 0, 300),
    (300, 4097, 3797, 300, 0, 0), (1000, 1000, 0, 1000, 0, 5000),
]


@pytest.mark.parametrize("q_len, kv_len, qo, split, qo2, ko", GENERIC)
def test_causal_tile_cost_on_any_positions(q_len, kv_len, qo, split, qo2, ko):
    p = cs.Problem(q_len=q_len, kv_len=kv_len, q_offset=qo, q_split=split, q_offset2=qo2, kv_offset=ko,
                   kv_chunk=kv_len, heads=1, batch=1, tile_m=128, tile_n=128, causal=True)
    q, keys = query_positions(q_len, qo, split, qo2), ko + np.arange(kv_len)
    assert np.array_equal(p.q_position(np.arange(q_len)), q)
    for it in cs.kernel_items(p):
        rows = q[it.m * 128:min((it.m + 1) * 128, q_len)]
        seen = np.nonzero((keys[None, :] <= rows[:, None]).any(axis=0))[0]
        assert it.blocks == (seen.max() // 128 + 1 if len(seen) else 0), it.m


@needs_nvcc
def test_item_order_is_the_kernels(tmp_path):
    """kernel_items against the header's own tile_of compiled for the host (tests/test_attention_cpu.py's
    walker): the same tiles in the same order with the same block counts, on cp_attention's problems."""
    from test_attention_cpu import walk, walker

    loaded = spec_variant(load_spec(ROOT / "specs" / "attention_hd128.yaml"),
                          {"name": "order", "params": {"causal": True, "heads": 3, "kv_heads": 1}})
    exe = walker(rendered_source(loaded, tmp_path), "order", tmp_path)
    for seq, world, l2 in ((2048, 2, 50 << 20), (4096, 4, 50 << 20), (2000, 2, 50 << 20), (4096, 2, 2 << 20)):
        shape = cs.Shape(seq=seq, world=world, heads=3, kv_heads=1, batch=2, l2_bytes=l2)
        for rank in range(world):
            for dynamic in (False, True):
                p = cs.cp_problem(shape, rank, dynamic=dynamic)
                assert p.head_group == (3 if dynamic else 0)  # one KV head: a group is its 3 query heads
                tiles = walk(exe, p.batch, p.q_len, p.kv_len, p.q_offset, p.q_split, p.q_offset2, p.kv_offset,
                             p.head_group)
                assert [t[:4] for t in tiles] == [[it.m * 128, it.head, it.batch, it.blocks]
                                                 for it in cs.kernel_items(p)], (seq, world, rank, dynamic)
                if dynamic:  # longest first within each group of 3 (batch, head) pairs
                    for g in range(0, len(tiles), 3 * p.m_tiles):
                        costs = [t[3] for t in tiles[g:g + 3 * p.m_tiles]]
                        assert costs == sorted(costs, reverse=True), (seq, world, rank)


HEAD_GROUPS = [  # heads, kv_heads, head_dim, kv_len, l2_bytes -> query heads per group
    (32, 4, 128, 16384, 50 << 20, 24), (32, 4, 128, 32768, 50 << 20, 8), (32, 4, 128, 1024, 50 << 20, 32),
    (32, 8, 64, 1 << 20, 50 << 20, 4), (4, 4, 128, 4096, 0, 1),
]


@pytest.mark.parametrize("heads, kv_heads, d, kv_len, l2, want", HEAD_GROUPS)
def test_head_group_fits_half_of_l2(heads, kv_heads, d, kv_len, l2, want):
    """The model's head_group: whole KV heads whose K and V fit in half of L2, at least one."""
    assert cs.head_group(heads, kv_heads, d, kv_len, l2) == want


@needs_nvcc
def test_head_group_is_the_headers(tmp_path):
    """tsgen::attention::head_group compiled for the host gives the model's groups."""
    import subprocess

    from tsgen.headers import include_flags
    from tsgen.toolchain import gencode_flags

    loaded = spec_variant(load_spec(ROOT / "specs" / "attention_hd128.yaml"),
                          {"name": "hg", "params": {"heads": 32, "kv_heads": 4}})
    main = tmp_path / "hg_main.cu"
    main.write_text(f'#include "{rendered_source(loaded, tmp_path)}"\n#include <cstdlib>\n'
                    "int main(int, char** argv) { printf(\"%u\\n\", tsgen::attention::head_group<hg::Config>("
                    "strtoull(argv[1], 0, 10), strtoull(argv[2], 0, 10), argv[3][0] == '1')); }\n")
    exe = tmp_path / "hg_main"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17", "-w", "-o", str(exe),
                    str(main)], check=True, capture_output=True)
    for kv_len, l2 in ((16384, 50 << 20), (32768, 50 << 20), (1024, 50 << 20), (4096, 0), (65536, 60 << 20),
                       (16384, 60 << 20)):
        for balanced in (False, True):
            got = subprocess.run([str(exe), str(kv_len), str(l2), str(int(balanced))], capture_output=True, text=True,
                                 check=True).stdout
            assert int(got) == cs.head_group(32, 4, 128, kv_len, l2, balanced), (kv_len, l2, balanced)


def test_single_gpu_kernel_items_longest_first_per_head():
    p = cs.single_problem(cs.Shape(seq=1024, world=2, heads=3))
    items = cs.kernel_items(p)
    assert [it.blocks for it in items] == [8, 7, 6, 5, 4, 3, 2, 1] * 3
    assert sum(it.blocks for it in items) == 3 * 8 * 9 // 2


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("zigzag", [True, False])
def test_positions_and_chunks_match_cp_attention(world, zigzag):
    """The model's Problem (the launcher's q_offset / q_split / q_offset2) gives
    cp_attention.positions; its chunks are the gathered buffers' (segments, kv_chunk)."""
    layout = "zigzag" if zigzag else "contiguous"
    count = 6 * 128
    shape = cs.Shape(seq=world * count, world=world, zigzag=zigzag)
    for rank in range(world):
        p = cs.cp_problem(shape, rank)
        assert np.array_equal(p.q_position(np.arange(count)), positions(layout, world, count, rank))
        assert p.kv_chunk == kv_chunk(layout, True, count)
        for s in range(world):
            for src_row, rows, dst_row, chunk in segments(layout, True, world, count, s, rank):
                assert dst_row == chunk * p.kv_chunk and rows == p.kv_chunk
                # the rows source s holds there are at those positions
                assert np.array_equal(positions(layout, world, count, s)[src_row:src_row + rows],
                                      np.arange(dst_row, dst_row + rows))


@pytest.mark.parametrize("n_items, ctas", [(1, 4), (7, 7), (8, 7), (100, 13), (2048, 130), (130, 130)])
@pytest.mark.parametrize("scheduler", ["static", "snake", "dynamic"])
def test_equal_items_take_ceil_rounds(n_items, ctas, scheduler):
    p = cs.single_problem(cs.Shape(seq=4096, world=2, causal=False))
    items = [cs.Item(0, 0, 0, 0, 5)] * n_items
    timing = cs.Timing(block_us=2.0, tile_overhead=1.0)
    run = cs.simulate(p, items, ctas, scheduler, timing)
    assert run.makespan == pytest.approx(math.ceil(n_items / ctas) * 6 * 2.0)
    assert run.busy == pytest.approx(n_items * 6 * 2.0) and run.waited == 0


@pytest.mark.parametrize("n, ctas", [(10, 3), (9, 3), (2048, 130), (5, 8)])
def test_static_shares_take_every_item_once(n, ctas):
    for snake in (False, True):
        shares = [cs.static_share(n, ctas, c, snake) for c in range(ctas)]
        assert sorted(i for s in shares for i in s) == list(range(n))
    assert cs.static_share(10, 3, 0, False) == [0, 3, 6, 9]
    assert cs.static_share(10, 3, 0, True) == [0, 5, 6]  # rounds 0-2, 3-5 backwards, 6-8, 9-11 backwards


def test_waits_follow_the_chunk_arrivals():
    """One CTA, one item over two chunks: it runs its top chunk, waits for the lower one."""
    p = cs.single_problem(cs.Shape(seq=1024, world=2, causal=False))
    p = cs.Problem(**{**p.__dict__, "kv_chunk": 512})  # 4 blocks a chunk
    run = cs.simulate(p, [cs.Item(0, 0, 0, 0, 8)], 1, "static", cs.Timing(block_us=1.0, tile_overhead=0.0),
                      ready=np.array([10.0, 0.0]))
    assert (run.makespan, run.waited) == (14.0, 6.0)


def test_gather_arrivals_follow_the_copy_order():
    """Own chunks after the self copy; a peer's after its self copy and its copy to us."""
    shape = cs.Shape(seq=4096, world=2)
    g = cs.Gather(nvlink_GBps=100.0, hbm_copy_GBps=1000.0, signal_us=1.0)
    shard = 2 * 2048 * 4 * 128 * 2
    own, peer = shard / 1e6 + 1, shard / 1e6 + 1 + shard / 1e5 + 1
    assert np.allclose(cs.chunk_ready(shape, 0, g), [own, peer, peer, own])


def test_static_stride_leaves_the_tail_and_longest_first_closes_it():
    """Zig-zag causal at W 2: CTA c of rank 0 takes within-head index c, c + 2, ... (130 mod
    64 = 2), so CTAs below 32 get only long tiles: about 0.56 of the CTAs' time is used; a
    dynamic longest-first order uses nearly all of it."""
    shape = cs.Shape(seq=16384, world=2)
    timing, gather = cs.Timing(tile_overhead=0.0), cs.Gather()
    today, rank = cs.cp_run(shape, cs.Variant("today", gather=False), timing, gather)
    assert rank == 0 and 0.5 < today.efficiency < 0.6
    lpt, _ = cs.cp_run(shape, cs.Variant("lpt", order="longest_first", scheduler="dynamic", gather=False), timing,
                       gather)
    assert lpt.efficiency > 0.97
    snake, _ = cs.cp_run(shape, cs.Variant("snake", order="longest_first", scheduler="snake", gather=False), timing,
                         gather)
    assert snake.efficiency > 0.97
    assert cs.ideal_run(shape, timing).efficiency > 0.99


def test_split_halves_cover_the_range():
    items = cs.split_longest([cs.Item(0, 0, 0, 0, 9), cs.Item(1, 0, 0, 0, 3)], above=4)
    assert [(it.lo, it.hi, it.merge) for it in items] == [(4, 9, True), (0, 4, True), (0, 3, False)]


def test_balanced_head_groups():
    """The single-GPU persistent schedule's groups: as many as the L2 rule gives, of equal sizes."""
    assert cs.head_group(32, 32, 64, 4096, 60 << 20) == 30  # 1 MiB of K and V per head: 30 fit
    assert cs.head_group(32, 32, 64, 4096, 60 << 20, balanced=True) == 16  # 2 groups: 16 + 16, not 30 + 2
    assert cs.head_group(32, 32, 64, 8192, 60 << 20, balanced=True) == 11  # 3 groups: 11 + 11 + 10
    assert cs.head_group(32, 8, 128, 8192, 60 << 20, balanced=True) == 16  # 6 of 8 KV heads fit: 2 groups of 4 (x 4)
    assert cs.head_group(32, 4, 128, 16384, 50 << 20, balanced=True) == 16


def test_single_gpu_persistent_schedule_removes_the_causal_tail():
    """The model's single-GPU schedules (suite attention-variants' predictions, docs/design/attention.md):
    the plain grid's causal tail at S = 4K is ~12 % idle SM time, longest first in balanced head
    groups from the counter leaves < 1 %; not causal, the counter changes nothing (equal tiles)."""
    t = cs.Timing()
    causal = cs.single_runs(cs.Shape(seq=4096, world=1, heads=32, kv_heads=32, head_dim=64, zigzag=False,
                                     l2_bytes=60 << 20), t)
    assert causal["grid"].efficiency < 0.9 and causal["persistent"].efficiency > 0.99
    flat = cs.single_runs(cs.Shape(seq=8192, world=1, heads=32, kv_heads=32, causal=False, zigzag=False), t)
    assert flat["persistent"].makespan == flat["grid"].makespan
    assert flat["overlap"].makespan < flat["grid"].makespan
