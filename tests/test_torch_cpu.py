"""tsgen.torch on CPU: the fake kernels (shapes, dtypes, errors), torch.compile(fullgraph=True) of a
module that calls two tsgen ops (forward and backward graphs) under FakeTensorMode, the error
messages (importing tsgen without torch: tests/test_torch_import.py). No GPU: the ops are loaded on a process group of
torch's "fake" backend, where they trace but do not run (tools/gpu_torch.sh runs them on GPUs).
Skipped, with the reason, where torch is not installed (`pip install ".[torch]"`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import aot_graphs, fake_groups, fake_mode, load_script

ROOT = Path(__file__).resolve().parents[1]
GEN = ROOT / "generated"


torch = pytest.importorskip("torch", reason="tsgen.torch needs PyTorch: pip install '.[torch]'")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover - builds without distributed
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

import tsgen.torch as tt  # noqa: E402
from tsgen.manifest import Manifest  # noqa: E402
from tsgen.torch.signature import (ShapedSignature, TsgenArgumentError, TsgenTorchError, entries_of,  # noqa: E402
                                   signature_of)

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def groups():
    """conftest.fake_groups, with a group rank 0 is not in."""
    yield from fake_groups(other=True)


@pytest.fixture(scope="module")
def ops(groups):
    """allgather and reduce_scatter at W 2 and W 4, paired (each the other's backward)."""
    return paired(groups, "allgather", "reduce_scatter")


def paired(groups, a: str, b: str, worlds=(2, 4)) -> dict:
    """Modules a and b (shipped manifests) loaded at each world size and paired: {W: (a op, b op)}."""
    out = {}
    for w in worlds:
        ops = tt.load(GEN / f"{a}.json", groups[w]), tt.load(GEN / f"{b}.json", groups[w])
        tt.pair(*ops)
        out[w] = ops
    return out


# -- fake kernels: shapes and dtypes --------------------------------------------------------

@pytest.mark.parametrize("w", [2, 4])
@pytest.mark.parametrize("shape", [(8,), (8, 16), (4, 3, 5)])
def test_fake_shapes(ops, w, shape):
    """Under FakeTensorMode the ops have torch's shapes: allgather (n, ...) -> (W n, ...) as
    all_gather_into_tensor, reduce_scatter (W n, ...) -> (n, ...) as reduce_scatter_tensor."""
    ag, rs = ops[w]
    with fake_mode():
        x = torch.empty(shape, dtype=BF16, device="cuda")
        y = ag(x)
        assert tuple(y.shape) == (shape[0] * w, *shape[1:]) and y.dtype == BF16 and y.device == x.device
        z = rs(y)
        assert tuple(z.shape) == shape and z.dtype == BF16


def test_ops_are_custom_ops(ops):
    ag, rs = ops[2]
    assert ag.signature.qualname == "tsgen::allgather" and rs.signature.qualname == "tsgen::reduce_scatter"
    schema = str(torch.ops.tsgen.allgather.default._schema)
    assert schema == "tsgen::allgather(Tensor x, str group_name) -> Tensor", schema
    assert ag.trace_only and "trace only" in repr(ag)


def test_make_fx_fake(ops):
    ag, rs = ops[4]

    def f(x):
        return rs(torch.relu(ag(x)))

    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_mode():
        gm = make_fx(f, tracing_mode="fake")(torch.empty(6, 8, dtype=BF16, device="cuda"))
    code = gm.code
    assert "torch.ops.tsgen.allgather.default" in code and "torch.ops.tsgen.reduce_scatter.default" in code


def test_symbolic_shapes(ops):
    """Dynamic shapes: the fake kernels compute on symbolic sizes."""
    ag, rs = ops[2]
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: rs(ag(x)), tracing_mode="symbolic")(torch.empty(6, 8, dtype=BF16))  # fakes it itself
    outs = [n for n in gm.graph.nodes if n.op == "call_function" and "tsgen" in str(n.target)]
    assert len(outs) == 2
    assert "s" in str(outs[0].meta["val"].shape[0])  # a symbol, not a constant


# -- torch.compile(fullgraph=True) ---------------------------------------------------------------

class Block(torch.nn.Module):
    """A tensor-parallel MLP's communication pattern: allgather -> matmul -> gelu -> reduce_scatter."""

    def __init__(self, ag, rs, h=16, device="cpu"):
        super().__init__()
        self.ag, self.rs = ag, rs
        # on fake CUDA tensors (a CPU-only torch) nothing may require grad: autograd needs a CUDA build
        self.w = torch.nn.Parameter(torch.randn(h, h, dtype=BF16, device=device), requires_grad=device == "cpu")

    def forward(self, x):
        return self.rs(torch.nn.functional.gelu(self.ag(x) @ self.w))


def test_compile_fullgraph_forward(ops):
    """torch.compile(fullgraph=True) traces both tsgen ops into one graph (a graph break raises)."""
    ag, rs = ops[2]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with fake_mode():
        block = Block(ag, rs, device="cuda")
        y = torch.compile(block, fullgraph=True, backend=backend)(torch.empty(4, 16, dtype=BF16, device="cuda"))
    assert tuple(y.shape) == (4, 16)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert "tsgen.allgather" in targets and "tsgen.reduce_scatter" in targets, targets


def test_compile_fullgraph_backward(ops):
    """With AOTAutograd the backward graph runs each op's adjoint: allgather's gradient is a
    reduce_scatter, reduce_scatter's an allgather."""
    ag, rs = ops[2]
    block = []

    def make():
        block.append(Block(ag, rs))
        return block[0], (torch.empty(4, 16, dtype=BF16, requires_grad=True),)

    (x,), _, fwd, bwd = aot_graphs(make)
    assert tuple(x.grad.shape) == (4, 16) and tuple(block[0].w.grad.shape) == (16, 16)
    assert fwd.index("tsgen.allgather.default") < fwd.index("tsgen.reduce_scatter.default"), fwd
    assert bwd.index("tsgen.allgather.default") < bwd.index("tsgen.reduce_scatter.default"), bwd


def test_backward_without_adjoint(groups):
    """An op with no adjoint paired says how to get one when its backward runs."""
    g = groups[2]
    pull = tt.load(GEN / "allgather_pull.json", g)
    with fake_mode():
        x = torch.empty(4, 8, dtype=BF16, requires_grad=True)
        y = pull(x)
        with pytest.raises(TsgenTorchError, match=r"tsgen::allgather_pull on rank 0: no adjoint .*tsgen.torch.pair"):
            y.sum().backward()


# -- errors: argument and rank named ----------------------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda: torch.empty(4, 8, dtype=torch.float32, device="cuda"),
     r"tsgen::reduce_scatter on rank 0: argument x: dtype float32, but specs/reduce_scatter.yaml was compiled for "
     r"bfloat16"),
    (lambda: torch.empty(8, 4, dtype=BF16, device="cuda").t(),
     r"argument x: not contiguous \(shape \(4, 8\)\); call .contiguous\(\)"),
    (lambda: torch.empty(3, 8, dtype=BF16, device="cuda"),
     r"argument x: dimension 0 is 3 \(shape \(3, 8\)\), not a multiple of the group size"),
    (lambda: torch.empty((), dtype=BF16, device="cuda"), r"argument x: a 0-dimensional tensor"),
])
def test_fake_kernel_errors(ops, make, match):
    _, rs = ops[2]
    with fake_mode():
        x = make()
        with pytest.raises(TsgenArgumentError, match=match):
            rs(x)


