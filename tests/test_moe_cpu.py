"""MoE dispatch / combine on the CPU: the NumPy references against brute-force loops, the
routing layout's arithmetic, spec errors, and the rendered source's shape."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from conftest import ROOT, compile_test, exhaustive, missing_tool, spec_problems
from tsgen.ops.collectives import from_f64, to_f64
from tsgen.ops.moe import (ROUTINGS, combine_reference, counts_array, dispatch_reference, e4m3_decode, e4m3_encode,
                           fp8_dequantize, fp8_error_bound, fp8_quantize, layout, ll_combine_reference,
                           ll_counts_array, ll_dispatch_reference, routing)
from tsgen.spec import load_spec
from tsgen.toolchain import compile_source, find_nvcc


def _inputs(case, world, experts, topk, hidden, tokens, seed):
    rng = np.random.default_rng(seed)
    return {
        "x": [from_f64(rng.standard_normal(tokens[r] * hidden), "bfloat16") for r in range(world)],
        "topk_idx": [routing(case, world, experts, topk, tokens[r], rng, r) for r in range(world)],
        "topk_weights": [rng.random(tokens[r] * topk, dtype=np.float32) for r in range(world)],
    }


def _brute_dispatch(inputs, world, experts, topk, hidden):
    """Token by token, rank by rank: what each rank receives, in (source, token) order."""
    local = experts // world
    got = [{"x": [], "idx": [], "w": [], "handle": [], "per_expert": [0] * local} for _ in range(world)]
    for s in range(world):
        idx = inputs["topk_idx"][s].reshape(-1, topk)
        w = inputs["topk_weights"][s].reshape(-1, topk)
        x = inputs["x"][s].reshape(-1, hidden)
        for t in range(idx.shape[0]):
            for d in range(world):
                mine = [0 <= e < experts and e // local == d for e in idx[t]]
                if not any(mine):
                    continue
                got[d]["x"].append(x[t])
                got[d]["idx"].append([e - d * local if m else -1 for e, m in zip(idx[t], mine)])
                got[d]["w"].append([wk if m else 0.0 for wk, m in zip(w[t], mine)])
                got[d]["handle"].append([s, t])
                for e, m in zip(idx[t], mine):
                    if m:
                        got[d]["per_expert"][e - d * local] += 1
    return got


def _brute_combine(inputs, ys, world, experts, topk, hidden, weighted):
    local = experts // world
    rows_seen = [0] * world  # next row of each rank, walked in the same (source, token) order
    outs = []
    for s in range(world):
        idx = inputs["topk_idx"][s].reshape(-1, topk)
        w = inputs["topk_weights"][s].reshape(-1, topk)
        out = np.zeros((idx.shape[0], hidden), dtype=np.float32)
        for t in range(idx.shape[0]):
            for d in range(world):
                mine = [0 <= e < experts and e // local == d for e in idx[t]]
                if not any(mine):
                    continue
                row = to_f64(ys[d].reshape(-1, hidden)[rows_seen[d]], "bfloat16").astype(np.float32)
                rows_seen[d] += 1
                scale = np.float32(sum(float(wk) for wk, m in zip(w[t], mine) if m)) if weighted else np.float32(1)
                out[t] += row * scale
        outs.append(out)
    return outs


CASES = [(case, world) for case in ROUTINGS for world in (2, 3, 4)]


@pytest.mark.parametrize("case,world", CASES, ids=lambda x: str(x))
def test_dispatch_reference_matches_brute_force(case, world):
    experts, topk, hidden = 12, 4, 8
    tokens = [5, 0, 1, 3][:world]
    inputs = _inputs(case, world, experts, topk, hidden, tokens, seed=world)
    ref = dispatch_reference(inputs, world, experts, topk, hidden, recv=1000)
    brute = _brute_dispatch(inputs, world, experts, topk, hidden)
    for d in range(world):
        n = len(brute[d]["x"])
        assert ref[d]["recv_x"].shape == (n, hidden)
        if n:
            assert np.array_equal(ref[d]["recv_x"], np.array(brute[d]["x"]))
            assert np.array_equal(ref[d]["recv_idx"], np.array(brute[d]["idx"]))
            assert np.array_equal(ref[d]["recv_w"], np.array(brute[d]["w"], dtype=np.float32))
            assert np.array_equal(ref[d]["handle"], np.array(brute[d]["handle"]))
        assert ref[d]["per_source"].sum() == n
        assert list(ref[d]["per_expert"]) == brute[d]["per_expert"]
        assert ref[d]["flags"] == 0


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("case,world", CASES, ids=lambda x: str(x))
def test_combine_reference_matches_brute_force(case, world, weighted):
    experts, topk, hidden = 12, 4, 8
    tokens = [5, 0, 1, 3][:world]
    inputs = _inputs(case, world, experts, topk, hidden, tokens, seed=world + 10)
    ref = dispatch_reference(inputs, world, experts, topk, hidden, recv=1000)
    rng = np.random.default_rng(3)
    ys = [from_f64(rng.standard_normal(r["recv_x"].size), "bfloat16") for r in ref]
    got = combine_reference(inputs, ys, world, experts, topk, hidden, weighted)
    brute = _brute_combine(inputs, ys, world, experts, topk, hidden, weighted)
    for s in range(world):
        want = to_f64(from_f64(brute[s].reshape(-1), "bfloat16"), "bfloat16")
        assert np.allclose(to_f64(got[s], "bfloat16"), want, rtol=2.0**-7, atol=0), (s, case)


@pytest.mark.parametrize("case,world", CASES, ids=lambda x: str(x))
def test_low_latency_references_match_brute_force(case, world):
    """Slots by (local expert, source rank), pairs in (token, k) order; combine weights each pair."""
    experts, topk, hidden, slot = 12, 4, 8, 6
    tokens = [5, 0, 1, 3][:world]
    inputs = _inputs(case, world, experts, topk, hidden, tokens, seed=world + 20)
    ref = ll_dispatch_reference(inputs, world, experts, topk, hidden, slot)
    local = experts // world
    ys = []
    for d in range(world):
        rows = {}
        for s in range(world):
            idx = inputs["topk_idx"][s].reshape(-1, topk)
            for t in range(idx.shape[0]):
                for k in range(topk):
                    e = int(idx[t, k])
                    if 0 <= e < experts and e // local == d:
                        rows.setdefault((e % local) * world + s, []).append((t, k))
        for i in range(experts):
            got = rows.get(i, [])
            assert ref[d]["counts"][i] == len(got)
            assert ref[d]["recv_src"][i, :len(got)].tolist() == [t * 32 + k for t, k in got]
            for j, (t, _) in enumerate(got):
                assert np.array_equal(ref[d]["recv_x"][i, j], inputs["x"][i % world].reshape(-1, hidden)[t])
        assert ll_counts_array(ref[d], 8, experts)[0] == sum(len(v) for v in rows.values())
        ys.append(ref[d]["recv_x"].reshape(-1))
    out = ll_combine_reference(inputs, ys, world, experts, topk, hidden, slot)
    for s in range(world):
        idx = inputs["topk_idx"][s].reshape(-1, topk)
        w = inputs["topk_weights"][s].reshape(-1, topk)
        x = to_f64(inputs["x"][s].reshape(-1, hidden), "bfloat16")
        want = np.array([sum(float(w[t, k]) for k in range(topk) if 0 <= idx[t, k] < experts) * x[t]
                         for t in range(idx.shape[0])]).reshape(-1)
        assert np.allclose(to_f64(out[s], "bfloat16"), want, rtol=2.0**-7, atol=1e-30)


def test_low_latency_slot_overflow_flagged():
    inputs = {"x": [from_f64(np.ones(5 * 8), "bfloat16")] * 2,
              "topk_idx": [np.zeros(5, np.int32), np.zeros(5, np.int32)],
              "topk_weights": [np.ones(5, np.float32)] * 2}
    ref = ll_dispatch_reference(inputs, 2, 4, 1, 8, slot=4)
    assert ref[0]["flags"] == 1 and ref[0]["counts"].tolist() == [5, 5, 0, 0] and ref[1]["flags"] == 0


def test_layout_arithmetic():
    """8 experts on 2 ranks (0-3 on rank 0, 4-7 on rank 1), top-3: a token goes once per rank."""
    idx = np.array([[0, 1, 5],     # ranks 0 and 1 (two experts on rank 0: once)
                    [-1, -1, -1],  # nowhere
                    [4, 7, -1],    # rank 1 only
                    [2, 9, -5]],   # rank 0; 9 and -5 are no experts
                   dtype=np.int32)
    lay = layout(idx.reshape(-1), world=2, experts=8, topk=3)
    assert lay["mask"].tolist() == [[True, True], [False, False], [False, True], [True, False]]
    assert lay["per_rank"].tolist() == [2, 2]
    assert lay["pos"].tolist() == [[0, 0], [-1, -1], [-1, 1], [1, -1]]
    assert lay["per_expert"].tolist() == [1, 1, 1, 0, 1, 1, 0, 1]


def test_receive_offsets_group_by_source():
    """Rank d receives source 0's rows first, then source 1's, each in token order; counts_array
    lays out total, flags, per source, per local expert."""
    world, experts, topk, hidden = 2, 4, 1, 8
    inputs = {"x": [from_f64(np.arange(3 * hidden, dtype=np.float64), "bfloat16"),
                    from_f64(100 + np.arange(2 * hidden, dtype=np.float64), "bfloat16")],
              "topk_idx": [np.array([3, 0, 2], dtype=np.int32), np.array([2, 1], dtype=np.int32)],
              "topk_weights": [np.ones(3, np.float32), np.ones(2, np.float32)]}
    ref = dispatch_reference(inputs, world, experts, topk, hidden, recv=3)
    assert ref[1]["handle"].tolist() == [[0, 0], [0, 2], [1, 0]]
    assert ref[0]["handle"].tolist() == [[0, 1], [1, 1]]
    assert counts_array(ref[1], wmax=4, experts=experts).tolist() == [3, 0, 2, 1, 0, 0, 2, 1, 0, 0]
    tight = dispatch_reference(inputs, world, experts, topk, hidden, recv=2)
    # rank 1 overflows and its own row (last in source order) is the one dropped; rank 0 lost none
    assert tight[1]["flags"] == 1 | 2 and tight[0]["flags"] == 0


MOE = """name: m
op: moe
world_sizes: [2, 4]
params:
  experts: {experts}
  hidden: {hidden}
  topk: 4
  capacity: 64
  payload: {payload}
  mode: {mode}
  weighted: {weighted}
{extra}test:
  count: {count}
