"""tsgen.torch.attention on CPU (issue 35): tsgen's attention forward and backward modules as one
differentiable torch op. The fake kernels (shapes, dtypes, errors naming the argument), the custom
ops' schemas, torch.compile(fullgraph=True) forward and backward graphs under FakeTensorMode, the
refused pairs (each differing field named), tsgen.torch.load pointing here; and the comparison
tests/torch_checks.py --attention makes on the GPU, run here against a float64 emulation of the
kernels' roundings (it must pass) and against wrong results (it must fail). No GPU: without CUDA
the ops trace but do not run (tools/gpu_torch.sh, TORCH_STEPS=attention, runs them). Skipped where
torch is not installed; importing tsgen without torch: tests/test_torch_import.py."""

from __future__ import annotations

import ctypes
import math
import re
from pathlib import Path

import pytest

from conftest import aot_graphs, compile_test, fake_mode, load_script, missing_tool

torch = pytest.importorskip("torch", reason="tsgen.torch needs PyTorch: pip install '.[torch]'")

import tsgen.torch as tt  # noqa: E402
from tsgen.spec import load_spec, spec_variant  # noqa: E402
from tsgen.toolchain import find_nvcc  # noqa: E402
from tsgen.torch.attention_op import AttentionSignature, _Module  # noqa: E402
from tsgen.torch.signature import TsgenArgumentError, TsgenTorchError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GEN = ROOT / "generated"
BF16 = torch.bfloat16
needs_nvcc = compile_test(missing_tool(find_nvcc) and f"nvcc not found: {missing_tool(find_nvcc)}")


def torch_checks():
    return load_script(ROOT / "tests" / "torch_checks.py")


@pytest.fixture(scope="module")
def attn():
    """The three pairs tests/torch_checks.py --attention runs, loaded from their specs (trace only)."""
    return {name: tt.attention(ROOT / fwd, ROOT / bwd) for name, (fwd, bwd) in torch_checks().ATTENTION_PAIRS.items()}


def variant(spec: str, **changes):
    """specs/<spec>.yaml with `changes` (params, or name / dtype at the top), as a LoadedSpec."""
    top = {k: changes.pop(k) for k in ("name", "dtype") if k in changes}
    return spec_variant(load_spec(ROOT / "specs" / f"{spec}.yaml"), {**top, **({"params": changes} if changes else {})})


def empty(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="cuda")


# -- the op: schemas, fake kernels, compile --------------------------------------------------------

def test_schemas_and_signature(attn):
    a = attn["hd128_causal_gqa"]
    assert str(torch.ops.tsgen.attention_hd128_causal_gqa.default._schema) == (
        "tsgen::attention_hd128_causal_gqa(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)")
    assert str(torch.ops.tsgen.attention_backward_hd128_causal_gqa.default._schema) == (
        "tsgen::attention_backward_hd128_causal_gqa(Tensor q, Tensor k, Tensor v, Tensor o, Tensor dout, Tensor lse)"
        " -> (Tensor, Tensor, Tensor)")
    s = a.signature
    assert (s.head_dim, s.heads, s.kv_heads, s.causal, s.layout, s.dtype) == (128, 32, 8, True, "bshd", "bfloat16")
    assert s.scale == 1 / math.sqrt(128) and "trace only" in repr(a.forward)
    assert "attention_backward_hd128_causal_gqa" in repr(a)


@pytest.mark.parametrize("name, q_shape, kv_shape", [
    ("hd128", (2, 1000, 32, 128), (2, 1000, 32, 128)),
    ("hd128_causal_gqa", (1, 77, 32, 128), (1, 300, 8, 128)),  # q_len != kv_len, GQA 4
    ("hd64_causal", (3, 1, 32, 64), (3, 5, 32, 64)),
])
def test_fake_shapes(attn, name, q_shape, kv_shape):
    """O as q, LSE float32 [batch, heads, S]; the gradients as q, k, v."""
    a = attn[name]
    with fake_mode():
        q, k = empty(*q_shape), empty(*kv_shape)
        o, lse = a(q, k, k.clone(), return_lse=True)
        assert o.shape == q.shape and o.dtype == BF16
        assert tuple(lse.shape) == (q_shape[0], 32, q_shape[1]) and lse.dtype == torch.float32
        assert a(q, k, k).shape == q.shape
        dq, dk, dv = a.grads(q, k, k, o, o, lse)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape) and dk.dtype == BF16


