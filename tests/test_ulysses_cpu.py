"""The Ulysses all-to-alls on CPU: spec errors, the NumPy reference against element-by-element
loops, buffer sizes, the bench conventions (sizes are S; bytes moved against the minimum), the
rendered negative control, and (marked compile) the host entry point that refuses an S the
world size does not divide."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from conftest import ROOT, compile_test, missing_tool, rendered_source, spec_problems
from tsgen.errors import RuntimeSetupError
from tsgen.ops import get_family
from tsgen.ops.ulysses import kv_head_base, kv_heads_per_rank, tokens_per_rank
from tsgen.spec import load_spec, spec_variant
from tsgen.toolchain import compile_source, find_nvcc

PRE, POST = get_family("ulysses_pre_a2a"), get_family("ulysses_post_a2a")


def _spec(op, world, **params):
    kind = {"pre": "ulysses_pre_a2a", "post": "ulysses_post_a2a"}[op]
    return get_family(kind).Spec.model_validate(
        {"name": "u", "op": kind, "world_sizes": [world], "params": params, "launch": {"blocks": 16}})


def _inputs(family, spec, world, count, seed=0):
    return family.make_inputs(spec, world, count, np.random.default_rng(seed), pattern=False)


# ---------------------------------------------------------------------------
# spec errors
# ---------------------------------------------------------------------------

BAD = [
    ("op: ulysses_pre_a2a\nworld_sizes: [2, 3]\nparams: {heads: 4}\n", "params.heads: 4 heads do not split over world size(s) 3"),
    ("op: ulysses_post_a2a\nworld_sizes: [8]\nparams: {heads: 12}\n", "params.heads: 12 heads do not split over world size(s) 8"),
    ("op: ulysses_pre_a2a\nworld_sizes: [2]\nparams: {kv_heads: 4}\n", "params.kv_heads: only with packed_qkv"),
    ("op: ulysses_pre_a2a\nworld_sizes: [2]\nparams: {packed_qkv: true, heads: 8, kv_heads: 3}\n",
     "params.kv_heads: 3 KV heads do not divide 8 query heads"),
    ("op: ulysses_pre_a2a\nworld_sizes: [3]\nparams: {packed_qkv: true, heads: 12, kv_heads: 2}\n",
     "params.kv_heads: 2 KV heads neither split over nor replicate evenly onto world size(s) 3"),
    ("op: ulysses_pre_a2a\nworld_sizes: [2, 8]\nparams: {packed_qkv: true, heads: 16, kv_heads: 4}\n",
     "world_sizes: with 4 KV heads the world sizes must all be <= 4 or all >= 4"),
    ("op: ulysses_pre_a2a\nworld_sizes: [8]\nlaunch: {blocks: 4}\n", "launch.blocks: needs at least one block per peer: 8"),
    ("op: ulysses_post_a2a\nworld_sizes: [2]\nlaunch: {blocks: 256}\n", "launch.blocks: its blocks wait on peers: at most 132"),
    ("op: ulysses_pre_a2a\nworld_sizes: [2]\nparams: {head_dim: 12}\n", "params.head_dim: Input should be a multiple of 8"),
    ("op: ulysses_post_a2a\nworld_sizes: [2]\ndtype: float32\n", "dtype: Input should be 'bfloat16' or 'float16'"),
    ("op: ulysses_post_a2a\nworld_sizes: [2]\nparams: {packed_qkv: true}\n", "params.packed_qkv: unknown key"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_spec_errors_name_the_field(tmp_path, text, message):
    problems = spec_problems(tmp_path, "name: u\n" + text)
    assert any(message in p for p in problems), problems


def test_shipped_gqa_spec_replicates_kv_heads():
    spec = load_spec(ROOT / "specs" / "ulysses_pre_a2a_gqa.yaml").model
    assert spec.params.packed_qkv and spec.params.kv_heads < max(spec.world_sizes)
    assert [kv_heads_per_rank(2, w) for w in (2, 4, 8)] == [1, 1, 1]
    assert [kv_head_base(2, 8, r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [kv_head_base(8, 4, r) for r in range(4)] == [0, 2, 4, 6]


# ---------------------------------------------------------------------------
# reference against loops
# ---------------------------------------------------------------------------


def _pre_loops(spec, world, count, inputs):
    """Element by element: rank r's token t, input head h, dim e -> (rank j, output, index)."""
    p = spec.params
    kv = (p.kv_heads or p.heads) if p.packed_qkv else 0
    in_heads = p.heads + 2 * kv
    seq = world * count
    names = [("q", 0, p.heads), ("k", p.heads, kv), ("v", p.heads + kv, kv)] if p.packed_qkv else [("dst", 0, p.heads)]
    out = {}
    for name, offset, heads in names:
        hl = max(1, heads // world) if name in ("k", "v") else heads // world
        out[name] = [np.zeros(p.batch * seq * hl * p.head_dim, dtype=inputs["qkv" if p.packed_qkv else "src"][0].dtype)
                     for _ in range(world)]
    src = inputs["qkv" if p.packed_qkv else "src"]
    for r, b, t, h, e in itertools.product(range(world), range(p.batch), range(count), range(in_heads),
                                           range(p.head_dim)):
        value = src[r][((b * count + t) * in_heads + h) * p.head_dim + e]
        for name, offset, heads in names:
            if not offset <= h < offset + heads:
                continue
            g = h - offset  # head within this tensor
            for j in range(world):
                if name in ("k", "v"):
                    hl = max(1, heads // world)
                    h0 = j * heads // world
                else:
                    hl = heads // world
                    h0 = j * hl
                if not h0 <= g < h0 + hl:
                    continue
                s = r * count + t
                if p.layout == "bshd":
                    i = ((b * seq + s) * hl + (g - h0)) * p.head_dim + e
                else:
                    i = ((b * hl + (g - h0)) * seq + s) * p.head_dim + e
                out[name][j][i] = value
    return out


@pytest.mark.parametrize("world,params", [
    (2, dict(batch=2, heads=4, head_dim=8, layout="bshd")),
    (3, dict(batch=1, heads=3, head_dim=16, layout="bhsd")),
    (4, dict(batch=2, heads=8, head_dim=8, layout="bhsd")),
    (2, dict(batch=1, heads=4, head_dim=8, packed_qkv=True, kv_heads=2, layout="bshd")),  # KV split
    (4, dict(batch=2, heads=8, head_dim=8, packed_qkv=True, kv_heads=2, layout="bshd")),  # KV replicated
    (8, dict(batch=1, heads=8, head_dim=8, packed_qkv=True, kv_heads=1, layout="bhsd")),  # MQA: one KV head
    (2, dict(batch=1, heads=2, head_dim=8, packed_qkv=True, layout="bhsd")),  # [3, heads] packing
])
def test_pre_reference_equals_loops(world, params):
    spec = _spec("pre", world, **params)
    count = 3
    inputs = _inputs(PRE, spec, world, count)
    want = _pre_loops(spec, world, count, inputs)
    got = PRE.reference(spec, world, count, inputs)
    assert set(got) == set(want)
    for name in want:
        for j in range(world):
            np.testing.assert_array_equal(got[name][j].view(np.uint16), want[name][j].view(np.uint16))
    # every output buffer is exactly as large as what the reference puts in it
    sizes = {b.name: b.elems(count, world) for b in PRE.buffers(spec)}
    assert all(got[n][j].size == sizes[n] for n in got for j in range(world))


@pytest.mark.parametrize("world,layout", [(2, "bshd"), (3, "bhsd"), (4, "bshd"), (8, "bhsd")])
def test_post_reference_equals_loops_and_undoes_pre(world, layout):
    spec = _spec("post", world, batch=2, heads=8 if world != 3 else 6, head_dim=8, layout=layout)
    p, count = spec.params, 3
    seq, hl = world * count, p.heads // world
    inputs = _inputs(POST, spec, world, count, seed=1)
    got = POST.reference(spec, world, count, inputs)["dst"]
    for r in range(world):
        want = np.zeros_like(got[r])
        for b, t, h, e in itertools.product(range(p.batch), range(count), range(p.heads), range(p.head_dim)):
            j, s = h // hl, r * count + t
            i = ((b * seq + s) * hl + h % hl) * p.head_dim + e if layout == "bshd" else \
                ((b * hl + h % hl) * seq + s) * p.head_dim + e
            want[((b * count + t) * p.heads + h) * p.head_dim + e] = inputs["src"][j][i]
        np.testing.assert_array_equal(got[r].view(np.uint16), want.view(np.uint16))
    pre = _spec("pre", world, batch=2, heads=p.heads, head_dim=8, layout=layout)
    x = _inputs(PRE, pre, world, count, seed=2)
    back = POST.reference(spec, world, count, {"src": PRE.reference(pre, world, count, x)["dst"]})["dst"]
    for r in range(world):
        np.testing.assert_array_equal(back[r].view(np.uint16), x["src"][r].view(np.uint16))


def test_inputs_are_bits_and_the_first_call_a_pattern():
    spec = _spec("pre", 2, batch=1, heads=2, head_dim=8)
    rng = np.random.default_rng(0)
    pattern = PRE.make_inputs(spec, 2, 5, rng, pattern=True)["src"]
    assert not np.array_equal(pattern[0], pattern[1])  # the rank is in the pattern
    fp16 = spec_variant_model(spec, dtype="float16")
    x = PRE.make_inputs(fp16, 2, 1000, rng, pattern=False)["src"][0]
    assert x.dtype == np.float16 and len(np.unique(x.view(np.uint16))) > 900  # distinct bits, NaN payloads too


def spec_variant_model(spec, **fields):
    return type(spec).model_validate(spec.model_dump() | fields)


# ---------------------------------------------------------------------------
# sizes and the bench conventions
# ---------------------------------------------------------------------------


def test_sequence_length_must_split_over_the_world():
    assert tokens_per_rank(4096, 8) == 512
    with pytest.raises(RuntimeSetupError, match="sequence length 1001 does not split over 4 ranks"):
        tokens_per_rank(1001, 4)
    spec = load_spec(ROOT / "specs" / "ulysses_post_a2a.yaml").model
    with pytest.raises(RuntimeSetupError, match="does not split over 3 ranks"):
        POST.bench.case(POST, spec, 3, 4096)


def test_bench_case_bytes_against_the_minimum():
    spec = load_spec(ROOT / "specs" / "ulysses_pre_a2a.yaml").model  # batch 2, 24 heads of 128, bf16
    case = PRE.bench.case(PRE, spec, 4, 4096)
    per_rank = 2 * 1024 * 24 * 128 * 2  # the input (= the output) of one rank, bytes
    fields = dict(case.fields)
    assert case.count == 1024 and case.bw_bytes == per_rank and case.link_bytes == per_rank * 3 // 4
    assert case.hbm_bytes == 2 * per_rank  # every byte read once and written once
    assert fields["read_B"] == fields["min_read_B"] == per_rank and fields["moved_vs_min"] == 1.0
    gqa = load_spec(ROOT / "specs" / "ulysses_pre_a2a_gqa.yaml").model  # 16 q + 2 x 2 KV heads
    f2, f8 = (dict(PRE.bench.case(PRE, gqa, w, 8192).fields) for w in (2, 8))
    assert f2["moved_vs_min"] == 1.0  # two KV heads over two ranks: nothing replicated
    row = 8192 // 8 * 128 * 2
    assert f8["min_read_B"] == 20 * row and f8["read_B"] == 8 * (2 + 2) * row  # a KV head read per receiver
    assert f8["moved_vs_min"] > 1.0
    post = load_spec(ROOT / "specs" / "ulysses_post_a2a.yaml").model
    assert dict(POST.bench.case(POST, post, 8, 8192).fields)["moved_vs_min"] == 1.0


def test_bench_rows_carry_the_bytes_moved(monkeypatch):
    from bench_fakes import install
    from test_bench_wing_cpu import FAST, fake_multiprocess

    from tsgen.bench.runner import bench_spec

    install(monkeypatch)
    fake_multiprocess(monkeypatch)
    out = bench_spec(ROOT / "specs" / "ulysses_post_a2a.yaml", 2, "256,1K", echo=lambda s: None,
                     variant={"params": {"batch": 1, "heads": 2, "head_dim": 8}, "world_sizes": [2]}, **FAST)
    assert out.errors == []
    rows = [r for r in out.rows if r["impl"] == "tsgen"]
    assert [r["size"] for r in rows] == [256, 1024] and all(r["moved_vs_min"] == 1.0 for r in rows)
    assert rows[0]["count"] == 128 and rows[0]["read_B"] == 128 * 2 * 8 * 2
    assert all("read_B" not in r for r in out.rows if r.get("baseline"))


def test_baseline_is_skipped_with_a_reason_without_torch(monkeypatch):
    import importlib.util

    from tsgen.bench.baselines import torch_a2a

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    spec = load_spec(ROOT / "specs" / "ulysses_pre_a2a.yaml").model
    rows = torch_a2a(["torch_a2a"], PRE, spec, 2, [4096], 3, 2, 1)
    assert rows[0].timing is None and "PyTorch is not installed" in rows[0].skipped


# ---------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------


def test_negative_control_renders_without_the_arrival_wait():
    loaded = load_spec(ROOT / "specs" / "ulysses_pre_a2a.yaml")
    from tsgen.render import render

    good = render(loaded, base=ROOT).source
    bad = render(spec_variant(loaded, {"params": {"arrival_wait": False}}), base=ROOT).source
    assert "epoch, slot == 0 && part == 0);" in good and "NEGATIVE CONTROL" not in good.split("namespace")[0]
    assert "epoch, false);" in bad and "NEGATIVE CONTROL: no arrival wait" in bad


# ---------------------------------------------------------------------------
# compiled (nvcc, no GPU)
# ---------------------------------------------------------------------------

NO_NVCC = missing_tool(find_nvcc)


@compile_test(NO_NVCC and f"nvcc not found: {NO_NVCC}")
def test_seq_entry_point_refuses_a_length_the_world_does_not_divide(capfd):
    """`<kernel>_launch_seq` checks S before touching CUDA: callable on a machine without a GPU."""
    lib = ctypes.CDLL(str(compile_source(ROOT / "generated" / "ulysses_post_a2a.cu", mode="shared").output))
    fn = lib.ulysses_post_a2a_w4_launch_seq
    fn.restype = ctypes.c_int
    args = [None, ctypes.c_int(0), None, ctypes.c_uint64(4 * 1001 + 2)] + [None] * 4 + [None]
    assert fn(*args) == 1  # cudaErrorInvalidValue
    assert "ulysses_post_a2a_w4: sequence length 4006 does not split over 4 ranks" in capfd.readouterr().err


@compile_test(NO_NVCC and f"nvcc not found: {NO_NVCC}")
@pytest.mark.parametrize("variant", [
    {"dtype": "float16", "params": {"layout": "bhsd"}},
    {"params": {"arrival_wait": False}},
    {"params": {"head_dim": 64, "heads": 8}, "world_sizes": [2, 4, 8], "launch": {"unroll": 8}},
], ids=["fp16-bhsd", "negative-control", "hd64-unroll8"])
def test_variants_compile_without_spills(tmp_path, variant):
    loaded = spec_variant(load_spec(ROOT / "specs" / "ulysses_pre_a2a.yaml"), variant)
    res = compile_source(rendered_source(loaded, tmp_path))
    kernels = [k for k in res.report if k.startswith("ulysses_pre_a2a_w")]
    assert kernels
    for k in kernels:
        assert res.report[k]["spill_stores"] == 0 and res.report[k]["spill_loads"] == 0, res.report[k]