"""


@pytest.mark.parametrize("fields,expect", [
    ({"experts": 6}, "params.experts: 6 experts do not divide over world size 4"),
    ({"hidden": 100}, "params.hidden: 100 is not a multiple of 8"),
    ({"hidden": 1000, "payload": "fp8"}, "params.hidden: 1000 is not a multiple of 128"),
    ({"count": 65}, "test.count: 65 tokens per rank, more than params.capacity 64"),
    ({"mode": "low_latency", "extra": "  recv_capacity: 100\n"},
     "params.recv_capacity: 100 rows is too small for the low-latency slots: 8 (local expert, source rank) slots "
     "of 64 rows (params.slot_tokens) need 512"),
    ({"mode": "low_latency", "weighted": "false"}, "params.weighted: low_latency combine always applies"),
    ({"extra": "  slot_tokens: 8\n"}, "params.slot_tokens: only the low_latency mode has slots"),
    ({"mode": "low_latency", "payload": "fp8"}, "params.payload: fp8 is built for the normal mode only"),
    ({"extra": "  fp8_send_unroll: 4\n"}, "params.fp8_send_unroll: only the fp8 payload quantizes"),
])
def test_spec_errors(tmp_path, fields, expect):
    values = {"experts": 8, "hidden": 256, "payload": "bf16", "count": 64, "mode": "normal", "weighted": "true",
              "extra": ""} | fields
    problems = spec_problems(tmp_path, MOE.format(**values))
    assert any(expect in p for p in problems), problems


@pytest.mark.parametrize("spec", ["moe", "moe_ll", "moe_fp8"])
def test_shipped_spec_loads_and_renders(tmp_path, spec):
    from conftest import rendered_source

    loaded = load_spec(f"specs/{spec}.yaml")
    text = rendered_source(loaded, tmp_path).read_text()
    for w in loaded.model.world_sizes:
        for part in ("dispatch", "combine"):
            assert f'extern "C" __global__ void __launch_bounds__(512, 1) {spec}_w{w}_{part}(' in text
            assert f'extern "C" cudaError_t {spec}_w{w}_{part}_launch(' in text
        assert f'extern "C" cudaError_t {spec}_w{w}_launch(' in text
    assert ("tsgen::moe::ll_dispatch<" in text) == (spec == "moe_ll")
    assert ("_dequantize<<<" in text) == (spec == "moe_fp8")


def test_e4m3_encoding():
    """Known codes, ties to even, saturation, subnormals; every finite code decodes and encodes back."""
    cases = [(1.0, 0x38), (448.0, 0x7E), (500.0, 0x7E), (-1.0, 0xB8), (2.0**-9, 0x01), (2.0**-10, 0x00),
             (3 * 2.0**-10, 0x02), (1.0625, 0x38), (1.1875, 0x3A), (2.0**-6, 0x08), (0.0, 0x00), (-0.0, 0x80),
             (240.0, 0x77), (232.0, 0x76)]
    got = e4m3_encode(np.array([v for v, _ in cases], dtype=np.float32))
    assert got.tolist() == [c for _, c in cases]
    codes = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)  # 0x7F / 0xFF: NaN
    assert np.array_equal(e4m3_encode(e4m3_decode(codes).astype(np.float32)), codes)


def _e4m3_by_logarithms(v: np.ndarray) -> np.ndarray:
    """An independent e4m3 encoder (float64 exponents and steps, np.rint's ties to even): the oracle for
    tsgen's integer one."""
    v = np.asarray(v, dtype=np.float32).astype(np.float64)
    a = np.abs(v)
    step = 2.0 ** (np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), -6) - 3)
    q = np.minimum(np.rint(a / step) * step, 448.0)
    e = np.floor(np.log2(np.where(q > 0, q, 1.0)))
    normal = q >= 2.0**-6
    code = np.where(normal, (e + 7) * 8 + q / 2.0**e * 8 - 8, q / 2.0**-9).astype(np.uint8)
    return (np.signbit(v).astype(np.uint8) << 7) | code


def test_e4m3_encoding_matches_an_independent_encoder():
    """Random values over every magnitude, every midpoint between codes and its float32 neighbours, a stride
    through all finite float32 bit patterns: the same bytes as the float64 encoder; infinities saturate,
    NaN is 0x7F with its sign."""
    rng = np.random.default_rng(7)
    values = e4m3_decode(np.arange(0x7F, dtype=np.uint8))
    mid = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    xs = np.concatenate([rng.standard_normal(200_000).astype(np.float32) * s for s in (1e-3, 1, 30, 300)] +
                        [mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf), values.astype(np.float32),
                         np.arange(0, 0x7F800000, 4099, dtype=np.uint32).view(np.float32)])
    xs = np.concatenate([xs, -xs])
    assert np.array_equal(e4m3_encode(xs), _e4m3_by_logarithms(xs))
    assert e4m3_encode(np.float32([np.inf, -np.inf, np.nan, -np.nan])).tolist() == [0x7E, 0xFE, 0x7F, 0xFF]


def test_fp8_quantization_error_within_bound():
    """Random rows, a row of zeros and a row with one large channel: the dequantized values stay within
    fp8_error_bound of the bf16 input; the measured worst relative error of normal-range values ~2^-4."""
    rng = np.random.default_rng(0)
    hidden = 256
    x = rng.standard_normal((6, hidden)) * np.array([1, 1e-3, 1e3, 0, 1, 1])[:, None]
    x[5, 7] = 300.0
    bits = from_f64(x.reshape(-1), "bfloat16")
    q, scale = fp8_quantize(bits, hidden)
    assert q.shape == (6, hidden) and scale.shape == (6, 2) and scale.dtype == np.float32
    got = to_f64(fp8_dequantize(q, scale), "bfloat16")
    xs = to_f64(bits, "bfloat16")
    err = np.abs(got - xs)
    assert (err <= fp8_error_bound(bits, hidden)).all()
    assert (got[3 * hidden:4 * hidden] == 0).all()  # zeros stay zeros (scale from the 1e-4 floor)
    big = np.abs(xs) >= 2.0**-6 * np.repeat(scale.reshape(-1), 128)  # normal-range e4m3 values
    assert (err[big] / np.abs(xs[big])).max() <= 2.0**-4 + 2.0**-7