def test_bhsd_and_fp16_variants():
    """A bhsd and an fp16 pair (spec variants: LoadedSpecs load as spec files do): [batch, heads, S,
    head_dim] in, LSE [batch, heads, S] out whatever the layout."""
    a = tt.attention(variant("attention_hd128", name="att_t_bhsd", layout="bhsd", kv_heads=4),
                     spec_variant(load_spec(ROOT / "specs" / "attention_backward_hd128.yaml"),
                                  {"name": "attbwd_t_bhsd", "params": {"layout": "bhsd", "kv_heads": 4}}))
    assert a.signature.layout == "bhsd" and a.signature.described(True) == "[batch, kv_heads 4, S_kv, head_dim 128]"
    with fake_mode():
        q, k = empty(2, 32, 100, 128), empty(2, 4, 60, 128)
        o, lse = a(q, k, k, return_lse=True)
        assert o.shape == q.shape and tuple(lse.shape) == (2, 32, 100)
        with pytest.raises(TsgenArgumentError, match=r"argument q: dimension 1 \(heads\) is 100"):
            a(empty(2, 100, 32, 128), k, k)
    h = tt.attention(variant("attention_hd128", name="att_t_f16", dtype="float16"))
    with fake_mode(), pytest.raises(TsgenArgumentError, match=r"argument q: dtype bfloat16, but .* float16"):
        h(empty(1, 8, 32, 128), empty(1, 8, 32, 128), empty(1, 8, 32, 128))


def test_symbolic_shapes(attn):
    """make_fx with symbolic sizes: batch and lengths stay symbols through the fake kernels."""
    from torch.fx.experimental.proxy_tensor import make_fx

    a = attn["hd128_causal_gqa"]

    def f(q, k, v):
        o, lse = a(q, k, v, return_lse=True)
        return a.grads(q, k, v, o, o, lse)

    def cpu(*shape):
        return torch.empty(shape, dtype=BF16)

    g = make_fx(f, tracing_mode="symbolic")(cpu(2, 9, 32, 128), cpu(2, 11, 8, 128), cpu(2, 11, 8, 128))  # fakes them
    nodes = {str(n.target): n for n in g.graph.nodes if n.op == "call_function"}
    fwd = nodes["tsgen.attention_hd128_causal_gqa.default"]
    bwd = nodes["tsgen.attention_backward_hd128_causal_gqa.default"]
    lse_shape = [str(d) for d in fwd.meta["val"][1].shape]
    assert lse_shape[1] == "32" and all(d.startswith("s") for d in (lse_shape[0], lse_shape[2])), lse_shape
    dk_shape = [str(d) for d in bwd.meta["val"][1].shape]
    assert dk_shape[0] == lse_shape[0] and dk_shape[1].startswith("s") and dk_shape[1] != lse_shape[2], dk_shape


class Block(torch.nn.Module):
    """A projection, attention, a residual: the shape of a transformer's attention sublayer."""

    def __init__(self, attn, heads: int, kv_heads: int, dim: int):
        super().__init__()
        self.attn, self.heads, self.kv_heads, self.dim = attn, heads, kv_heads, dim
        self.proj = torch.nn.Linear(heads * dim, (heads + 2 * kv_heads) * dim, bias=False, dtype=BF16)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.proj(x).split([self.heads * self.dim, self.kv_heads * self.dim, self.kv_heads * self.dim], -1)
        o = self.attn(q.reshape(b, s, self.heads, self.dim).contiguous(),
                      k.reshape(b, s, self.kv_heads, self.dim).contiguous(),
                      v.reshape(b, s, self.kv_heads, self.dim).contiguous())
        return o.reshape(b, s, -1) + x


