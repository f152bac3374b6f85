"""The `attention_backward` op on the CPU: spec errors, rendering and the manifest, the family's
inputs / reference / tolerance (what `tsgen test` and the GPU sweep check the kernel against),
and the sm_90a build of its three kernels (no spills). Needs nvcc for the build checks, no GPU;
the kernel itself is checked on a GPU by tests/test_gpu.py's one-GPU sweep (the shipped specs
through the harness) and tools/gpu_attention_bwd.sh."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conftest import ROOT, compile_test, host_program, load_script, missing_tool, rendered_source, spec_problems
from sass_checks import sass_function, sass_names
from tsgen.ops import get_family
from tsgen.ops.attention import (attention_backward_reference, attention_reference, from_bshd, o_tolerance,
                                 to_bshd)
from tsgen.ops.attention_backward import flops, smem_bytes
from tsgen.ops.collectives import from_f64, to_f64
from tsgen.render import render
from tsgen.shipped import shipped_specs
from tsgen.spec import load_spec, merge, spec_variant
from tsgen.toolchain import compile_module, compile_source, dump_sass, find_cuobjdump, find_nvcc

SPEC = ROOT / "specs" / "attention_backward_hd128.yaml"
SHIPPED = [p.stem for p in shipped_specs(op="attention_backward")]
BWD = "name: a\nop: attention_backward\nworld_sizes: [1]\n"
NO_NVCC = missing_tool(find_nvcc)
needs_nvcc = compile_test(NO_NVCC and f"nvcc not found: {NO_NVCC}")
NO_SASS = NO_NVCC or missing_tool(find_cuobjdump)
needs_sass = compile_test(NO_SASS and f"SASS checks need nvcc and cuobjdump: {NO_SASS}")


def variant(name, **changes):
    """SPEC in the default product order (it ships params.dk_after_dq, which mma_sync and deterministic refuse)."""
    return spec_variant(load_spec(SPEC), merge({"params": {"dk_after_dq": False}}, {**changes, "name": name}))


# the first main kernel (tsgen/attention_bwd.cuh), no longer the shipped specs' (they run wgmma)
MMA_SYNC = {"params": {"impl": "mma_sync"}, "launch": {"threads": 128}}


BAD = [
    ("kv_heads_divide", BWD + "params:\n  heads: 32\n  kv_heads: 5\n",
     ["7:3: params.kv_heads: 5 KV heads do not divide 32 query heads"]),
    ("kv_heads_more", BWD + "params:\n  kv_heads: 64\n",
     ["6:3: params.kv_heads: 64 KV heads do not divide 32 query heads"]),
    ("head_dim_96", BWD + "params:\n  head_dim: 96\n", ["6:3: params.head_dim: Input should be 64 or 128"]),
    ("dtype", BWD + "dtype: float32\n", ["5:1: dtype: Input should be 'bfloat16' or 'float16'"]),
    ("world_size", "name: a\nop: attention_backward\nworld_sizes: [2]\n", ["4:15: world_sizes[0]: Input should be 1"]),
    ("forward_tiles", BWD + "params:\n  stages: 2\n", ["6:3: params.stages: unknown key"]),
    ("threads", BWD + "launch:\n  threads: 384\n",
     ["6:3: launch.threads: params.impl mma_sync runs 128 threads per CTA, not 384: set launch.threads: 128"]),
    ("threads_wgmma", BWD + "params:\n  impl: wgmma\n",
     ["2:1: launch.threads: params.impl wgmma runs 384 threads per CTA, not 128: set launch.threads: 384"]),
    ("impl", BWD + "params:\n  impl: hgmma\n", ["6:3: params.impl: Input should be 'mma_sync' or 'wgmma'"]),
    ("scale", BWD + "params:\n  softmax_scale: 0\n", ["6:3: params.softmax_scale: Input should be greater than 0"]),
]


@pytest.mark.parametrize("text,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec(tmp_path, text, expected):
    assert spec_problems(tmp_path, text) == expected


def test_shipped_specs_and_sizes():
    assert sorted(SHIPPED) == ["attention_backward_hd128", "attention_backward_hd64_causal_gqa"]
    for name in SHIPPED:
        spec = load_spec(ROOT / "specs" / f"{name}.yaml").model
        assert spec.test.count % 64 != 0, f"{name}: the harness's count must leave a tail of query and key rows"
    gqa = load_spec(ROOT / "specs" / "attention_backward_hd64_causal_gqa.yaml").model.params
    assert gqa.causal and gqa.heads // gqa.kv_heads == 4 and gqa.head_dim == 64
    # K, V, Q, dO tiles of 64 rows x (128 + 8) elements, dS^T 64 x 72, LSE2 and D of 64 rows
    assert smem_bytes(variant("v", **MMA_SYNC).model) == 2 * (4 * 64 * 136 + 64 * 72) + 512 == 79360
    assert flops(1, 4096, 4096, 32, 128, False) == 2.5 * 4 * 4096 * 4096 * 32 * 128
    assert flops(1, 4096, 4096, 32, 128, True) == flops(1, 4096, 4096, 32, 128, False) / 2


def test_render_and_manifest():
    loaded = load_spec(SPEC)
    assert get_family("attention_backward").launched_from_host(loaded.model)
    r = render(loaded, base=ROOT)
    for name in SHIPPED:
        rr = render(load_spec(ROOT / "specs" / f"{name}.yaml"), base=ROOT)
        assert rr.files() == {n: (ROOT / "generated" / n).read_text() for n in rr.files()}, "generated/ is stale"
    m = json.loads(r.manifest)
    assert m["host_launch"] and m["world_sizes"] == [1] and m["count_unit"] == "rows"
    per, lse = 32 * 128, 32
    assert [(b["name"], b["dtype"], b["role"], b["elems"]["per_count"]) for b in m["buffers"]] == [
        ("calls", "uint64", "signal", 0), ("q", "bfloat16", "input", per), ("k", "bfloat16", "input", per),
        ("v", "bfloat16", "input", per), ("o", "bfloat16", "input", per), ("dout", "bfloat16", "input", per),
        ("lse", "float32", "input", lse), ("dq", "bfloat16", "output", per), ("dk", "bfloat16", "output", per),
        ("dv", "bfloat16", "output", per), ("dq_accum", "float32", "scratch", per),
        ("dsum", "float32", "scratch", lse), ("lse2", "float32", "scratch", lse)]
    (k,) = m["kernels"]
    assert k["shared_bytes"] == m["constants"]["SMEM_BYTES"] == smem_bytes(loaded.model)
    assert k["block"] == [384, 1, 1]  # impl wgmma: a producer warpgroup and two consumers
    for entry in ("_w1_preprocess(", "_w1_main(", "_w1_convert(", "_w1_backward(const void* q"):
        assert f"attention_backward_hd128{entry}" in r.source, entry
    assert "#include \"tsgen/attention_bwd_wgmma.cuh\"" in r.source
    assert "static constexpr bool BF16 = true;" in r.source
    assert f"SCALE = {1 / math.sqrt(128)!r}f" in r.source
    assert f"SCALE_LOG2 = {1 / math.sqrt(128) * math.log2(math.e)!r}f" in r.source
    f16 = render(variant("b16", dtype="float16", params={"head_dim": 64, "layout": "bhsd"}), base=ROOT).source
    assert "using Element = __half;" in f16 and "static constexpr bool BF16 = false;" in f16


# ---------------------------------------------------------------------------
# What the harness checks the kernel against
# ---------------------------------------------------------------------------


def tiny(layout="bshd", causal=True):
    return variant("tiny", params={"heads": 4, "kv_heads": 2, "head_dim": 64, "causal": causal, "batch": 2,
                                   "layout": layout}).model


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_inputs_are_the_forwards_and_the_reference_is_the_backwards(layout):
    spec, count = tiny(layout), 7
    family = get_family("attention_backward")
    inputs = family.make_inputs(spec, 1, count, np.random.default_rng(3), pattern=False)
    assert sorted(inputs) == ["dout", "k", "lse", "o", "q", "v"]

    def shaped(name, heads):
        return to_bshd(to_f64(inputs[name][0], "bfloat16"), 2, count, heads, 64, layout)

    q, o, do = (shaped(n, 4) for n in ("q", "o", "dout"))
    k, v = shaped("k", 2), shaped("v", 2)
    want_o, want_lse = attention_reference(q, k, v, 1 / 8, True)
    np.testing.assert_allclose(o, want_o, rtol=2**-8, atol=1e-6)  # O rounded to bf16, as the forward writes it
    np.testing.assert_allclose(inputs["lse"][0], want_lse.reshape(-1), rtol=1e-6)
    ref = family.reference(spec, 1, count, inputs)
    grads = attention_backward_reference(q, k, v, o, do, inputs["lse"][0].reshape(2, 4, count), 1 / 8, True)
    for name, g in zip(("dq", "dk", "dv"), grads):
        np.testing.assert_allclose(to_f64(ref[name][0], "bfloat16"), from_bshd(g, layout).reshape(-1),
                                   rtol=2**-8, atol=1e-6, err_msg=name)


def test_tolerance_catches_missing_gradients():
    """The per-element bounds the harness applies: the reference passes them; all-zero gradients,
    dK / dV of one query head of the group only (the GQA sum missing) and dQ without the scale
    fail in most elements."""
    spec, count = tiny(causal=False), 9
    family = get_family("attention_backward")
    inputs = family.make_inputs(spec, 1, count, np.random.default_rng(5), pattern=False)
    ref = {n: to_f64(x[0], "bfloat16") for n, x in family.reference(spec, 1, count, inputs).items()}
    tol = {n: t[0] for n, t in family.tolerance(spec, 1, count, inputs).items()}

    def failing(name, got):
        return np.mean(np.abs(got - ref[name]) > tol[name])

    for name in ("dq", "dk", "dv"):
        assert failing(name, ref[name]) == 0
        assert failing(name, np.zeros_like(ref[name])) > 0.9, name
    assert failing("dq", ref["dq"] * 8) > 0.9  # 1 / scale: the scale folded in twice or not at all
    # GQA: the gradient of query head 0 alone for KV head 0 (heads 0 and 1 share it)
    q = to_bshd(to_f64(inputs["q"][0], "bfloat16"), 2, count, 4, 64, "bshd")
    k = to_bshd(to_f64(inputs["k"][0], "bfloat16"), 2, count, 2, 64, "bshd")
    v = to_bshd(to_f64(inputs["v"][0], "bfloat16"), 2, count, 2, 64, "bshd")
    o = to_bshd(to_f64(inputs["o"][0], "bfloat16"), 2, count, 4, 64, "bshd")
    do = to_bshd(to_f64(inputs["dout"][0], "bfloat16"), 2, count, 4, 64, "bshd")
    lse = inputs["lse"][0].reshape(2, 4, count).astype(np.float64)
    keep = np.array([1.0, 0.0, 1.0, 0.0])[None, None, :, None]  # every group's second head dropped
    _, dk, dv = attention_backward_reference(q, k, v, o, do * keep, lse, 1 / 8, False)
    assert failing("dk", dk.reshape(-1)) > 0.5 and failing("dv", dv.reshape(-1)) > 0.5


# ---------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------


@needs_nvcc
@pytest.mark.parametrize("name", SHIPPED)
def test_compiles_without_spills(name):
    """As the runtime loads it (the launchers' shared library): the three kernels, no local memory."""
    res = compile_module(ROOT / "generated" / f"{name}.cu")
    for kernel in ("preprocess", "main", "convert"):
        entry = res.report[f"{name}_w1_{kernel}"]
        assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, (kernel, entry)


@needs_sass
def test_sass_of_the_main_kernel(tmp_path, monkeypatch):
    """The mma_sync main kernel (the shipped specs run wgmma: tests/test_attention_backward_wgmma_cpu.py):
    bf16 HMMA m16n8k16, ldmatrix plain and transposed, dQ added with fp32 reductions (no value
    returned: RED, not ATOM), no local memory, no calls."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = variant("v", **MMA_SYNC)
    sass = dump_sass(compile_source(rendered_source(spec, tmp_path)).output)
    names = sass_names(sass_function(sass, "v_w1_main"))
    assert "HMMA.16816.F32.BF16" in names and "LDSM.16.M88.4" in names and "LDSM.16.MT88.4" in names
    assert "REDG.E.ADD.F32.FTZ.RN.STRONG.GPU" in names and not [n for n in names if n.startswith("ATOM")]
    assert not [n for n in names if n.startswith(("LDL", "STL", "CALL"))], "no local memory, no calls"


@needs_nvcc
@pytest.mark.parametrize("changes", [
    {"dtype": "float16", "params": {"causal": True}},
    {"params": {"layout": "bhsd", "kv_heads": 4, "head_dim": 64}},
], ids=["f16_causal", "bhsd_gqa8_hd64"])
def test_variants_compile(tmp_path, changes, monkeypatch):
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    res = compile_source(rendered_source(variant("v", **changes), tmp_path))
    entry = res.report["v_w1_main"]
    assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, entry


# ---------------------------------------------------------------------------
# tools/gpu_attention_bwd.py (the GPU script the lead runs)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool():
    return load_script(ROOT / "tools" / "gpu_attention_bwd.py")


def test_gpu_tool_op_refuses_a_workspace_made_for_another_variant(tool):
    """The entry takes bare pointers: a deterministic variant handed the plain variant's workspace
    (no room for the dQ semaphores) would write past dq_accum's end; the Op refuses it by name."""
    from tsgen.ops.attention_backward import workspace_floats

    class Floats:  # a stand-in tensor: only its address and size are read before the refusal
        def __init__(self, n):
            self.n = n

        def data_ptr(self):
            return id(self)

        def numel(self):
            return self.n

    op = object.__new__(tool.Op)
    op.manifest = {"name": "attbwd_det"}
    op.heads, op.head_dim, op.deterministic, op.tail_items = 32, 128, True, 0
    plain = [Floats(n) for n in workspace_floats(4, 4096, 32, 128, False)]
    with pytest.raises(ValueError, match=r"attbwd_det_backward: workspace of .* needs"):
        op({}, plain, 4, 4096, 4096, None)
    assert workspace_floats(4, 4096, 32, 128, True)[0] > plain[0].numel()
    # params.tail_split: the tail slots after dq_accum (64 slots at hd 128: 2 097 152 floats more)
    op.manifest, op.deterministic, op.tail_items = {"name": "attbwd_tail"}, False, 64
    with pytest.raises(ValueError, match=r"attbwd_tail_backward: workspace of .* needs"):
        op({}, plain, 4, 4096, 4096, None)
    assert workspace_floats(4, 4096, 32, 128, False, 64)[0] == plain[0].numel() + 64 * 256 * 128


def test_gpu_tool_variants_are_valid_specs(tool):
    from tsgen.spec import merge

    for name, changes in tool.VARIANTS.items():
        spec_variant(load_spec(SPEC), merge(changes, {"name": f"attbwd_{name}"}))  # raises SpecError if invalid
    assert set(tool.CHECK_VARIANTS) | set(tool.BENCH_VARIANTS) <= set(tool.VARIANTS)
    forward = load_script(ROOT / "tools" / "gpu_attention.py")
    for name, fwd in tool.CHAINED.items():  # the chained forward computes the same shape
        assert name in tool.CHECK_VARIANTS
        mine = spec_variant(load_spec(SPEC), merge(tool.VARIANTS[name], {"name": "b"})).model
        theirs = forward.variant_spec(fwd).model
        for field in ("head_dim", "heads", "kv_heads", "causal", "layout", "softmax_scale", "batch"):
            assert getattr(mine.params, field) == getattr(theirs.params, field), (name, field)
        assert mine.dtype == theirs.dtype


def test_gpu_tool_report(tool):
    case = {"case": {"batch": 2, "q_len": 1000, "kv_len": 1000}, "calls": 20, "pass": False,
            "dq": {"wrong": 3, "of": 100, "rel_err": 2e-3}, "dk": {"wrong": 0, "of": 50, "rel_err": 1e-3},
            "dv": {"wrong": 0, "of": 50, "rel_err": 1e-3}}
    summary = {"device": "NVIDIA H200", "date": "2026-11-27", "command": "python tools/gpu_attention_bwd.py out",
               "checks": {"a": {"pass": False, "cases": [case]}, "b": {"pass": False, "error": "timed out after 120 s"}},
               "bench": {"rows": [{"variant": "v", "seq": 4096, "batch": 4, "tsgen": {"tflops": 200.0},
                                   "sdpa_cudnn": {"tflops": 500.0, "ratio": 2.5}}]}}
    text = tool.markdown(summary)
    assert "| a | b2 q1000 kv1000 | 20 | 3 / 100 | 0 / 50 | 0 / 50 | 2.0e-03 / 1.0e-03 / 1.0e-03 | NO |" in text
    assert "| b | timed out after 120 s |" in text
    assert "| v | 4096 | 200 | - | - | 500 | 2.50 |" in text
    # cuDNN through cudnn-frontend (the bench's cudnn_fe column) beside SDPA's, where a row has it
    summary["bench"]["rows"][0]["cudnn_fe"] = {"tflops": 550.0, "ratio": 2.75}
    text = tool.markdown(summary)
    assert "| SDPA cuDNN | ratio | cuDNN frontend | ratio |" in text and "| v | 4096 | 200 | - | - | 500 | 2.50 | 550 | 2.75 |" in text


def test_gpu_tool_cudnn_frontend_column_says_why_it_is_missing(tool, monkeypatch):
    """Without cudnn-frontend (or where it refuses the shape) the column is a note, not a failure."""
    import builtins

    real = builtins.__import__

    def no_cudnn(name, *a, **kw):
        if name == "cudnn":
            raise ImportError("No module named 'cudnn'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_cudnn)
    fn, why = tool.cudnn_fe_backward(None, {}, True, None)
    assert fn is None and why.startswith("cudnn-frontend does not import: ImportError")


def test_gpu_tool_reference_is_the_familys(tool):
    """The GPU script's float32 torch reference (run here on the CPU) against the float64 NumPy
    one: causal with a query offset (q_len < kv_len, bottom-right aligned) and GQA 4:2."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    q, do = rng.standard_normal((2, 2, 5, 4, 16))
    k, v = rng.standard_normal((2, 2, 9, 2, 16))
    scale, offset = 0.3, 4
    as_t = [torch.tensor(x, dtype=torch.float32) for x in (q, k, v, do)]
    o, lse, grads = tool.reference(torch, *as_t, scale, True, q_offset=offset)
    qpos = offset + np.arange(5)
    want_o, want_lse = attention_reference(q, k, v, scale, True, q_pos=qpos)
    np.testing.assert_allclose(o.numpy(), want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-5)
    got = grads(o)
    want = attention_backward_reference(q, k, v, o.numpy().astype(np.float64), do, lse.numpy().astype(np.float64),
                                        scale, True, q_pos=qpos, with_abs=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-4, atol=1e-5)
    # two query segments (a zig-zag rank's): rows 0-1 at positions 0, 1, rows 2-4 at 6, 7, 8
    o, lse, _ = tool.reference(torch, *as_t, scale, True, q_offset=0, q_split=2, q_offset2=6)
    want_o, want_lse = attention_reference(q, k, v, scale, True, q_pos=np.array([0, 1, 6, 7, 8]))
    np.testing.assert_allclose(o.numpy(), want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-5)


class FakeOp:
    """The GPU script's Op, on the CPU: the gradients from its own reference, the fp32 workspace
    ws[0] (dq_accum) filled with a constant (`wrong`: dK / dV of the first query head of each group
    only, nothing written to dQ, (flaky) dQ's last bit flipped on every other call, a run-to-run
    difference within the tolerance, or (flaky_accum) one fp32 dq_accum word that differs from call
    to call, the outputs unchanged: an order difference the 16-bit rounding hid)."""

    def __init__(self, tool, torch, layout="bshd", causal=True, dtype="bfloat16", wrong=None, deterministic=False,
                 dq_tiled=False):
        self.tool, self.torch, self.wrong = tool, torch, wrong
        self.head_dim, self.heads, self.kv_heads, self.causal = 16, 4, 2, causal
        self.bhsd, self.dtype, self.scale = layout == "bhsd", dtype, 0.25
        self.deterministic, self.dq_tiled, self.calls = deterministic, dq_tiled or deterministic, 0

    def workspace(self, torch, batch, q_len, device="cuda"):  # dq_accum, dsum, lse2 (the real Op's three)
        rows = batch * q_len * self.heads
        return tuple(torch.empty(n, device=device) for n in (rows * self.head_dim, rows, rows))

    def __call__(self, t, ws, batch, q_len, kv_len, stream, q_offset=0, kv_offset=0, q_split=None, q_offset2=0):
        torch, tool = self.torch, self.tool
        q, k, v, do = (tool.to_bshd(t[n], self.bhsd).float() for n in ("q", "k", "v", "do"))
        if self.wrong == "gqa":
            do = do * torch.tensor([1.0, 0.0] * (self.heads // 2))[None, None, :, None]
        _, lse, grads = tool.reference(torch, q, k, v, do, self.scale, self.causal, q_offset=q_offset,
                                       q_split=q_split, q_offset2=q_offset2)
        for name, g in zip(("dq", "dk", "dv"), grads(tool.to_bshd(t["o"], self.bhsd).float())):
            if not (self.wrong == "no_dq" and name == "dq"):
                t[name].copy_(tool.to_bshd(g, self.bhsd))
        self.calls += 1
        self.offsets = [w.storage_offset() for w in ws]  # where each workspace buffer starts (ws_offset cases)
        ws[0].fill_(0.5)
        if self.wrong == "flaky_accum":
            ws[0][-1] = 0.5 + self.calls * 2.0 ** -20
        if self.wrong == "flaky" and self.calls % 2 == 0:
            bits = t["dq"].view(torch.int16)
            bits.copy_(bits ^ 1)


@pytest.mark.parametrize("layout,dtype", [("bshd", "bfloat16"), ("bhsd", "float16")])
def test_gpu_tool_case_passes_the_right_gradients_and_fails_wrong_ones(tool, layout, dtype):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    for case in ({"batch": 2, "q_len": 7, "kv_len": 7}, {"batch": 1, "q_len": 8, "kv_len": 6, "ws_offset": 1},
                 {"batch": 1, "q_len": 5, "kv_len": 11, "calls": 3}):
        op = FakeOp(tool, torch, layout, dtype=dtype)
        r = tool.run_case(torch, op, case, gen, device="cpu")
        assert r["pass"], r
        # ws_offset: D and LSE2 one float into their buffers (4 bytes past any 16-byte boundary), dq_accum not
        assert op.offsets == [0] + [case.get("ws_offset", 0)] * 2, (case, op.offsets)
    r = tool.run_case(torch, FakeOp(tool, torch, layout, dtype=dtype, wrong="gqa"), case, gen, device="cpu")
    assert not r["pass"] and r["dk"]["wrong"] > 0 and r["dv"]["wrong"] > 0 and r["dq"]["wrong"] > 0, r
    r = tool.run_case(torch, FakeOp(tool, torch, layout, dtype=dtype, wrong="no_dq"), case, gen, device="cpu")
    assert not r["pass"] and r["dq"]["wrong"] == r["dq"]["of"] and r["dq"]["nan"] == r["dq"]["of"], r


def test_gpu_tool_cases_take_both_lse_paths(tool):
    """Every variant's check cases include a q_len that is a multiple of 4 and one that is not: a producer that
    bulk-copies a step's LSE2 / D rows (16-byte runs) does so only in the first, and copies through its lanes in
    the second (results/attention_backward/2026-11-29-a59ef26-bulk-lse.patch); both paths get checked."""
    torch = pytest.importorskip("torch")
    for op in (FakeOp(tool, torch), FakeOp(tool, torch, dq_tiled=True), FakeOp(tool, torch, deterministic=True)):
        for quick in (True, False):
            cases = tool.cases_for(op, quick)
            lens = {c["q_len"] % 4 == 0 for c in cases}
            assert lens == {True, False}, (quick, lens)
            assert [c for c in cases if c.get("ws_offset") and c["q_len"] % 4 == 0], "an unaligned D / LSE2 case"


def test_gpu_tool_deterministic_cases_need_identical_bits(tool):
    """wgmma_det's cases (Op.deterministic, from the manifest's DETERMINISTIC): the same inputs run
    again pass only with bit-identical gradients and fp32 dq_accum (ws[0]); a last-bit difference of
    dQ (within the tolerance) fails, and so does a dq_accum word that differs while the outputs do not;
    the two-segment case (its split inside a query block) reaches the reference. wgmma's (Op.dq_tiled,
    not deterministic) one repeated case is information: it passes with differing bits and says so."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    op = FakeOp(tool, torch, deterministic=True)
    cases = [c for c in tool.cases_for(op, quick=True) if c.get("repeats", 1) > 1]
    assert cases and not [c for c in cases if c.get("info")]
    assert [c["q_split"] % 64 for c in cases if "q_split" in c] == [480 % 64], "the split inside a query block"
    assert not [c for c in tool.cases_for(FakeOp(tool, torch), True) if "repeats" in c], "mma_sync, wgmma_red: none"
    for quick in (True, False):
        info = [c for c in tool.cases_for(FakeOp(tool, torch, dq_tiled=True), quick) if "repeats" in c]
        assert len(info) == 1 and info[0]["info"] and info[0]["repeats"] > 1, info
    small = [{"batch": 1, "q_len": 6, "kv_len": 9, "repeats": 3},
             {"batch": 1, "q_len": 6, "kv_len": 12, "q_split": 3, "q_offset2": 9, "repeats": 3}]
    for case in small:
        r = tool.run_case(torch, op, case, gen, device="cpu")
        assert r["pass"] and r["bit_identical"] and r["dq_accum_identical"], r
        r = tool.run_case(torch, FakeOp(tool, torch, wrong="flaky", deterministic=True), case, gen, device="cpu")
        assert not r["pass"] and not r["bit_identical"] and r["dq"]["wrong"] == 0, r
        accum = tool.run_case(torch, FakeOp(tool, torch, wrong="flaky_accum", deterministic=True), case, gen,
                              device="cpu")
        assert not accum["pass"] and accum["bit_identical"] and not accum["dq_accum_identical"], accum
    text = tool.markdown({"device": "d", "date": "t", "command": "c", "checks": {"v_wgmma_det": {"cases": [r, accum]}}})
    assert "rows from 3 at 9, 3 runs: BITS DIFFER (outputs)" in text
    assert "rows from 3 at 9, 3 runs: BITS DIFFER (fp32 dq_accum)" in text
    # wgmma (no fixed order): the same repeated case, information only
    info = dict(small[0], info=True)
    r = tool.run_case(torch, FakeOp(tool, torch, wrong="flaky_accum", dq_tiled=True), info, gen, device="cpu")
    assert r["pass"] and not r["dq_accum_identical"], r
    same = tool.run_case(torch, FakeOp(tool, torch, dq_tiled=True), info, gen, device="cpu")
    assert same["pass"] and same["dq_accum_identical"], same
    text = tool.markdown({"device": "d", "date": "t", "command": "c", "checks": {"v_wgmma": {"cases": [r, same]}}})
    assert "3 runs (information): fp32 dq_accum differs, outputs identical | 1 |" in text
    assert "3 runs (information): fp32 dq_accum identical, outputs identical | 1 |" in text