def test_errors_inside_compile(ops):
    """torch.compile reports the fake kernel's message (rank and argument)."""
    _, rs = ops[2]
    torch._dynamo.reset()
    with fake_mode():
        f = torch.compile(lambda x: rs(x), fullgraph=True, backend=lambda gm, ex: gm.forward)
        with pytest.raises(Exception, match=r"tsgen::reduce_scatter on rank 0: argument x: dimension 0 is 5"):
            f(torch.empty(5, 8, dtype=BF16, device="cuda"))


def test_real_call_errors(ops):
    """The real kernel checks the device too; on a fake group it refuses to run."""
    ag, _ = ops[2]
    with pytest.raises(TsgenArgumentError, match=r"tsgen::allgather on rank 0: argument x: on cpu, but this rank's "
                                                 r"op runs on a CUDA device"):
        ag(torch.zeros(4, 8, dtype=BF16))
    with pytest.raises(TsgenArgumentError, match=r"argument x: dtype int32"):
        ag(torch.zeros(4, 8, dtype=torch.int32))
    with pytest.raises(TsgenTorchError, match=r"tsgen::allgather on rank 0: loaded on a group without GPUs"):
        ag._need_gpu()
    with pytest.raises(TsgenTorchError, match=r"loaded on a group without GPUs"):
        ag.empty(4, 8)


def test_group_size_not_compiled(groups):
    with pytest.raises(TsgenTorchError, match=r"tsgen::allgather on rank 0: the process group has 5 ranks, but "
                                              r"specs/allgather.yaml was compiled for world sizes \[2, 3, 4, 8\]"):
        tt.load(GEN / "allgather.json", groups[5])


def test_not_a_member(groups):
    with pytest.raises(TsgenTorchError, match=r"not a member of the group"):
        tt.load(GEN / "allgather.json", groups["other"])


@pytest.mark.parametrize("name, match", [
    ("allgather_inplace", r"one input and one output buffer; specs/allgather_inplace.yaml has dst \(inout\)"),
    ("allgather_multimem", r"NVLink multicast"),
    ("allgather_nvshmem", r"NVSHMEM transport"),
    ("simple_shift", r"op kind simple_shift \(primitive\) is not a tsgen.torch op yet.*allgather"),
    ("gemm_bf16", r"op kind gemm \(\w+\) is not a tsgen.torch op yet"),
    ("moe_fp8", r"specs/moe_fp8.yaml is not a tsgen.torch op: the fp8 payload quantizes the rows"),
    ("moe_ll", r"specs/moe_ll.yaml is not a tsgen.torch op: the low-latency mode's rows"),
])
def test_unsupported_modules(groups, name, match):
    with pytest.raises(TsgenTorchError, match=match):
        tt.load(GEN / f"{name}.json", groups[2])


def test_load_twice_and_from_spec(ops, groups):
    """The same module on the same group is one op, whether loaded from its manifest or its spec."""
    ag, _ = ops[2]
    assert tt.load(GEN / "allgather.json", groups[2]) is ag
    assert tt.load(ROOT / "specs" / "allgather.yaml", groups[2]) is ag
    assert ag in tt.loaded()


def test_same_name_other_spec(ops, groups):
    data = json.loads((GEN / "allgather.json").read_text())
    data["spec_sha256"] = "0" * 64
    other = Manifest.from_json(json.dumps(data))
    with pytest.raises(TsgenTorchError, match=r"already loaded on this group from another spec"):
        tt.load(other, groups[2], source=GEN / "allgather.cu")
    with pytest.raises(TsgenTorchError, match=r"another spec of this name"):
        tt.load(other, dist.group.WORLD, source=GEN / "allgather.cu")  # not loaded on this group yet


def test_pair_checks(ops, groups):
    ag2, rs2 = ops[2]
    ag4, _ = ops[4]
    with pytest.raises(TsgenTorchError, match=r"needs a reduce_scatter op as its adjoint, not tsgen::allgather"):
        tt.pair(ag2, ag2)
    with pytest.raises(TsgenTorchError, match=r"on group .* an adjoint runs on the same group"):
        tt.pair(ag4, rs2)
    one_shot = tt.load(GEN / "all_reduce_one_shot.json", groups[2])
    with pytest.raises(TsgenTorchError, match=r"\(all_reduce\) has no adjoint op in tsgen.torch"):
        tt.pair(one_shot, one_shot)