@pytest.mark.parametrize("name", ["hd128_causal_gqa", "hd64_causal"])
def test_compile_fullgraph_forward_and_backward(attn, name):
    """torch.compile(fullgraph=True) + AOTAutograd of the block: the forward graph runs tsgen's
    forward op, the backward graph tsgen's backward op (a graph break would raise)."""
    a = attn[name]
    s = a.signature

    def make():
        block = Block(a, s.heads, s.kv_heads, s.head_dim)
        return block, (torch.randn(2, 64, s.heads * s.head_dim, dtype=BF16, requires_grad=True),)

    (x,), y, fw, bw = aot_graphs(make)
    assert y.shape == x.shape and x.grad is not None and x.grad.shape == x.shape
    assert f"tsgen.{s.module}.default" in fw and not any("attention_backward" in t for t in fw), fw
    assert f"tsgen.{a.backward.name}.default" in bw and f"tsgen.{s.module}.default" not in bw, bw


def test_compile_inductor_with_stand_in_kernels(attn, monkeypatch):
    """torch.compile(fullgraph=True) with Inductor itself (as the GPU check compiles its tiny module),
    on CPU tensors: the real kernels replaced by float64 stand-ins (emulated_kernels, below), the
    compiled forward and backward equal eager autograd through the same ops."""
    a = attn["hd128_causal_gqa"]
    sig = a.signature

    def forward(q, k, v):
        got = emulated_kernels(sig, q, k, v, torch.zeros_like(q))
        return got["o"], got["lse"]

    def backward(q, k, v, o, dout, lse):
        got = emulated_kernels(sig, q, k, v, dout)
        return got["dq"], got["dk"], got["dv"]

    monkeypatch.setattr(a.forward, "run_forward", forward)
    monkeypatch.setattr(a.backward, "run_backward", backward)

    class Tiny(torch.nn.Module):
        def forward(self, q, k, v):
            o, lse = a(q, k, v, return_lse=True)
            return o.float(), lse

    gen = torch.Generator().manual_seed(5)
    q, k, v, do = torch_checks().attention_inputs(sig, 1, 40, 40, gen, device="cpu")
    results = []
    for module in (Tiny(), torch.compile(Tiny(), fullgraph=True, backend="inductor")):
        torch._dynamo.reset()
        qa, ka, va = (x.clone().requires_grad_(True) for x in (q, k, v))
        out, lse = module(qa, ka, va)
        out.backward(do.float())
        results.append([out, lse, qa.grad, ka.grad, va.grad])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_lse_has_no_gradient_and_grads_follow_needs(attn):
    """LSE is returned without a gradient; only the inputs that need one get one."""
    a = attn["hd128"]
    with fake_mode():
        q = torch.empty(1, 16, 32, 128, dtype=BF16, requires_grad=True)
        k = torch.empty(1, 16, 32, 128, dtype=BF16)
        v = torch.empty(1, 16, 32, 128, dtype=BF16, requires_grad=True)
        o, lse = a(q, k, v, return_lse=True)
        assert o.requires_grad and not lse.requires_grad
        o.sum().backward()
        assert q.grad is not None and k.grad is None and v.grad is not None


# -- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda: (empty(1, 8, 32, 128, dtype=torch.float16), empty(1, 8, 8, 128), empty(1, 8, 8, 128)),
     r"tsgen::attention_hd128_causal_gqa: argument q: dtype float16, but specs/attention_hd128_causal_gqa.yaml "
     r"was compiled for bfloat16"),
    (lambda: (empty(8, 32, 128), empty(1, 8, 8, 128), empty(1, 8, 8, 128)),
     r"argument q: 3 dimensions \(shape \(8, 32, 128\)\), but .* takes \[batch, S, heads 32, head_dim 128\]"),
    (lambda: (empty(1, 8, 32, 128), empty(1, 8, 32, 128), empty(1, 8, 32, 128)),
     r"argument k: dimension 2 \(kv_heads\) is 32 .* compiled for kv_heads 8"),
    (lambda: (empty(1, 8, 32, 64), empty(1, 8, 8, 128), empty(1, 8, 8, 128)),
     r"argument q: dimension 3 \(head_dim\) is 64"),
    (lambda: (empty(1, 32, 8, 128).transpose(1, 2), empty(1, 8, 8, 128), empty(1, 8, 8, 128)),
     r"argument q: not contiguous .* call .contiguous\(\) first"),
    (lambda: (empty(2, 8, 32, 128), empty(1, 8, 8, 128), empty(1, 8, 8, 128)),
     r"argument k: batch 1 \(shape \(1, 8, 8, 128\)\), but q's is 2"),
    (lambda: (empty(1, 8, 32, 128), empty(1, 8, 8, 128), empty(1, 9, 8, 128)),
     r"argument v: batch 1 and length 9 .* but k has batch 1 and length 8"),
    (lambda: (empty(1, 8, 32, 128), empty(1, 0, 8, 128), empty(1, 0, 8, 128)), r"argument k: no keys"),
])
def test_fake_kernel_errors(attn, make, match):
    with fake_mode(), pytest.raises(TsgenArgumentError, match=match):
        attn["hd128_causal_gqa"](*make())