# ---------------------------------------------------------------------------
# The main kernel's fragments, modelled lane by lane (no GPU here)
# ---------------------------------------------------------------------------
#
# ldmatrix and mma.sync.m16n8k16 as the PTX ISA defines them, on NumPy arrays; the four operand
# loads' address arithmetic is read from the header itself (so a wrong row or column offset
# there fails this test), and the main kernel's use of them (which fragment feeds which product,
# the C-to-A fragment reuse, the dS^T store, the element-wise indices) is the kernel's, written
# again here at warp level. One CTA: a block of 50 keys (a tail) against 100 queries (two query
# blocks, a tail) of the 2 query heads of one KV head, causal: the whole problem, so dQ, dK and
# dV are complete and checked against the family's reference and tolerance.

HEADER = ROOT / "templates" / "include" / "tsgen" / "attention_bwd.cuh"


def header_loads():
    """{load_a: (trans, (row, col) of a lane)} from the header's four operand loads."""
    import re

    text = HEADER.read_text()
    out = {}
    for m in re.finditer(r"void (load_\w+)\(uint32_t \(&\w\)\[4\], const uint16_t\* s, int pitch, int (\w+), "
                         r"int (\w+), int lane\) \{\n((?:  const int i = lane >> 3;\n)?)  ldmatrix_x4(_trans)?"
                         r"\(\w, s \+ \((.+)\) \* pitch \+ (.+)\);", text):
        name, p0, p1, pre, trans, row, col = m.groups()

        def at(lane, a, b, row=row, col=col, p0=p0, p1=p1, pre=pre):
            env = {"lane": lane, p0: a, p1: b}
            if pre:
                env["i"] = lane >> 3
            return eval(row, {}, env), eval(col, {}, env)  # C's + * & >> on small non-negative ints
        out[name] = (bool(trans), at)
    assert sorted(out) == ["load_a", "load_a_trans", "load_b_kn", "load_b_nk"], sorted(out)
    return out


