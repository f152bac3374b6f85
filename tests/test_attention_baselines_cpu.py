"""The attention baselines' math on CPU: interleaved rounds and paired ratios, the cudnn-frontend
graph's arguments, and the zig-zag context-parallel baseline (chunks, position order, LSE merge)
against the NumPy reference. The torch parts run where torch is installed (CPU torch is enough)."""

from __future__ import annotations

import collections
import numpy as np
import pytest

from tsgen.bench import attention_baselines as AB
from tsgen.bench.runner import add_ratios
from tsgen.bench.timing import Timing, paired_ratio, round_order, time_interleaved
from tsgen.ops.attention import attention_reference
from tsgen.ops.cp_attention import positions

# ---------------------------------------------------------------------------
# interleaved rounds, paired ratios
# ---------------------------------------------------------------------------


def test_round_order_rotate_puts_each_implementation_in_every_place():
    names = ["tsgen", "flash", "cudnn"]
    orders = [round_order(names, r, "rotate") for r in range(6)]
    assert orders[0] == names and orders[1] == ["flash", "cudnn", "tsgen"] and orders[3] == names
    for place in range(3):
        assert {o[place] for o in orders[:3]} == set(names)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_round_order_balanced_gives_every_place_and_every_predecessor_alike(n):
    """A Williams design: over a cycle each name takes every place equally often and follows every
    other name equally often (the rotation makes B follow A in every round: the bias this removes)."""
    names = [f"impl{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    orders = [round_order(names, r) for r in range(cycle)]
    assert all(sorted(o) == sorted(names) for o in orders)
    places = collections.Counter((o[i], i) for o in orders for i in range(n))
    assert set(places.values()) == {cycle // n}
    follows = collections.Counter((o[i], o[i + 1]) for o in orders for i in range(n - 1))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
    rotated = collections.Counter((o[i], o[i + 1]) for o in (round_order(names, r, "rotate") for r in range(cycle))
                                  for i in range(n - 1))
    assert n == 2 or len(rotated) < n * (n - 1)  # the control: rotation leaves neighbours fixed
    with pytest.raises(ValueError, match="round order"):
        round_order(names, 0, "shuffled")


class Recorder:
    """A Sampler stand-in: its samples are the device's "drift" clock at the time it is sampled."""

    def __init__(self, name, log, clock, cost):
        self.name, self.log, self.clock, self.cost, self.samples = name, log, clock, cost, []

    def prepare(self):
        self.log.append(("prepare", self.name))

    def sample(self):
        self.clock[0] += 1
        self.log.append(("sample", self.name))
        self.samples.append(self.cost * self.clock[0])  # the device slows down over the run
        return self.samples[-1]

    def finish(self):
        return Timing(self.samples, 1, "eager")


def test_time_interleaved_takes_one_sample_of_each_per_round_and_pairs_them():
    log, clock = [], [0]
    samplers = {n: Recorder(n, log, clock, c) for n, c in (("tsgen", 1.0), ("sdpa", 1.5))}
    got = time_interleaved(samplers, rounds=6)
    assert log[:2] == [("prepare", "tsgen"), ("prepare", "sdpa")]
    order = [n for kind, n in log if kind == "sample"]
    assert order == ["tsgen", "sdpa", "sdpa", "tsgen"] * 3  # rotated every round
    assert all(len(t.samples_us) == 6 for t in got.values())
    assert got["tsgen"].round_set and got["tsgen"].round_set == got["sdpa"].round_set
    # the drift (samples grow 12x over the run) cancels in the paired ratio: 1.5 within each round,
    # up to the one step the second of a round comes later
    paired = paired_ratio(got["sdpa"].samples_us, got["tsgen"].samples_us)
    assert 1.2 < paired["ratio"] < 2.0 and paired["rounds"] == 6
    assert abs(paired["ratio"] - 1.5) < abs(got["sdpa"].samples_us[-1] / got["tsgen"].samples_us[0] - 1.5)


def test_paired_ratio_compares_samples_of_the_same_round():
    tsgen = [10.0, 40.0, 20.0, 50.0, 30.0]
    base = [44.0, 11.0, 22.0, 33.0, 55.0]  # per round: 4.4, 0.275, 1.1, 0.66, 1.83
    p = paired_ratio(base, tsgen)
    assert p["ratio"] == pytest.approx(1.1) and p["min"] == pytest.approx(0.275) and p["max"] == pytest.approx(4.4)
    assert p["q1"] == pytest.approx(0.66) and p["q3"] == pytest.approx(55.0 / 30.0)
    # sorted samples (rounds not paired) would give 1.1 with no spread at all
    assert paired_ratio(sorted(base), sorted(tsgen))["max"] == pytest.approx(1.1)
    with pytest.raises(ValueError, match="not timed in the same rounds"):
        paired_ratio(base[:4], tsgen)


def test_add_ratios_pairs_rows_of_the_same_rounds_only():
    row = {"impl": "tsgen", "size": 8, "group": "g", "time_us": 30.0, "round_set": 3,
           "samples_us": [10.0, 40.0, 20.0, 50.0, 30.0]}
    inter = {"impl": "b", "baseline": True, "compare": True, "size": 8, "group": "g", "time_us": 33.0,
             "round_set": 3, "samples_us": [44.0, 11.0, 22.0, 33.0, 55.0]}
    other = dict(inter, impl="o", round_set=4, time_us=45.0)  # timed in other rounds (a suite's earlier entry)
    plain = {"impl": "c", "baseline": True, "compare": True, "size": 8, "group": "g", "time_us": 60.0}
    add_ratios([row, inter, other, plain])
    assert row["ratios"]["b"] == pytest.approx(1.1) and row["ratio_spread"]["b"]["rounds"] == 5
    assert row["ratios"]["o"] == pytest.approx(1.5) and "o" not in row["ratio_spread"]  # medians: not paired
    assert row["ratios"]["c"] == pytest.approx(2.0) and "c" not in row["ratio_spread"]


def test_method_control_pairs_the_two_callers_of_one_cudnn_kernel_in_tsgens_rounds():
    """SDPA cuDNN and cudnn-frontend run one cuDNN kernel: add_ratios keeps their paired ratio on tsgen's
    row (timed in its rounds) and the Markdown report prints it; an expanded-heads SDPA cuDNN, another
    round set or a missing partner gives no control."""
    from tsgen.bench.report import markdown_table

    sdpa, fe = "torch 2.11.0 SDPA cuDNN", "cuDNN 9.19.0 via cudnn-frontend 1.32.0 SDPA"
    assert AB.same_kernel_pair([sdpa, fe, "torch 2.11.0 SDPA flash"]) == (sdpa, fe)
    assert AB.same_kernel_pair([sdpa + " (K / V expanded to every head)", fe]) is None
    assert AB.same_kernel_pair([sdpa]) is None

    def rows(fe_round_set=3):
        base = {"size": 8192, "group": "g", "op": "attention", "baseline": True, "compare": True}
        return [{"impl": "tsgen", "label": "attention_hd128", "size": 8192, "group": "g", "op": "attention",
                 "time_us": 10.0, "spread_pct": 1.0, "round_set": 3, "samples_us": [10.0, 10.0, 10.0, 10.0]},
                dict(base, impl=sdpa, time_us=9.5, spread_pct=1.0, round_set=3, samples_us=[9.0, 9.5, 10.0, 9.5]),
                dict(base, impl=fe, time_us=10.0, spread_pct=1.0, round_set=fe_round_set,
                     samples_us=[9.9, 10.45, 10.0, 9.5])]

    timed = rows()
    add_ratios(timed)
    control = timed[0]["method_control"]
    assert control["pair"] == [sdpa, fe] and control["rounds"] == 4
    assert control["ratio"] == pytest.approx(1.05) and control["min"] == pytest.approx(1.0)
    text = markdown_table(timed)
    assert "The method's control" in text and "attention_hd128 8K 1.050 (1.000 - 1.100)" in text
    apart = rows(fe_round_set=4)  # cudnn-frontend timed in other rounds: no control
    add_ratios(apart)
    assert "method_control" not in apart[0] and "method's control" not in markdown_table(apart)


def test_add_ratios_prefers_the_baseline_of_the_rows_own_rounds():
    """A suite with baselines_per_entry times the same baseline once per entry of a group: each
    tsgen row is paired with the one of its own rounds, whatever the order of the rows."""
    rows = []
    for n, (t, b) in enumerate([(30.0, 33.0), (20.0, 36.0)], start=1):
        rows.append({"impl": "tsgen", "size": 8, "group": "g", "time_us": t, "round_set": n, "samples_us": [t] * 3})
        rows.append({"impl": "b", "baseline": True, "compare": True, "size": 8, "group": "g", "time_us": b,
                     "round_set": n, "samples_us": [b] * 3})
    for order in (rows, rows[::-1]):
        add_ratios(list(order))
        assert rows[0]["ratios"]["b"] == pytest.approx(1.1) and rows[2]["ratios"]["b"] == pytest.approx(1.8)


def test_suite_baselines_must_be_the_ops(tmp_path):
    from tsgen.bench.suites import load_suite
    from tsgen.errors import SpecError

    from conftest import ROOT

    bad = tmp_path / "s.yaml"
    bad.write_text(f"description: d\ngpus: 1\nbaselines: [nccl]\nentries:\n  - spec: {ROOT / 'specs' / 'attention_hd128.yaml'}\n")
    with pytest.raises(SpecError, match="baselines: 'nccl' is not a baseline of op attention \\(sdpa, cudnn_frontend, flash_attn_4\\)"):
        load_suite(bad)


# ---------------------------------------------------------------------------
# cudnn-frontend's graph arguments
# ---------------------------------------------------------------------------


def test_cudnn_sdpa_args_causal_gqa():
    a = AB.cudnn_sdpa_args(2, 64, 8, 4096, 128, 0.125, causal=True)
    assert a["q"] == {"dim": [2, 64, 4096, 128], "stride": [64 * 4096 * 128, 4096 * 128, 128, 1]}
    assert a["k"]["dim"] == a["v"]["dim"] == [2, 8, 4096, 128] and a["k"]["stride"] == [8 * 4096 * 128, 4096 * 128, 128, 1]
    assert a["o"] == a["q"]
    assert a["sdpa"] == {"attn_scale": 0.125, "generate_stats": False, "diagonal_alignment": "TOP_LEFT",
                         "diagonal_band_right_bound": 0}


def test_cudnn_sdpa_args_not_causal_has_no_band():
    a = AB.cudnn_sdpa_args(1, 32, 32, 1000, 64, 0.125, causal=False)
    assert a["sdpa"] == {"attn_scale": 0.125, "generate_stats": False}
    assert a["k"]["dim"] == [1, 32, 1000, 64]


def test_cudnn_versions_names_library_and_frontend():
    class Fake:
        __version__ = "1.32.0"

        @staticmethod
        def backend_version_string():
            return "9.19.0"

    assert AB.cudnn_versions(Fake) == "cuDNN 9.19.0 via cudnn-frontend 1.32.0"


class FakeCudnn:
    """cudnn-frontend's graph API as far as the builder uses it, recording every call."""

    __version__ = "1.32.0"

    class data_type:
        BFLOAT16, FLOAT = "bf16", "f32"

    class diagonal_alignment:
        TOP_LEFT, BOTTOM_RIGHT = "enum TOP_LEFT", "enum BOTTOM_RIGHT"

    class heur_mode:
        A, FALLBACK = "A", "FALLBACK"

    def __init__(self):
        self.log = []
        outer = self

        class T:
            def __init__(self, **kw):
                self.kw = kw

            def __getattr__(self, name):  # set_output, set_dim, set_stride, set_data_type: chained
                def setter(*a):
                    outer.log.append((name, a))
                    return self
                return setter

        class Graph:
            def __init__(self, **kw):
                outer.log.append(("pygraph", kw))

            def tensor(self, **kw):
                outer.log.append(("tensor", kw))
                return T(**kw)

            def sdpa(self, **kw):
                outer.log.append(("sdpa", {k: (v.kw["name"] if isinstance(v, T) else v) for k, v in kw.items()}))
                return T(name="O"), None

            def __getattribute__(self, name):
                if name in ("validate", "build_operation_graph", "create_execution_plans", "check_support",
                            "build_plans"):
                    return lambda *a: outer.log.append((name, a))
                if name == "get_workspace_size":
                    return lambda: 1024
                return object.__getattribute__(self, name)

        self.pygraph = Graph

    def create_handle(self):
        return "handle"


class FakeTorch:
    uint8 = "u8"

    class cuda:
        @staticmethod
        def device(dev):
            import contextlib
            return contextlib.nullcontext()

    @staticmethod
    def empty(n, dtype, device):
        return ("workspace", n, device)


def test_cudnn_graph_builder_passes_the_arguments_through():
    cudnn = FakeCudnn()
    args = AB.cudnn_sdpa_args(1, 64, 8, 2048, 128, 0.088, causal=True)
    handle, g, ts, ws = AB._cudnn_graph(cudnn, FakeTorch, 3, args)
    assert handle == "handle" and ws == ("workspace", 1024, "cuda:3") and set(ts) == {"q", "k", "v", "o"}
    log = dict((k, v) for k, v in cudnn.log if k in ("pygraph", "sdpa"))
    assert log["pygraph"] == {"io_data_type": "bf16", "intermediate_data_type": "f32", "compute_data_type": "f32",
                              "handle": "handle"}
    assert log["sdpa"] == {"name": "sdpa", "q": "q", "k": "k", "v": "v", "attn_scale": 0.088, "generate_stats": False,
                           "diagonal_alignment": "enum TOP_LEFT", "diagonal_band_right_bound": 0}
    tensors = {kw["name"]: kw for k, kw in cudnn.log if k == "tensor"}
    assert tensors["k"]["dim"] == [1, 8, 2048, 128] and tensors["q"]["data_type"] == "bf16"
    steps = [k for k, _ in cudnn.log]
    assert ("set_dim", ([1, 64, 2048, 128],)) in cudnn.log and ("set_output", (True,)) in cudnn.log
    assert steps[-5:] == ["validate", "build_operation_graph", "create_execution_plans", "check_support", "build_plans"]
    # one build per shape: the same arguments again reuse it
    n = len(cudnn.log)
    assert AB._cudnn_graph(cudnn, FakeTorch, 3, args)[1] is g and len(cudnn.log) == n


# ---------------------------------------------------------------------------
# the zig-zag context-parallel baseline
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_pieces_cover_each_querys_causal_keys(world):
    half = 5
    for rank in range(world):
        pos = positions("zigzag", world, 2 * half, rank)
        pieces = AB.zigzag_pieces(world, rank, half)
        assert [p[1] for p in pieces] == list(AB.zigzag_query_chunks(world, rank))
        for row, chunk, full, diag in pieces:
            rows = pos[row:row + half]
            assert list(rows) == list(range(chunk * half, (chunk + 1) * half))  # the chunk's queries
            assert full == rows[0] and diag == rows[-1] + 1  # keys [0, first) whole, then the diagonal


def _torch():
    return pytest.importorskip("torch", reason="torch is not installed: the zig-zag math runs on torch")


def _attend(torch, scale):
    """Explicit float64 softmax attention on CPU: (o, lse); causal top-left, K / V heads grouped."""
    def attend(q, k, v, causal):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = (q @ k.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)
    return attend


def test_merge_lse_equals_attention_over_the_union():
    torch = _torch()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 16, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = torch.cat([k, torch.randn(1, 2, 5, 16, generator=g, dtype=torch.float64)], 2), \
        torch.cat([v, torch.randn(1, 2, 5, 16, generator=g, dtype=torch.float64)], 2)
    attend = _attend(torch, 0.25)
    o_all, lse_all = attend(q, k, v, False)
    o1, l1 = attend(q, k[:, :, :4], v[:, :, :4], False)
    o2, l2 = attend(q, k[:, :, 4:], v[:, :, 4:], False)
    o, lse = AB.merge_lse(torch, o1, l1, o2, l2)
    assert torch.allclose(o, o_all, atol=1e-12) and torch.allclose(lse, lse_all, atol=1e-12)
    o_bad, _ = AB.merge_lse(torch, o1, l1, o2, l2 + 1.0)  # a wrong weight shows
    assert not torch.allclose(o_bad, o_all, atol=1e-3)


@pytest.mark.parametrize("world", [2, 3])
def test_to_position_order_matches_cp_attention_layout(world):
    torch = _torch()
    n = 6
    gathered = torch.stack([torch.as_tensor(positions("zigzag", world, n, r), dtype=torch.float64)
                            .reshape(1, 1, n, 1).expand(1, 2, n, 3) for r in range(world)])
    got = AB.to_position_order(torch, gathered, world)
    assert torch.equal(got[0, 1, :, 0], torch.arange(world * n, dtype=torch.float64))


@pytest.mark.parametrize("world,heads,kv_heads", [(2, 2, 2), (3, 4, 2), (4, 2, 1)])
def test_zigzag_attention_equals_the_reference(world, heads, kv_heads):
    """Every rank's zig-zag output (gathered K / V put in position order, per-chunk SDPA, LSE merge)
    against the NumPy reference of causal attention over the whole sequence at its positions."""
    torch = _torch()
    rng = np.random.default_rng(1)
    n, d, scale = 8, 16, 0.25
    seq = world * n
    qg = rng.standard_normal((1, seq, heads, d))
    kg = rng.standard_normal((1, seq, kv_heads, d))
    vg = rng.standard_normal((1, seq, kv_heads, d))

    def local(x, r):  # rank r's rows, [b, h, n, d]
        return torch.as_tensor(x[:, positions("zigzag", world, n, r)]).permute(0, 2, 1, 3).contiguous()

    k_all = torch.stack([local(kg, r) for r in range(world)])
    v_all = torch.stack([local(vg, r) for r in range(world)])
    kp, vp = AB.to_position_order(torch, k_all, world), AB.to_position_order(torch, v_all, world)
    for rank in range(world):
        pos = positions("zigzag", world, n, rank)
        got = AB.zigzag_attention(torch, local(qg, rank), kp, vp, world, rank, _attend(torch, scale))
        ref, _ = attention_reference(qg[:, pos], kg, vg, scale, True, q_pos=pos)
        assert np.allclose(got.permute(0, 2, 1, 3).numpy(), ref, atol=1e-10), f"rank {rank}"
    # the same without the merge (only the diagonal chunk) is wrong: the test sees dropped keys
    def diagonal_only(q, k, v, causal):  # the earlier chunks come back empty (LSE -inf)
        if causal:
            return _attend(torch, scale)(q, k, v, causal)
        return q * 0, torch.full(q.shape[:3], -torch.inf, dtype=q.dtype)

    got = AB.zigzag_attention(torch, local(qg, 0), kp, vp, world, 0, diagonal_only)
    ref, _ = attention_reference(qg[:, positions("zigzag", world, n, 0)], kg, vg, scale, True,
                                 q_pos=positions("zigzag", world, n, 0))
    assert not np.allclose(got.permute(0, 2, 1, 3).numpy(), ref, atol=1e-3)


# ---------------------------------------------------------------------------
# cudnn-frontend's SDPA backward (the backward bench's cuDNN column)
# ---------------------------------------------------------------------------


class ExecCudnn:
    """cudnn-frontend's graph API as cudnn_backward uses it, executing on CPU torch in float64: each
    tensor is read through the dims and strides the graph declared for it (so a layout that does not
    match the buffers reads scrambled values), the forward's statistics are the natural-log LSE, the
    backward checks that it was handed the forward's O and statistics."""

    __version__ = "1.32.0"

    class data_type:
        BFLOAT16, HALF, FLOAT = "bf16", "f16", "f32"

    class diagonal_alignment:
        TOP_LEFT = "TOP_LEFT"

    class heur_mode:
        A, FALLBACK = "A", "FALLBACK"

    def __init__(self, torch):
        self.torch, self.log = torch, []
        outer = self

        class T:
            def __init__(self, name, dim=None, stride=None):
                self.name, self.dim, self.stride = name, dim, stride

            def set_output(self, flag):
                return self

            def set_dim(self, dim):
                self.dim = dim
                return self

            def set_stride(self, stride):
                self.stride = stride
                return self

            def set_data_type(self, dt):
                return self

        class Graph:
            def __init__(self, **kw):
                self.node = None

            def tensor(self, name, dim, stride, data_type):
                return T(name, dim, stride)

            def sdpa(self, name, q, k, v, **kw):
                self.node = ("sdpa", (q, k, v), kw)
                self.outs = (T("o"), T("stats"))
                return self.outs

            def sdpa_backward(self, name, q, k, v, o, dO, stats, **kw):
                self.node = ("bwd", (q, k, v, o, dO, stats), kw)
                self.outs = (T("dq"), T("dk"), T("dv"))
                return self.outs

            def validate(self):
                pass

            build_operation_graph = check_support = build_plans = validate

            def create_execution_plans(self, modes):
                pass

            def get_workspace_size(self):
                return 16

            def execute(self, pack, ws, handle):
                outer.log.append((self.node[0], handle))
                outer.run(self, pack)

        self.pygraph = Graph

    def create_handle(self):
        return "handle"

    def set_stream(self, handle, stream):
        self.log.append(("stream", handle, stream))

    def view(self, t, buf):
        return self.torch.as_strided(buf, t.dim, t.stride)

    def attend(self, q, k, v, kw):
        torch = self.torch
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = (q @ k.transpose(-1, -2)) * kw["attn_scale"]
        if kw.get("diagonal_alignment") == "TOP_LEFT":
            assert kw["diagonal_band_right_bound"] == 0
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1, keepdim=True)
        return torch.exp(s - lse) @ v, lse

    def run(self, graph, pack):
        kind, ins, kw = graph.node
        x = [self.view(t, pack[t]).double() for t in ins]
        if kind == "sdpa":
            o, lse = self.attend(*x, kw)
            for t, val in zip(graph.outs, (o, lse)):
                self.view(t, pack[t]).copy_(val)
            return
        q, k, v, o, do, stats = x
        q, k, v = (a.clone().requires_grad_(True) for a in (q, k, v))
        want_o, want_lse = self.attend(q, k, v, kw)
        assert self.torch.allclose(o, want_o.detach(), atol=2e-2) and self.torch.allclose(stats, want_lse.detach())
        grads = self.torch.autograd.grad(want_o, (q, k, v), do)
        for t, val in zip(graph.outs, grads):
            self.view(t, pack[t]).copy_(val)


@pytest.mark.parametrize("heads,kv_heads,causal", [(4, 4, False), (4, 2, True)])
def test_cudnn_backward_reads_the_bench_layout_and_gets_sdpas_gradients(heads, kv_heads, causal):
    """cudnn_backward on [batch, seq, heads, d] buffers: the forward once (O and its statistics into
    the backward), the backward on the handle's stream; its dQ, dK, dV those of the float64 reference
    (a layout declared wrong reads scrambled values and fails)."""
    torch = _torch()
    gen = torch.Generator().manual_seed(5)
    b, s, d = 2, 24, 16
    q, do = (torch.randn(b, s, heads, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, s, kv_heads, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    cudnn = ExecCudnn(torch)
    call, (dq, dk, dv) = AB.cudnn_backward(cudnn, torch, q, k, v, do, causal, d ** -0.5, 1234)
    assert cudnn.log == [("stream", "handle", 1234), ("sdpa", "handle")]
    call()
    assert cudnn.log[-1] == ("bwd", "handle")
    qq, kk, vv = (x.double().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    ref, _ = cudnn.attend(qq, kk, vv, {"attn_scale": d ** -0.5, **({"diagonal_alignment": "TOP_LEFT",
                                                                     "diagonal_band_right_bound": 0} if causal else {})})
    want = torch.autograd.grad(ref, (qq, kk, vv), do.double().transpose(1, 2))
    for got, w in zip((dq, dk, dv), want):
        assert got.shape == w.transpose(1, 2).shape
        assert AB.tensor_rel_err(got, w.transpose(1, 2)) < 1e-2


def test_cudnn_backward_args_match_the_forward_and_the_buffers():
    args = AB.cudnn_sdpa_backward_args(2, 32, 8, 4096, 128, 0.088, causal=True)
    assert args["k"] == {"dim": [2, 8, 4096, 128], "stride": [4096 * 8 * 128, 128, 8 * 128, 1]}
    assert args["stats"] == {"dim": [2, 32, 4096, 1], "stride": [32 * 4096, 4096, 1, 1]}
    band = {"diagonal_alignment": "TOP_LEFT", "diagonal_band_right_bound": 0}
    assert args["forward"] == {"attn_scale": 0.088, "generate_stats": True, **band}
    assert args["backward"] == {"attn_scale": 0.088, **band}
    assert "diagonal_alignment" not in AB.cudnn_sdpa_backward_args(1, 4, 4, 64, 64, 0.1, causal=False)["backward"]