def test_not_initialised(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(TsgenTorchError, match=r"needs torch.distributed initialised"):
        tt.load(GEN / "allgather.json")


def test_heap_mode_checked(groups):
    from tsgen.torch.heap import heap_mode

    assert heap_mode(None, {}) == "auto" and heap_mode(None, {"TSGEN_TORCH_HEAP": "ipc"}) == "ipc"
    with pytest.raises(TsgenTorchError, match=r"heap mode 'nccl'.*auto, symm_mem, ipc"):
        heap_mode("nccl", {})


def test_ranks_sharing_a_gpu_take_ipc_heaps_without_trying_symmetric_memory():
    """torch's symmetric memory refuses several ranks' allocations on one device; with auto the ops of
    co-located ranks go to CUDA IPC heaps directly (before: a warning from every op at its first
    call, 2026-11-27 W 8 on one GPU), an explicit mode stays (symm_mem then fails by name)."""
    from tsgen.torch.ops import colocated_heap_mode

    one_each, shared = ["0000:1B:00.0", "0000:43:00.0"], ["0000:1B:00.0"] * 3 + ["0000:43:00.0"]
    assert colocated_heap_mode("auto", one_each) == "auto"
    assert colocated_heap_mode("auto", shared) == "ipc"
    assert colocated_heap_mode("symm_mem", shared) == "symm_mem" and colocated_heap_mode("ipc", one_each) == "ipc"


# -- Ulysses: tensors with shapes of their own --------------------------------------------------

@pytest.fixture(scope="module")
def ulysses(groups):
    """ulysses_pre_a2a and ulysses_post_a2a (bshd, batch 2, 24 heads of 128) at W 2 and 4, paired."""
    return paired(groups, "ulysses_pre_a2a", "ulysses_post_a2a")


@pytest.mark.parametrize("w", [2, 4])
@pytest.mark.parametrize("tokens", [1, 1001])
def test_ulysses_fake_shapes(ulysses, w, tokens):
    """pre: [batch, S/P, heads, head_dim] -> [batch, S, heads/P, head_dim]; post the inverse."""
    pre, post = ulysses[w]
    with fake_mode():
        x = torch.empty(2, tokens, 24, 128, dtype=BF16, device="cuda")
        y = pre(x)
        assert tuple(y.shape) == (2, w * tokens, 24 // w, 128) and y.dtype == BF16
        z = post(y)
        assert tuple(z.shape) == (2, tokens, 24, 128) and z.dtype == BF16
    assert str(torch.ops.tsgen.ulysses_pre_a2a.default._schema) == \
        "tsgen::ulysses_pre_a2a(Tensor x, str group_name) -> Tensor"


@pytest.mark.parametrize("w, q_heads", [(2, 8), (4, 4)])
def test_ulysses_gqa_three_outputs(groups, w, q_heads):
    """Packed QKV (16 query, 2 KV heads, bhsd): one tensor in, q, k and v out; with P > 2 a KV head
    is replicated (one per rank)."""
    op = tt.load(GEN / "ulysses_pre_a2a_gqa.json", groups[w])
    assert str(torch.ops.tsgen.ulysses_pre_a2a_gqa.default._schema).endswith("-> (Tensor, Tensor, Tensor)")
    with fake_mode():
        q, k, v = op(torch.empty(1, 9, 20, 128, dtype=BF16, device="cuda"))
    assert tuple(q.shape) == (1, q_heads, 9 * w, 128)
    assert tuple(k.shape) == tuple(v.shape) == (1, 2 // w or 1, 9 * w, 128)
    with pytest.raises(TsgenTorchError, match=r"ulysses_pre_a2a_gqa \(ulysses_pre_a2a\) has no adjoint op.*one "
                                              r"tensor in and one out"):
        tt.pair(op, tt.load(GEN / "ulysses_post_a2a.json", groups[w]))


@pytest.mark.parametrize("make, match", [
    (lambda: torch.empty(2, 8, 16, 128, dtype=BF16, device="cuda"),
     r"tsgen::ulysses_pre_a2a on rank 0: argument x: dimension 2 \(heads\) is 16 \(shape \(2, 8, 16, 128\)\), but "
     r"specs/ulysses_pre_a2a.yaml was compiled for heads 24: tsgen::ulysses_pre_a2a takes \[batch 2, S/P, heads 24, "
     r"head_dim 128\] at world size 2"),
    (lambda: torch.empty(8, 24, 128, dtype=BF16, device="cuda"),
     r"argument x: 3 dimensions \(shape \(8, 24, 128\)\), but tsgen::ulysses_pre_a2a takes \[batch 2, S/P"),
    (lambda: torch.empty(2, 8, 24, 128, dtype=torch.float16, device="cuda"),
     r"argument x: dtype float16, but specs/ulysses_pre_a2a.yaml was compiled for bfloat16"),
    (lambda: torch.empty(2, 24, 8, 128, dtype=BF16, device="cuda").transpose(1, 2),
     r"argument x: not contiguous"),
])
def test_ulysses_errors(ulysses, make, match):
    pre, _ = ulysses[2]
    with fake_mode():
        x = make()
        with pytest.raises(TsgenArgumentError, match=match):
            pre(x)


def test_ulysses_post_sequence_not_divisible(ulysses):
    _, post = ulysses[4]
    with fake_mode():
        with pytest.raises(TsgenArgumentError, match=r"tsgen::ulysses_post_a2a on rank 0: argument x: dimension 1 "
                                                     r"\(S\) is 10 .*not a multiple of 4 \(the group size\)"):
            post(torch.empty(2, 10, 6, 128, dtype=BF16, device="cuda"))
        with pytest.raises(TsgenArgumentError, match=r"dimension 2 \(heads/P\) is 12 .*compiled for heads/P 6"):
            post(torch.empty(2, 8, 12, 128, dtype=BF16, device="cuda"))


def test_ulysses_pair_checks(ulysses, ops, groups):
    pre2, post2 = ulysses[2]
    ag2, _ = ops[2]
    with pytest.raises(TsgenTorchError, match=r"needs a ulysses_post_a2a op as its adjoint, not tsgen::allgather"):
        tt.pair(pre2, ag2)
    with pytest.raises(TsgenTorchError, match=r"needs a ulysses_pre_a2a op as its adjoint, not tsgen::ulysses_post"):
        tt.pair(post2, post2)
    # the same kinds compiled for other shapes are not adjoints: a bhsd pre does not invert a bshd post
    pre_sig = pre2.signature
    data = json.loads((GEN / "ulysses_pre_a2a.json").read_text())
    data["constants"]["BHSD"] = 1
    other = signature_of(Manifest.from_json(json.dumps(data)), 2, 0)
    post_sig = post2.signature
    assert pre_sig.adjoint_problem(post_sig) is None and post_sig.adjoint_problem(pre_sig) is None
    assert "does not map [batch 2, heads/P 12, S, head_dim 128] back to [batch 2, S/P, heads 24, head_dim 128]" in \
        other.adjoint_problem(post_sig)


def test_ulysses_compile_backward(ulysses):
    """torch.compile(fullgraph=True) of pre -> (local work) -> post: the backward graph runs each op's
    adjoint (post for pre's gradient, pre for post's), in reverse order."""
    pre, post = ulysses[2]

    def make():
        return (lambda x: post(torch.tanh(pre(x)))), (torch.empty(2, 5, 24, 128, dtype=BF16, requires_grad=True),)

    (x,), y, fwd, bwd = aot_graphs(make)
    assert tuple(y.shape) == (2, 5, 24, 128) and tuple(x.grad.shape) == (2, 5, 24, 128)
    assert fwd.index("tsgen.ulysses_pre_a2a.default") < fwd.index("tsgen.ulysses_post_a2a.default"), fwd
    assert bwd.index("tsgen.ulysses_pre_a2a.default") < bwd.index("tsgen.ulysses_post_a2a.default"), bwd


# -- the fused GEMMs: allgather_gemm and gemm_reduce_scatter ------------------------------------------

@pytest.fixture(scope="module")
def fused(groups):
    """specs/allgather_gemm.yaml (K 8192, N/P 2048) and gemm_reduce_scatter.yaml (K 8192, N 8192) at W 4,
    where they are each other's adjoint (K/P = 2048 = N/P of the other, N = K); paired."""
    return paired(groups, "allgather_gemm", "gemm_reduce_scatter", (4,))[4]


def test_fused_fake_shapes(fused):
    """allgather_gemm: A [M/P, K], B [K, N/P] -> C [M, N/P] and the gathered A [M, K];
    gemm_reduce_scatter: A [M, K/P], B [K/P, N] -> C [M/P, N]."""
    ag, rs = fused
    assert str(torch.ops.tsgen.allgather_gemm.default._schema) == \
        "tsgen::allgather_gemm(Tensor a, Tensor b, str group_name) -> (Tensor, Tensor)"
    assert str(torch.ops.tsgen.gemm_reduce_scatter.default._schema) == \
        "tsgen::gemm_reduce_scatter(Tensor a, Tensor b, str group_name) -> Tensor"
    with fake_mode():
        c, a_full = ag(torch.empty(129, 8192, dtype=BF16, device="cuda"), torch.empty(8192, 2048, dtype=BF16, device="cuda"))
        assert tuple(c.shape) == (4 * 129, 2048) and tuple(a_full.shape) == (4 * 129, 8192) and c.dtype == BF16
        y = rs(c, torch.empty(2048, 8192, dtype=BF16, device="cuda"))
        assert tuple(y.shape) == (129, 8192)


@pytest.mark.parametrize("which, a, b, match", [
    ("ag", (8, 4096), (8192, 2048), r"tsgen::allgather_gemm on rank 0: argument a: dimension 1 \(K\) is 4096 \(shape "
     r"\(8, 4096\)\), but specs/allgather_gemm.yaml was compiled for K 8192: tsgen::allgather_gemm takes \[M/P, K "
     r"8192\] at world size 4"),
    ("ag", (8, 8192), (8192, 1024), r"argument b: dimension 1 \(N/P\) is 1024 .*takes \[K 8192, N/P 2048\]"),
    ("rs", (10, 2048), (2048, 8192), r"tsgen::gemm_reduce_scatter on rank 0: argument a: dimension 0 \(M\) is 10 .*not "
     r"a multiple of 4 \(the group size\)"),
    ("rs", (8, 4096), (2048, 8192), r"argument a: dimension 1 \(K/P\) is 4096 .*compiled for K/P 2048"),
])
def test_fused_errors(fused, which, a, b, match):
    ag, rs = fused
    op = ag if which == "ag" else rs
    with fake_mode():
        with pytest.raises(TsgenArgumentError, match=match):
            op(torch.empty(a, dtype=BF16, device="cuda"), torch.empty(b, dtype=BF16, device="cuda"))


def test_fused_pair_needs_mirrored_shapes(groups):
    """At W 2 the shipped gemm_reduce_scatter (K/P = 4096) is not allgather_gemm's (N/P 2048) adjoint."""
    ag = tt.load(GEN / "allgather_gemm.json", groups[2])
    rs = tt.load(GEN / "gemm_reduce_scatter.json", groups[2])
    with pytest.raises(TsgenTorchError, match=r"tsgen::gemm_reduce_scatter's weight b is \[K/P 4096, N 8192\] at world "
                                              r"size 2; the adjoint of tsgen::allgather_gemm \(b \[K 8192, N/P 2048\]\) "
                                              r"needs b\^T, 2048 x 8192"):
        tt.pair(ag, rs)


def test_fused_compile_backward(fused):
    """A TP MLP (AG-GEMM -> gelu -> GEMM-RS) under torch.compile(fullgraph=True) + AOTAutograd: the
    backward runs gemm_reduce_scatter's adjoint (an allgather_gemm of dY) and allgather_gemm's (a
    gemm_reduce_scatter), plus the local weight-gradient GEMMs; every gradient has its parameter's shape."""
    ag, rs = fused

    def make():
        w1 = torch.empty(8192, 2048, dtype=BF16, requires_grad=True)
        w2 = torch.empty(2048, 8192, dtype=BF16, requires_grad=True)
        x = torch.empty(64, 8192, dtype=BF16, requires_grad=True)
        return (lambda x, w1, w2: rs(torch.nn.functional.gelu(ag(x, w1)[0]), w2)), (x, w1, w2)

    (x, w1, w2), y, fwd, bwd = aot_graphs(make)
    assert tuple(y.shape) == (64, 8192) and tuple(x.grad.shape) == (64, 8192)
    assert tuple(w1.grad.shape) == (8192, 2048) and tuple(w2.grad.shape) == (2048, 8192)
    assert fwd.index("tsgen.allgather_gemm.default") < fwd.index("tsgen.gemm_reduce_scatter.default"), fwd
    assert bwd.index("tsgen.allgather_gemm.default") < bwd.index("tsgen.gemm_reduce_scatter.default"), bwd
    assert sum("mm" in t for t in bwd) >= 2, bwd  # the two local weight-gradient GEMMs


# -- the out= form ------------------------------------------------------------------------------------

def test_out_schemas_and_local_buffers(fused, ops, groups):
    """Each op has a mutating out= form, tsgen::<module>_out (outputs as Tensor(a!) arguments,
    nothing returned: what torch.compile functionalizes). The fused GEMMs' A, B and C are local (only
    this rank's kernel touches them: passed by address); the gathered A is not (peers' copies land in
    it), nor C of a gemm_reduce_scatter whose peers add into it (reduce: add), nor a collective's
    buffers."""
    ag, rs = fused
    assert str(torch.ops.tsgen.allgather_gemm_out.default._schema) == (
        "tsgen::allgather_gemm_out(Tensor a, Tensor b, Tensor(a!) c, Tensor(b!) a_full, str group_name) -> ()")
    assert str(torch.ops.tsgen.gemm_reduce_scatter_out.default._schema) == (
        "tsgen::gemm_reduce_scatter_out(Tensor a, Tensor b, Tensor(a!) c, str group_name) -> ()")
    assert str(torch.ops.tsgen.allgather_out.default._schema) == \
        "tsgen::allgather_out(Tensor x, Tensor(a!) dst, str group_name) -> ()"
    assert ag.signature.local() == {"a", "b", "c"} and rs.signature.local() == {"a", "b", "c"}
    add = signature_of(Manifest.load(GEN / "gemm_reduce_scatter_push_add.json"), 2, 0)
    assert add.local() == {"a", "b"}
    assert ops[2][0].signature.local() == frozenset()


def _fused_operands(device: str = "cuda"):
    """x, W1, W2 and the out= tensors (C, the gathered x, y) of AG-GEMM -> GEMM-RS at W 4, 64 rows per rank."""
    shapes = ((64, 8192), (8192, 2048), (2048, 8192), (256, 2048), (256, 8192), (64, 8192))
    return tuple(torch.empty(s, dtype=BF16, device=device) for s in shapes)


def test_out_fake(fused, ops):
    """Under FakeTensorMode the out= form checks and returns the tensors it was given."""
    ag, rs = fused
    with fake_mode():
        x, w1, w2, c, a_full, y = _fused_operands()
        got = ag(x, w1, out=(c, a_full))
        assert got[0] is c and got[1] is a_full
        assert rs(c, w2, out=y) is y
        z = torch.empty(8, 16, dtype=BF16, device="cuda")
        assert ops[2][0](torch.empty(4, 16, dtype=BF16, device="cuda"), out=z) is z


@pytest.mark.parametrize("make, match", [
    (lambda c, a_full: (c.float(), a_full), r"tsgen::allgather_gemm on rank 0: out c: dtype float32, but "
     r"specs/allgather_gemm.yaml writes bfloat16"),
    (lambda c, a_full: (torch.empty(128, 2048, dtype=BF16, device="cuda"), a_full), r"out c: shape \(128, 2048\), but this call writes \(256, 2048\) \(\[M, N/P "
     r"2048\]\)"),
    (lambda c, a_full: (c, torch.empty(8192, 256, dtype=BF16, device="cuda").t()), r"out a_full: not contiguous"),
    (lambda c, a_full: (c,), r"tsgen::allgather_gemm on rank 0: out= takes a tuple of 2 tensors \(c, a_full\), got "
     r"tuple of 1"),
    (lambda c, a_full: c, r"out= takes a tuple of 2 tensors \(c, a_full\), got FakeTensor"),
])
def test_out_errors(fused, make, match):
    ag, _ = fused
    with fake_mode():
        x, w1, _, c, a_full, _ = _fused_operands()
        with pytest.raises(TsgenArgumentError, match=match):
            ag(x, w1, out=make(c, a_full))


def test_out_collective_errors(ops):
    ag, rs = ops[2]
    with fake_mode():
        x = torch.empty(4, 16, dtype=BF16, device="cuda")
        with pytest.raises(TsgenArgumentError, match=r"tsgen::allgather on rank 0: out dst: shape \(4, 16\), but this "
                                                     r"call writes \(8, 16\) \(2/1 of the input's dimension 0"):
            ag(x, out=torch.empty(4, 16, dtype=BF16, device="cuda"))
        with pytest.raises(TsgenArgumentError, match=r"tsgen::reduce_scatter on rank 0: argument x: dimension 0 is 3"):
            rs(torch.empty(3, 16, dtype=BF16, device="cuda"), out=x)


def test_out_refuses_grad(fused):
    """The out= form has no backward: inputs that require a gradient are refused (not silently cut)."""
    ag, _ = fused
    with fake_mode():
        x, w1, _, c, a_full, _ = _fused_operands()
        w1.requires_grad_(True)
        with pytest.raises(TsgenArgumentError, match=r"tsgen::allgather_gemm on rank 0: the out= form has no backward"):
            ag(x, w1, out=(c, a_full))
        with torch.no_grad():
            ag(x, w1, out=(c, a_full))


@pytest.mark.parametrize("dynamic", [False, True])
def test_out_compile_fullgraph(fused, dynamic):
    """AG-GEMM -> gelu -> GEMM-RS on the out= form under torch.compile(fullgraph=True): no graph break,
    both ops in the graph (functionalized: auto_functionalized), the outputs' shapes; static and
    symbolic sizes (the out= checks become guards). CPU fake
    tensors: the graph's epilogue copies into the mutated inputs, which fake CUDA tensors cannot
    do on a CPU build."""
    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import make_boxed_func

    ag, rs = fused
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def block(x, w1, w2, c, a_full, y):
        ag(x, w1, out=(c, a_full))
        return rs(torch.nn.functional.gelu(c), w2, out=y)

    torch._dynamo.reset()
    with fake_mode():
        args = _fused_operands("cpu")
        y = torch.compile(block, fullgraph=True, dynamic=dynamic, backend=aot_autograd(fw_compiler=keep))(*args)
        assert tuple(y.shape) == (64, 8192)
    code = graphs[0].code
    assert code.index("tsgen.allgather_gemm_out") < code.index("tsgen.gemm_reduce_scatter_out"), code


def test_out_not_for_module_entries(moe):
    with pytest.raises(TsgenArgumentError, match=r"tsgen::moe_dispatch on rank 0: no out= form for one op of a module"):
        moe.dispatch(torch.empty(4, 2048, dtype=BF16), out=torch.empty(1))
    assert not hasattr(torch.ops.tsgen, "moe_dispatch_out")


def test_empty_out_needs_gpu(fused, moe):
    ag, _ = fused
    with pytest.raises(TsgenTorchError, match=r"tsgen::allgather_gemm on rank 0: loaded on a group without GPUs"):
        ag.empty_out(64, 8192)
    with pytest.raises(TsgenArgumentError, match=r"argument a: dimension 1 \(K\) is 4096"):
        ag.empty_out(64, 4096)
    with pytest.raises(TsgenArgumentError, match=r"tsgen::moe_combine on rank 0: no out= form"):
        moe.combine.empty_out(2048, 2048)


def _heap_views(sig, count: int, world: int):
    """A CPU stand-in for a heap: one tensor per buffer of `sig`'s manifest slots, and view(name)."""
    manifest_buffers = {b.name: b for b in (*sig.inputs, *sig.outputs)}
    heap = {name: torch.zeros(b.elems(count, world) + 64, dtype=getattr(torch, b.dtype))[8:]  # 16-byte aligned
            for name, b in manifest_buffers.items()}
    return heap, heap.__getitem__


def test_plan_call_binds_local_buffers(fused):
    """The fused GEMMs' A, B and C go to the launcher by address (no copy); the gathered A is copied
    out of the heap, unless the out tensor is its heap slot (empty_out); a tensor at an address TMA
    cannot take (2 bytes off) goes through its heap slot."""
    from tsgen.torch.ops import plan_call

    ag, _ = fused
    sig = ag.signature
    heap, view = _heap_views(sig, 64, 4)
    x, w1, c, a_full = (torch.zeros(s, dtype=BF16) for s in ((64, 8192), (8192, 2048), (256, 2048), (256, 8192)))
    plan = plan_call(sig, (x, w1), (c, a_full), view)
    assert plan.pointers == {"a": x.data_ptr(), "b": w1.data_ptr(), "c": c.data_ptr()} and not plan.copy_in
    assert [(o.data_ptr(), v.data_ptr()) for o, v in plan.copy_out] == [(a_full.data_ptr(), heap["a_full"].data_ptr())]
    in_heap = heap["a_full"][:a_full.numel()].view(a_full.shape)
    assert not plan_call(sig, (x, w1), (c, in_heap), view).copy_out
    odd = torch.zeros(c.numel() + 1, dtype=BF16)[1:].view(c.shape)
    plan = plan_call(sig, (x, w1), (odd, in_heap), view)
    assert "c" not in plan.pointers and [o.data_ptr() for o, _ in plan.copy_out] == [odd.data_ptr()]


def test_plan_call_collective_copies(ops):
    """A collective's buffers are all in the heap: the input copied in unless it is the slot (op.empty),
    the output copied out unless it is the slot (op.empty_out)."""
    from tsgen.torch.ops import plan_call

    ag, _ = ops[2]
    heap, view = _heap_views(ag.signature, 32, 2)
    x, y = torch.zeros(4, 8, dtype=BF16), torch.zeros(8, 8, dtype=BF16)
    plan = plan_call(ag.signature, (x,), (y,), view)
    assert not plan.pointers and len(plan.copy_in) == 1 and len(plan.copy_out) == 1
    slots = (heap["src"][:32].view(4, 8), heap["dst"][:64].view(8, 8))
    plan = plan_call(ag.signature, slots[:1], slots[1:], view)
    assert not plan.pointers and not plan.copy_in and not plan.copy_out


def test_call_path_on_cpu(fused, monkeypatch):
    """A whole allgather_gemm call, on CPU: its heap a CPU tensor laid out by the manifest, the
    launcher a stand-in that writes what the kernel would (C, and the peers' rows of the gathered
    A in its heap slot). The launcher gets the caller's A, B and C by address and the heap's slots
    for the rest; C comes back written in place, the gathered A copied out with this rank's rows
    from A; a C at an unaligned address goes through its slot and is copied out."""
    import ctypes
    from types import SimpleNamespace

    from tsgen.torch.heap import Heap
    from tsgen.torch.ops import _HeapState

    ag, _ = fused
    sig, kernel, count, world = ag.signature, ag.kernel, 2, 4
    slots, nbytes = ag.manifest.layout(count, world)
    heap = Heap("cpu", torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(world, dtype=torch.int64),
                (ctypes.c_uint64 * world)())
    state = _HeapState.of(heap, slots, kernel, 0, count)
    names = [a.name for a in kernel.launcher_args]
    seen = []

    def launcher(*args):  # the kernel's writes: C = 1, the other ranks' rows of the gathered A = 2
        got = {n: a.value for n, a in zip(names, args)}
        seen.append(got)
        for name, value, skip in (("c", 1.0, 0), ("a_full", 2.0, count * 8192)):
            src = torch.full((world * count * {"c": 2048, "a_full": 8192}[name] - skip,), value, dtype=BF16)
            ctypes.memmove(got[name] + skip * 2, src.data_ptr(), src.numel() * 2)
        return 0

    monkeypatch.setattr(ag, "trace_only", False)
    monkeypatch.setattr(ag, "device", -1)  # torch.cuda.device(-1): no device switch
    monkeypatch.setattr(ag, "_launcher", launcher)
    monkeypatch.setattr(ag, "_heap", lambda n: state)
    monkeypatch.setattr(ag, "_check", lambda tensors: sig.check([(t.shape, "bfloat16", True) for t in tensors]))
    monkeypatch.setattr(ag, "_check_out", lambda tensors, outs: sig.check_out([t.shape for t in tensors],
                                                                                [(o.shape, "bfloat16", True) for o in outs]))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=0))
    x, w1 = torch.full((count, 8192), 3.0, dtype=BF16), torch.zeros(8192, 2048, dtype=BF16)
    offset = {s.name: s.offset for s in slots}
    c, a_full = torch.zeros(8, 2048, dtype=BF16), torch.zeros(8, 8192, dtype=BF16)
    got = ag._forward(x, w1, out=(c, a_full))
    assert got[0] is c and got[1] is a_full
    assert seen[-1]["a"] == x.data_ptr() and seen[-1]["b"] == w1.data_ptr() and seen[-1]["c"] == c.data_ptr()
    assert seen[-1]["a_full"] == heap.base + offset["a_full"] and seen[-1]["calls"] == heap.base + offset["calls"]
    assert bool((c == 1).all()) and bool((a_full[:count] == 3).all()) and bool((a_full[count:] == 2).all())
    odd = torch.zeros(c.numel() + 1, dtype=BF16)[1:].view(c.shape)
    ag._forward(x, w1, out=(odd, a_full))
    assert seen[-1]["c"] == heap.base + offset["c"] and bool((odd == 1).all())
    c2, a_full2 = ag._forward(x, w1)  # the functional form: new tensors, C written in place
    assert seen[-1]["c"] == c2.data_ptr() and bool((c2 == 1).all()) and bool((a_full2[count:] == 2).all())


def test_out_overlap_refused():
    from tsgen.torch.ops import overlap_problem

    buf = torch.zeros(100, dtype=BF16)
    assert overlap_problem(("a",), (buf[:50],), ("c",), (buf[50:],)) is None
    assert overlap_problem(("a",), (buf[:50],), ("c",), (buf[40:90],)) == (
        "out c overlaps argument a in memory (the kernel reads its inputs while it writes its outputs); pass a tensor "
        "of its own")
    assert "out d overlaps out c" in overlap_problem(("a",), (buf[:10],), ("c", "d"), (buf[20:40], buf[30:50]))


def _example_fused():
    """The fused GEMM specs examples/torch/tp_mlp.py loads at each world size, rendered: {W: (ag, rs) CachedModule}."""
    import sys

    from tsgen.harness import render_to_cache
    from tsgen.spec import load_spec

    sys.path.insert(0, str(ROOT / "examples" / "torch"))
    try:
        import tp_mlp
    finally:
        sys.path.remove(str(ROOT / "examples" / "torch"))
    return {w: tuple(render_to_cache(load_spec(p)) for p in pair) for w, pair in tp_mlp.FUSED_SPECS.items()}


class _OneRankOp:
    """A stand-in for a fused op at world size 1 with the out= form's contract (no kernel): the
    AG-GEMM writes (C, gathered A), the GEMM-RS writes C; empty_out gives plain tensors."""

    world = 1

    def __init__(self, n: int | None = None):
        self.n = n  # the AG-GEMM's N (None: a GEMM-RS)

    def __call__(self, a, b, out):
        if self.n is None:
            out.copy_(a @ b)
        else:
            out[0].copy_(a @ b)
            out[1].copy_(a)
        return out

    def empty_out(self, *shape):
        m, k = shape[0] if len(shape) == 1 else shape
        return torch.empty(m, self.n, dtype=torch.float64), torch.empty(m, k, dtype=torch.float64)


def test_example_out_variant_gradients():
    """examples/torch/tp_mlp.py's out= variant (its own autograd.Function over the out= form) gives
    autograd's output and gradients of the same block (float64, one rank: the gather and scatter are
    identities), so its backward formulas are those of the functional ops."""
    import sys

    sys.path.insert(0, str(ROOT / "examples" / "torch"))
    try:
        import tp_mlp
    finally:
        sys.path.remove(str(ROOT / "examples" / "torch"))
    g = torch.Generator().manual_seed(3)
    h, f, rows = 16, 24, 10
    w1, w2 = torch.randn(h, f, generator=g, dtype=torch.float64), torch.randn(f, h, generator=g, dtype=torch.float64)
    x, dy = torch.randn(rows, h, generator=g, dtype=torch.float64), torch.randn(rows, h, generator=g, dtype=torch.float64)
    got = tp_mlp.step(tp_mlp.FusedOutTPMLP(_OneRankOp(f), _OneRankOp(), w1, w2), x, dy)
    want = tp_mlp.step(tp_mlp.TPMLP(lambda t: t, lambda t: t, w1, w2), x, dy)
    for name, a, b in zip(tp_mlp.NAMES, got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), name


def test_example_fused_specs_are_adjoints():
    """The TP MLP example's AG-GEMM / GEMM-RS pair at each world size is compiled for mirrored shapes."""
    for w, (ag, rs) in _example_fused().items():
        a, r = signature_of(ag.manifest, w, 0), signature_of(rs.manifest, w, 0)
        assert a.adjoint_problem(r) is None and r.adjoint_problem(a) is None, w


@pytest.mark.compile
def test_example_fused_specs_compile():
    """...and each compiles as the shared library tsgen.torch loads (sm_90a, the GPU's arch on Hopper)."""
    from tsgen.toolchain import compile_source

    for w, pair in _example_fused().items():
        if w == 4:
            continue  # the shipped specs: `tsgen build specs --compile` compiles them
        for module in pair:
            assert compile_source(module.source, arch="sm_90a", mode="shared").output.exists()


# -- MoE: dispatch and combine, two ops on one heap ------------------------------------------------

@pytest.fixture(scope="module")
def moe(groups):
    """specs/moe.yaml (64 experts, top-8, hidden 2048, capacity 256, receive 2048 rows) at W 2."""
    return tt.load(GEN / "moe.json", groups[2])


def test_moe_ops_and_fake_shapes(moe):
    """load gives both ops (paired: unweighted combine); dispatch returns the receive buffers (fixed
    size: their first recv_counts[0] rows are this call's), combine a row per token."""
    assert isinstance(moe, tt.ModuleOps) and moe["dispatch"] is moe.dispatch
    assert moe.dispatch.adjoint is moe.combine and moe.combine.adjoint is moe.dispatch
    assert str(torch.ops.tsgen.moe_dispatch.default._schema) == ("tsgen::moe_dispatch(Tensor x, Tensor topk_idx, "
                                                                 "Tensor topk_weights, str group_name) -> (Tensor, Tensor, Tensor, Tensor)")
    assert str(torch.ops.tsgen.moe_combine.default._schema) == \
        "tsgen::moe_combine(Tensor y, Tensor topk_idx, str group_name) -> Tensor"
    with fake_mode():
        idx = torch.empty(100, 8, dtype=torch.int32, device="cuda")
        rx, ri, rw, rc = moe.dispatch(torch.empty(100, 2048, dtype=BF16, device="cuda"), idx,
                                      torch.empty(100, 8, device="cuda"))
        assert [(tuple(t.shape), t.dtype) for t in (rx, ri, rw, rc)] == [
            ((2048, 2048), BF16), ((2048, 8), torch.int32), ((2048, 8), torch.float32), ((2 + 8 + 64,), torch.int32)]
        out = moe.combine(rx, idx)
        assert tuple(out.shape) == (100, 2048) and out.dtype == BF16


@pytest.mark.parametrize("args, match", [
    (((300, 2048), torch.int32), r"tsgen::moe_dispatch on rank 0: argument x: 300 tokens, but specs/moe.yaml was "
                                 r"compiled for at most 256 \(params.capacity\)"),
    (((100, 2048), torch.int64), r"argument topk_idx: dtype int64, but specs/moe.yaml was compiled for int32"),
    (((100, 1024), torch.int32), r"argument x: dimension 1 \(hidden\) is 1024 .*compiled for hidden 2048"),
])
def test_moe_errors(moe, args, match):
    (shape, idx_dtype) = args
    with fake_mode():
        x = torch.empty(shape, dtype=BF16, device="cuda")
        idx = torch.empty(shape[0], 8, dtype=idx_dtype, device="cuda")
        with pytest.raises(TsgenArgumentError, match=match):
            moe.dispatch(x, idx, torch.empty(shape[0], 8, device="cuda"))


def test_moe_combine_checks_y(moe):
    with fake_mode():
        with pytest.raises(TsgenArgumentError, match=r"tsgen::moe_combine on rank 0: argument y: dimension 0 \(recv\) "
                                                     r"is 100 .*compiled for recv 2048"):
            moe.combine(torch.empty(100, 2048, dtype=BF16, device="cuda"),
                        torch.empty(100, 8, dtype=torch.int32, device="cuda"))


def test_moe_combine_has_no_heap_input_to_make(moe):
    """combine reads y where it is: op.empty names that, rather than sizing a heap with no count."""
    with pytest.raises(TsgenArgumentError, match=r"tsgen::moe_combine on rank 0: argument y: op.empty makes the first "
                                                 r"input in the op's heap, but \[recv 2048, hidden 2048\] is read where it is"):
        moe.combine.empty(2048, 2048)

def test_moe_call_order(moe):
    """dispatch, combine, dispatch, ...: on one heap an op out of turn raises, naming the order."""
    from types import SimpleNamespace

    moe.dispatch._check_order(SimpleNamespace(last=None))
    moe.combine._check_order(SimpleNamespace(last="dispatch"))
    moe.dispatch._check_order(SimpleNamespace(last="combine"))
    with pytest.raises(TsgenTorchError, match=r"tsgen::moe_combine on rank 0: called out of turn \(none was called "
                                              r"yet with this many tokens\); specs/moe.yaml's ops run in the order "
                                              r"dispatch -> combine -> dispatch"):
        moe.combine._check_order(SimpleNamespace(last=None))
    with pytest.raises(TsgenTorchError, match=r"moe_dispatch on rank 0: called out of turn \(the last was dispatch"):
        moe.dispatch._check_order(SimpleNamespace(last="dispatch"))


def test_moe_weighted_not_paired(groups):
    data = json.loads((GEN / "moe.json").read_text())
    data["constants"]["WEIGHTED"] = 1
    sig_d = signature_of(Manifest.from_json(json.dumps(data)), 2, 0, "dispatch")
    sig_c = signature_of(Manifest.from_json(json.dumps(data)), 2, 0, "combine")
    assert "combines weighted" in sig_d.adjoint_problem(sig_c)
    with pytest.raises(TsgenTorchError, match=r"specs/moe.yaml is 2 ops \(dispatch, combine\); name one"):
        signature_of(Manifest.from_json(json.dumps(data)), 2, 0)


def test_moe_compile_backward(moe):
    """An MoE layer (dispatch -> a per-row expert -> combine) under torch.compile(fullgraph=True) +
    AOTAutograd: the backward runs combine's adjoint (a dispatch of the output's gradient) before
    dispatch's (a combine), keeping the kernels' call order."""

    def layer(x, idx, weights, w):
        rx, _, rw, _ = moe.dispatch(x, idx, weights)
        return moe.combine(torch.tanh(rx @ w), idx)

    def make():
        x = torch.empty(64, 2048, dtype=BF16, requires_grad=True)
        w = torch.empty(2048, 2048, dtype=BF16, requires_grad=True)
        return layer, (x, torch.empty(64, 8, dtype=torch.int32), torch.empty(64, 8), w)

    (x, _, _, w), _, fwd, bwd = aot_graphs(make)
    assert tuple(x.grad.shape) == (64, 2048) and tuple(w.grad.shape) == (2048, 2048)
    assert fwd.index("tsgen.moe_dispatch.default") < fwd.index("tsgen.moe_combine.default"), fwd
    assert bwd.index("tsgen.moe_dispatch.default") < bwd.index("tsgen.moe_combine.default"), bwd


# -- signatures of every shipped collective --------------------------------------------------------

def _manifests():
    return sorted(GEN.glob("*.json"))


@pytest.mark.parametrize("path", _manifests(), ids=lambda p: p.stem)
def test_signature_matches_semantics(path):
    """Every shipped module either loads as a torch op (or ops, one per entry), with the chunk counts
    its family's semantics state (the torch layout) or the tensors its family names (each filling
    its buffer exactly; a fixed-shape one may be its buffer's first elements), or is refused with a
    TsgenTorchError, never anything else."""
    from tsgen.ops import get_family

    manifest = Manifest.load(path)
    for w in manifest.world_sizes:
        try:
            entries = entries_of(manifest, w)
            sigs = [signature_of(manifest, w, 0, e) for e in (entries["entries"] if entries else [None])]
        except TsgenTorchError:
            continue
        for sig in sigs:
            if not isinstance(sig, ShapedSignature):
                sem = get_family(manifest.op).semantics
                assert (sig.in_units, sig.out_units) == (sem.n_in(w), sem.n_out(w)), (path.stem, w)
                continue
            for t in sig.ins + sig.outs:
                if t.how == "arg":
                    continue  # a pointer argument, in no buffer
                numel = 1
                for n in t.shape(5):
                    numel *= n
                # gemm_reduce_scatter's B is the first K/P of K rows; MoE's receive buffers are whole
                fits = numel <= t.buffer.elems(5, w) if t.count_dim is None else numel == t.buffer.elems(5, w)
                assert fits, (path.stem, w, t.name)


def test_timeout_diagnosis_becomes_an_error(groups, monkeypatch, capfd):
    """synchronize() captures what the kernel printed at the failing synchronization and raises it
    as the error of this rank (simulated: a CUDA synchronize that prints a timeout and fails)."""
    line = ("tsgen: timeout: rank 0 block 3 thread 0 waited 10000 ms on arrive[1] (memory of rank 0) "
            "for a value >= 5; last seen 4")

    def failing_sync(device=None):
        os.write(1, (line + "\n").encode())
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(torch.cuda, "synchronize", failing_sync)
    with pytest.raises(TsgenTorchError, match=r"rank 0: a tsgen kernel timed out waiting for a peer: tsgen: timeout: "
                                              r"rank 0 block 3 .* last seen 4; CUDA: CUDA error: unspecified launch "
                                              r"failure; the CUDA context is lost"):
        tt.synchronize()
    assert line in capfd.readouterr().out  # passed on to stdout as well


@pytest.mark.compile
def test_launcher_plumbing_without_a_driver():
    """The path a call takes to the kernel, up to the driver: the module compiled as the shared library
    with the host launchers, `<kernel>_launch` through ctypes, the arguments by the manifest's roles
    (what TorchOp._heap builds). With no CUDA driver the launcher returns a CUDA error (35,
    insufficient driver) instead of launching: the call got through. Skipped where a driver is (the
    made-up addresses would then reach a GPU)."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("a CUDA driver is installed: the made-up heap addresses must not reach a GPU")
    except OSError:
        pass
    from tsgen.runtime.world import _host_launcher, arg_values, launcher_cargs
    from tsgen.toolchain import compile_source

    manifest = Manifest.load(GEN / "allgather.json")
    kernel = manifest.kernel(2)
    launch, prepare = _host_launcher(compile_source(GEN / "allgather.cu", mode="shared").output, kernel)
    assert prepare is None
    slots, nbytes = manifest.layout(1000, 2)
    base = 1 << 40
    values = arg_values(kernel.launcher_args, 1, 1000, base, {s.name: s.offset for s in slots}, 1 << 41, 0)
    by_name = {a.name: v for a, v in zip(kernel.launcher_args, values)}
    assert by_name["peers"] == 1 << 41 and by_name["rank"] == 1 and by_name["count"] == 1000
    assert by_name["calls"] == base and by_name["dst"] == base + {s.name: s.offset for s in slots}["dst"]
    err = launch(*launcher_cargs(kernel.launcher_args, values), ctypes.c_void_p(0))
    assert err != 0  # a cudaError_t, returned rather than crashed


# -- tests/torch_checks.py --shared: the parts that need no GPU -------------------------------------

def torch_checks():
    return load_script(ROOT / "tests" / "torch_checks.py")


def simulated_all_to_all(sends: list[torch.Tensor]) -> list[torch.Tensor]:
    """all_to_all_single of every rank's [W, ...] send buffer, in one process: rank j receives
    source r's slot j at its slot r."""
    return [torch.stack([send[j] for send in sends]) for j in range(len(sends))]


def test_shared_device_and_pattern():
    tc = torch_checks()
    assert [tc.shared_device(r, 1) for r in range(4)] == [0, 0, 0, 0]
    assert [tc.shared_device(r, 2) for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(RuntimeError, match="no CUDA device"):
        tc.shared_device(0, 0)
    xs = [tc.pattern(r, c, (6, 5, 7)) for r in range(8) for c in range(3)]
    assert all(x.dtype == BF16 and x.shape == (6, 5, 7) for x in xs)
    assert all(bool((x == x.float().round()).all()) and x.abs().max() <= 8 for x in xs)  # small integers
    assert len({tuple(x.flatten().tolist()) for x in xs}) == len(xs)  # every rank and call its own data
    total = torch.stack(xs[:8]).float().sum(0)
    assert torch.equal(total.to(BF16).float(), total)  # a sum over 8 ranks is exact in bf16


def test_shared_local_references():
    """The local references against what the collectives mean: allgather then reduce_scatter gives W
    times the own rows; all_to_all twice is the identity; Ulysses pre against the twin's reshape /
    permute formula (examples/torch/twins.py) over a simulated all_to_all, post its inverse."""
    tc = torch_checks()
    w = 4
    xs = [tc.pattern(r, 1, (6, 5)) for r in range(w)]
    gathered = [tc.local_allgather(xs, r) for r in range(w)]
    assert all(torch.equal(g, torch.cat(xs)) for g in gathered)
    assert all(torch.equal(tc.local_reduce_scatter(gathered, r), xs[r] * w) for r in range(w))
    ys = [tc.pattern(r, 2, (w * 3, 5)) for r in range(w)]
    once = [tc.local_all_to_all(ys, r) for r in range(w)]
    assert torch.equal(once[1][:3], ys[0][3:6])  # rank 1 gets rank 0's chunk 1 first
    assert all(torch.equal(tc.local_all_to_all(once, r), ys[r]) for r in range(w))
    b, s, h, d = 2, 3, 8, 4
    shards = [tc.pattern(r, 3, (b, s, h, d)) for r in range(w)]
    recv = simulated_all_to_all([x.reshape(b, s, w, h // w, d).permute(2, 0, 1, 3, 4) for x in shards])
    twin = [t.permute(1, 0, 2, 3, 4).reshape(b, w * s, h // w, d) for t in recv]
    pre = [tc.local_ulysses_pre(shards, r) for r in range(w)]
    assert all(torch.equal(p, t) for p, t in zip(pre, twin))
    assert all(torch.equal(tc.local_ulysses_post(pre, r), shards[r]) for r in range(w))


# -- ranks sharing a GPU (TSGEN_SHARE_GPUS=1): the specs fitted as tsgen test --share-gpus fits them --


class _Props:
    multi_processor_count = 132


def _shared_world(monkeypatch, ranks_on_gpu0: int, world: int):
    """tsgen.torch.ops as on a rank of `world` ranks, `ranks_on_gpu0` of them on GPU 0, TSGEN_SHARE_GPUS=1."""
    from tsgen.torch import ops

    monkeypatch.setenv("TSGEN_SHARE_GPUS", "1")
    buses = ["gpu0"] * ranks_on_gpu0 + [f"gpu{i}" for i in range(1, world - ranks_on_gpu0 + 1)]
    monkeypatch.setattr(ops.heap_mod, "all_gather", lambda group, obj: [(b, 132) for b in buses])
    monkeypatch.setattr(ops.dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(ops, "_bus", lambda dev: "gpu0")
    monkeypatch.setattr(ops.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(ops.torch.cuda, "get_device_properties", lambda dev: _Props())
    monkeypatch.setattr(ops.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(ops.dist, "get_rank", lambda group=None: 0)
    return ops


@pytest.mark.parametrize("colocated, blocks", [(8, 16), (4, 33), (2, 64)])
def test_shared_gpu_load_fits_the_spec_to_one_block_per_sm(monkeypatch, colocated, blocks):
    """8 ranks on one 132-SM GPU: 16 blocks each (8 x 64 did not fit: three ranks' grids held every SM
    while the other five never started); W 2 fits as shipped (2 x 64 <= 132)."""
    ops = _shared_world(monkeypatch, colocated, colocated)
    fitted = ops._fit_shared(ROOT / "specs" / "allgather.yaml", None)
    assert fitted.model.launch.blocks == blocks
    assert blocks * colocated <= 132


def test_shared_gpu_load_leaves_a_spec_alone_without_sharing(monkeypatch):
    ops = _shared_world(monkeypatch, 1, 2)
    assert ops._fit_shared(ROOT / "specs" / "allgather.yaml", None).model.launch.blocks == 64
    monkeypatch.delenv("TSGEN_SHARE_GPUS")
    path = ROOT / "specs" / "allgather.yaml"
    assert ops._fit_shared(path, None) is path  # not shared: no collective, the path as given


def test_shared_gpu_load_refuses_what_cannot_share_by_name(monkeypatch):
    ops = _shared_world(monkeypatch, 2, 2)
    with pytest.raises(TsgenTorchError, match=r"tsgen.torch.load on rank 0, 2 ranks per GPU: .*allgather_ce"):
        ops._fit_shared(ROOT / "specs" / "allgather_ce.yaml", None)


def test_shared_gpu_load_fits_the_smallest_gpu_and_skips_the_fake_backend(monkeypatch):
    """Every rank fits to the smallest SM count in the group (one variant for all); torch's fake backend
    only traces, so nothing is fitted there."""
    ops = _shared_world(monkeypatch, 4, 4)
    monkeypatch.setattr(ops.heap_mod, "all_gather", lambda group, obj: [("gpu0", 132)] * 3 + [("gpu0", 114)])
    assert ops._fit_shared(ROOT / "specs" / "allgather.yaml", None).model.launch.blocks == 114 // 4
    monkeypatch.setattr(ops.dist, "get_backend", lambda group=None: "fake")
    path = ROOT / "specs" / "allgather.yaml"
    assert ops._fit_shared(path, None) is path


def test_residency_counts_one_block_per_sm_for_ranks_sharing_a_gpu(monkeypatch):
    """_local_problem: ranks on one GPU are held to one block per SM (the bound fit_shared fits to, whatever
    the occupancy: under MPS three ranks' 64-block grids held all 132 SMs of an H200), so 4 x 64 blocks
    are refused by name; one rank per GPU keeps the threads' bound."""
    from tsgen.torch import ops

    class Props:
        multi_processor_count, max_threads_per_multi_processor = 132, 2048

    op = object.__new__(ops.TorchOp)
    op.rank, op.kernel = 0, type("K", (), {"name": "allgather_w4", "grid": (64,), "block": (512,)})()
    op.manifest = type("M", (), {"blocks_wait": False})()
    op.signature = type("S", (), {"qualname": "tsgen::allgather"})()
    monkeypatch.setattr(ops.torch.cuda, "get_device_properties", lambda dev: Props())
    monkeypatch.setattr(ops.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(ops, "_bus_id", lambda i: "gpu0")
    problem = op._local_problem(0, ["gpu0"] * 4)
    assert problem and "4 ranks share this GPU" in problem and "At most 33 blocks per rank" in problem, problem
    assert op._local_problem(0, ["gpu0"] * 2) is None  # 2 x 64 <= 132


def test_call_on_stream_switches_device_only_when_needed(monkeypatch):
    """tsgen.torch's launch path: where the op's GPU is current, the launcher gets the current stream's raw
    handle from torch's C API with no device context entered (a context and a Stream object cost tens of us a
    call); on another GPU, inside that device's context with its current stream; where torch has no such API
    (this CPU build), always the context."""
    import ctypes
    from types import SimpleNamespace

    from tsgen.torch.ops import call_on_stream

    entered, got = [], []

    class Ctx:
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            entered.append(self.d)

        def __exit__(self, *a):
            return False

    def launcher(*args):
        got.append(args)
        return 0

    monkeypatch.setattr(torch.cuda, "device", Ctx)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=77))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1000 + d, raising=False)
    assert call_on_stream(1, launcher, (5,)) == 0
    assert entered == [] and got[-1][0] == 5 and isinstance(got[-1][1], ctypes.c_void_p) and got[-1][1].value == 1001
    call_on_stream(0, launcher, (6,))
    assert entered == [0] and got[-1][0] == 6 and got[-1][1].value == 77
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")
    call_on_stream(1, launcher, (7,))
    assert entered == [0, 1] and got[-1][1].value == 77