def bf16(x):
    return to_f64(from_f64(x, "bfloat16"), "bfloat16")


def ldmatrix(mat, load, a, b):
    """Four 8x8 matrices; lanes 8i .. 8i + 7 address the rows of matrix i. -> regs [4][32][2]."""
    trans, at = load
    regs = np.zeros((4, 32, 2))
    for i in range(4):
        rows = [at(8 * i + r, a, b) for r in range(8)]
        m = np.stack([mat[r, c:c + 8] for r, c in rows])
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            regs[i, lane] = m[2 * t:2 * t + 2, g] if trans else m[g, 2 * t:2 * t + 2]
    return regs


def mma(d, a, b0, b1):
    """d [32][4] += A (16 x 16, fragments a[4][32][2]) . B (16 x 8, fragments b0, b1 [32][2])."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = a[0, lane], a[1, lane]
        A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = a[2, lane], a[3, lane]
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = b0[lane], b1[lane]
        C[g, 2 * t:2 * t + 2], C[g + 8, 2 * t:2 * t + 2] = d[lane, :2], d[lane, 2:]
    D = A @ B + C
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        d[lane] = np.concatenate([D[g, 2 * t:2 * t + 2], D[g + 8, 2 * t:2 * t + 2]])


def model_main_kernel(q, k, v, do, lse, dsum, scale, d):
    """The main kernel of one CTA (keys 0 .. 63 of one KV head; q, do [heads, rows, d], k, v [keys, d],
    causal, positions from 0) -> dQ [heads, rows, d] (before the conversion's scale), dK, dV."""
    def r16(x):  # rounded to bf16, as the kernel's A fragments
        return bf16(np.asarray(x, dtype=np.float64))

    L = header_loads()
    heads, rows, kv_len = q.shape[0], q.shape[1], k.shape[0]
    ks, vs = np.zeros((64, d)), np.zeros((64, d))
    ks[:kv_len], vs[:kv_len] = k, v
    nt = d // 8
    dk, dv = np.zeros((4, nt, 32, 4)), np.zeros((4, nt, 32, 4))
    dq = np.zeros((heads, rows + 64, d))
    lanes = np.arange(32)
    g, t = lanes >> 2, lanes & 3
    for h in range(heads):
        for r0 in range(0, rows, 64):
            qs, dos = np.zeros((64, d)), np.zeros((64, d))
            n = min(64, rows - r0)
            qs[:n], dos[:n] = q[h, r0:r0 + n], do[h, r0:r0 + n]
            lse2 = np.full(64, np.inf)
            lse2[:n] = lse[h, r0:r0 + n] * np.log2(np.e)
            ds_smem = np.zeros((64, 64 + 8))
            for w in range(4):
                s, dp = np.zeros((8, 32, 4)), np.zeros((8, 32, 4))
                for kk in range(0, d, 16):
                    ak, av = ldmatrix(ks, L["load_a"], w * 16, kk), ldmatrix(vs, L["load_a"], w * 16, kk)
                    for j in range(0, 8, 2):
                        bq, bd = ldmatrix(qs, L["load_b_nk"], j * 8, kk), ldmatrix(dos, L["load_b_nk"], j * 8, kk)
                        mma(s[j], ak, bq[0], bq[1]), mma(s[j + 1], ak, bq[2], bq[3])
                        mma(dp[j], av, bd[0], bd[1]), mma(dp[j + 1], av, bd[2], bd[3])
                for j in range(8):
                    for e in range(4):
                        key, row = w * 16 + g + (e >> 1) * 8, j * 8 + 2 * t + (e & 1)
                        seen = (key < kv_len) & (key <= r0 + row)
                        with np.errstate(over="ignore"):
                            p = np.where(seen, np.exp2(s[j, :, e] * scale * np.log2(np.e) - lse2[row]), 0.0)
                        dp[j, :, e] = p * (dp[j, :, e] - np.where(row < n, dsum[h, np.minimum(r0 + row, rows - 1)], 0))
                        s[j, :, e] = p
                for kq in range(4):
                    ap = r16(np.stack([s[2 * kq][:, :2], s[2 * kq][:, 2:], s[2 * kq + 1][:, :2], s[2 * kq + 1][:, 2:]]))
                    ad = r16(np.stack([dp[2 * kq][:, :2], dp[2 * kq][:, 2:], dp[2 * kq + 1][:, :2],
                                       dp[2 * kq + 1][:, 2:]]))
                    for lane in range(32):
                        lo, c = w * 16 + g[lane], kq * 16 + 2 * t[lane]
                        ds_smem[lo, c:c + 2], ds_smem[lo + 8, c:c + 2] = ad[0, lane], ad[1, lane]
                        ds_smem[lo, c + 8:c + 10], ds_smem[lo + 8, c + 8:c + 10] = ad[2, lane], ad[3, lane]
                    for j in range(0, nt, 2):
                        bd, bq = ldmatrix(dos, L["load_b_kn"], j * 8, kq * 16), ldmatrix(qs, L["load_b_kn"], j * 8, kq * 16)
                        mma(dv[w, j], ap, bd[0], bd[1]), mma(dv[w, j + 1], ap, bd[2], bd[3])
                        mma(dk[w, j], ad, bq[0], bq[1]), mma(dk[w, j + 1], ad, bq[2], bq[3])
            for w in range(4):  # after the CTA barrier: dQ rows 16 w .. 16 w + 15
                for c0 in range(0, d, 64):
                    acc = np.zeros((8, 32, 4))
                    for kk in range(0, 64, 16):
                        a = ldmatrix(ds_smem, L["load_a_trans"], w * 16, kk)
                        for j in range(0, 8, 2):
                            bk = ldmatrix(ks, L["load_b_kn"], c0 + j * 8, kk)
                            mma(acc[j], a, bk[0], bk[1]), mma(acc[j + 1], a, bk[2], bk[3])
                    for j in range(8):
                        for lane in range(32):
                            row, col = r0 + w * 16 + g[lane], c0 + j * 8 + 2 * t[lane]
                            dq[h, row, col:col + 2] += acc[j, lane, :2]
                            dq[h, row + 8, col:col + 2] += acc[j, lane, 2:]
    dk_out, dv_out = np.zeros((64, d)), np.zeros((64, d))
    for w in range(4):
        for j in range(nt):
            for lane in range(32):
                for half in range(2):
                    key, col = w * 16 + g[lane] + 8 * half, j * 8 + 2 * t[lane]
                    dk_out[key, col:col + 2] = dk[w, j, lane, 2 * half:2 * half + 2] * scale
                    dv_out[key, col:col + 2] = dv[w, j, lane, 2 * half:2 * half + 2]
    return dq[:, :rows], dk_out[:kv_len], dv_out[:kv_len]


def test_fragment_model_of_the_main_kernel():
    rng = np.random.default_rng(7)
    d, rows, kv_len, heads, scale = 64, 100, 50, 2, 0.125
    q, do = rng.standard_normal((2, 1, rows, heads, d))
    k, v = rng.standard_normal((2, 1, kv_len, 1, d))
    q, do, k, v = (bf16(x) for x in (q, do, k, v))
    o, lse = attention_reference(q, k, v, scale, True)
    o = bf16(o)
    lse = lse.astype(np.float32).astype(np.float64)
    dsum = np.einsum("bshd,bshd->bhs", do, o)[0]
    got = model_main_kernel(q[0].transpose(1, 0, 2), k[0, :, 0], v[0, :, 0], do[0].transpose(1, 0, 2), lse[0], dsum,
                            scale, d)
    want = attention_backward_reference(q, k, v, o, do, lse, scale, True, with_abs=True)
    gq = got[0].transpose(1, 0, 2)[None] * scale
    for name, g, w, a in (("dq", gq, want[0], want[3]), ("dk", got[1][None, :, None], want[1], want[4]),
                          ("dv", got[2][None, :, None], want[2], want[5])):
        bad = ~(np.abs(g - w) <= o_tolerance(w, a, "bfloat16"))  # a NaN is bad too
        assert not bad.any(), (name, int(bad.sum()), bad.size)



# ---------------------------------------------------------------------------
# The causal skip (the header's rows_see_keys, compiled as host code)
# ---------------------------------------------------------------------------

SKIP = r"""
#include "SOURCE"
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char** argv) {
  (void)argc;
  tsgen::attention_bwd::Problem p = {};
  p.q_len = atoi(argv[1]); p.kv_len = atoi(argv[2]);
  p.q_offset = atoi(argv[3]); p.q_split = atoi(argv[4]); p.q_offset2 = atoi(argv[5]); p.kv_offset = atoi(argv[6]);
  for (uint32_t k0 = 0; k0 < p.kv_len; k0 += tsgen::attention_bwd::BLOCK_N)
    for (uint32_t r0 = 0; r0 < p.q_len; r0 += tsgen::attention_bwd::BLOCK_M) {
      const uint32_t r1 = r0 + tsgen::attention_bwd::BLOCK_M < p.q_len ? r0 + tsgen::attention_bwd::BLOCK_M : p.q_len;
      printf("%u %u %d\n", k0, r0, (int)tsgen::attention_bwd::rows_see_keys(p, r0, r1, p.kv_offset + (int)k0));
    }
}
"""


@needs_nvcc
def test_causal_skip_visits_exactly_the_blocks_with_a_visible_key(tmp_path):
    """Every (KV block, query block) pair with a visible (query, key) pair is visited, and no
    other, for positions from 0, offsets, and the zig-zag's two segments (the forward's cases)."""
    import subprocess

    from tsgen.ops.attention import query_positions

    exe = host_program(variant("skip", params={"causal": True}), SKIP, tmp_path, "skip_main")
    problems = [(77, 77, 0, None, 0, 0), (1000, 1000, 0, None, 0, 0), (77, 1000, 923, None, 0, 0),
                (1000, 1000, 500, None, 0, 700), (600, 2400, 300, 300, 1800, 0), (1024, 2048, 0, 512, 1536, 0),
                (500, 4096, 768, 250, 3072, 0), (1000, 1000, 0, None, 0, 5000), (100, 100, 0, 70, 30, 0),
                (129, 129, 0, None, 0, 0), (65, 200, 63, None, 0, 0)]  # a block whose last row is the first key
    for sq, skv, qo, split, qo2, ko in problems:
        split = sq if split is None else split
        out = subprocess.run([str(exe), *map(str, (sq, skv, qo, split, qo2, ko))], capture_output=True, text=True,
                             check=True).stdout
        qp, kp = query_positions(sq, qo, split, qo2), ko + np.arange(skv)
        got = {(int(a), int(b)): bool(int(c)) for a, b, c in (line.split() for line in out.splitlines())}
        assert sorted(got) == [(k0, r0) for k0 in range(0, skv, 64) for r0 in range(0, sq, 64)]
        for (k0, r0), seen in got.items():
            vis = kp[None, k0:k0 + 64] <= qp[r0:r0 + 64, None]
            assert seen == bool(vis.any()), (sq, skv, qo, split, qo2, ko, k0, r0)


def test_gpu_tool_ncu_profiles_every_kernel_of_one_variants_warm_calls(tool, tmp_path, monkeypatch):
    """--ncu VARIANT[:SEQ]: ncu over every kernel (preprocess, main, dQ conversion) of the warm calls (the child
    `one` makes three calls of the bench's shape and starts the profiler after the first: --profile-from-start
    off, as for a baseline), the report kept in OUT; an unknown variant is refused by name."""
    import json
    import subprocess

    ran = []
    monkeypatch.setattr(tool, "build", lambda out, name, impl: {"name": name, "impl": impl})
    monkeypatch.setattr(tool.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(
        cmd, 0, "==PROF== Profiling main\nRESULT {\"pass\": true}\n", ""))
    monkeypatch.setattr(tool.sys, "argv", ["gpu_attention_bwd.py", str(tmp_path), "--impl", "wgmma",
                                           "--ncu", "hd128_causal_kv8:4096"])
    assert tool.main() == 0
    (cmd,) = ran
    assert cmd[0] == "ncu" and cmd[cmd.index("--profile-from-start") + 1] == "off" and "--kernel-name" not in cmd
    assert cmd[cmd.index("--clock-control") + 1] == "none"  # never lock the lent GPU's clocks
    assert "--launch-skip" not in cmd and cmd[cmd.index("--launch-count") + 1] == "16"
    child = cmd[cmd.index("--child"):]
    assert child[1] == "one" and json.loads(child[2]) == {"name": "hd128_causal_kv8", "impl": "wgmma"} and child[3] == "4096"
    assert "Profiling main" in (tmp_path / "ncu_hd128_causal_kv8_wgmma_s4096.txt").read_text()
    monkeypatch.setattr(tool.sys, "argv", ["gpu_attention_bwd.py", str(tmp_path), "--ncu", "nope"])
    with pytest.raises(SystemExit):
        tool.main()


def test_gpu_tool_kernel_times_summarizes_each_implementations_kernels(tool, tmp_path, monkeypatch):
    """--kernel-times VARIANT[:SEQ]: one child `kernels` given the variant's build, the shape and the baselines;
    its blocks of kernel records become, per implementation, the span a call (first kernel start to last end over
    a block's calls, median over blocks), the busy share (the GPU idle between kernels shows), and each kernel's
    count a call and median duration, in order of first appearance; the report is kept in OUT. A baseline that
    cannot run fails the command; a variant the impl does not build and a baseline not in the bench are refused."""
    result = {"pass": True, "seq": 8192, "batch": 2, "calls": 2, "blocks": {
        "tsgen": [[("pre", 0, 10), ("main", 12, 100), ("conv", 100, 110), ("pre", 110, 120), ("main", 120, 200),
                   ("conv", 200, 210)],
                  [("pre", 0, 10), ("main", 10, 90), ("conv", 90, 100), ("pre", 100, 110), ("main", 110, 190),
                   ("conv", 190, 200)]],
        "sdpa_cudnn": [[("a", 0, 50), ("b", 60, 100)], [("a", 0, 50), ("b", 50, 100)]]}}
    s = tool.summarize_kernels(result)
    assert s["tsgen"]["span_us"] == (105 + 100) / 2 and [k["name"] for k in s["tsgen"]["kernels"]] == ["pre", "main", "conv"]
    assert s["tsgen"]["spans_us"] == [105, 100] and "vs_first" not in s["tsgen"]
    # the baseline's span over tsgen's, round by round (the rounds interleave them): 50 / 105 and 50 / 100
    assert s["sdpa_cudnn"]["vs_first"] == {"median": pytest.approx((50 / 105 + 0.5) / 2), "min": pytest.approx(50 / 105),
                                           "max": 0.5}
    assert s["tsgen"]["kernels"][1] == {"name": "main", "per_call": 1.0, "median_us": 80.0}
    assert s["sdpa_cudnn"]["busy"] == pytest.approx((0.9 + 1.0) / 2)  # 10 us of 100 idle in the first block
    ran = []
    monkeypatch.setattr(tool, "build", lambda out, name, impl: {"name": name, "impl": impl})
    monkeypatch.setattr(tool, "child", lambda args, timeout: ran.append(args) or (result, ""))
    monkeypatch.setattr(tool.sys, "argv", ["gpu_attention_bwd.py", str(tmp_path), "--kernel-times",
                                           "hd128_full_kv32:8192"])
    assert tool.main() == 0
    (args,) = ran
    assert args[0] == "kernels" and args[2:] == ["8192", "sdpa_cudnn,cudnn_fe", "3"]
    text = (tmp_path / "kernels_hd128_full_kv32_s8192.md").read_text()
    assert "## tsgen: 102.5 us a call" in text and "| main | 1.00 | 80.0 |" in text
    assert "Spans a call, block by block (us): 105.0, 100.0." in text and "Its span over tsgen's in the same rounds: 0.488" in text
    assert "Command: `python tools/gpu_attention_bwd.py OUT --kernel-times hd128_full_kv32:8192`" in text
    saved = json.loads((tmp_path / "kernels_hd128_full_kv32_s8192.json").read_text())
    assert saved["raw"]["blocks"]["tsgen"][0][0] == ["pre", 0, 10] and saved["meta"]["commit"]
    assert saved["summary"]["sdpa_cudnn"]["spans_us"] == [50, 50]
    monkeypatch.setattr(tool, "child", lambda args, timeout: ({"pass": False, "why": "cudnn_fe: not installed"}, ""))
    assert tool.main() == 1
    for bad in (["--kernel-times", "nope"], ["--kernel-times", "hd128_full_kv32", "--kt-baselines", "nccl"],
                ["--impl", "wgmma_m128", "--kernel-times", "hd128_full_kv32"],
                ["--kernel-times", "hd128_full_kv32", "--kt-rounds", "0"]):
        monkeypatch.setattr(tool.sys, "argv", ["gpu_attention_bwd.py", str(tmp_path), *bad])
        with pytest.raises(SystemExit):
            tool.main()


def test_gpu_tool_ncu_profiles_a_baseline_at_the_same_shape(tool, tmp_path, monkeypatch):
    """--ncu VARIANT:SEQ --ncu-baseline sdpa_cudnn: ncu over that baseline's warm backward calls (the child
    starts the profiler after its first call and its check: --profile-from-start off), the child told which
    baseline to call on the variant's tensors, the report named after both; a child that could not run the
    baseline fails the command though ncu exits 0; --ncu-baseline alone is refused (it needs a shape), and so
    is a baseline not in the bench."""
    import json
    import subprocess

    ran, stdout = [], ["==PROF== Profiling bprop\nRESULT {\"pass\": true}\n"]
    monkeypatch.setattr(tool, "build", lambda out, name, impl: {"name": name, "impl": impl})
    monkeypatch.setattr(tool.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(
        cmd, 0, stdout[0], ""))
    argv = ["gpu_attention_bwd.py", str(tmp_path), "--impl", "wgmma", "--ncu", "hd128_full_kv32:8192",
            "--ncu-baseline", "sdpa_cudnn"]
    monkeypatch.setattr(tool.sys, "argv", argv)
    assert tool.main() == 0
    (cmd,) = ran
    assert cmd[0] == "ncu" and cmd[cmd.index("--profile-from-start") + 1] == "off" and "--kernel-name" not in cmd
    assert cmd[cmd.index("--clock-control") + 1] == "none"
    child = cmd[cmd.index("--child"):]
    assert child[1] == "one" and json.loads(child[2])["name"] == "hd128_full_kv32" and child[3:] == ["8192", "sdpa_cudnn"]
    assert "Profiling bprop" in (tmp_path / "ncu_sdpa_cudnn_hd128_full_kv32_s8192.txt").read_text()
    stdout[0] = 'RESULT {"pass": false, "why": "cuDNN refuses the shape"}\n'
    assert tool.main() == 1
    for bad in (["--ncu-baseline", "sdpa_cudnn"], ["--ncu", "hd128_full_kv32", "--ncu-baseline", "nccl"]):
        monkeypatch.setattr(tool.sys, "argv", ["gpu_attention_bwd.py", str(tmp_path), *bad])
        with pytest.raises(SystemExit):
            tool.main()
    assert tool.BASELINES == ("sdpa_flash", "sdpa_cudnn", "cudnn_fe", "fa4")  # the bench's columns