def plain_moe():
    """specs/moe.yaml as shipped before 2026-11-27 (one grid of 32 blocks for both kernels, combine in
    row order with the kernel's default senders): the base the tests below vary one knob of. The
    shipped spec now sets the combine's grid, order and senders (moe-w2-tune's winner)."""
    from tsgen.spec import spec_variant

    return spec_variant(load_spec(ROOT / "specs" / "moe.yaml"), {
        "launch": {"blocks": 32},
        "params": {"combine_blocks": None, "combine_order": "rows", "combine_senders": None,
                   "combine_send_unroll": None}})


def test_traffic_per_row_and_minimum():
    """Normal mode: a row per (token, other rank) each way, 8 K + 8 bytes of metadata with the
    dispatched row; low-latency: a row per (token, expert on another rank); fp8: 1 byte per channel
    plus a 4-byte scale per 128."""
    from tsgen.ops.moe import row_bytes, traffic

    idx = [np.array([[0, 1], [2, 3], [-1, 3]], dtype=np.int32).reshape(-1),  # rank 0: experts 0-1 local
           np.array([[0, 2]], dtype=np.int32).reshape(-1)]
    inputs = {"topk_idx": idx}
    from tsgen.spec import spec_variant

    base = plain_moe()
    small = {"params": {"experts": 4, "topk": 2, "hidden": 128}, "world_sizes": [2], "test": {"count": 3}}
    normal = spec_variant(base, small).model
    t = traffic(normal, 2, inputs)
    # rank 0: tokens 1 and 2 go to rank 1 (2 rows); rank 1: its token goes to rank 0 (1 row)
    assert t["dispatch"] == [2 * (256 + 8 * 2 + 8), 1 * (256 + 24)]
    assert t["combine"] == [1 * 256, 2 * 256] and t["min_dispatch"] == [2 * 256, 256]
    ll = spec_variant(base, {**small, "params": {**small["params"], "mode": "low_latency", "weighted": True}}).model
    t = traffic(ll, 2, inputs)
    assert t["dispatch"] == [3 * (256 + 4), 1 * 260]  # rank 0 pairs on rank 1: (1,2) (1,3) (2,3)
    fp8 = spec_variant(base, {**small, "params": {**small["params"], "payload": "fp8", "hidden": 128}}).model
    assert row_bytes(fp8)["dispatch"] == 128 + 4 + 24 and row_bytes(fp8)["min_dispatch"] == 132


