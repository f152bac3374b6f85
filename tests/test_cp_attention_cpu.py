"""The `cp_attention` op on the CPU: spec errors, the shared-GPU fit, the NumPy reference
(attention over the whole sequence at each rank's rows) against a brute-force loop over
positions, the chunk geometry (Python's `segments` against the header's, compiled as host
code), rendering, and the sm_90a build of every kernel without spills. No GPU."""

from __future__ import annotations

import json
import math
import subprocess

import numpy as np
import pytest

from conftest import ROOT, compile_test, exhaustive, missing_tool, rendered_source, spec_problems
from tsgen.errors import RuntimeSetupError
from tsgen.ops import get_family
from tsgen.ops.collectives import to_f64
from tsgen.ops.cp_attention import first_remote_chunk, kv_chunk, own_in_place, positions, segments
from tsgen.render import render
from tsgen.shipped import shipped_specs
from tsgen.spec import load_spec, spec_variant
from tsgen.headers import include_flags
from tsgen.toolchain import compile_source, find_nvcc, gencode_flags

SHIPPED = [p.stem for p in shipped_specs(op="cp_attention")]
CP = "name: a\nop: cp_attention\nworld_sizes: [2, 4]\n"
needs_nvcc = compile_test(missing_tool(find_nvcc) and f"nvcc not found: {missing_tool(find_nvcc)}")


def variant(name, base="cp_attention", **changes):
    """A variant of a shipped spec; of the not-causal one with local_kv off unless `params` sets it (the
    knobs' tests below start from the gather of every shard; the shipped spec reads its own in place)."""
    if base == "cp_attention":
        changes["params"] = {"local_kv": False, **changes.get("params", {})}
    return spec_variant(load_spec(ROOT / "specs" / f"{base}.yaml"), {**changes, "name": name})


# ---------------------------------------------------------------------------
# Spec
# ---------------------------------------------------------------------------

BAD = [
    ("kv_heads_divide", CP + "params:\n  heads: 32\n  kv_heads: 5\n",
     ["7:3: params.kv_heads: 5 KV heads do not divide 32 query heads"]),
    ("layout", CP + "params:\n  layout: ring\n", ["6:3: params.layout: Input should be 'contiguous' or 'zigzag'"]),
    ("gather", CP + "params:\n  gather: nvshmem\n", ["6:3: params.gather: Input should be 'copy_engine' or 'sm'"]),
    ("one_rank", "name: a\nop: cp_attention\nworld_sizes: [1]\n",
     ["4:15: world_sizes[0]: Input should be greater than or equal to 2"]),
    ("zigzag_odd_count", CP + "params:\n  layout: zigzag\ntest:\n  count: 999\n",
     ["8:3: test.count: 999 rows per rank: zigzag splits them into two chunks, so the count must be even"]),
    ("skip_wait_ce", CP + "params:\n  skip_wait: true\n",
     ["6:3: params.skip_wait: the negative control runs on a shared GPU: needs gather: sm"]),
    ("registers", CP + "params:\n  tile: {n: 192}\n",
     ["6:10: params.tile.n: head_dim 128 with blocks of 192 keys needs 208 accumulator registers per consumer thread "
      "(S 96, O 64, P 48); at most 200 fit: use a smaller tile.n"]),
    ("threads", CP + "launch:\n  threads: 256\n", ["6:3: launch.threads: Input should be 384"]),
]