@pytest.mark.parametrize("change, match", [
    (lambda: {"lse": empty(1, 8, 32, dtype=torch.float32)},
     r"argument lse: dtype float32, shape \(1, 8, 32\), but the forward's LSE for this q is float32 \(1, 32, 8\)"),
    (lambda: {"lse": empty(1, 32, 8)}, r"argument lse: dtype bfloat16"),
    (lambda: {"dout": empty(1, 9, 32, 128)}, r"argument dout: batch 1 and length 9 .* but q has batch 1 and length 8"),
    (lambda: {"o": empty(1, 8, 32, 64)}, r"argument o: dimension 3 \(head_dim\) is 64"),
])
def test_backward_op_errors(attn, change, match):
    with fake_mode():
        t = {"q": empty(1, 8, 32, 128), "k": empty(1, 8, 8, 128), "v": empty(1, 8, 8, 128), "o": empty(1, 8, 32, 128),
             "dout": empty(1, 8, 32, 128), "lse": empty(1, 32, 8, dtype=torch.float32)}
        t.update(change())
        with pytest.raises(TsgenArgumentError, match=match):
            attn["hd128_causal_gqa"].grads(*t.values())


def test_real_call_without_cuda(attn):
    """Loaded where CUDA is not available, the op traces but does not run; a real call says so."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the op would run")
    x = torch.zeros(1, 8, 32, 128, dtype=BF16)
    with pytest.raises(TsgenTorchError, match=r"tsgen::attention_hd128: loaded where CUDA is not available"):
        attn["hd128"](x, x, x)
    with pytest.raises(TsgenArgumentError, match=r"argument k: dtype float32"):  # the checks come first
        attn["hd128"](x, x.float(), x)


def test_mismatched_pairs_refused():
    """A pair that does not compute the same attention is refused at load, naming every difference;
    so are the op kinds in the wrong places and a second backward for one forward."""
    fwd, bwd = GEN / "attention_hd128.json", GEN / "attention_backward_hd64_causal_gqa.json"
    with pytest.raises(TsgenTorchError) as e:
        tt.attention(fwd, bwd)
    text = str(e.value)
    assert re.search(r"same attention \((.*), forward / backward\)", text)[1] == (
        "head_dim 128 / 64; kv_heads 32 / 8; causal False / True; scale 0.08838834764831843 / 0.125"), text
    for part in ("specs/attention_hd128.yaml (tsgen::attention_hd128) and "
                 "specs/attention_backward_hd64_causal_gqa.yaml", "compile the backward spec"):
        assert part in text, (part, text)
    bshd_bwd = ROOT / "specs" / "attention_backward_hd128.yaml"
    for changes, part in (({"name": "att_t_layout", "layout": "bhsd"}, "tensors bhsd / bshd"),
                          ({"name": "att_t_scale", "softmax_scale": 0.1}, "scale 0.1 / 0.08838834764831843"),
                          ({"name": "att_t_dtype", "dtype": "float16"}, "dtype float16 / bfloat16"),
                          ({"name": "att_t_heads", "heads": 16, "kv_heads": 16}, "heads 16 / 32; kv_heads 16 / 32")):
        with pytest.raises(TsgenTorchError, match=part):
            tt.attention(variant("attention_hd128", **changes), bshd_bwd)
    with pytest.raises(TsgenTorchError, match=r"attention_backward_hd128.yaml is op attention_backward; its first "
                                              r"argument is an attention spec"):
        tt.attention(bshd_bwd, bshd_bwd)
    with pytest.raises(TsgenTorchError, match=r"attention_hd128.yaml is op attention; its second argument is an "
                                              r"attention_backward spec"):
        tt.attention(ROOT / "specs" / "attention_hd128.yaml", ROOT / "specs" / "attention_hd128.yaml")
    with pytest.raises(TsgenTorchError, match=r"is op allgather; its first argument"):
        tt.attention(GEN / "allgather.json")


def test_one_backward_per_forward_and_close():
    """A forward module has one backward (its autograd formula): another is refused until close()."""
    fwd = variant("attention_hd128", name="att_t_pairs")
    bwd = ROOT / "specs" / "attention_backward_hd128.yaml"
    other = spec_variant(load_spec(bwd), {"name": "attbwd_t_pairs"})
    a = tt.attention(fwd, bwd)
    assert tt.attention(fwd, bwd).backward is a.backward  # the same pair again: fine
    with pytest.raises(TsgenTorchError, match=r"tsgen::att_t_pairs is paired with tsgen::attention_backward_hd128 "
                                              r"already"):
        tt.attention(fwd, other)
    a.close()
    with pytest.raises(TsgenTorchError, match=r"tsgen::att_t_pairs is not loaded"), fake_mode():
        torch.ops.tsgen.att_t_pairs(empty(1, 8, 32, 128), empty(1, 8, 32, 128), empty(1, 8, 32, 128))
    b = tt.attention(fwd, other)
    assert b.backward.name == "attbwd_t_pairs"
    with pytest.raises(TsgenTorchError, match=r"another spec \(specs/attention_hd128.yaml"):
        tt.attention(variant("attention_hd128", name="att_t_pairs", causal=True))


def test_unpaired_forward_has_no_backward():
    """Loaded without its backward spec the op runs forward; its backward raises, saying what to load."""
    a = tt.attention(variant("attention_hd128", name="att_t_unpaired"))
    with fake_mode():
        q = torch.empty(1, 8, 32, 128, dtype=BF16, requires_grad=True)
        o = a(q, q.detach(), q.detach())
        assert o.shape == q.shape
        with pytest.raises(TsgenTorchError, match=r"tsgen::att_t_unpaired has no backward: load it with its "
                                                  r"attention_backward spec"):
            o.sum().backward()
        with pytest.raises(TsgenTorchError, match=r"loaded without its attention_backward spec"):
            a.grads(q, q, q, q, q, torch.empty(1, 32, 8))


def test_load_points_to_attention():
    """tsgen.torch.load of an attention spec (a process-group op loader) says which loader to use."""
    from tsgen.manifest import Manifest
    from tsgen.torch.signature import kind_problem, supported_kinds

    for name in ("attention_hd128", "attention_backward_hd128"):
        problem = kind_problem(Manifest.load(GEN / f"{name}.json").op)
        assert "runs on one GPU, without a process group: load it with tsgen.torch.attention(forward_spec, " \
               "backward_spec)" in problem
    # cp_attention runs on a process group (tsgen.torch.load, or cp_attention(..., fused=)); attention does not
    assert "attention" not in supported_kinds() and "cp_attention" in supported_kinds()
    assert kind_problem("cp_attention") is None


# -- the GPU check's comparison (tests/torch_checks.py --attention), on the CPU --------------------

def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(BF16).double()


def emulated_kernels(sig, q, k, v, do):
    """The forward and backward as tsgen's kernels round them, in float64 (bshd): O rounded to bf16,
    LSE to float32; D = rowsum(dO O) of that O, P from that LSE, P rounded to bf16 before dV = P^T dO,
    dS rounded to bf16 before dK and dQ, each gradient rounded to bf16; GQA sums over the group."""
    group = sig.heads // sig.kv_heads
    qd, kd, vd, dod = (x.double() for x in (q, k, v, do))
    kr, vr = (x.repeat_interleave(group, 2) for x in (kd, vd))  # [B, S, H, D]
    s = sig.scale * torch.einsum("bqhd,bkhd->bhqk", qd, kr)
    if sig.causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    lse = torch.logsumexp(s, -1).float()
    p = torch.exp(s - lse.double()[..., None])
    o = bf16(torch.einsum("bhqk,bkhd->bqhd", p, vr))
    dsum = torch.einsum("bqhd,bqhd->bhq", dod, o)
    ds = bf16(p * (torch.einsum("bqhd,bkhd->bhqk", dod, vr) - dsum[..., None]))
    dv = torch.einsum("bhqk,bqhd->bkhd", bf16(p), dod)
    dk = sig.scale * torch.einsum("bhqk,bqhd->bkhd", ds, qd)
    dq = sig.scale * torch.einsum("bhqk,bkhd->bqhd", ds, kr)
    b, skv = k.shape[:2]
    dk, dv = (x.reshape(b, skv, sig.kv_heads, group, sig.head_dim).sum(3) for x in (dk, dv))
    out = {"o": o.to(BF16), "lse": lse, "dq": dq.to(BF16), "dk": dk.to(BF16), "dv": dv.to(BF16)}
    return {name: x.contiguous() for name, x in out.items()}  # as the kernels write them (einsum permutes strides)


def cpu_sig(causal: bool, heads: int, kv_heads: int, head_dim: int) -> AttentionSignature:
    return AttentionSignature("t", "attention", "t.yaml", head_dim, heads, kv_heads, causal, "bshd", "bfloat16",
                              head_dim ** -0.5)


@pytest.mark.parametrize("causal, heads, kv_heads, head_dim, seq", [(True, 4, 2, 64, 300), (False, 2, 2, 128, 257)])
def test_gpu_check_comparison(causal, heads, kv_heads, head_dim, seq):
    """torch_checks.py --attention's reference (SDPA autograd in float32) and bounds (the families'
    o_tolerance / grad_tolerance, and the kernel's D from its own 16-bit O) hold an emulation of
    the kernels' roundings, every element and well inside the norm bound; and they catch what its
    negative controls feed them (an LSE 0.05 too large into the backward, dK and dV swapped, the
    last row of O zeroed), and a gradient of the wrong sign or without the GQA sum."""
    tc = torch_checks()
    sig = cpu_sig(causal, heads, kv_heads, head_dim)
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = tc.attention_inputs(sig, 2, seq, seq, gen, device="cpu")
    got = emulated_kernels(sig, q, k, v, do)
    ref = tc.sdpa_reference(sig, q, k, v, do)
    ref["lse"], bounds = tc.attention_bounds(sig, q, k, v, do, ref, got["o"])
    ok, detail = tc.attention_compare(got, ref, bounds)
    assert ok, detail
    for name in ("o", "dq", "dk", "dv"):  # the norm criterion's margin: bf16 results sit near 2.4e-3
        assert float((got[name].float() - ref[name]).norm() / ref[name].norm()) < tc.MAX_REL_ERR / 2, (name, detail)
    tail = got["o"].clone()
    tail[:, -1] = 0
    # LSE + 0.05 read by the backward: P, so every gradient, times e^-0.05
    scaled = {n: (got[n].double() * math.exp(-0.05)).to(BF16) for n in ("dq", "dk", "dv")}
    wrong = {"lse + 0.05": {**got, **scaled},
             "dk, dv swapped": {**got, "dk": got["dv"], "dv": got["dk"]},
             "last row of O zeroed": {**got, "o": tail},
             "dq negated": {**got, "dq": -got["dq"]}}
    if kv_heads < heads:  # one query head's share of dK, dV: the GQA sum dropped
        wrong["no GQA sum"] = {**got, "dk": (got["dk"].double() / (heads // kv_heads)).to(BF16)}
    for what, bad in wrong.items():
        caught, detail = tc.attention_compare(bad, ref, bounds)
        assert not caught, (what, detail)


def test_gpu_check_poison_spans():
    """poisoned(): a tensor counts when it lies wholly inside a filled range."""
    tc = torch_checks()
    t = torch.zeros(100, dtype=torch.float32)
    base = t.data_ptr()
    assert tc.poisoned(t, [(base, base + 400)]) and tc.poisoned(t, [(0, 8), (base - 16, base + 512)])
    assert not tc.poisoned(t, [(base, base + 396)]) and not tc.poisoned(t, [(base + 4, base + 800)])


def test_gpu_check_is_a_step_of_its_own():
    """tools/gpu_torch.sh runs the check alone on one GPU with TORCH_STEPS=attention (no torchrun)."""
    script = (ROOT / "tools" / "gpu_torch.sh").read_text()
    assert "want attention && step" in script and "tests/torch_checks.py --attention" in script
    assert "torch.distributed.run" not in next(line for line in script.splitlines() if "--attention" in line)


# -- the build: each pair's modules compile and export their entries ------------------------------

@needs_nvcc
def test_pairs_compile_and_export_their_entries(attn):
    """Each module compiles as the shared library with the host launchers and exports the run-time
    entry the op calls (<kernel>_forward, <kernel>_backward); without a CUDA driver the entry, given
    made-up addresses, returns a CUDA error rather than launching (the arguments got through ctypes)."""
    try:
        ctypes.CDLL("libcuda.so.1")
        driver = True
    except OSError:
        driver = False
    for a in attn.values():
        for m in (a.forward, a.backward):
            module = _Module(m.manifest, m.source, m.signature, "sm_90a")  # an architecture given: no GPU asked
            fn = module._fn(0)
            assert fn.restype is ctypes.c_int and module.entry.endswith(("_forward", "_backward"))
            if driver:
                continue  # made-up addresses must not reach a GPU
            if m is a.forward:
                err = fn(1 << 40, 1 << 40, 1 << 40, 1 << 40, 1 << 40, 1, 128, 128, 0, 128, 0, 0, None, 0, 0, 0, None)
            else:
                err = fn(*([1 << 40] * 12), 1, 128, 128, 0, 128, 0, 0, None)
            assert err != 0


def test_outputs_nan_filled_only_when_asked(monkeypatch):
    """TSGEN_TORCH_POISON=1 (tests/torch_checks.py --attention sets it): the op's outputs and workspace
    come NaN-filled, so an element its kernels leave unwritten reads NaN; unset, torch.empty alone (no
    extra kernel in a user's step)."""
    from tsgen.torch import attention_op

    x = torch.zeros(2, 3, dtype=torch.bfloat16)
    filled = []
    real = torch.Tensor.fill_
    monkeypatch.setattr(torch.Tensor, "fill_", lambda self, v: filled.append(v) or real(self, v))
    monkeypatch.delenv("TSGEN_TORCH_POISON", raising=False)
    a = attention_op._output(like=x)
    assert a.shape == x.shape and a.dtype == x.dtype and filled == []
    monkeypatch.setenv("TSGEN_TORCH_POISON", "1")
    b, c = attention_op._output(like=x), attention_op._output(5, dtype=torch.float32)
    assert torch.isnan(b).all() and torch.isnan(c).all() and c.shape == (5,) and c.dtype == torch.float32


def test_launch_goes_through_the_shared_launch_path(attn, monkeypatch):
    """The attention modules launch through tsgen.torch.ops.call_on_stream (the path every tsgen.torch op
    takes: no device context where the GPU is current, the raw stream handle), with the entry for the call's
    device and its arguments; a non-zero return is the op's error, naming the cudaError."""
    import tsgen.torch.ops as ops_mod

    module = attn["hd128"].forward
    seen = []
    monkeypatch.setattr(ops_mod, "call_on_stream", lambda device, fn, args: seen.append((device, fn, list(args))) or 0)
    monkeypatch.setattr(module, "_fn", lambda device, suffix=None: ("entry", device, suffix))
    module._launch(3, [11, 12], "a call")
    assert seen == [(3, ("entry", 3, None), [11, 12])]
    monkeypatch.setattr(ops_mod, "call_on_stream", lambda device, fn, args: 7)
    with pytest.raises(TsgenTorchError, match=r"failed with cudaError 7 \(a call\)"):
        module._launch(0, [], "a call")