def test_dispatch_position_arithmetic_matches_layout():
    """tsgen/moe.cuh's dispatch arithmetic, step by step in Python: each block's tokens-before count,
    the base from the counts matrix, rounds of THREADS tokens with per-warp ballots and the scan
    over warps carried between rounds, give every row the place the reference layout gives it."""
    rng = np.random.default_rng(1)
    for _ in range(30):
        world = int(rng.choice([2, 3, 4, 8]))
        experts, threads, blocks = world * int(rng.integers(1, 4)), int(rng.choice([32, 64])), int(rng.integers(1, 6))
        topk = int(rng.integers(1, min(experts, 4) + 1))
        case = str(rng.choice(["random", "skewed", "no_expert", "same_rank"]))
        tokens = [int(rng.integers(0, 150)) for _ in range(world)]
        lays = [layout(routing(case, world, experts, topk, tokens[r], rng, r), world, experts, topk)
                for r in range(world)]
        counts = np.array([lay["per_rank"] for lay in lays])  # counts[s][d]
        for s in range(world):
            masks = lays[s]["mask"]
            per = (tokens[s] + blocks - 1) // blocks
            for b in range(blocks):
                lo = min(tokens[s], b * per)
                hi = min(tokens[s], lo + per)
                run = counts[:s].sum(axis=0) + masks[:lo].sum(axis=0)  # base + tokens before the chunk
                for rnd in range(lo, hi, threads):
                    m = np.zeros((threads, world), dtype=bool)
                    m[: min(threads, hi - rnd)] = masks[rnd:hi][:threads]
                    warp_sums = m.reshape(threads // 32, 32, world).sum(axis=1)
                    warp_base = run + np.cumsum(warp_sums, axis=0) - warp_sums  # exclusive scan over warps
                    run = run + warp_sums.sum(axis=0)
                    for i in range(min(threads, hi - rnd)):
                        w, lane = divmod(i, 32)
                        pre = m[w * 32:w * 32 + lane].sum(axis=0)  # popc(ballot & lanemask_lt)
                        for d in np.flatnonzero(m[i]):
                            assert warp_base[w, d] + pre[d] == counts[:s, d].sum() + lays[s]["pos"][rnd + i, d]


def combine_push_schedule(order: str, rank: int, world: int, rows: int, per_source, chunk: int,
                          senders: int) -> list[list[tuple[int, int, int]]]:
    """tsgen/moe.cuh's normal combine, step 1, in Python: per sender warp g (of `senders`), the
    (chunk, first row, end row) it pushes, in its order. rows: the rows received (at most the
    capacity); per_source: recv_counts' rows from each source rank (in rank order in the buffer)."""
    out = [[] for _ in range(senders)]
    if order == "rows":
        for g in range(senders):
            out[g] = [(c, c * chunk, min(rows, (c + 1) * chunk)) for c in range(g, -(-rows // chunk), senders)]
        return out
    P = max(world - 1, 1)
    end = np.cumsum(per_source)
    lo, hi = np.minimum(end - per_source, rows), np.minimum(end, rows)
    first = lo // chunk
    chunks = [int((hi[s] - 1) // chunk + 1 - first[s]) if s != rank and hi[s] > lo[s] else 0 for s in range(world)]
    slots = P * max(chunks)
    for g in range(senders):
        i = 0
        while i * senders < slots:
            v = i * senders + (g + i) % senders
            s, k = (rank + 1 + v % P) % world, v // P
            if k < chunks[s]:
                c = int(first[s]) + k
                out[g].append((c, max(c * chunk, int(lo[s])), min((c + 1) * chunk, int(hi[s]))))
            i += 1
    return out


@pytest.mark.parametrize("order", ["rows", "peers"])
def test_combine_chunk_schedule_covers_every_wait_and_every_token(order):
    """tsgen/moe.cuh's normal combine in Python: the chunks of each rank's receive buffer dealt over
    the sender warps in either order (params.combine_order; "peers" pushes a chunk that straddles two
    sources in two parts), the ranks each push signals (those with rows in it, from the handles), and
    the chunk every token's sum waits for (its row on that rank, from dispatch's sent_row, over CHUNK):
    every row of another rank is pushed exactly once, every (chunk, rank) signal is raised by one push
    that holds all that rank's rows of the chunk, every wait is for a chunk whose signal goes to the
    waiting rank; the blocks' token queues (block b: tokens b, b + blocks, ..., `parts` items each) hand
    out every (token, part) exactly once. CHUNK: params.combine_chunk_rows, the default 2 and others;
    some receive capacities smaller than the rows (the rows past it dropped)."""
    rng = np.random.default_rng(2)
    for i in range(40):
        CHUNK = 2 if i < 20 else int(rng.choice([1, 3, 4, 8]))
        world = int(rng.choice([2, 3, 4, 8]))
        experts = world * int(rng.integers(1, 4))
        topk = int(rng.integers(1, min(experts, 4) + 1))
        case = str(rng.choice(["random", "skewed", "no_expert", "same_rank", "one_rank_idle"]))
        tokens = [int(rng.integers(0, 150)) for _ in range(world)]
        blocks, warps = int(rng.integers(1, 9)), int(rng.choice([1, 2, 16]))
        # sender warps per block: the default half, or params.combine_senders (1 .. all of them)
        senders = warps // 2 if warps > 1 and i % 3 else int(rng.integers(1, warps + 1))
        inputs = {"x": [np.zeros(tokens[r] * 8, np.uint16) for r in range(world)],
                  "topk_idx": [routing(case, world, experts, topk, tokens[r], rng, r) for r in range(world)],
                  "topk_weights": [np.ones(tokens[r] * topk, np.float32) for r in range(world)]}
        recv = world * max(tokens + [1])
        if i % 5 == 4:
            recv = int(rng.integers(1, recv + 1))
        disp = dispatch_reference(inputs, world, experts, topk, 8, recv)
        lays = [layout(inputs["topk_idx"][s], world, experts, topk) for s in range(world)]
        signalled = set()  # (rank d whose chunk, chunk, rank it is signalled to)
        for d in range(world):
            handles = disp[d]["handle"]
            rows = min(len(handles), recv)
            pushed = []
            for push in combine_push_schedule(order, d, world, rows, disp[d]["per_source"], CHUNK, blocks * senders):
                for c, r0, r1 in push:
                    assert c * CHUNK <= r0 < r1 <= min(rows, (c + 1) * CHUNK)
                    pushed += [r for r in range(r0, r1) if handles[r, 0] != d]
                    for s in {int(handles[r, 0]) for r in range(r0, r1)} - {d}:
                        assert (d, c, s) not in signalled
                        signalled.add((d, c, s))
                        assert all(r0 <= r < r1 for r in range(c * CHUNK, min(rows, (c + 1) * CHUNK))
                                   if handles[r, 0] == s)
            assert sorted(pushed) == [r for r in range(rows) if handles[r, 0] != d]
        for s in range(world):
            sent_row = np.where(lays[s]["mask"], lays[s]["pos"] + sum(lays[j]["per_rank"] for j in range(s)), -1)
            sent_row[sent_row >= recv] = -1  # dropped past the capacity: not waited for
            for t in range(tokens[s]):
                for d in range(world):
                    if d != s and sent_row[t, d] >= 0:
                        assert disp[d]["handle"][sent_row[t, d]].tolist() == [s, t]
                        assert (d, sent_row[t, d] // CHUNK, s) in signalled, (s, t, d)
            parts = max(1, blocks * warps // tokens[s]) if tokens[s] else 1
            handed = []
            for b in range(blocks):
                items = ((tokens[s] - 1 - b) // blocks + 1 if tokens[s] > b else 0) * parts
                handed += [(b + i // parts * blocks, i % parts) for i in range(items)]
            assert sorted(handed) == [(t, p) for t in range(tokens[s]) for p in range(parts)]


def test_combine_peer_order_pushes_to_every_peer_at_once():
    """The reason for params.combine_order "peers" (docs/design/moe.md, "World 4: combine's incast"): at
    world 4 with rows from every source (the moe-w4 shape, scaled down), the row order's first round of
    sender warps pushes every rank's rows to one peer, rank 0 for ranks 1-3 (incast: three senders on
    rank 0's links, the rest idle); the peer order's first round pushes to each peer G / 3 times, and
    every round keeps the peers within one chunk of each other while they all have chunks left."""
    world, CHUNK = 4, 2
    per_source = np.array([3690, 3700, 3680, 3710])
    rows = int(per_source.sum())
    source = np.repeat(np.arange(world), per_source)
    for rank, senders in itertools.product(range(world), (96 * 8, 96 * 2)):  # 2: params.combine_senders
        def first_rounds(order, n):
            sched = combine_push_schedule(order, rank, world, rows, per_source, CHUNK, senders)
            return [[int(source[push[i][1]]) for push in sched if len(push) > i] for i in range(n)]
        if rank:
            assert set(first_rounds("rows", 1)[0]) - {rank} == {0}
        for dests in first_rounds("peers", 4):
            counts = np.bincount(dests, minlength=world)
            assert counts[rank] == 0 and max(counts) - min(np.delete(counts, rank)) <= 1, counts


def last_wave_rows(schedule) -> int:
    """Rows of the last round (every sender warp's chunk i, for the largest i any warp has): the rows
    that land together at the end of the transfer where the link is shared evenly by the warps pushing
    (the warps' chunks of one round go at one pace and land at about the same time; the tokens of the
    last round are summed after it: docs/design/moe.md, "World 2: combine's waves")."""
    last = max(len(push) for push in schedule) - 1
    return sum(push[last][2] - push[last][1] for push in schedule if len(push) > last)


def test_combine_senders_shrink_the_last_wave():
    """The arithmetic of docs/design/moe.md, "World 2: combine's waves", on the moe-w2 shape (a rank
    receives 4080 rows of the other's tokens after its own 4091, 96 combine blocks): 8 sender warps a
    block (768) push 2040 chunks in rounds of 768, the last of 504 chunks, 1008 rows that land at the
    end and are summed after it, the first chunk signal only after a round, 768 chunks (57 us at the
    link's 385 GB/s); 2 sender warps a block (params.combine_senders 2, 192 warps): 11 rounds, the last
    of 120 chunks, 240 rows, a round 15 us. Both orders push the same rows; peers skips the rank's own
    run, rows (rank 0, whose own rows come first) deals it out to warps that find nothing to push."""
    world, CHUNK = 2, 2
    for rank in range(world):
        per_source = np.array([4091, 4080] if rank == 0 else [4080, 4091])
        rows = int(per_source.sum())
        for G, last, rounds in ((96 * 8, 1008, 3), (96 * 2, 240, 11)):
            sched = combine_push_schedule("peers", rank, world, rows, per_source, CHUNK, G)
            assert abs(last_wave_rows(sched) - last) <= 2, (rank, G, last_wave_rows(sched))  # rank 0: 4091 is odd
            assert max(len(p) for p in sched) == rounds
            assert sum(p[2] - p[1] for push in sched for p in push) == 4080
        own = combine_push_schedule("rows", 0, world, rows, per_source, CHUNK, 96 * 8)
        if rank == 0:  # rows order on rank 0: every warp first walks chunks of its own run (nothing to push)
            assert all(push[0][2] <= 4091 for push in own if push)
        link_us = 96 * 8 * CHUNK * 7168 * 2 / 385e3
        assert 56 < link_us < 58


def test_combine_senders_sets_the_senders_and_nothing_else():
    """params.combine_senders / combine_send_unroll: unset (the shipped specs before 2026-11-27), the rendered source has
    neither SENDERS nor SEND_UNROLL (the kernel keeps half the warps and UNROLL: sources unchanged);
    set, both constants (the other one at its default), no buffer changes; more senders than warps,
    out-of-range values and low_latency are refused."""
    from tsgen.errors import SpecError
    from tsgen.harness import render_to_cache
    from tsgen.ops import get_family
    from tsgen.spec import spec_variant

    family = get_family("moe")
    base = plain_moe()
    text = render_to_cache(base).source.read_text()
    assert "SENDERS" not in text and "SEND_UNROLL" not in text
    assert "SENDERS" not in family.constants(base.model)
    for params, senders, unroll in (({"combine_senders": 2}, 2, 4), ({"combine_send_unroll": 8}, 8, 8),
                                    ({"combine_senders": 3, "combine_send_unroll": 6}, 3, 6)):
        loaded = spec_variant(base, {"params": params})
        text = render_to_cache(loaded).source.read_text()
        assert f"constexpr int SENDERS = {senders};" in text and f"constexpr int SEND_UNROLL = {unroll};" in text
        assert "static constexpr int SENDERS = ::moe::SENDERS, SEND_UNROLL = ::moe::SEND_UNROLL;" in text
        assert family.buffers(loaded.model) == family.buffers(base.model)
    for bad in ({"combine_senders": 17}, {"combine_senders": 0}, {"combine_send_unroll": 0},
                {"combine_send_unroll": 17}):
        with pytest.raises(SpecError, match=next(iter(bad))):
            spec_variant(base, {"params": bad})
    for bad in ({"combine_senders": 2}, {"combine_send_unroll": 8}):
        with pytest.raises(SpecError, match=next(iter(bad))):
            spec_variant(load_spec(ROOT / "specs" / "moe_ll.yaml"), {"params": bad})


@compile_test(missing_tool(find_nvcc) and f"nvcc not found: {missing_tool(find_nvcc)}")
@pytest.mark.parametrize("params", [  # by default the other combine_order at the largest unroll
    exhaustive({"combine_order": "peers", "combine_senders": 2, "combine_send_unroll": 8}),
    {"combine_senders": 4, "combine_send_unroll": 8},
    exhaustive({"combine_order": "peers", "combine_senders": 16, "combine_send_unroll": 2})])
def test_combine_senders_compile_without_spills(tmp_path, monkeypatch, params):
    """The moe-w2 shape (hidden 7168, 4096 tokens, 96 combine blocks of 512 threads) with its own
    senders: every world's combine within the 128 registers of __launch_bounds__(512, 1), no spills
    (the 64-byte frame is the timeout trap's printf, in the default's too)."""
    from tsgen.harness import render_to_cache
    from tsgen.spec import spec_variant

    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    loaded = spec_variant(load_spec(ROOT / "specs" / "moe.yaml"), {"name": "v", "launch": {"blocks": 64}, "params": {
        "experts": 32, "hidden": 7168, "capacity": 4096, "combine_blocks": 96, **params}})
    res = compile_source(render_to_cache(loaded).source)
    for w in loaded.model.world_sizes:
        entry = res.report[f"v_w{w}_combine"]
        assert entry["registers"] <= 128 and entry["spill_stores"] == 0 and entry["spill_loads"] == 0, entry


def _gathered_send_replay(bits: np.ndarray, hidden: int, U: int) -> tuple[np.ndarray, np.ndarray]:
    """tsgen/moe.cuh's push_row_fp8_gathered (params.fp8_send_unroll = U) on one row, lane by lane: slot u
    of lane l in the pass at chunk `base` is chunk base + 32 u + l (16 channels); each slot's amax reduced
    over its 8 lanes (xor 4, 2, 1); lane j < 4 U takes group base / 8 + j's amax from lane 8 (j % 4) of slot
    j / 4, divides, and stores that group's scale; lane l of slot u takes its factor from lane 4 u + l / 8.
    Returns the row's e4m3 bytes and scales as the kernel stores them (a group or chunk written twice, or
    never, is an error)."""
    chunks, groups = hidden // 16, hidden // 128
    x = to_f64(bits, "bfloat16").astype(np.float32)
    q, scale = np.zeros(hidden, np.uint8), np.full(groups, np.nan, np.float32)
    wrote_q, wrote_s = np.zeros(chunks, int), np.zeros(groups, int)
    lanes = np.arange(32)
    for base in range(0, chunks, 32 * U):
        amax = np.zeros((U, 32), np.float32)
        for u, lane in itertools.product(range(U), range(32)):
            c = base + 32 * u + lane
            if c < chunks:
                amax[u, lane] = np.abs(x[16 * c:16 * c + 16]).max()
        for off in (4, 2, 1):
            amax = np.maximum(amax, amax[:, lanes ^ off])
        mine = np.array([amax[lane >> 2, (lane & 3) * 8] if lane >> 2 < U else 0 for lane in lanes], np.float32)
        mine = np.maximum(mine, np.float32(1e-4))
        sc, inv = (mine / np.float32(448)).astype(np.float32), (np.float32(448) / mine).astype(np.float32)
        for lane in range(min(32, 4 * U)):
            g = base // 8 + lane
            if g < groups:
                scale[g] = sc[lane]
                wrote_s[g] += 1
        for u in range(U):
            if base + 32 * u >= chunks:
                break
            for lane in lanes:
                c = base + 32 * u + lane
                if c < chunks:
                    f = inv[4 * u + (lane >> 3)]
                    q[16 * c:16 * c + 16] = e4m3_encode((x[16 * c:16 * c + 16] * f).astype(np.float32))
                    wrote_q[c] += 1
    assert (wrote_q == 1).all() and (wrote_s == 1).all()
    return q, scale


@pytest.mark.parametrize("hidden", [128, 640, 2048, 7168])
def test_fp8_gathered_send_replay_is_bit_exact(hidden):
    """The lanes of the gathered send (params.fp8_send_unroll 1-8) replayed: every chunk and scale written
    once, bytes and scales bit for bit those of fp8_quantize (what the GPU tests compare the kernel with),
    also for rows of zeros (the 1e-4 floor), tiny and large values; hidden 640: a pass with a partial slot
    (40 chunks, 5 groups), 128: lanes with no chunk."""
    rng = np.random.default_rng(hidden)
    x = rng.standard_normal((4, hidden)) * np.array([1, 1e-30, 1e4, 0])[:, None]
    x[0, 5] = 3e38  # saturates the group's bf16 scale range, not e4m3's
    bits = from_f64(x.reshape(-1), "bfloat16").reshape(4, hidden)
    want_q, want_s = fp8_quantize(bits.reshape(-1), hidden)
    for U in range(1, 9):
        for r in range(4):
            q, scale = _gathered_send_replay(bits[r], hidden, U)
            assert np.array_equal(q, want_q[r]), (U, r)
            assert np.array_equal(scale.view(np.uint32), want_s[r].view(np.uint32)), (U, r)


def test_fp8_send_unroll_sets_the_send_and_nothing_else():
    """params.fp8_send_unroll: unset (the bf16 specs, and fp8 with it set to null), the rendered source has no
    FP8_UNROLL (dispatch keeps push_row_fp8); set (the shipped fp8 spec: 7), the constant and the Config's line,
    no buffer changes; out of [1, 8] and a bf16 payload are refused."""
    from tsgen.errors import SpecError
    from tsgen.harness import render_to_cache
    from tsgen.ops import get_family
    from tsgen.spec import spec_variant

    family = get_family("moe")
    base = load_spec(ROOT / "specs" / "moe_fp8.yaml")
    assert base.model.params.fp8_send_unroll == 7
    unset = [load_spec(ROOT / "specs" / f"{name}.yaml") for name in ("moe", "moe_ll")]
    for loaded in [*unset, spec_variant(base, {"name": "plain", "params": {"fp8_send_unroll": None}})]:
        assert "FP8_UNROLL" not in render_to_cache(loaded).source.read_text()
        assert "FP8_UNROLL" not in family.constants(loaded.model)
    for u in (1, 7, 8):
        loaded = spec_variant(base, {"params": {"fp8_send_unroll": u}})
        text = render_to_cache(loaded).source.read_text()
        assert f"constexpr int FP8_UNROLL = {u};" in text
        assert "static constexpr int FP8_UNROLL = ::moe_fp8::FP8_UNROLL;" in text
        assert family.buffers(loaded.model) == family.buffers(base.model)
    for bad in (0, 9):
        with pytest.raises(SpecError, match="fp8_send_unroll"):
            spec_variant(base, {"params": {"fp8_send_unroll": bad}})
    with pytest.raises(SpecError, match="params.fp8_send_unroll: only the fp8 payload quantizes"):
        spec_variant(load_spec(ROOT / "specs" / "moe.yaml"), {"params": {"fp8_send_unroll": 7}})


@compile_test(missing_tool(find_nvcc) and f"nvcc not found: {missing_tool(find_nvcc)}")
@pytest.mark.parametrize("unroll", [exhaustive(4), exhaustive(7), 8])  # by default the largest
def test_fp8_send_unroll_compiles_without_spills(tmp_path, monkeypatch, unroll):
    """The moe-w2 shape (hidden 7168, 4096 tokens, 64 dispatch blocks of 512 threads) with the gathered
    send: every world's dispatch within the 128 registers of __launch_bounds__(512, 1), no spills (the
    80-byte frame is the printfs', as in the shipped send's)."""
    from tsgen.harness import render_to_cache
    from tsgen.spec import spec_variant

    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    loaded = spec_variant(load_spec(ROOT / "specs" / "moe_fp8.yaml"), {"name": "v", "launch": {"blocks": 64}, "params": {
        "experts": 32, "hidden": 7168, "capacity": 4096, "combine_blocks": 96, "fp8_send_unroll": unroll}})
    res = compile_source(render_to_cache(loaded).source)
    for w in loaded.model.world_sizes:
        entry = res.report[f"v_w{w}_dispatch"]
        assert entry["registers"] <= 128 and entry["spill_stores"] == 0 and entry["spill_loads"] == 0, entry


def test_combine_grid_of_its_own():
    """params.combine_blocks: the combine launch uses it, dispatch keeps launch.blocks, the manifest's
    grid (what the residency checks read) is the larger, a shared GPU fits both, the phase rows name
    each kernel's SMs; low-latency mode refuses it."""
    from tsgen.harness import render_to_cache
    from tsgen.ops import get_family
    from tsgen.ops.moe import combine_chunks, phase_sms
    from tsgen.spec import spec_variant

    family = get_family("moe")
    base = plain_moe()
    assert phase_sms(base.model, "combine") == phase_sms(base.model, "dispatch") == base.model.launch.blocks
    loaded = spec_variant(base, {"params": {"combine_blocks": 64}})
    spec = loaded.model
    assert {k.grid for k in family.abi(spec).kernels} == {64}
    assert (phase_sms(spec, "dispatch"), phase_sms(spec, "combine")) == (32, 64)
    text = render_to_cache(loaded).source.read_text()
    assert text.count("_combine<<<64, 512, 0, stream>>>") == len(spec.world_sizes)
    assert text.count("_dispatch<<<32, 512, 0, stream>>>") == len(spec.world_sizes)
    assert family.shared_fit(spec, 2, 132) == {}
    assert family.shared_fit(spec, 4, 132) == {"params": {"combine_blocks": 33}}
    assert family.shared_fit(spec, 8, 132) == {"launch": {"blocks": 16}, "params": {"combine_blocks": 16}}
    sig = {b.name: b for b in family.buffers(spec)}["chunk_sig"]
    assert sig.fixed == max(spec.world_sizes) * combine_chunks(spec)
    with pytest.raises(Exception, match="only the normal mode's combine has a grid of its own"):
        spec_variant(load_spec(ROOT / "specs" / "moe_ll.yaml"), {"params": {"combine_blocks": 64}})


def test_combine_chunk_rows_sets_the_chunk_the_buffers_and_nothing_else():
    """params.combine_chunk_rows (default 2, the shipped sources' CHUNK) is the rendered CHUNK and
    sizes chunk_sig (one signal per chunk per rank); out of [1, 64] it is refused."""
    from tsgen.errors import SpecError
    from tsgen.harness import render_to_cache
    from tsgen.ops import get_family
    from tsgen.spec import spec_variant

    family = get_family("moe")
    base = load_spec(ROOT / "specs" / "moe.yaml")
    assert base.model.params.combine_chunk_rows == 2
    assert "constexpr int CHUNK = 2;" in render_to_cache(base).source.read_text()
    for rows in (1, 8):
        loaded = spec_variant(base, {"params": {"combine_chunk_rows": rows}})
        assert f"constexpr int CHUNK = {rows};" in render_to_cache(loaded).source.read_text()
        sig = {b.name: b for b in family.buffers(loaded.model)}["chunk_sig"]
        recv = max(base.model.world_sizes) * base.model.params.capacity
        assert sig.fixed == max(base.model.world_sizes) * -(-recv // rows)
    for bad in (0, 65):
        with pytest.raises(SpecError, match="combine_chunk_rows"):
            spec_variant(base, {"params": {"combine_chunk_rows": bad}})


def test_combine_order_sets_peer_order_and_nothing_else():
    """params.combine_order (default rows, the shipped sources' PEER_ORDER 0) is the rendered PEER_ORDER,
    sizes no buffer, and low_latency refuses peers (its combine has no chunks)."""
    from tsgen.errors import SpecError
    from tsgen.harness import render_to_cache
    from tsgen.ops import get_family
    from tsgen.spec import spec_variant

    family = get_family("moe")
    base = plain_moe()
    assert base.model.params.combine_order == "rows"
    assert "constexpr int PEER_ORDER = 0;" in render_to_cache(base).source.read_text()
    loaded = spec_variant(base, {"params": {"combine_order": "peers"}})
    assert "constexpr int PEER_ORDER = 1;" in render_to_cache(loaded).source.read_text()
    assert family.buffers(loaded.model) == family.buffers(base.model)
    with pytest.raises(SpecError, match="combine_order"):
        spec_variant(load_spec(ROOT / "specs" / "moe_ll.yaml"), {"params": {"combine_order": "peers"}})
    with pytest.raises(SpecError, match="combine_order"):
        spec_variant(base, {"params": {"combine_order": "ring"}})


# ---------------------------------------------------------------------------
# The GPU tests' driver (tests/test_moe_gpu.py) on a simulated device: the kernels' effects come
# from the references, so every check, poison and bookkeeping path of the driver runs on CPU.
# ---------------------------------------------------------------------------


class _Arr(np.ndarray):
    def set(self, a):
        self[...] = a

    def get(self):
        return np.asarray(self).copy()


class _FakeStream:
    """A stream whose capture records the pair launches made meanwhile (the fake launcher's calls)."""

    capturing = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        pass

    def begin_capture(self):
        _FakeStream.capturing = []

    def end_capture(self):
        graph, _FakeStream.capturing = _FakeGraph(_FakeStream.capturing), None
        return graph


class _FakeGraph:
    def __init__(self, calls):
        self.calls = calls

    def launch(self, stream):
        for fn in self.calls:
            fn()


class _FakeWorld:
    class cp:
        class cuda:
            @staticmethod
            def Device(i):
                import contextlib

                return contextlib.nullcontext()

        @staticmethod
        def asarray(a):
            return np.array(a).view(_Arr)

    def __init__(self, size, share_gpus=None):
        import contextlib

        self.size, self.ranks, self.devices = size, list(range(size)), {r: 0 for r in range(size)}
        self.streams = {r: _FakeStream() for r in range(size)}

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        pass


def _fake_moe_class(gpu, break_what=None):
    from tsgen.ops.moe import low_latency, recv_rows, slot_rows
    from tsgen.runtime.world import np_dtype

    class FakeBufs:
        def __init__(self, family, spec, cap, world):
            from tsgen.ops.base import CALLS

            self.data = [{b.name: np.zeros(b.elems(cap, world), np_dtype(b.dtype)).view(_Arr)
                          for b in (CALLS,) + tuple(family.buffers(spec))} for _ in range(world)]

        def array(self, name, rank):
            return self.data[rank][name]

        def free(self):
            pass

    class FakeMoe(gpu.Moe):
        def __init__(self, world, loaded, skew=None, mutate=None, echo=print):
            from tsgen.ops import get_family

            self.world, self.spec = world, loaded.model
            p = self.spec.params
            self.cap, self.hidden, self.topk, self.experts = p.capacity, p.hidden, p.topk, p.experts
            self.recv, self.ll, self.slot, self.fp8 = recv_rows(self.spec), low_latency(self.spec), slot_rows(self.spec), \
                p.payload == "fp8"
            self.fp8_worst, self.dispatches, self.device_calls = 0.0, 0, 0
            self.bufs = FakeBufs(get_family("moe"), self.spec, self.cap, world.size)
            rows = self.experts * self.slot if self.ll else self.recv
            self.y = {r: np.zeros(rows * self.hidden, np.uint16).view(_Arr) for r in world.ranks}
            self.mutated = mutate is not None

        def _args(self, rank, tokens, extra=()):
            return (rank, dict(tokens))

        def pair_fn(self, rank, tokens):
            """The pair launcher of one rank: under capture, recorded; the simulated pair runs
            for every rank at once, so the last rank's launch carries it."""
            if rank != self.world.ranks[-1]:
                call = lambda: None  # noqa: E731
            else:
                call = lambda: self.launch("pair", tokens, count=False)  # noqa: E731
            if _FakeStream.capturing is not None:
                _FakeStream.capturing.append(call)
            else:
                call()
            return 0

        def _inputs(self, tokens):
            a = self.bufs.array
            return {"x": [a("x", r)[: tokens[r] * self.hidden].copy() for r in self.world.ranks],
                    "topk_idx": [a("topk_idx", r)[: tokens[r] * self.topk].copy() for r in self.world.ranks],
                    "topk_weights": [a("topk_weights", r)[: tokens[r] * self.topk].copy() for r in self.world.ranks]}

        def launch(self, which, tokens, count=True):
            W, a, inputs = self.world.size, self.bufs.array, self._inputs(tokens)
            wmax = max(self.spec.world_sizes)
            if which in ("dispatch", "pair"):
                self.device_calls += 1
                for r in range(W):
                    a("calls", r)[0] = self.device_calls
                if count:
                    self.dispatches += 1
                half = self.device_calls & 1
                if self.ll:
                    ref = ll_dispatch_reference(inputs, W, self.experts, self.topk, self.hidden, self.slot)
                    for d in range(W):
                        a("recv_counts", d)[...] = ll_counts_array(ref[d], wmax, self.experts)
                        if self.mutated:  # a stale count: what the removed wait lets through
                            a("recv_counts", d)[2 + wmax] += 1
                        rx = a("recv_x", d).reshape(2, self.experts, self.slot, self.hidden)
                        rs = a("recv_src", d).reshape(2, self.experts, self.slot)
                        for i in range(self.experts):
                            n = min(int(ref[d]["counts"][i]), self.slot)
                            rx[half, i, :n] = ref[d]["recv_x"][i, :n]
                            rs[half, i, :n] = ref[d]["recv_src"][i, :n]
                    rows = [rx_half(a("recv_x", d), half, self) for d in range(W)]
                else:
                    ref = dispatch_reference(inputs, W, self.experts, self.topk, self.hidden, self.recv)
                    rows = []
                    for d in range(W):
                        a("recv_counts", d)[...] = counts_array(ref[d], wmax, self.experts)
                        n = min(len(ref[d]["handle"]), self.recv)
                        if self.mutated:
                            a("recv_counts", d)[0] += 1
                        payload = ref[d]["recv_x"][:n]
                        if self.fp8:
                            q, sc = fp8_quantize(payload, self.hidden)
                            a("recv_q", d)[: q.size] = q.reshape(-1)
                            a("recv_scale", d)[: sc.size] = sc.reshape(-1)
                            rows.append(fp8_dequantize(q, sc))
                        else:
                            a("recv_x", d)[: payload.size] = payload.reshape(-1)
                            rows.append(payload.reshape(-1))
                        for name, key in (("recv_idx", "recv_idx"), ("recv_w", "recv_w"), ("handle", "handle")):
                            v = ref[d][key][:n].reshape(-1)
                            a(name, d)[: v.size] = v
                if break_what == "dispatch" or (break_what == "pair_counts" and which == "pair"):
                    a("recv_counts", 0)[2] += 1  # rows from source 0: what a stale `cnt` read shows
                if which == "dispatch":
                    return
                ys = rows
            else:
                ys = [np.asarray(self.y[d]).copy() for d in range(W)]
            if self.ll:
                want = ll_combine_reference(inputs, ys, W, self.experts, self.topk, self.hidden, self.slot)
            else:
                want = combine_reference(inputs, ys, W, self.experts, self.topk, self.hidden,
                                         self.spec.params.weighted)
            for s in range(W):
                a("out", s)[: want[s].size] = want[s]
            if break_what == "combine":
                a("out", 0)[0] ^= 0x4000  # an exponent bit: far past the one-unit tolerance, also for 0

    def rx_half(arr, half, moe):
        return np.asarray(arr).reshape(2, -1)[half].copy()

    return FakeMoe


@pytest.mark.parametrize("spec,world", [("moe", 2), ("moe", 3), ("moe_fp8", 2), ("moe_ll", 2), ("moe_ll", 4)])
def test_gpu_driver_on_a_simulated_device(monkeypatch, spec, world):
    import test_moe_gpu as gpu
    import tsgen.runtime

    small = {"params": {"hidden": 256, "capacity": 40}, "test": {"count": 39}}  # fast references
    if spec == "moe" and world == 3:  # a world size the spec does not ship: a variant
        variant = {"world_sizes": [3], "params": {**small["params"], "experts": 63}, "test": small["test"]}
    else:
        variant = small
    monkeypatch.setattr(tsgen.runtime, "World", _FakeWorld)
    monkeypatch.setattr(gpu, "Moe", _fake_moe_class(gpu))
    problems, lines = gpu.run_moe(world, iters=7, spec=f"specs/{spec}.yaml", burst=3, variant=variant,
                                  graph_replays=3)
    assert problems == [], problems
    if spec == "moe_fp8":
        assert any("fp8: largest" in line for line in lines)
    for broken in ("dispatch", "combine"):  # the driver sees a wrong count, a wrong output element
        monkeypatch.setattr(gpu, "Moe", _fake_moe_class(gpu, broken))
        problems, _ = gpu.run_moe(world, iters=2, spec=f"specs/{spec}.yaml", variant=variant)
        assert problems, broken


@pytest.mark.parametrize("spec", ["moe", "moe_ll"])
def test_gpu_driver_poisons_combine_scratch_and_checks_every_burst_pair_counts(monkeypatch, spec):
    """Moe.load poisons combine's inbox (bf16 NaN) and, in normal mode, sent_row (-2), so a sum
    read too early or a row dispatch did not record fails whatever the call before left; the
    back-to-back pairs compare every pair's recv_counts, not only out (a count read from a peer's
    next call shows only there)."""
    import test_moe_gpu as gpu
    import tsgen.runtime

    variant = {"params": {"hidden": 256, "capacity": 40}, "test": {"count": 39}}
    monkeypatch.setattr(tsgen.runtime, "World", _FakeWorld)
    loads = []

    class Watched(_fake_moe_class(gpu)):
        def load(self, inputs, call):
            super().load(inputs, call)
            for r in self.world.ranks:
                comb = self.bufs.array("comb", r).view(np.uint16)
                assert (comb == gpu.COMB_POISON).all()
                assert np.isnan(to_f64(comb[:1], "bfloat16")).all()
                if not self.ll:
                    assert (self.bufs.array("sent_row", r) == gpu.SENT_ROW_POISON).all()
            loads.append(call)

    monkeypatch.setattr(gpu, "Moe", Watched)
    problems, _ = gpu.run_moe(2, iters=2, spec=f"specs/{spec}.yaml", burst=3, variant=variant)
    assert problems == [] and loads == [0, 1]
    monkeypatch.setattr(gpu, "Moe", _fake_moe_class(gpu, "pair_counts"))
    problems, _ = gpu.run_moe(2, iters=1, spec=f"specs/{spec}.yaml", burst=3, variant=variant)
    assert problems and all(p.startswith("back-to-back pair") and "recv_counts" in p for p in problems), problems
    assert len(problems) == 3  # one per pair (rank 0's)


def test_gpu_driver_overflow_and_negative_control_paths(monkeypatch):
    import test_moe_gpu as gpu
    import tsgen.runtime

    monkeypatch.setattr(tsgen.runtime, "World", _FakeWorld)
    monkeypatch.setattr(gpu, "Moe", _fake_moe_class(gpu))
    problems, _ = gpu.run_moe(2, cases=("skewed",), iters=3, variant={"params": {"recv_capacity": 200}}, combine=False)
    assert problems == []
    problems, _ = gpu.run_moe(4, cases=("skewed",), iters=3, variant={"params": {"recv_capacity": 200}}, combine=False)
    assert problems == []
    problems, _ = gpu.run_moe(2, spec=gpu.LL_SPEC, cases=("skewed",), iters=3, combine=False,
                              variant={"params": {"slot_tokens": 16}})
    assert problems == []
    problems, _ = gpu.run_moe(2, cases=("random",), iters=2, combine=False, mutate=lambda t: t)
    assert problems  # the fake's stand-in for a removed wait: a stale count


def test_combine_tolerance_is_one_bf16_unit():
    """fp32 and float64 sums that round to neighbouring bf16 values pass; two units apart fail
    (on one H100: 0x4100 = 8.0 against a reference of 0x4101 = 8.0625)."""
    from tsgen.ops.collectives import to_f64
    from tsgen.ops.moe import out_tolerance

    ref = np.array([0x4101, 0xBFDA, 0x3F80], np.uint16)
    for delta, ok in ((1, True), (-1, True), (2, False)):
        got = (ref.astype(np.int32) + delta).astype(np.uint16)
        diff = np.abs(to_f64(got, "bfloat16") - to_f64(ref, "bfloat16"))
        assert (diff <= out_tolerance(ref)).all() == ok, delta


def test_every_negative_control_edits_the_source_it_loads(tmp_path):
    """Each GPU negative control's edit applies to the rendered .cu (exactly once) through the same
    path the GPU test loads (render_to_cache, then harness._mutated on the source): an edit that
    left the source unchanged, or one applied to the manifest, would make the control vacuous."""
    import test_moe_gpu as gpu
    from tsgen.harness import _mutated, render_to_cache
    from tsgen.headers import amalgamate
    from tsgen.spec import load_spec

    controls = [(gpu.SPEC, *gpu.COUNTS_WAIT), (gpu.LL_SPEC, *gpu.LL_SLOT_WAIT)] + list(gpu.MORE_CONTROLS.values())
    for spec, old, new in controls:
        cached = render_to_cache(load_spec(ROOT / spec))
        assert amalgamate(cached.source.read_text()).count(old) == 1, (spec, old)  # what _mutated edits
        edited = _mutated(cached.source, lambda text: text.replace(old, new))
        assert new in edited.read_text() and old not in edited.read_text()


@compile_test(missing_tool(find_nvcc) and f"nvcc not found: {missing_tool(find_nvcc)}")
def test_launchers_refuse_too_many_tokens_and_a_null_y_before_touching_cuda(capfd):
    """The host launchers check what they can see (count against params.capacity; normal mode's
    y) and return cudaErrorInvalidValue with a message before any CUDA call: callable without a
    GPU. (On the device the same count would trap and take the shared context down.)"""
    import ctypes
    import json

    manifest = json.loads((ROOT / "generated" / "moe.json").read_text())
    kernel, cap = manifest["kernels"][0]["name"], manifest["constants"]["CAP"]
    nargs = len(manifest["kernels"][0]["launcher_args"])
    lib = ctypes.CDLL(str(compile_source(ROOT / "generated" / "moe.cu", mode="shared").output))

    def args(count):
        return [None, ctypes.c_int(1), None, ctypes.c_uint64(count)] + [None] * (nargs - 4)

    dispatch, combine = getattr(lib, f"{kernel}_dispatch_launch"), getattr(lib, f"{kernel}_combine_launch")
    dispatch.restype = combine.restype = ctypes.c_int
    assert dispatch(*args(cap + 1), None) == 1  # cudaErrorInvalidValue
    assert f"{kernel}_dispatch_launch: rank 1: more tokens than the capacity (count = {cap + 1}" in capfd.readouterr().err
    assert combine(*args(cap), None, None) == 1
    assert f"{kernel}_combine_launch: rank 1: y is null" in capfd.readouterr().err


@pytest.mark.parametrize("spec", ["moe", "moe_fp8", "moe_ll"])
def test_combine_checks_its_count_against_the_last_dispatch(spec):
    """Normal mode: dispatch keeps its token count in sig's last word (a signal: zeroed once at
    allocation, so 0 before the first dispatch), and combine's entry stops on a larger count with
    both counts named (tokens past dispatch's have no rows in sent_row and would wait for chunks
    nobody signals). Low-latency mode has neither. (Source checks: the trap itself needs a GPU.)"""
    from tsgen.harness import render_to_cache
    from tsgen.headers import amalgamate
    from tsgen.ops import get_family

    loaded = load_spec(ROOT / "specs" / f"{spec}.yaml")
    wmax = max(loaded.model.world_sizes)
    bufs = {b.name: b for b in get_family("moe").buffers(loaded.model)}
    text = amalgamate(render_to_cache(loaded).source.read_text())
    if spec == "moe_ll":
        assert "sig" not in bufs and "combine_tokens" not in text
        return
    assert (bufs["sig"].role, bufs["sig"].fixed, bufs["sig"].init) == ("signal", 2 * wmax + 1, 0)
    assert text.count("b.sig[SIG_TOKENS * WMAX] = (uint64_t)tokens;") == 1
    assert "SIG_COUNTS = 0, SIG_DATA = 1, SIG_TOKENS = 2" in text
    assert text.count("::combine_tokens(count, sig, rank)") == len(loaded.model.world_sizes)
    assert "but its last dispatch had %llu" in text
    # recv_counts comes from shared memory, never from `cnt` after the arrival wait
    tail = text[text.index("make_site(\"moe.data\""):text.index("static __device__ __forceinline__ void combine(")]
    assert "b.cnt" not in tail and "s_from[j]" in tail and "s_ecount[l]" in tail


def test_static_shared_memory_over_the_limit_is_a_spec_error():
    """Low-latency dispatch keeps threads x topk pairs in static shared memory: 1024 threads with
    top-16 need 65,668 bytes (ptxas reported 65,676), over the 48 KiB a block may declare."""
    from tsgen.errors import SpecError
    from tsgen.ops.moe import dispatch_static_smem
    from tsgen.spec import spec_variant

    shipped = load_spec(ROOT / "specs" / "moe_ll.yaml")
    assert dispatch_static_smem(shipped.model, 8) == 16452  # ptxas: 16.1 KB (docs/design/moe.md)
    with pytest.raises(SpecError, match=r"launch.threads: 1024 threads need 65668 bytes of static shared memory"):
        spec_variant(shipped, {"params": {"topk": 16}, "launch": {"threads": 1024}})


# ---------------------------------------------------------------------------
# The data-wait control's process of its own (tests/test_moe_gpu.py, run_control_in_child)
# ---------------------------------------------------------------------------

def _child(outcome: str, printed: str = "") -> str:
    """A stand-in for test_moe_gpu.CHILD: imports the test module in the child as the real one does,
    prints `printed` through C stdio (as the device's printf does), then the outcome line, and
    leaves with os._exit (the real child's way out of a dead CUDA context)."""
    return f"""
import ctypes, json, os, sys
sys.path.insert(0, "tests")
import test_moe_gpu
libc = ctypes.CDLL(None)
for line in {printed!r}.splitlines():
    libc.printf((line + "\\n").encode())
print("CONTROL " + json.dumps({outcome}), flush=True)
libc.fflush(None)
os._exit(0)
"""


def test_control_in_child_wrong_output():
    import test_moe_gpu as g

    problems, lines, trap = g.run_control_in_child("data", _child('{"problems": ["back-to-back pair 3 of 50: x"], "lines": ["l"]}'))
    assert (problems, lines, trap) == (["back-to-back pair 3 of 50: x"], ["l"], None)


def test_control_in_child_timeout_trap_counts_as_caught():
    import test_moe_gpu as g

    printed = "tsgen: timeout: rank 0 block 2 thread 2 waited 10000 ms on moe.counts[2] (memory of rank 0)\nother"
    problems, lines, trap = g.run_control_in_child(
        "data", _child('{"error": "KernelFailed: kernel failed on ranks 0, 1, 2, 3 (GPU 0)"}', printed))
    assert problems == [] and trap.startswith("tsgen: timeout: rank 0 block 2"), trap


@pytest.mark.parametrize("outcome, printed, message", [
    ('{"error": "KernelFailed: kernel failed"}', "", "not a timeout trap"),  # a trap with no timeout line
    ('{"error": "CUDARuntimeError: cudaErrorIllegalAddress"}', "tsgen: timeout: rank 1", "not a timeout trap"),
], ids=["no_timeout_line", "not_kernel_failed"])
def test_control_in_child_other_errors_fail(outcome, printed, message):
    import test_moe_gpu as g

    with pytest.raises(AssertionError, match=message):
        g.run_control_in_child("data", _child(outcome, printed))


def test_control_in_child_that_prints_nothing_fails():
    import test_moe_gpu as g

    with pytest.raises(AssertionError, match="printed no outcome"):
        g.run_control_in_child("data", "import sys; sys.exit(3)")


def test_control_outcome_reports_the_kernel_failure_under_the_clean_up_error(monkeypatch):
    """After a trap the context is dead, so run_moe's clean-up raises a CUDA error of its own with the
    KernelFailed as its context: control_outcome reports the KernelFailed (the parent counts it as
    caught only then), not the clean-up's error."""
    import test_moe_gpu as g
    from tsgen.errors import KernelFailed

    def run_moe(*args, **kwargs):
        try:
            raise KernelFailed("kernel failed on ranks 0, 1, 2, 3 (GPU 0): cudaErrorLaunchFailure")
        finally:
            raise RuntimeError("CUDARuntimeError: cudaErrorLaunchFailure (cudaFree in moe.free)")

    monkeypatch.setattr(g, "run_moe", run_moe)
    assert g.control_outcome("data")["error"].startswith("KernelFailed: kernel failed on ranks 0, 1, 2, 3")
    monkeypatch.setattr(g, "run_moe", lambda *a, **k: (_ for _ in ()).throw(ValueError("other")))
    assert g.control_outcome("data")["error"] == "ValueError: other"


def test_control_outcome_line_glued_to_device_output():
    """The device's printf (C stdio) may leave a line unfinished in the pipe: an outcome glued to it is
    still found."""
    import test_moe_gpu as g

    child = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None)
libc.printf(b"tsgen: timeout: rank 0 cut short")
libc.fflush(None)
print("CONTROL " + json.dumps({"problems": ["p"], "lines": []}), flush=True)
os._exit(0)
"""
    assert g.run_control_in_child("data", child) == (["p"], [], None)