@pytest.mark.parametrize("text,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec(tmp_path, text, expected):
    assert spec_problems(tmp_path, text) == expected


def test_shipped_specs_and_render():
    for name in SHIPPED:
        loaded = load_spec(ROOT / "specs" / f"{name}.yaml")
        spec = loaded.model
        assert spec.world_sizes == [2, 4, 8] and not spec.params.skip_wait, name
        assert spec.test.count % spec.params.tile.m and spec.test.iters >= 20, "odd lengths, 20 calls"
        r = render(loaded, base=ROOT)
        assert r.source == render(loaded, base=ROOT).source, "rendering is deterministic"
        assert r.files() == {n: (ROOT / "generated" / n).read_text() for n in r.files()}, "generated/ is stale"
        assert "NEGATIVE CONTROL" not in r.source and "tsgen_skew" not in r.source
    manifest = json.loads((ROOT / "generated" / "cp_attention.json").read_text())
    k = manifest["kernels"][0]
    assert [a["name"] for a in k["launcher_args"]][:6] == ["peers", "peers_host", "rank", "calls", "count", "q"]
    assert [b["name"] for b in manifest["buffers"]] == ["calls", "q", "k", "v", "o", "lse", "k_full", "v_full", "sig"]


def test_negative_control_and_skew_render():
    v = variant("neg", base="cp_attention_zigzag_causal_sm", params={"skip_wait": True})
    source = render(v, base=ROOT, skew=7).source
    assert "NEGATIVE CONTROL" in source and "tsgen_skew(rank, tsgen::ptx::ld_relaxed_gpu_global_u64(calls));" in source


def test_shared_fit():
    from tsgen.harness import shared_gpu_variant

    family = get_family("cp_attention")
    sm = variant("s", base="cp_attention_zigzag_causal_sm").model
    assert family.shared_fit(sm, 1, 132) == {}
    assert family.shared_fit(sm, 2, 132) == {"launch": {"blocks": 57}}  # 66 per rank, 8 for the push, 1 entry
    assert family.shared_fit(sm, 8, 132) == {"launch": {"blocks": 11}, "params": {"gather_blocks": 4}}
    ce = variant("c").model
    assert family.copy_engine(ce) and not family.copy_engine(sm)
    assert family.shared_refusal(sm) is None
    assert "copy-engine transport does not run on a shared GPU" in family.shared_refusal(ce)
    world = type("SharedWorld", (), {"shared": True, "colocated": 2})()
    with pytest.raises(RuntimeSetupError, match="copy-engine transport does not run on a shared GPU.*gather: sm"):
        shared_gpu_variant(load_spec(ROOT / "specs" / "cp_attention_zigzag_causal.yaml"), world, print)
    with pytest.raises(RuntimeSetupError, match="ranks on one GPU"):
        family.shared_fit(sm, 8, 8)


# ---------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------


def brute_force(q, k, v, world, count, layout, causal, scale, group):
    """Per rank, per row, per head: the softmax over every key of every rank, by explicit
    positions (contiguous: r count + i; zig-zag: chunk r for the first half, 2P-1-r after)."""
    def pos(r, i):
        if layout == "contiguous":
            return r * count + i
        h = count // 2
        return r * h + i if i < h else (2 * world - 1 - r) * h + i - h

    keys = [(pos(s, j), s, j) for s in range(world) for j in range(count)]
    out_o, out_lse = [], []
    for r in range(world):
        b_, n, heads, d = q[r].shape
        o, lse = np.zeros(q[r].shape), np.zeros((b_, heads, n))
        for b in range(b_):
            for i in range(n):
                for h in range(heads):
                    vis = [(s, j) for p, s, j in keys if not causal or p <= pos(r, i)]
                    sc = np.array([scale * q[r][b, i, h] @ k[s][b, j, h // group] for s, j in vis])
                    m = sc.max()
                    e = np.exp(sc - m)
                    o[b, i, h] = sum(w * v[s][b, j, h // group] for w, (s, j) in zip(e, vis)) / e.sum()
                    lse[b, h, i] = m + math.log(e.sum())
        out_o.append(o)
        out_lse.append(lse)
    return out_o, out_lse


@pytest.mark.parametrize("layout,causal,tensors", [("contiguous", False, "bshd"), ("contiguous", True, "bhsd"),
                                                   ("zigzag", True, "bshd"), ("zigzag", False, "bhsd")])
def test_reference_against_brute_force(layout, causal, tensors):
    world, count = 3, 6
    v = variant("r", world_sizes=[world], params={"head_dim": 64, "heads": 4, "kv_heads": 2, "batch": 2,
                                                  "layout": layout, "causal": causal, "tensors": tensors},
                test={"count": count})
    spec, family = v.model, get_family("cp_attention")
    inputs = family.make_inputs(spec, world, count, np.random.default_rng(1), pattern=True)
    ref = family.reference(spec, world, count, inputs)
    tol = family.tolerance(spec, world, count, inputs)

    def shaped(name, heads, r):
        x = to_f64(inputs[name][r], spec.dtype)
        return x.reshape(2, count, heads, 64) if tensors == "bshd" else x.reshape(2, heads, count, 64).transpose(0, 2, 1, 3)

    q = [shaped("q", 4, r) for r in range(world)]
    k = [shaped("k", 2, r) for r in range(world)]
    vv = [shaped("v", 2, r) for r in range(world)]
    o, lse = brute_force(q, k, vv, world, count, layout, causal, 1 / 8, 2)
    for r in range(world):
        got = to_f64(ref["o"][r], spec.dtype)
        want = (o[r] if tensors == "bshd" else o[r].transpose(0, 2, 1, 3)).reshape(-1)
        assert np.all(np.abs(got - want) <= 2.0**-8 * np.abs(want) + 1e-12), "rounded once to bf16"
        assert np.allclose(ref["lse"][r], lse[r].reshape(-1), rtol=1e-6)
        assert tol["o"][r].shape == got.shape and tol["lse"][r].shape == lse[r].reshape(-1).shape
    assert family.outputs(spec, world, count, inputs) is family.outputs(spec, world, count, inputs), "cached per call"


def test_positions_and_segments():
    for world in (2, 3, 4, 8):
        for count in (2, 6, 250):
            for layout in ("contiguous", "zigzag"):
                pos = [positions(layout, world, count, r) for r in range(world)]
                assert sorted(np.concatenate(pos).tolist()) == list(range(world * count)), "a partition"
                for causal in (False, True):
                    chunk = kv_chunk(layout, causal, count)
                    for d in range(world):
                        rows, chunks = [], []
                        for s in range(world):
                            for src, n, dst, c in segments(layout, causal, world, count, s, d):
                                rows += list(range(dst, dst + n))
                                chunks.append(c)
                                assert dst == c * chunk and n == chunk
                                if causal:  # position order: gathered row = position
                                    assert pos[s][src:src + n].tolist() == list(range(dst, dst + n))
                        assert sorted(rows) == list(range(world * count)) and len(set(chunks)) == len(chunks)
                        if not causal:  # d's own shard is the last slot: walked first
                            assert segments(layout, False, world, count, d, d)[0][3] == world - 1
                        first = first_remote_chunk(layout, causal, world, count, d)
                        assert first == -1 if (causal and layout == "contiguous" and d == 0) else first >= 0


# ---------------------------------------------------------------------------
# Build: the header's geometry as host code, every kernel without spills
# ---------------------------------------------------------------------------

GEOMETRY = r"""
#include "SOURCE"
#include <cstdlib>
int main(int argc, char** argv) {
  const int world = atoi(argv[1]);
  const tsgen::cp::Geometry g = MODULE::geometry(world, atoi(argv[2]));
  printf("C %u\n", tsgen::cp::kv_chunk(g));
  for (int d = 0; d < world; ++d) {
    printf("F %d %d", d, tsgen::cp::first_remote_chunk(g, d));
    // own_in_place at three tile sizes, and whether the launch's LocalKv then passes the attention launch's check
    const tsgen::attention::LocalKv local = tsgen::cp::own_local(g, d, &g, &g);
    for (uint32_t tile : {128u, 96u, 192u}) {
      const bool place = tsgen::cp::own_in_place(g, d, tile);
      printf(" %d", (int)place);
      if (place && !local.fits((uint64_t)world * g.count, tsgen::cp::kv_chunk(g), tile)) printf("!");
    }
    printf("\n");
    for (int s = 0; s < world; ++s)
      for (int i = 0; i < tsgen::cp::segments(g); ++i) {
        const tsgen::cp::Segment x = tsgen::cp::segment(g, s, d, i);
        printf("S %d %d %u %u %u %u\n", s, d, x.src_row, x.rows, x.dst_row, x.chunk);
      }
  }
}
"""


@needs_nvcc
@pytest.mark.parametrize("layout,causal", [("contiguous", False), exhaustive("contiguous", True), ("zigzag", True),
                                           exhaustive("zigzag", False)])  # by default the shipped specs' pairs
def test_header_geometry_matches_python(tmp_path, layout, causal):
    loaded = variant("g", params={"layout": layout, "causal": causal, "tensors": "bhsd"})
    source = rendered_source(loaded, tmp_path)
    main = tmp_path / "geometry.cu"
    main.write_text(GEOMETRY.replace("SOURCE", str(source)).replace("MODULE", "g"))
    exe = tmp_path / "geometry"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17",
                    "-w", "-o", str(exe), str(main)],
                   check=True, capture_output=True)
    for world, count in ((2, 250), (3, 6), (8, 1000), (2, 256), (3, 64), (2, 384), (4, 128), (4, 192), (8, 96)):
        out = subprocess.run([str(exe), str(world), str(count)], capture_output=True, text=True, check=True).stdout
        want = [f"C {kv_chunk(layout, causal, count)}"]
        for d in range(world):
            want.append(f"F {d} {first_remote_chunk(layout, causal, world, count, d)} "  # no "!": LocalKv fits
                        + " ".join(str(int(own_in_place(layout, causal, world, count, d, n))) for n in (128, 96, 192)))
            for s in range(world):
                want += [f"S {s} {d} {a} {b} {c} {e}" for a, b, c, e in segments(layout, causal, world, count, s, d)]
        assert out.split("\n")[:-1] == want


FITS = r"""
#include "SOURCE"
#include <cstdlib>
int main(int argc, char** argv) {  // argv: kv_len kv_chunk tile rows chunk0 src0 chunk1 src1
  tsgen::attention::LocalKv l;
  l.k = l.v = argv;
  l.rows = (uint32_t)atoi(argv[4]);
  for (int i = 0; i < 2; ++i) l.chunk[i] = atoi(argv[5 + 2 * i]), l.src[i] = (uint32_t)atoi(argv[6 + 2 * i]);
  printf("%d\n", (int)l.fits((uint64_t)atoll(argv[1]), (uint64_t)atoll(argv[2]), (uint32_t)atoi(argv[3])));
}
"""


@needs_nvcc
def test_local_kv_fits_refuses_what_the_kernel_cannot_read(tmp_path):
    """tsgen::attention::LocalKv::fits, the attention launch's check of what a call reads in place (host code,
    compiled and run here): the launcher's own chunks pass (zig-zag W 2 rank 0 at 256 rows: chunks 0 and 3, rows 0
    and 128 of its k / v; not causal: the last slot); a chunk off a block boundary, one that ends inside a block
    short of kv_len, one at kv_len whose last block would read a real row of k / v past it, rows past k / v, the
    same chunk twice and overlapping rows are refused."""
    main = tmp_path / "fits.cu"
    main.write_text(FITS.replace("SOURCE", str(rendered_source(local(), tmp_path))))
    exe = tmp_path / "fits"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17", "-w", "-o", str(exe),
                    str(main)], check=True, capture_output=True)

    def fits(kv_len, kv_chunk, tile, rows, c0, s0, c1=-1, s1=0):
        args = [str(x) for x in (kv_len, kv_chunk, tile, rows, c0, s0, c1, s1)]
        return subprocess.run([str(exe), *args], capture_output=True, text=True, check=True).stdout.strip() == "1"

    assert fits(512, 128, 128, 256, 0, 0, 3, 128)  # zig-zag W 2 rank 0, 256 rows a rank
    assert fits(512, 256, 128, 256, 1, 0)  # not causal W 2: the last slot
    assert not fits(512, 64, 128, 64, 2, 0)  # rows 128-191 of 512: ends inside a block short of kv_len
    assert not fits(512, 128, 128, 128, 4, 0)  # rows 512-639: past kv_len
    assert fits(192, 64, 128, 64, 2, 0)  # contiguous causal W 3 rank 2: from 128, ends at kv_len inside a block
    assert not fits(192, 64, 128, 128, 2, 0)  # the same, but k / v go on past the chunk: a real row read past kv_len
    assert not fits(384, 64, 128, 64, 1, 0)  # from 64: off a block boundary
    assert not fits(384, 192, 128, 192, 1, 0)  # from 192
    assert not fits(512, 128, 128, 200, 0, 100)  # rows past k / v
    assert not fits(512, 128, 128, 256, 0, 0, 0, 128)  # the same chunk twice
    assert not fits(512, 128, 128, 256, 0, 0, 3, 64)  # overlapping rows of k / v
    assert not fits(512, 0, 128, 256, 0, 0)


@needs_nvcc
@pytest.mark.parametrize("name", SHIPPED)
def test_compiles_without_spills(name):
    res = compile_source(ROOT / "generated" / f"{name}.cu", mode="shared")
    kernels = {k: v for k, v in res.report.items() if k.startswith(name + "_")}
    expected = {f"{name}_attention"} | {f"{name}_w{w}_sync" for w in (2, 4, 8)}
    if name.endswith("_sm"):
        expected |= {f"{name}_w{w}_push" for w in (2, 4, 8)}
    assert set(kernels) == expected
    assert kernels[f"{name}_attention"]["registers"] == 168  # setmaxnreg's 40 / 232 split, as the attention op
    for k, entry in kernels.items():
        assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0, (k, entry)
    assert kernels[f"{name}_attention"]["stack_frame"] == 0


@compile_test(missing_tool(find_nvcc) and f"nvcc not found: {missing_tool(find_nvcc)}")
def test_launcher_refuses_bad_calls_with_a_message_before_touching_cuda(capfd):
    """A rank out of range and an odd zig-zag row count are refused with what and where, before
    anything is launched (callable without a GPU)."""
    import ctypes

    lib = ctypes.CDLL(str(compile_source(ROOT / "generated" / "cp_attention_zigzag_causal_sm.cu", mode="shared").output))
    fn = lib.cp_attention_zigzag_causal_sm_w2_launch
    fn.restype = ctypes.c_int

    def call(rank, count):
        return fn(None, None, ctypes.c_int(rank), None, ctypes.c_uint64(count), *([None] * 8), None)

    assert call(0, 333) == 1  # cudaErrorInvalidValue
    assert "cp_attention_zigzag_causal_sm_w2_launch: rank 0, count 333: zig-zag needs an even row count" \
        in capfd.readouterr().err
    assert call(2, 334) == 1
    assert "rank 2, count 334: rank out of range" in capfd.readouterr().err


def test_check_rows_fails_an_output_that_drops_the_last_keys():
    """cp_attention's bench check at 16K causal zig-zag over 2 ranks: O computed as if every key
    past 0.75 S did not exist fails, the true O (bf16) passes (issue 33 item 4)."""
    from tsgen.bench.runner import MAX_REL_ERR
    from tsgen.ops.attention import attention_reference, check_query_rows
    from tsgen.ops.collectives import from_f64

    seq, kept, world, d = 16384, 12288, 2, 128
    count = seq // world
    loaded = variant("chk", base="cp_attention_zigzag_causal", params={"heads": 2, "kv_heads": 1})
    family = get_family("cp_attention")
    rng = np.random.default_rng(7)
    raw = {n: [from_f64(rng.standard_normal(count * h * d), "bfloat16") for _ in range(world)]
           for n, h in (("q", 2), ("k", 1), ("v", 1))}
    pos = [positions("zigzag", world, count, r) for r in range(world)]
    k, v = (np.zeros((1, seq, 1, d)) for _ in range(2))
    for r in range(world):
        k[:, pos[r]] = to_f64(raw["k"][r], "bfloat16").reshape(1, count, 1, d)
        v[:, pos[r]] = to_f64(raw["v"][r], "bfloat16").reshape(1, count, 1, d)
    rows = check_query_rows(count)
    outputs = {}
    for name, keys in (("true", seq), ("drops keys", kept)):
        outputs[name] = []
        for r in range(world):
            q = to_f64(raw["q"][r], "bfloat16").reshape(1, count, 2, d)
            o = np.zeros((1, count, 2, d))
            o[:, rows] = attention_reference(q[:, rows], k[:, :keys], v[:, :keys], 1 / math.sqrt(d), True,
                                             q_pos=pos[r][rows])[0]
            outputs[name].append(from_f64(o.reshape(-1), "bfloat16"))

    def check(o):
        bufs = {**raw, "o": o}
        return family.bench.check_rows(family, loaded.model, world, count, lambda n, r, a, b: bufs[n][r][a:b])

    assert check(outputs["true"]) <= MAX_REL_ERR
    assert check(outputs["drops keys"]) > 10 * MAX_REL_ERR


# ---------------------------------------------------------------------------
# The test-only trace (params.trace; tools/attention_trace.py)
# ---------------------------------------------------------------------------


def _trace_words(records, count=None, room=None):
    """The trace's words (after sig's signals and the call timeline's stamps: a count, a spare word, the
    records) holding `records` [(sm, cta, tile, start, end, waited[, first_ready, last_ready[, cycles]])]."""
    from tsgen.ops.cp_attention import TRACE_WORDS

    n = TRACE_WORDS
    w = np.zeros(2 + n * (room or len(records)), np.uint64)
    w[0] = len(records) if count is None else count
    for i, rec in enumerate(records):
        sm, cta, tile, start, end, waited, *more = rec
        more = list(more) + [0] * (3 - len(more))  # first_ready, last_ready, cycles
        w[2 + n * i:2 + n * (i + 1)] = [sm << 48 | cta << 32 | tile, start, end, waited, *more]
    return w


def test_trace_table_and_summary():
    from tsgen.ops.cp_attention import trace_summary, trace_table

    # 2 CTAs, 3 tiles: CTA 0 runs tile 0 (0-100 us, waited 5), then tile 2 (100-150); CTA 1 tile 1 (0-120)
    us = 1000
    recs = [(7, 1, 1, 10 * us, 130 * us, 0), (3, 0, 2, 110 * us, 160 * us, 0), (3, 0, 0, 10 * us, 110 * us, 5 * us)]
    table = trace_table(_trace_words(recs))
    assert table["count"] == 3 and [r["tile"] for r in table["records"]] == [1, 0, 2]  # by start
    assert table["records"][0] == {"index": 0, "sm": 7, "cta": 1, "tile": 1, "start": 10 * us, "end": 130 * us,
                                   "waited": 0, "first_ready": 0, "last_ready": 0, "cycles": 0}
    s = trace_summary(table, 3)
    assert s["complete"] and s["tiles_once"] and s["ctas"] == 2
    assert s["span_us"] == pytest.approx(150) and s["efficiency"] == pytest.approx(270 / 300)
    assert s["busy_us"] == pytest.approx({"max": 150, "mean": 135, "min": 120})
    assert s["tail_us"] == pytest.approx(30) and s["waited_us_per_cta"] == pytest.approx(2.5)
    assert s["tiles_per_cta"] == {"max": 2, "min": 1}
    assert s["tile_us"] == pytest.approx({"max": 120, "median": 120, "min": 75})  # CTA 1: 120 / 1; CTA 0: 150 / 2
    assert s["first_wait_us"] == pytest.approx({"max": 5, "mean": 2.5})  # CTA 0's first tile (tile 0) waited 5
    ft = s["first_tile_us"]  # medians over the two CTAs' first tiles (120 and 100 us long)
    assert ft["ctas"] == 2 and ft["duration"] == pytest.approx(120) and ft["waited"] == pytest.approx(5)
    assert ft["first_ready"] is None and ft["last_ready"] is None and ft["kernel_start"] == 10 * us
    assert s["later_tile_us"] == pytest.approx(50)  # CTA 0's second tile
    assert s["sm_clock_ghz"] is None  # no cycles recorded
    clocked = trace_summary(trace_table(_trace_words(recs[:2] + [recs[2][:6] + (0, 0, 90_000_000)])), 3)
    assert clocked["sm_clock_ghz"] is None  # CTA 0's later tile (tile 2, recs[1]) has none; tile 0 is a first
    clocked = trace_summary(trace_table(_trace_words([recs[0], recs[1][:6] + (0, 0, 90_000), recs[2]])), 3)
    assert clocked["sm_clock_ghz"] == pytest.approx(1.8)  # 90000 cycles over tile 2's 50 us
    assert not trace_summary(table, 4)["tiles_once"]  # a tile missing
    assert not trace_summary(trace_table(_trace_words(recs + recs[:1])), 3)["tiles_once"]  # a tile twice
    lost = trace_table(_trace_words(recs[:2], count=3, room=2))  # the kernel made 3, there was room for 2
    assert lost["count"] == 3 and not trace_summary(lost, 3)["complete"]


def test_trace_is_only_in_the_trace_variant():
    """The shipped sources define no TSGEN_ATTENTION_TRACE (so the header's trace code does not
    exist there) and keep sig at its signals; params.trace adds both."""
    from tsgen.ops.cp_attention import SIGNALS, STAMP_WORDS, trace_words

    for name in SHIPPED:
        assert "_host_timeline" not in (ROOT / "generated" / f"{name}.cu").read_text()
        assert "#define TSGEN_ATTENTION_TRACE" not in (ROOT / "generated" / f"{name}.cu").read_text()
    loaded = variant("tr", base="cp_attention_zigzag_causal_sm", params={"trace": 100})
    rendered = render(loaded)
    assert "#define TSGEN_ATTENTION_TRACE 1" in rendered.source
    sig = [b for b in rendered.lowered.manifest.buffers if b.name == "sig"][0]
    assert trace_words(100) == STAMP_WORDS + 2 + 700 and sig.fixed == SIGNALS + STAMP_WORDS + 702
    assert trace_words(0) == 0


@needs_nvcc
def test_trace_variant_compiles_without_spills(tmp_path):
    """The trace build (a lab tool's, test-only) at the shipped kernel's 168 registers, without spills
    (83be7bf's build spilled one word here, the high half of the persistent counter's last value, until
    next_tile compared i + 1 with tiles)."""
    loaded = variant("tr", base="cp_attention_zigzag_causal_sm", params={"trace": 100})
    res = compile_source(rendered_source(loaded, tmp_path), mode="shared")
    entry = res.report["tr_attention"]
    assert entry["registers"] == 168 and entry["spill_stores"] == 0 and entry["spill_loads"] == 0, entry


def test_trace_tool_reports_without_a_gpu():
    """tools/attention_trace.py's parts that need no GPU: the tile count and the printed report."""
    import importlib.util

    from tsgen.ops.cp_attention import CpAttentionParams, trace_summary, trace_table

    spec = importlib.util.spec_from_file_location("attention_trace", ROOT / "tools" / "attention_trace.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.tiles_per_rank(CpAttentionParams(heads=32, kv_heads=4), 8192) == 64 * 32
    table = trace_table(_trace_words([(0, 0, 0, 0, 5000, 0), (1, 1, 1, 0, 4000, 1000)]))
    result = {"spec": "s", "world": 2, "seq": 512, "tiles_per_rank": 2, "calls": 1, "row_error": 1e-3,
              "row_error_ok": True, "ranks": {0: {"summary": trace_summary(table, 2)},
                                              1: {"summary": trace_summary(trace_table(_trace_words([(0, 0, 0, 0, 1, 0)], 2, 1)), 2)}}}
    text = tool.report(result)
    assert "rank 0: every tile once: True; 2 CTAs; span 5 us; efficiency 0.900" in text
    assert "rank 1: trace incomplete: 1 records kept of 2" in text
    assert "tiles a CTA 1 / 1; a CTA's mean tile max / median / min 5.0 / 5.0 / 4.0 us" in text
    assert tool.parse_params(["tile_counter=true", "gather_blocks=4"]) == {"tile_counter": True, "gather_blocks": 4}
    with pytest.raises(SystemExit):
        tool.parse_params(["tile_counter"])


# ---------------------------------------------------------------------------
# params.tile_counter (issue 33, not causal): tiles from the rank's counter, opt-in
# ---------------------------------------------------------------------------


def opt_in_constant(name: str, loaded, absent: str | None = None) -> str:
    """An opt-in knob's constant: in no shipped source (nor `absent`), and in the variant `loaded`'s source as
    the module's `constexpr int NAME = 1` and the Config's flag; that source."""
    for shipped in SHIPPED:
        text = (ROOT / "generated" / f"{shipped}.cu").read_text()
        assert name not in text and (absent is None or absent not in text), shipped
    source = render(loaded).source
    assert f"\nconstexpr int {name} = 1;\n" in source
    assert f"static constexpr bool {name} = {loaded.model.name}::{name} != 0;" in source
    return source


def test_tile_counter_renders_only_where_set():
    """Unset, the shipped sources stay as they are (no TILE_COUNTER anywhere); set on the
    not-causal spec, the module constant and the Host's flag appear, and the header's launcher
    then passes sig[WORK] as the kernel's counter (tile_counter_of)."""
    opt_in_constant("TILE_COUNTER", variant("tc", params={"tile_counter": True}))
    header = (ROOT / "templates" / "include" / "tsgen" / "cp.cuh").read_text()
    assert "Op::CAUSAL || tile_counter_of<Op>::value ? sig + WORK : nullptr" in header


def test_attention_only_entry_renders_only_where_set():
    """params.attention_only_entry (test-only, tools/cp_clock_probe.py --solo): unset, no shipped source has the
    entry; set, every world's <kernel>_attention_only_launch takes the launcher's arguments and calls the same
    launcher with ATTENTION_ONLY, which returns the attention kernel's launch before the entry exchange."""
    for shipped in SHIPPED:
        assert "attention_only" not in (ROOT / "generated" / f"{shipped}.cu").read_text(), shipped
    loaded = variant("solo", params={"local_kv": True, "attention_only_entry": True})
    source = render(loaded).source
    for w in loaded.model.world_sizes:
        assert (f"cudaError_t solo_w{w}_attention_only_launch(char* const* peers, char* const* peers_host, int rank, "
                in source)
        assert f"tsgen::cp::launch<solo::Host, {w}, solo_w{w}_sync, nullptr, solo_attention, true>(" in source
    header = (ROOT / "templates" / "include" / "tsgen" / "cp.cuh").read_text()
    body = header[header.index("bool ATTENTION_ONLY = false"):]
    body = body[:body.index("\n}\n")]  # tsgen::cp::launch alone
    early = body.index("if constexpr (ATTENTION_ONLY) return attention();")
    # the full call: the entry exchange, then the copies and their signals, then the kernel, then the joins
    assert early < body.index("SYNC<<<1, 32, 0, stream>>>") < body.index("Op::SIGNAL_CHUNKS, d, count)") \
        < body.index("const cudaError_t launched = attention();") < body.index("cudaEventRecord(l->copy_done")
    assert body.count("attention()") == 2


@needs_nvcc
@pytest.mark.exhaustive  # one cp_attention build (about a minute on 2 cores): the gate runs it
def test_attention_only_entry_compiles(tmp_path):
    """The ATTENTION_ONLY instance of tsgen::cp::launch compiles (sm_90a) beside the full one, and the kernel is
    the shipped spec's (the entry changes host code only: 168 registers, no spill, no serialized wgmma); the
    shared library exports every world's entry."""
    loaded = variant("solo", params={"local_kv": True, "row_max_chains": 2, "attention_only_entry": True})
    res = compile_source(rendered_source(loaded, tmp_path), mode="shared")
    entry = res.report["solo_attention"]
    assert entry["registers"] == 168 and entry["spill_stores"] == 0 and entry["spill_loads"] == 0, entry
    assert res.serialized == [], res.serialized
    import ctypes

    lib = ctypes.CDLL(str(res.output))
    for w in loaded.model.world_sizes:
        assert getattr(lib, f"solo_w{w}_attention_only_launch") is not None


def test_own_copy_first_renders_only_where_set():
    """params.own_copy_first: unset, no shipped source has the own-copy kernel; set, the module's kernel, its
    Host entry (OWN_COPY, which tsgen::cp::own_first_of must detect: a static_assert) and the thread count; the
    launcher copies and signals the own rows on `stream` after the fork and before the kernel, and the copy
    engine's loop then starts at the first peer."""
    for shipped in SHIPPED:
        assert "own_copy" not in (ROOT / "generated" / f"{shipped}.cu").read_text(), shipped
    source = render(variant("own", params={"own_copy_first": True})).source
    assert "\nconstexpr int OWN_COPY_THREADS = 256;\n" in source
    assert "own_own_copy(int rank, const char* k, const char* v, char* k_full, char* v_full, tsgen::cp::Geometry g)" \
        in source
    assert "static constexpr auto OWN_COPY = own_own_copy;" in source
    header = (ROOT / "templates" / "include" / "tsgen" / "cp.cuh").read_text()
    body = header[header.index("bool ATTENTION_ONLY = false"):]
    body = body[:body.index("\n}\n")]
    entry, fork = body.index("ENTRY, 0, count);"), body.index("cudaEventRecord(l->fork, stream)")
    copy, signal = body.index("Op::OWN_COPY<<<"), body.index("Op::SIGNAL_CHUNKS, rank, count);")
    # after the fork (the peers' copies start beside it), before the kernel
    assert entry < fork < copy < signal < body.index("const cudaError_t launched = attention();")
    assert "static_assert(tsgen::cp::own_first_of<Host>::value" in source
    assert "for (int i = in_place || own_first ? 1 : 0; i < WORLD; ++i)" in body


@needs_nvcc
@pytest.mark.exhaustive  # one cp_attention build: the gate runs it
def test_own_copy_first_compiles(tmp_path):
    loaded = variant("own", params={"own_copy_first": True})
    res = compile_source(rendered_source(loaded, tmp_path), mode="shared")
    for name, regs in (("own_attention", 168), ("own_own_copy", None)):
        entry = res.report[name]
        assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, (name, entry)
        assert regs is None or entry["registers"] == regs, (name, entry)
    assert res.serialized == [], res.serialized


def test_row_max_chains_renders_only_where_set(tmp_path):
    """params.row_max_chains (attention's parameter, one type: RowMaxChains): the not-causal shipped spec sets 2
    (docs/design/cp_attention.md, "The cp kernel alone"), the causal ones leave it unset and have no constant (the
    serial chain); set, the module constant and the Config's, as attention's; a count that does not divide tile.n / 4
    is refused by the check the two ops share."""
    for shipped in SHIPPED:
        text = (ROOT / "generated" / f"{shipped}.cu").read_text()
        chains = load_spec(ROOT / "specs" / f"{shipped}.yaml").model.params.row_max_chains
        assert ("\nconstexpr int ROW_MAX_CHAINS = 2;\n" in text) == (chains == 2), shipped
        assert ("ROW_MAX_CHAINS" in text) == (chains is not None), shipped
    assert load_spec(ROOT / "specs" / "cp_attention.yaml").model.params.row_max_chains == 2
    source = render(variant("chains", params={"row_max_chains": 4})).source
    assert "\nconstexpr int ROW_MAX_CHAINS = 4;\n" in source
    assert "static constexpr int ROW_MAX_CHAINS = chains::ROW_MAX_CHAINS;" in source
    text = CP + "params:\n  tile: {m: 128, n: 80}\n  row_max_chains: 8\n"
    assert spec_problems(tmp_path, text) == [
        "7:3: params.row_max_chains: row_max_chains 8 does not divide the 20 scores per row a consumer thread holds "
        "with blocks of 80 keys (tile.n / 4): use a divisor of it"]


def test_rescale_at_renders_only_where_set(tmp_path):
    """params.rescale_at (attention's parameter, one type: RescaleAt; the consumer loop is the same code): set only in
    the not-causal cp spec (since 2026-11-29), whose source has the constant; the causal ones' sources have none (the
    header's default order); set, the module constant and the Config's; more groups than tile.n / 16 refused by the
    check the two ops share."""
    assert "cp_attention" in SHIPPED
    for shipped in SHIPPED:
        expected = 4 if shipped == "cp_attention" else None
        assert load_spec(ROOT / "specs" / f"{shipped}.yaml").model.params.rescale_at == expected, shipped
        assert ("RESCALE_AT" in (ROOT / "generated" / f"{shipped}.cu").read_text()) == (expected is not None), shipped
    source = render(variant("ra", params={"rescale_at": 2})).source  # not the shipped 4: the override is what shows
    assert "\nconstexpr int RESCALE_AT = 2;\n" in source
    assert "static constexpr int RESCALE_AT = ra::RESCALE_AT;" in source
    assert spec_problems(tmp_path, CP + "params:\n  rescale_at: 9\n") == [
        "6:3: params.rescale_at: rescale_at 9: a block of 128 keys has 8 column groups of exp2 (tile.n / 16); use 0 "
        "to 8"]


def test_rescale_skip_renders_only_where_set():
    """params.rescale_skip (attention's parameter, one type: RescaleSkip; the consumer loop is the same code): no
    shipped cp spec sets it yet (it waits for a W 2 measurement: suites/cp-w2-causal.yaml); set, the module constant
    and the Config's, on the zig-zag causal spec (ping-pong, no rescale_at: where the single-GPU kernel gained)."""
    for shipped in SHIPPED:
        assert "RESCALE_SKIP" not in (ROOT / "generated" / f"{shipped}.cu").read_text(), shipped
        assert load_spec(ROOT / "specs" / f"{shipped}.yaml").model.params.rescale_skip is False, shipped
    source = render(variant("rs", base="cp_attention_zigzag_causal", params={"rescale_skip": True})).source
    assert "\nconstexpr int RESCALE_SKIP = 1;\n" in source
    assert "static constexpr bool RESCALE_SKIP = rs::RESCALE_SKIP != 0;" in source


# The test-only and opt-in knobs' combinations a spec may not ask for: (params, the check's message)
REFUSED_KNOBS = [
    ("  causal: true\n  tile_counter: true\n",
     "7:3: params.tile_counter: causal tiles are always handed out from the counter (longest first): tile_counter is "
     "the not-causal option"),
    ("  gather: sm\n  own_copy_first: true\n",
     "7:3: params.own_copy_first: the SM push copies the own rows itself: own_copy_first needs gather: copy_engine"),
    ("  own_copy_first: true\n  trace: 64\n",
     "6:3: params.own_copy_first: own_copy_first with trace: the call timeline reads the first signal kernel as the "
     "copy stream's own copy, which this one is not"),
    ("  attention_only_entry: true\n  trace: 64\n",
     "6:3: params.attention_only_entry: attention_only_entry with trace: the host timeline would count the entry's "
     "calls, which advance no epoch; trace the full calls only"),
]


@pytest.mark.parametrize("params,message", REFUSED_KNOBS, ids=["tile_counter_causal", "own_copy_first_sm",
                                                                "own_copy_first_trace", "attention_only_entry_trace"])
def test_knob_combinations_refused(tmp_path, params, message):
    assert spec_problems(tmp_path, CP + "params:\n" + params) == [message]


@needs_nvcc
@pytest.mark.parametrize("base,changes", [("cp_attention", {}), exhaustive("cp_attention", {"epilogue_overlap": True}),
                                          exhaustive("cp_attention", {"gather": "sm", "trace": 100})],
                         ids=["copy_engine", "overlap", "sm_trace"])  # by default the copy engine's
def test_tile_counter_compiles_without_spills_or_serialized_wgmma(tmp_path, base, changes):
    loaded = variant("tc", base=base, params={"tile_counter": True, **changes})
    res = compile_source(rendered_source(loaded, tmp_path), mode="shared")
    entry = res.report["tc_attention"]
    assert entry["registers"] == 168 and entry["spill_stores"] == 0 and entry["spill_loads"] == 0, entry
    assert entry["stack_frame"] == 0
    assert res.serialized == [], res.serialized


# ---------------------------------------------------------------------------
# params.local_kv (issue 33, not causal): the own shard read in place, no copy to ourselves, opt-in
# ---------------------------------------------------------------------------


def local(name="lk", **params):
    return variant(name, params={"local_kv": True, **params}, test={"count": 1024})


def test_local_kv_renders_only_where_set():
    """Every shipped spec sets it (since 2026-11-27), and its source has the module constant, the Config's flag,
    the kernel's two more maps (passed to run) and, with the SM push, the push kernel's tile.n; a variant with it
    off has none of it; the header's launcher, where own_in_place, passes our chunks to the kernel as read in
    place and skips the copy to ourselves."""
    for name in SHIPPED:
        assert load_spec(ROOT / "specs" / f"{name}.yaml").model.params.local_kv, name
        text = (ROOT / "generated" / f"{name}.cu").read_text()
        assert "k_local_map" in text and "\nconstexpr int LOCAL_KV = 1;\n" in text, name
        assert ("push_body<2, " + name + "::Config::TILE_N>" in text) == name.endswith("_sm"), name
    assert "LOCAL_KV" not in render(variant("off")).source
    source = render(local()).source
    assert "\nconstexpr int LOCAL_KV = 1;\n" in source
    assert "static constexpr bool LOCAL_KV = lk::LOCAL_KV != 0;" in source
    assert "const __grid_constant__ CUtensorMap k_local_map, const __grid_constant__ CUtensorMap v_local_map," in source
    assert "run<lk::Config>(&q_map, &k_map, &v_map, &o_map, problem, &k_local_map, &v_local_map);" in source
    assert "push_body<2, lk::Config::TILE_N>" in render(local(gather="sm")).source
    header = (ROOT / "templates" / "include" / "tsgen" / "cp.cuh").read_text()
    assert "const bool in_place = LOCAL_KV && own_in_place(g, rank, Op::Config::TILE_N);" in header
    assert "const int unwaited = Op::SKIP_WAIT ? first_remote_chunk(g, rank) : -1;" in header
    assert "local.chunk[s] = (int32_t)x.chunk, local.src[s] = x.src_row;" in header
    assert "for (int i = in_place || own_first ? 1 : 0; i < WORLD; ++i) {" in header  # own_first: own_copy_first
    assert "const bool skip_own = LOCAL_TILE != 0 && own_in_place(g, rank, LOCAL_TILE);" in header


@pytest.mark.parametrize("text", [
    CP + "params:\n  causal: true\n  layout: zigzag\n  local_kv: true\ntest:\n  count: 1024\n",
    CP + "params:\n  causal: true\n  local_kv: true\n",
    CP + "params:\n  local_kv: true\n  gather: sm\n  skip_wait: true\n",
], ids=["zigzag_causal", "contiguous_causal", "skip_wait"])
def test_local_kv_takes_every_layout_and_the_control(tmp_path, text):
    """Since 2026-11-27 causal specs read their own chunks in place too, and the negative control (a peer's
    chunk not waited for) holds beside it: none of these is refused."""
    assert spec_problems(tmp_path, text) == []


def test_local_kv_takes_any_count():
    """A count whose own rows would start or end inside a KV block is not refused: the call gathers them like a
    peer's (own_in_place false), in the spec's test and in the bench alike; every bench size of the shipped
    specs reads them in place, their harness count (1000) does not."""
    family = get_family("cp_attention")
    spec = variant("lk", params={"local_kv": True}, test={"count": 1000}).model
    assert family.bench.case(family, spec, 2, 16000).count == 8000
    for layout, causal in (("contiguous", False), ("zigzag", True)):
        for w in (2, 4, 8):
            for r in range(w):
                assert own_in_place(layout, causal, w, 16384 // w, r, 128)  # bench sizes (8K-32K)
                assert not own_in_place(layout, causal, w, 1000, r, 128)  # the harness count
    # not causal: the last slot from (world - 1) x count; zig-zag: chunks r and 2P - 1 - r of count / 2 rows
    assert own_in_place("contiguous", False, 3, 64, 0, 128) and not own_in_place("contiguous", False, 2, 64, 0, 128)
    assert own_in_place("zigzag", True, 2, 256, 1, 128) and not own_in_place("zigzag", True, 2, 250, 1, 128)
    # contiguous causal, chunk r from r x count: rank 0's ends inside a block at 200 rows, rank 1's starts there;
    # at 64 rows rank 1's starts inside a block too, at 128 it is whole blocks
    assert not own_in_place("contiguous", True, 2, 200, 0, 128) and not own_in_place("contiguous", True, 2, 200, 1, 128)
    assert not own_in_place("contiguous", True, 2, 64, 1, 128) and own_in_place("contiguous", True, 2, 128, 1, 128)


@needs_nvcc
# by default the overlap and bhsd: every shipped spec sets local_kv (the copy engine's and the SM push), and
# test_trace_variant_compiles_without_spills builds it with the trace
@pytest.mark.parametrize("params", [exhaustive({}), exhaustive({"gather": "sm"}), {"epilogue_overlap": True},
                                    exhaustive({"trace": 100}), {"tensors": "bhsd", "batch": 2}],
                         ids=["copy_engine", "sm", "overlap", "trace", "bhsd_batch2"])
def test_local_kv_compiles_without_spills_or_serialized_wgmma(tmp_path, params):
    res = compile_source(rendered_source(local(**params), tmp_path), mode="shared")
    kernels = {k: v for k, v in res.report.items() if k.startswith("lk_")}
    assert kernels["lk_attention"]["registers"] == 168 and kernels["lk_attention"]["stack_frame"] == 0
    for k, entry in kernels.items():
        assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0, (k, entry)
    assert res.serialized == [], res.serialized


# ---------------------------------------------------------------------------
# params.copy_1d (issue 33): one-run pieces copied with cudaMemcpyAsync, not cudaMemcpy2DAsync, opt-in
# ---------------------------------------------------------------------------


def test_copy_1d_renders_only_where_set_and_needs_the_copy_engine(tmp_path):
    opt_in_constant("COPY_1D", variant("c1", params={"copy_1d": True}))
    header = (ROOT / "templates" / "include" / "tsgen" / "cp.cuh").read_text()
    assert "if (copy_1d_of<Op>::value && g.lines == 1) {  // one run: the 1-D copy (params.copy_1d)" in header
    assert spec_problems(tmp_path, CP + "params:\n  copy_1d: true\n  gather: sm\n") == [
        "6:3: params.copy_1d: the SM push has no copy-engine copies: copy_1d needs gather: copy_engine"]


@needs_nvcc
def test_copy_1d_with_local_kv_compiles_without_spills(tmp_path):
    res = compile_source(rendered_source(local(copy_1d=True), tmp_path), mode="shared")
    entry = res.report["lk_attention"]
    assert entry["registers"] == 168 and entry["spill_stores"] == 0 and entry["stack_frame"] == 0, entry
