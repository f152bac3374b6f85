"""tsgen.torch.cp_attention on CPU (issue 35, item 2): context-parallel attention composed from tsgen's
allgather, attention (forward, backward at run-time positions) and reduce_scatter ops. The positions
and the gathered order against tsgen.ops.cp_attention's, the positioned ops' schemas and fake
kernels, the fake shapes of a forward + backward, the errors (layouts, rows, world size, mismatched
specs), and the composition's math: W ranks simulated by threads in this process (the collectives
exchanged through a barrier), the kernels replaced by float64 stand-ins (tsgen.ops.attention's
references at the positions the op hands them), each rank's O, LSE, dQ, dK and dV against the
reference over the whole sequence, split per rank; overlap_backward's runs of key rows, the order of its
calls and its sums the same way. No GPU: the ops load on a group of torch's fake
backend, where they trace but do not run (tests/torch_checks.py --cp runs them on GPUs)."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import fake_groups, fake_mode, load_script

torch = pytest.importorskip("torch", reason="tsgen.torch needs PyTorch: pip install '.[torch]'")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover - builds without distributed
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

import tsgen.torch as tt  # noqa: E402
from tsgen.ops.attention import attention_backward_reference, attention_reference  # noqa: E402
from tsgen.ops.cp_attention import positions as row_positions  # noqa: E402
from tsgen.spec import load_spec, spec_variant  # noqa: E402
from tsgen.torch.cp_attention_op import _sum, backward_runs, cp_positions, gather_order  # noqa: E402
from tsgen.torch.signature import TsgenArgumentError, TsgenTorchError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GEN = ROOT / "generated"
BF16 = torch.bfloat16


def torch_checks():
    return load_script(ROOT / "tests" / "torch_checks.py")


def pair_specs(name: str) -> tuple[Path, Path]:
    fwd, bwd = torch_checks().ATTENTION_PAIRS[name]
    return ROOT / fwd, ROOT / bwd


@pytest.fixture(scope="module")
def groups():
    """conftest.fake_groups: 2, 4 and 5 ranks of a fake world of 8."""
    yield from fake_groups()


def load_cp(groups, w: int, pair: str, layout: str, **kw):
    fwd, bwd = pair_specs(pair)
    return tt.cp_attention(fwd, bwd, GEN / "allgather.json", GEN / "reduce_scatter.json", groups[w], layout=layout,
                           **kw)


# -- positions and the gathered order -------------------------------------------------------------

def rows_of(pos: tuple, count: int) -> np.ndarray:
    q_offset, q_split, q_offset2, _ = pos
    r = np.arange(count)
    return np.where(r < q_split, q_offset + r, q_offset2 + r - q_split)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_positions_are_the_cp_ops(layout, world):
    """The run-time positions give each row the position tsgen.ops.cp_attention.positions gives it
    (the forward kernel's test layout), and the ranks' rows cover the sequence once."""
    count = 6
    seen = []
    for rank in range(world):
        got = rows_of(cp_positions(layout, world, count, rank), count)
        np.testing.assert_array_equal(got, row_positions(layout, world, count, rank))
        seen.extend(got)
    assert sorted(seen) == list(range(world * count))


@pytest.mark.parametrize("world", [2, 4])
def test_gather_order_is_position_order(world):
    """Causal zig-zag: the all-gather's rows (rank-major) picked by gather_order are in position order;
    contiguous or not causal: no reordering."""
    count = 6
    gathered = np.concatenate([row_positions("zigzag", world, count, r) for r in range(world)])
    assert list(gathered[gather_order("zigzag", True, world, count)]) == list(range(world * count))
    assert gather_order("zigzag", False, world, count) is None
    assert gather_order("contiguous", True, world, count) is None


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_backward_runs_cover_the_rows_the_rank_makes(layout, causal, world):
    """overlap_backward's runs, in the kernel's key order: disjoint, together every key row that sees one
    of this rank's queries (causal: positions up to its last query's; else all), the own runs this rank's
    rows only, each mapping to consecutive local rows, the peers' runs none of them; at W 2 one run of
    the peers' rows (one kernel call before the reduce-scatter)."""
    count = 6
    for rank in range(world):
        peers, own = backward_runs(layout, causal, world, count, rank)
        order = gather_order(layout, causal, world, count)
        gathered = (lambda j: order[j]) if order is not None else (lambda j: j)
        last = rows_of(cp_positions(layout, world, count, rank), count).max()
        want = set(range(last + 1 if causal else world * count))
        rows = [j for a, b in peers + own for j in range(a, b)]
        assert sorted(rows) == sorted(want), (rank, peers, own)
        mine = range(rank * count, (rank + 1) * count)
        assert all(gathered(j) not in mine for a, b in peers for j in range(a, b)), (rank, peers)
        for a, b in own:
            local = [gathered(j) - rank * count for j in range(a, b)]
            assert local == list(range(local[0], local[0] + b - a)) and set(local) <= set(range(count)), (rank, own)
        if world == 2:
            assert len(peers) <= 1, (rank, peers)


def test_the_partial_dqs_are_rounded_once():
    """overlap_backward adds the calls' 16-bit dQs with one rounding: two by torch's add (fp32, then one
    rounding), three in fp32; one part is itself."""
    gen = torch.Generator().manual_seed(35)
    a, b, c = (torch.randn(4096, generator=gen).to(BF16) for _ in range(3))
    assert torch.equal(_sum([a, b]), (a.float() + b.float()).to(BF16))
    assert torch.equal(_sum([a, b, c]), (a.float() + b.float() + c.float()).to(BF16))
    assert _sum([a]) is a


# -- the ops: schemas, fake kernels ---------------------------------------------------------------

def test_positioned_schemas(groups):
    cp = load_cp(groups, 2, "hd128_causal_gqa", "zigzag")
    fwd, bwd = cp.attention.forward.name, cp.attention.backward.name
    assert str(getattr(torch.ops.tsgen, f"{fwd}_at").default._schema) == (
        f"tsgen::{fwd}_at(Tensor q, Tensor k, Tensor v, SymInt q_offset, SymInt q_split, SymInt q_offset2, "
        "SymInt kv_offset) -> (Tensor, Tensor)")
    assert str(getattr(torch.ops.tsgen, f"{bwd}_at").default._schema).endswith(
        "SymInt q_offset, SymInt q_split, SymInt q_offset2, SymInt kv_offset) -> (Tensor, Tensor, Tensor)")
    assert cp.world == 2 and cp.rank == 0 and cp.causal and "zigzag" in repr(cp)


@pytest.mark.parametrize("w", [2, 4])
@pytest.mark.parametrize("pair, layout, kv_together, overlap", [("hd128_causal_gqa", "zigzag", False, False),
                                                                ("hd128", "contiguous", False, False),
                                                                ("hd128_causal_gqa", "zigzag", True, False),
                                                                ("hd128_causal_gqa", "zigzag", False, True),
                                                                ("hd128", "contiguous", True, True)])
def test_fake_forward_and_backward_shapes(groups, w, pair, layout, kv_together, overlap):
    """Under FakeTensorMode: O and LSE of this rank's rows, dQ, dK, dV of the inputs' shapes (the fake
    allgather, attention _at ops, reduce_scatter; overlap_backward: the backward op on runs of key rows)."""
    cp = load_cp(groups, w, pair, layout, kv_together=kv_together, overlap_backward=overlap)
    sig = cp.attention.signature
    n = 64
    with fake_mode():
        q = torch.empty(1, n, sig.heads, sig.head_dim, dtype=BF16, requires_grad=True)
        k, v = (torch.empty(1, n, sig.kv_heads, sig.head_dim, dtype=BF16, requires_grad=True) for _ in range(2))
        o, lse = cp(q, k, v, return_lse=True)
        assert tuple(o.shape) == tuple(q.shape) and tuple(lse.shape) == (1, sig.heads, n)
        assert lse.dtype == torch.float32 and not lse.requires_grad
        o.float().sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_positioned_fake_kernel_errors(groups):
    cp = load_cp(groups, 2, "hd128", "contiguous")
    at = getattr(torch.ops.tsgen, f"{cp.attention.forward.name}_at")
    with fake_mode():
        q = torch.empty(1, 8, 32, 128, dtype=BF16)
        with pytest.raises(TsgenArgumentError, match=r"q_split 9: the first query segment's rows, 0..q_len \(8\)"):
            at(q, q, q, 0, 9, 0, 0)
        with pytest.raises(TsgenArgumentError, match=r"kv_offset -1: positions are >= 0"):
            at(q, q, q, 0, 8, 0, -1)


# -- errors -----------------------------------------------------------------------------------------

def test_argument_errors(groups):
    cp = load_cp(groups, 2, "hd128_causal_gqa", "zigzag")
    with fake_mode():
        q = torch.empty(1, 6, 32, 128, dtype=BF16)
        k = torch.empty(1, 6, 8, 128, dtype=BF16)
        with pytest.raises(TsgenArgumentError, match=r"argument k: 4 rows .* but q has 6: every rank holds"):
            cp(q, k[:, :4], k)
        with pytest.raises(TsgenArgumentError, match=r"7 rows per rank: zigzag holds two chunks"):
            q7, k7 = torch.empty(1, 7, 32, 128, dtype=BF16), torch.empty(1, 7, 8, 128, dtype=BF16)
            cp(q7, k7, k7)
        with pytest.raises(TsgenArgumentError, match=r"argument q: 3 dimensions"):
            cp(q[0], k, k)
        with pytest.raises(TsgenArgumentError, match=r"dimension 2 \(kv_heads\) is 32"):
            cp(q, q, q)  # K with the query heads: the gathered K reaches the kernel's check


def test_load_errors(groups):
    fwd, bwd = pair_specs("hd128")
    ag, rs = GEN / "allgather.json", GEN / "reduce_scatter.json"
    with pytest.raises(TsgenTorchError, match=r"layout 'ring'; one of contiguous, zigzag"):
        tt.cp_attention(fwd, bwd, ag, rs, groups[2], layout="ring")
    with pytest.raises(TsgenTorchError, match=r"needs the attention_backward spec"):
        tt.cp_attention(fwd, None, ag, rs, groups[2])
    with pytest.raises(TsgenTorchError, match=r"its allgather argument is .*op reduce_scatter, not allgather"):
        tt.cp_attention(fwd, bwd, rs, ag, groups[2])
    with pytest.raises(TsgenTorchError, match=r"compiled for"):  # world 5: the collectives' world_sizes lack it
        tt.cp_attention(fwd, bwd, ag, rs, groups[5])
    fp16 = spec_variant(load_spec(ROOT / "specs" / "allgather.yaml"), {"name": "allgather_cp_fp16", "dtype": "float16"})
    with pytest.raises(TsgenTorchError, match=r"allgather .* moves float16, the attention is bfloat16"):
        tt.cp_attention(fwd, bwd, fp16, rs, groups[2])
    other = tt.load(ag, groups[4])
    with pytest.raises(TsgenTorchError, match=r"reduce_scatter is on group .* not the allgather's"):
        tt.cp_attention(fwd, bwd, other, rs, groups[2])
    causal_fwd, _ = pair_specs("hd128_causal_gqa")
    with pytest.raises(TsgenTorchError, match=r"do not compute the same attention"):
        tt.cp_attention(causal_fwd, bwd, ag, rs, groups[2])


# -- the composition's math: a simulated world, stand-in kernels ----------------------------------

class SimulatedWorld:
    """W ranks as threads of this process: allgather and reduce_scatter through a barrier (every rank
    posts its tensor, waits, reads them all), as torch's all_gather_into_tensor and
    reduce_scatter_tensor define them."""

    def __init__(self, world: int):
        self.world = world
        self.posted: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def _exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.posted[rank] = x
        self.barrier.wait()
        seen = list(self.posted)
        self.barrier.wait()  # every rank read them before the next exchange posts
        return seen

    def allgather(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(rank, x))

    def reduce_scatter(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        parts = [t.chunk(self.world)[rank] for t in self._exchange(rank, x)]
        return torch.stack(parts).sum(0)


def run_ranks(sim: SimulatedWorld, rank_main) -> None:
    """rank_main(rank) on a thread per rank of `sim`; the first exception of any rank raised here (the
    barrier aborted, so that the other ranks stop waiting)."""
    errors: list = []

    def body(rank: int) -> None:
        try:
            rank_main(rank)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            sim.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(sim.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def stand_in_kernels(cp, monkeypatch, calls: list):
    """The attention modules' run-time entries replaced by tsgen.ops.attention's float64 references
    at the positions the op hands them (bshd)."""
    sig = cp.attention.signature

    def rows(positions, q_len, kv_len):
        q_offset, q_split, q_offset2, kv_offset = positions
        r = np.arange(q_len)
        return np.where(r < q_split, q_offset + r, q_offset2 + r - q_split), kv_offset + np.arange(kv_len)

    def forward(q, k, v, positions=None):
        qp, kp = rows(positions, q.shape[1], k.shape[1])
        calls.append(("forward", tuple(positions), k.shape[1]))
        o, lse = attention_reference(q.numpy(), k.numpy(), v.numpy(), sig.scale, sig.causal, qp, kp)
        return torch.from_numpy(o), torch.from_numpy(lse)  # float64 (the kernel's is float32): exact comparisons

    def backward(q, k, v, o, do, lse, positions=None):
        qp, kp = rows(positions, q.shape[1], k.shape[1])
        calls.append(("backward", tuple(positions), k.shape[1]))
        got = attention_backward_reference(q.numpy(), k.numpy(), v.numpy(), o.numpy(), do.numpy(),
                                           lse.numpy(), sig.scale, sig.causal, qp, kp)
        return tuple(torch.from_numpy(x) for x in got[:3])

    monkeypatch.setattr(cp.attention.forward, "run_forward", forward)
    monkeypatch.setattr(cp.attention.backward, "run_backward", backward)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("pair, layout, regather, kv_together, overlap, fused", [
    ("hd128_causal_gqa", "zigzag", False, False, False, False),
    ("hd128_causal_gqa", "contiguous", True, False, False, False),
    ("hd128", "zigzag", False, False, False, False),
    ("hd128", "contiguous", False, False, False, False),
    ("hd128_causal_gqa", "zigzag", False, True, False, False),
    ("hd128_causal_gqa", "zigzag", True, True, False, False),
    ("hd128", "contiguous", False, True, False, False),
    ("hd128_causal_gqa", "zigzag", False, False, True, False),
    ("hd128_causal_gqa", "contiguous", False, False, True, False),
    ("hd128", "zigzag", False, False, True, False),
    ("hd128", "contiguous", True, False, True, False),
    ("hd128_causal_gqa", "zigzag", True, True, True, False),
    ("hd128_causal_gqa", "zigzag", False, False, False, True),
    ("hd128", "contiguous", False, False, False, True),
    ("hd128_causal_gqa", "contiguous", False, False, False, True),
    ("hd128", "zigzag", False, True, False, True),
    ("hd128_causal_gqa", "zigzag", True, False, False, True),
    ("hd128_causal_gqa", "zigzag", False, True, True, True)])
def test_composition_in_a_simulated_world(groups, monkeypatch, world, pair, layout, regather, kv_together, overlap,
                                          fused):
    """Every rank's O, LSE, dQ, dK, dV through the op (its gather, positions, reorder, the backward's
    reorder and reduce-scatter; kv_together: K and V in one gather, dK and dV in one scatter;
    overlap_backward: the backward kernel on runs of key rows, the peers' partial sums reduce-scattered,
    the own ones added after), with the kernels as float64 references, equal the reference over the
    whole sequence (float64, positions from 0), split per rank: the composition is the whole-sequence
    attention and its adjoint. `fused`: the forward through a float64 stand-in of the cp_attention kernel
    that leaves this rank's own rows of the gathered K, V unwritten (fused_forward copies them in)."""
    base = load_cp(groups, world, pair, layout, regather=regather, kv_together=kv_together, overlap_backward=overlap,
                   fused=fused_spec(pair, layout) if fused else None)
    sig = base.attention.signature
    calls: list = []
    stand_in_kernels(base, monkeypatch, calls)
    n, batch = 8, 1
    S = world * n
    gen = torch.Generator().manual_seed(35 + world)
    heads, kv_heads, d = sig.heads, sig.kv_heads, sig.head_dim
    q = torch.randn(batch, S, heads, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, S, kv_heads, d, generator=gen, dtype=torch.float64) for _ in range(2))
    do = torch.randn(batch, S, heads, d, generator=gen, dtype=torch.float64)
    o_ref, lse_ref = attention_reference(q.numpy(), k.numpy(), v.numpy(), sig.scale, sig.causal)
    dq_ref, dk_ref, dv_ref = attention_backward_reference(q.numpy(), k.numpy(), v.numpy(), o_ref, do.numpy(), lse_ref,
                                                          sig.scale, sig.causal)[:3]
    sim = SimulatedWorld(world)
    results: dict = {}
    gathers: list = []

    def rank_main(rank: int) -> None:
        op = copy.copy(base)
        op.rank = rank
        op._allgather = lambda x: gathers.append(rank) or sim.allgather(rank, x)
        op._reduce_scatter = lambda x: sim.reduce_scatter(rank, x)
        if fused:  # a stand-in of the cp_attention kernel that leaves its own rows unwritten
            op._fused = fused_stand_in(op, sim_gathered(sim, rank, 1), True)
        pos = row_positions(layout, world, n, rank)
        qa, ka, va = (x[:, pos].clone().requires_grad_(True) for x in (q, k, v))
        o, lse = op(qa, ka, va, return_lse=True)
        o.backward(do[:, pos])
        results[rank] = (pos, o.detach(), lse, qa.grad, ka.grad, va.grad)

    run_ranks(sim, rank_main)
    for rank, (pos, o, lse, dq, dk, dv) in results.items():
        for name, got, want in (("o", o, o_ref[:, pos]), ("lse", lse, lse_ref[:, :, pos]), ("dq", dq, dq_ref[:, pos]),
                                ("dk", dk, dk_ref[:, pos]), ("dv", dv, dv_ref[:, pos])):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12, err_msg=f"rank {rank} {name}")
    if fused:  # the forward gathers nothing and runs no attention kernel of its own; regather: K, V in the backward
        assert not [c for c in calls if c[0] == "forward"]
        assert len(gathers) == (world * (1 if kv_together else 2) if regather else 0)
    backward = [c for c in calls if c[0] == "backward"]
    if not overlap:
        assert len(backward) == world and all(c[2] == S for c in calls)  # every kernel call over the whole sequence
        return
    assert all(c[2] == S for c in calls if c[0] == "forward")
    runs = sorted((b - a, a) for x in range(world) for a, b in sum(backward_runs(layout, sig.causal, world, n, x), []))
    assert sorted((c[2], c[1][3]) for c in backward) == runs  # one call per run: its rows, kv_offset its start


@pytest.mark.parametrize("kv_together", [False, True])
def test_overlap_backward_sends_the_peers_rows_first(groups, monkeypatch, kv_together):
    """overlap_backward at W 2, causal zig-zag, rank 1: the kernel on the peers' run (chunk 0) is called
    first, then on the own run (chunks 1 and 2), then the reduce-scatter, whose input holds the peers'
    partial sums and zeros in the own rows and the later keys (chunk 3); the own partial sums are added
    to what it returns."""
    base = load_cp(groups, 2, "hd128_causal_gqa", "zigzag", kv_together=kv_together, overlap_backward=True)
    base.rank = 1
    events: list = []
    sig = base.attention.signature
    n = 8

    def backward(q, k, v, o, do, lse, positions=None):
        events.append(("kernel", k.shape[1], positions[3]))
        return torch.ones_like(q), torch.full_like(k, 1.0 + positions[3]), torch.full_like(v, 2.0 + positions[3])

    monkeypatch.setattr(base.attention.backward, "run_backward", backward)
    received = []
    base._reduce_scatter = lambda x: received.append(x) or events.append(("reduce_scatter",)) or x.chunk(2)[1].clone()
    q = torch.zeros(1, n, sig.heads, sig.head_dim, dtype=torch.float64)
    k_full = torch.zeros(1, 2 * n, sig.kv_heads, sig.head_dim, dtype=torch.float64)
    pos = base.positions(q, k_full[:, :n], k_full[:, :n])
    lse = torch.zeros(1, sig.heads, n)
    dq, dk, dv = base.backward_overlapped(q, k_full, k_full, q, q, lse, pos)
    scatters = [("reduce_scatter",)] * (1 if kv_together else 2)
    assert events == [("kernel", 4, 0), ("kernel", 8, 4)] + scatters, events
    assert torch.equal(dq, torch.full_like(q, 2.0))  # the two calls' dQs added
    sent = received[0][:, :, :sig.kv_heads]  # dK, sequence-first, in the all-gather's order (rank 0's rows first)
    assert torch.equal(sent[:4], torch.full_like(sent[:4], 1.0))  # chunk 0: the peers' run, kv_offset 0
    assert not sent[4:].any()  # rank 0's chunk 3 (later keys) and rank 1's own rows: zero
    # what the reduce-scatter returned (zeros: this rank's rows of its input) plus the own run's dK (kv_offset 4)
    assert torch.equal(dk, torch.full_like(dk, 5.0)) and torch.equal(dv, torch.full_like(dv, 6.0))


@pytest.mark.parametrize("kv_together", [False, True])
def test_regather_keeps_the_local_kv(groups, monkeypatch, kv_together):
    """regather=True saves the local K, V (and gathers them again in the backward); the default the
    gathered ones. kv_together: one collective call where there were two, each of both tensors."""
    for regather, rows in ((False, 16), (True, 8)):
        base = load_cp(groups, 2, "hd128", "contiguous", regather=regather, kv_together=kv_together)
        stand_in_kernels(base, monkeypatch, [])
        gathers, scatters = [], []
        base._allgather = lambda x: gathers.append(x.shape) or torch.cat([x, x])
        base._reduce_scatter = lambda x: scatters.append(x.shape) or x.chunk(2)[0]
        sig = base.attention.signature
        q = torch.randn(1, 8, sig.heads, sig.head_dim, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(1, 8, sig.kv_heads, sig.head_dim, dtype=torch.float64, requires_grad=True)
                for _ in range(2))
        o = base(q, k, v)
        saved = [t.shape[1] for t in o.grad_fn.saved_tensors[1:3]]
        assert saved == [rows, rows], (regather, saved)
        o.sum().backward()
        calls = 1 if kv_together else 2
        assert len(gathers) == calls * (2 if regather else 1) and len(scatters) == calls
        heads = sig.kv_heads * (2 if kv_together else 1)  # side by side in the heads dimension
        assert all(g[2] == heads for g in gathers) and all(x[2] == heads for x in scatters)


def test_the_zigzag_order_is_made_once_per_size(groups, monkeypatch):
    """Causal zig-zag reorders the gathered rows and their gradients by index tensors made at the first
    step of a size and kept (a tensor from a Python list, made per call, waited for the device's work
    four times a step: 1.6 ms each at 8192 rows on an H200)."""
    import tsgen.torch.cp_attention_op as cpo

    base = load_cp(groups, 2, "hd128_causal_gqa", "zigzag")
    stand_in_kernels(base, monkeypatch, [])
    made = []
    real = cpo.gather_order
    monkeypatch.setattr(cpo, "gather_order", lambda *a: made.append(a) or real(*a))
    base._allgather = lambda x: torch.cat([x, x])
    base._reduce_scatter = lambda x: x.chunk(2)[0]
    sig = base.attention.signature
    for n in (8, 8, 4):
        q = torch.randn(1, n, sig.heads, sig.head_dim, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(1, n, sig.kv_heads, sig.head_dim, dtype=torch.float64, requires_grad=True) for _ in range(2))
        base(q, k, v).sum().backward()
    assert [a[3] for a in made] == [8, 4]  # one per size: the second step of 8 rows made none


@pytest.mark.parametrize("tensor_layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("pair, layout", [("hd128_causal_gqa", "zigzag"), ("hd128", "contiguous")])
def test_kv_together_moves_what_two_calls_move(groups, tensor_layout, pair, layout):
    """gather_kv / scatter_kv with kv_together equal two gathers / two scatters, batch 3, both tensor
    layouts (the heads side by side in the sequence-first layout, split back at kv_heads), with a
    stand-in all-gather (this rank's rows, then the same rows + 1: a second rank) and reduce-scatter."""
    base = load_cp(groups, 2, pair, layout)
    together = load_cp(groups, 2, pair, layout, kv_together=True)
    for op in (base, together):
        op.tensor_layout = tensor_layout  # the layout the specs would declare; only the composition is tested
        op._allgather = lambda x: torch.cat([x, x + 1])
        op._reduce_scatter = lambda x: x.chunk(2)[0] + x.chunk(2)[1]
    sig = base.attention.signature
    n, batch = 8, 3
    shape = (batch, n, sig.kv_heads, sig.head_dim) if tensor_layout == "bshd" else (batch, sig.kv_heads, n, sig.head_dim)
    k, v = torch.randn(*shape, dtype=torch.float64), torch.randn(*shape, dtype=torch.float64)
    for got, want in zip(together.gather_kv(k, v), base.gather_kv(k, v)):
        assert got.is_contiguous() and torch.equal(got, want)
    full = tuple(torch.cat([x, x + 2], dim=1 if tensor_layout == "bshd" else 2) for x in (k, v))
    for got, want in zip(together.scatter_kv(*full), base.scatter_kv(*full)):
        assert got.is_contiguous() and torch.equal(got, want)


def test_kv_together_refuses_k_and_v_that_differ(groups):
    """Side by side, K and V must match: a V of other heads or another dtype is refused by name (no silent mix)."""
    cp = load_cp(groups, 2, "hd128_causal_gqa", "zigzag", kv_together=True)
    sig = cp.attention.signature
    k = torch.randn(1, 8, sig.kv_heads, sig.head_dim, dtype=torch.float64)
    with pytest.raises(TsgenArgumentError, match=r"argument v: shape .* but k is .* same shape, dtype and device"):
        cp.gather_kv(k, torch.randn(1, 8, sig.kv_heads + 4, sig.head_dim, dtype=torch.float64))
    with pytest.raises(TsgenArgumentError, match=r"argument v: .*float32"):
        cp.gather_kv(k, k.float())


# -- tests/torch_checks.py --cp's step times (cp_step_times), the parts that need no GPU ------------------

def test_cp_time_settings():
    """CP_TIME_SEQS / CP_TIME_VARIANTS / CP_TIME_ROUNDS: the defaults where unset or empty, the variants in
    the TIME lines' order whatever order they are named in, a wrong one refused by name."""
    tc = torch_checks()
    assert tc.cp_time_settings({}) == ([2048, 8192, 16384, 32768], ["tsgen", "twin", "twin_cudnn", "ideal"], 8)
    assert tc.cp_time_settings({"CP_TIME_SEQS": " ", "CP_TIME_VARIANTS": "", "CP_TIME_ROUNDS": ""})[2] == 8
    env = {"CP_TIME_SEQS": "8192 16384 32768", "CP_TIME_VARIANTS": "ideal tsgen_overlap tsgen", "CP_TIME_ROUNDS": "4"}
    assert tc.cp_time_settings(env) == ([8192, 16384, 32768], ["tsgen", "tsgen_overlap", "ideal"], 4)
    for bad, match in (({"CP_TIME_VARIANTS": "tsgen sdpa"}, "not sdpa"), ({"CP_TIME_SEQS": "8k"}, "whole numbers"),
                       ({"CP_TIME_ROUNDS": "0"}, "rounds >= 1"), ({"CP_TIME_ROUNDS": "4 8"}, "whole numbers")):
        with pytest.raises(ValueError, match=match):
            tc.cp_time_settings(bad)
    assert [tc.steps_per_sample(x) for x in (0.1, 2.2, 12.5, 13.0, 35.0)] == [250, 12, 2, 2, 2]


def test_cp_time_rounds_on_the_host():
    """cp_time_rounds on the timing core's host clock, steps that sleep: each implementation's estimate
    (2 warm-up steps, 1 timed), then every round one sample of each, in round_order's balanced order,
    each sample the lineup, 1 settling step and N (about 25 ms) timed steps, grads cleared before every
    step; a twin that SDPA refuses is left out with its reason, a refusing tsgen op is an error."""
    from tsgen.bench.timing import HostClock, round_order

    tc = torch_checks()
    log, leaf = [], torch.zeros(2, requires_grad=True)

    def step(label, ms):
        def run():
            assert leaf.grad is None  # cleared by the core's call
            leaf.grad = torch.ones(2)
            log.append(label)
            time.sleep(ms / 1e3)
        return run

    def refuse():
        log.append("twin_cudnn")
        raise RuntimeError("No available kernel. Aborting execution.\nmore")

    lined = []
    steps = {"tsgen": (step("tsgen", 5), (leaf,)), "twin_cudnn": (refuse, (leaf,)),
             "ideal": (step("ideal", 9), (leaf,))}
    got = tc.cp_time_rounds(HostClock(torch), 0, {0: None}, steps, 4, lambda: lined.append(1), "case")
    assert got["refused"] == {"twin_cudnn": "No available kernel. Aborting execution."} and not got["problems"]
    assert list(got["ms"]) == ["tsgen", "ideal"] and all(len(x) == 4 for x in got["ms"].values())
    assert got["order"] == [round_order(["tsgen", "ideal"], i) for i in range(4)]
    calls = got["calls"]
    assert calls == {x: tc.steps_per_sample(got["estimate_ms"][x]) for x in ("tsgen", "ideal")}
    assert 2 <= calls["ideal"] <= calls["tsgen"] <= 5  # ~25 ms at 5 and 9 ms a step (or more: a busy host)
    want = ["tsgen"] * 3 + ["twin_cudnn"] + ["ideal"] * 3  # the estimates
    for order in got["order"]:
        want += [x for label in order for x in [label] * (1 + calls[label])]
    assert log == want and len(lined) == 2 + 4 * 2
    assert min(got["ms"]["tsgen"]) >= 5 and min(got["ms"]["ideal"]) >= 9  # ms per step, not per sample
    with pytest.raises(RuntimeError, match="No available kernel"):
        tc.cp_time_rounds(HostClock(torch), 0, {0: None}, {"tsgen": (refuse, ())}, 2, lambda: None, "case")


def test_cp_time_lines():
    """The TIME lines (median ms/step; the twin's and the ideal's samples over this one's, paired round
    by round, the latter with its min-max) and the RAW line with every round's sample."""
    tc = torch_checks()
    ms = {"tsgen": [10.0, 9.0, 11.0], "twin": [11.0, 9.9, 10.0], "ideal": [9.0, 9.0, 10.4]}
    lines = tc.cp_time_lines("hd128_contiguous_w2_s16384", ms, {"tsgen": 3, "twin": 3, "ideal": 2}, 16384, 2)
    assert lines == [
        "TIME cp_attention hd128_contiguous_w2_s16384_tsgen: 10.000 ms/step (1.10x the twin; ideal/this 0.95, "
        "rounds 0.90-1.00)",
        "TIME cp_attention hd128_contiguous_w2_s16384_twin: 10.000 ms/step (1.00x the twin; ideal/this 0.91, "
        "rounds 0.82-1.04)",
        "TIME cp_attention hd128_contiguous_w2_s16384_ideal: 9.000 ms/step (single-GPU tsgen attention fwd+bwd "
        "over S 16384 / 2)",
        "RAW cp_attention hd128_contiguous_w2_s16384 (ms/step per round; steps per sample tsgen 3, twin 3, "
        "ideal 2): tsgen=[10.000, 9.000, 11.000] twin=[11.000, 9.900, 10.000] ideal=[9.000, 9.000, 10.400]"]
    alone = tc.cp_time_lines("k", {"tsgen": [1.0, 2.0]}, {"tsgen": 2}, 8, 2)
    assert alone == ["TIME cp_attention k_tsgen: 1.500 ms/step", "RAW cp_attention k (ms/step per round; steps per "
                     "sample tsgen 2): tsgen=[1.000, 2.000]"]


def test_rel_errors():
    """The timed step's check: norm error within the bound and every element finite, on both sides."""
    tc = torch_checks()
    want = {"o": torch.ones(4, dtype=BF16), "dq": torch.ones(4)}
    ok, text = tc.rel_errors({"o": torch.ones(4, dtype=BF16), "dq": torch.tensor([1.0, 1.0, 1.0, 1.03])}, want, 2e-2)
    assert ok and text == "o 0.0e+00, dq 1.5e-02"
    ok, text = tc.rel_errors({"o": torch.ones(4, dtype=BF16), "dq": torch.tensor([1.0, 1.0, 1.0, 1.1])}, want, 2e-2)
    assert not ok and text.endswith("dq 5.0e-02 FAIL")
    ok, text = tc.rel_errors({"o": torch.tensor([1.0, 1.0, 1.0, float("inf")])}, want, 2e-2)
    assert not ok and "NOT FINITE FAIL" in text


# -- the fused forward (cp_attention(..., fused=)): one cp_attention call, its gathered K, V kept ---------

def fused_spec(pair: str, layout: str, causal: bool | None = None):
    """The cp_attention spec of tests/torch_checks.py CP_FUSED for (pair, layout), or, where the pair's own
    placement differs (the composed op takes any), a variant of the pair's fused spec with this layout."""
    fused = torch_checks().CP_FUSED
    if (pair, layout) in fused:
        return ROOT / fused[(pair, layout)]
    (spec,) = [ROOT / v for (p, _), v in fused.items() if p == pair]
    return spec_variant(load_spec(spec), {"name": f"{spec.stem}_{layout}", "params": {"layout": layout}})


def fused_stand_in(op, gathered, local_kv: bool):
    """A stand-in of the cp_attention kernel for rank op.rank: O, LSE by the float64 reference at the
    rank's positions over the whole sequence, and k_full / v_full as the kernel leaves them
    (tsgen.ops.cp_attention.segments: position order where causal, the shards rotated otherwise), this
    rank's own rows NaN where `local_kv` (the kernel read them in place). `gathered(x)` is every rank's x
    concatenated along the rows, rank by rank; tensors in op.tensor_layout (bhsd: the rows dimension 2)."""
    from tsgen.ops.cp_attention import segments

    sig = op.attention.signature

    def run(q, k, v):
        dim, w = op._seq_dim, op.world
        n = q.shape[dim]
        every_k, every_v = gathered(k), gathered(v)  # every rank's rows, rank by rank
        fulls = []
        for x, every in ((k, every_k), (v, every_v)):
            shape = list(x.shape)
            shape[dim] = w * n
            full = torch.full(shape, float("nan"), dtype=x.dtype)
            for src_rank in range(w):
                if local_kv and src_rank == op.rank:
                    continue
                for src, rows, dst, _ in segments(op.layout, sig.causal, w, n, src_rank, op.rank):
                    full.narrow(dim, dst, rows).copy_(every.narrow(dim, src_rank * n + src, rows))
            fulls.append(full)
        order = gather_order(op.layout, sig.causal, w, n)
        if order is not None:  # the whole sequence in position order, for the reference
            every_k, every_v = (x.index_select(dim, torch.tensor(order)) for x in (every_k, every_v))
        bshd = (lambda x: x) if dim == 1 else (lambda x: x.transpose(1, 2))
        o, lse = attention_reference(bshd(q).numpy(), bshd(every_k).numpy(), bshd(every_v).numpy(), sig.scale,
                                     sig.causal, rows_of(op.positions(q, k, v), n), np.arange(w * n))
        return bshd(torch.from_numpy(o)), torch.from_numpy(lse), *fulls

    return run


def sim_gathered(sim: SimulatedWorld, rank: int, dim: int):
    """Every rank's x concatenated along dimension `dim`, through the simulated all-gather."""
    return lambda x: sim.allgather(rank, x.transpose(0, dim)).transpose(0, dim)


@pytest.mark.parametrize("w", [2, 4])
@pytest.mark.parametrize("pair, layout", [("hd128_causal_gqa", "zigzag"), ("hd128", "contiguous")])
def test_fused_forward_shapes_and_signature(groups, w, pair, layout):
    """The fused spec loads as a torch op of four outputs (O, LSE, the gathered K, V; q, k, v, o, lse the
    caller's tensors), and a fake forward + backward through cp_attention(..., fused=) gives the composed
    op's shapes, also from a K and V that are not contiguous (copied for the kernel)."""
    cp = load_cp(groups, w, pair, layout, fused=fused_spec(pair, layout))
    sig = cp.attention.signature
    fsig = cp.fused.signature
    assert fsig.out_names == ("o", "lse", "k_full", "v_full") and fsig.local() == {"q", "k", "v", "o", "lse"}
    assert cp.local_kv and "fused" in repr(cp)
    n = 64
    with fake_mode():
        q = torch.empty(1, n, sig.heads, sig.head_dim, dtype=BF16, requires_grad=True)
        k, v = (torch.empty(1, sig.kv_heads, n, sig.head_dim, dtype=BF16).transpose(1, 2).requires_grad_(True)
                for _ in range(2))
        assert not k.is_contiguous()
        o, lse, k_full, v_full = cp.fused(q.detach(), k.detach().contiguous(), v.detach().contiguous())
        assert tuple(k_full.shape) == (1, w * n, sig.kv_heads, sig.head_dim) and tuple(lse.shape) == (1, sig.heads, n)
        o, lse = cp(q, k, v, return_lse=True)
        assert tuple(o.shape) == tuple(q.shape) and tuple(lse.shape) == (1, sig.heads, n)
        o.float().sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
        with pytest.raises(TsgenArgumentError, match=r"a batch of 2 sequences .* compiled for 1: compile it with "
                                                     r"params.batch 2, or leave fused= out"):
            q2, k2 = torch.empty(2, n, sig.heads, sig.head_dim, dtype=BF16), torch.empty(2, n, sig.kv_heads,
                                                                                        sig.head_dim, dtype=BF16)
            cp(q2, k2, k2)


def test_fused_load_errors(groups):
    """A fused spec of another attention, another placement, another group or another op kind is refused,
    naming what differs; so is the negative-control variant (skip_wait)."""
    fwd, bwd = pair_specs("hd128")
    ag, rs = GEN / "allgather.json", GEN / "reduce_scatter.json"
    with pytest.raises(TsgenTorchError, match=r"fused forward .*cp_attention_hd128_causal_gqa.yaml does not compute "
                                              r".*kv_heads 8 / 32; causal True / False; placement zigzag / contiguous"):
        tt.cp_attention(fwd, bwd, ag, rs, groups[2], layout="contiguous",
                        fused=fused_spec("hd128_causal_gqa", "zigzag"))
    causal_fwd, causal_bwd = pair_specs("hd128_causal_gqa")
    with pytest.raises(TsgenTorchError, match=r"placement zigzag / contiguous"):
        tt.cp_attention(causal_fwd, causal_bwd, ag, rs, groups[2], layout="contiguous",
                        fused=fused_spec("hd128_causal_gqa", "zigzag"))
    with pytest.raises(TsgenTorchError, match=r"its fused argument is .*op allgather, not cp_attention"):
        tt.cp_attention(fwd, bwd, ag, rs, groups[2], layout="contiguous", fused=ag)
    elsewhere = tt.load(fused_spec("hd128", "contiguous"), groups[4])
    with pytest.raises(TsgenTorchError, match=r"group .* / .*: compile it"):
        tt.cp_attention(fwd, bwd, ag, rs, groups[2], layout="contiguous", fused=elsewhere)
    control = spec_variant(load_spec(fused_spec("hd128", "contiguous")),
                           {"name": "cp_attention_hd128_skip", "params": {"skip_wait": True, "gather": "sm"}})
    with pytest.raises(TsgenTorchError, match=r"is a negative control \(params.skip_wait"):
        tt.cp_attention(fwd, bwd, ag, rs, groups[2], layout="contiguous", fused=control)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("tensor_layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("pair, layout", [("hd128_causal_gqa", "zigzag"), ("hd128", "contiguous"),
                                          ("hd128_causal_gqa", "contiguous"), ("hd128", "zigzag")])
def test_fused_forward_leaves_what_the_gather_gives(groups, world, tensor_layout, pair, layout):
    """fused_forward's K_full, V_full equal gather_kv's (the composed forward's, which the backward reads)
    on every rank, both tensor layouts, every placement with and without causal: the kernel's order
    turned back (not causal: the rotated shards) and this rank's own rows, which the kernel read in place
    and left unwritten (NaN here), copied in. Without the copy the own rows stay NaN: the check would see
    it (the control)."""
    sim = SimulatedWorld(world)
    n = 8
    gen = torch.Generator().manual_seed(7 + world)
    base = load_cp(groups, world, pair, layout, fused=fused_spec(pair, layout))
    base.tensor_layout = tensor_layout  # the layout the specs would declare; only the composition is tested
    sig = base.attention.signature
    dim = base._seq_dim
    shape = [1, world * n, sig.kv_heads, sig.head_dim] if dim == 1 else [1, sig.kv_heads, world * n, sig.head_dim]
    k_all, v_all = (torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(2))
    results = {}

    def rank_main(rank: int) -> None:
        op = copy.copy(base)
        op.rank = rank
        k, v = (x.narrow(dim, rank * n, n) for x in (k_all, v_all))  # this rank's tensors (any content)
        q = torch.zeros(*(k.shape[:dim]), n, *(k.shape[dim + 1:]), dtype=torch.float64)
        op._allgather = lambda x: sim.allgather(rank, x)
        want = op.gather_kv(k, v)
        op._fused = fused_stand_in(op, sim_gathered(sim, rank, dim), True)
        got = op.fused_forward(q, k, v)[2:]
        op.local_kv = False  # the control: the own rows not copied in
        bad = op.fused_forward(q, k, v)[2:]
        results[rank] = (want, got, bad)

    run_ranks(sim, rank_main)
    for rank, (want, got, bad) in results.items():
        for name, w_, g, b in zip(("k", "v"), want, got, bad):
            assert torch.equal(g, w_), f"rank {rank} {name}_full"
            assert torch.isnan(b).any(), f"rank {rank} {name}_full: the control (no own rows) passed"


def test_push_load_errors_and_pushes(groups):
    """push= takes an attention_backward spec with params.kv_push computing the forward's attention: a spec without
    kv_push and one of another attention are refused, naming why; a fitting one is kept unpaired (the forward's
    autograd pair stays the composed backward) and taken only on CUDA (pushes())."""
    ag, rs = GEN / "allgather.json", GEN / "reduce_scatter.json"
    fwd, bwd = pair_specs("hd128_causal_gqa")
    push = ROOT / "examples" / "torch" / "specs" / "attention_backward_hd128_causal_gqa_push.yaml"
    with pytest.raises(TsgenTorchError, match=r"push=.*has no params.kv_push"):
        tt.cp_attention(fwd, bwd, ag, rs, groups[2], layout="zigzag", push=bwd)
    other = ROOT / "examples" / "torch" / "specs" / "attention_backward_hd128_push.yaml"
    with pytest.raises(TsgenTorchError, match=r"push=.*do not compute the same attention .*kv_heads 8 / 32"):
        tt.cp_attention(fwd, bwd, ag, rs, groups[2], layout="zigzag", push=other)
    with pytest.raises(TsgenTorchError, match=r"push= and overlap_backward=True are two backwards"):
        tt.cp_attention(fwd, bwd, ag, rs, groups[2], layout="zigzag", push=push, overlap_backward=True)
    cp = tt.cp_attention(fwd, bwd, ag, rs, groups[2], layout="zigzag", push=push)
    assert cp.push.signature.kv_push and not cp.attention.backward.signature.kv_push
    assert not cp.pushes(torch.zeros(1, 256, 32, 128))  # on the CPU: the composed backward


def test_close_all_frees_push_heaps(groups):
    """tsgen.torch.close_all() reaches push='s heaps (ops.AT_CLOSE_ALL): every heap closed once, the op's table
    emptied and the op no longer registered; a heap whose close fails is named, the others still closed."""
    from tsgen.torch import cp_attention_op as cp_mod
    from tsgen.torch import ops as ops_mod

    class FakeHeap:
        def __init__(self, fail=False):
            self.closed, self.fail = 0, fail

        def close(self):
            self.closed += 1
            if self.fail:
                raise TsgenTorchError("peer gone")

    fwd, bwd = pair_specs("hd128_causal_gqa")
    push = ROOT / "examples" / "torch" / "specs" / "attention_backward_hd128_causal_gqa_push.yaml"
    cp = tt.cp_attention(fwd, bwd, GEN / "allgather.json", GEN / "reduce_scatter.json", groups[2], layout="zigzag",
                         push=push)
    heaps = [FakeHeap(), FakeHeap(fail=True), FakeHeap()]
    for i, h in enumerate(heaps):
        cp._push[(256 * (i + 1), 1, torch.bfloat16)] = cp_mod._PushHeap(h, torch.zeros(1))
    cp_mod._PUSHING.add(cp)
    assert cp_mod._close_push_heaps in ops_mod.AT_CLOSE_ALL
    with pytest.raises(TsgenTorchError, match="closing its kv_push heaps: peer gone"):
        cp_mod._close_push_heaps()
    assert [h.closed for h in heaps] == [1, 1, 1] and not cp._push and cp not in cp_mod._PUSHING
    cp_mod._close_push_heaps()  # nothing left: no second close
    assert [h.closed for h in heaps] == [1, 1, 1]


def test_failed_checks_reads_the_result_word():
    """tests/test_torch_gpu.py fails a run by its CHECK lines' result word: a caught negative control, whose detail
    lists the FAILs it caught, passes (the gate's cp mode once failed on that detail); a FAIL result fails."""
    lines = "\n".join([
        "CHECK cp_load PASS r0: 9 ops at world 2 in 1.1 s",
        "CHECK cp_negative_control_w2 PASS r0: caught (dk 224317/1048576 wrong, rel 3.9e-01 FAIL)",
        "CHECK cp_broken FAIL r0: dk 5/10 wrong",
        "CHECK cp_skipped SKIP r0: no multicast",
        "TIME cp_attention FAIL-free line",
    ])
    assert torch_checks().failed_checks(lines) == ["CHECK cp_broken FAIL r0: dk 5/10 wrong"]


def test_push_heap_refused_after_a_failed_launch(groups, monkeypatch):
    """A kv_push backward whose launch fails after its arguments were checked leaves its heap's counters possibly out
    of step with the peers': the heap is refused from then on, naming why and close_push(); a call refused for its
    arguments (nothing launched) leaves the heap usable."""
    from tsgen.torch import cp_attention_op as cp_mod
    from tsgen.torch.signature import TsgenArgumentError

    class Stream:
        def wait_event(self, event):
            pass

    class Event:
        def record(self, stream):
            pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    fwd, bwd = pair_specs("hd128_causal_gqa")
    push = ROOT / "examples" / "torch" / "specs" / "attention_backward_hd128_causal_gqa_push.yaml"
    cp = tt.cp_attention(fwd, bwd, GEN / "allgather.json", GEN / "reduce_scatter.json", groups[2], layout="zigzag",
                         push=push)
    q = torch.zeros(1, 256, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 512, 8, 128, dtype=torch.bfloat16)
    cp._push[(256, 1, torch.bfloat16)] = state = cp_mod._PushHeap(None, torch.zeros(1))
    outcome = []

    class Module:
        def run_backward_push(self, *args):
            return outcome.pop(0)()

    def argument_error():
        raise TsgenArgumentError("k: 512 gathered rows")

    def launch_error():
        raise TsgenTorchError("attention_backward_push failed with cudaError 700")

    cp.push = Module()
    args = (q, k, k, q, q, torch.zeros(1), (0, 128, 384, 0))
    outcome[:] = [argument_error, lambda: ("dq", "dk", "dv")]
    with pytest.raises(TsgenArgumentError, match="512 gathered rows"):
        cp.backward_push(*args)
    assert state.broken is None
    assert cp.backward_push(*args) == ("dq", "dk", "dv")
    outcome[:] = [launch_error]
    with pytest.raises(TsgenTorchError, match="cudaError 700"):
        cp.backward_push(*args)
    outcome[:] = [lambda: ("dq", "dk", "dv")]  # would succeed: the heap is refused before it is reached
    with pytest.raises(TsgenTorchError, match=r"rows a rank failed \(.*cudaError 700\).*close_push\(\)"):
        cp.backward_push(*args)
    assert outcome, "the refused heap's call reached the module"
    cp._push.clear()


def test_gpu_test_stops_torchrun_and_every_rank(tmp_path):
    """tests/test_torch_gpu.py's run_group past its timeout: torchrun's ranks run in sessions of their own (a signal
    to torchrun's process group misses them), so it sends SIGTERM, which torchrun's agent turns into stopping its
    ranks (here: a parent that stops its own-session child on TERM), and kills whatever is left of the command and
    its descendants after the grace (here: a parent that ignores TERM); in both, no child survives and the output so
    far comes back. Within the timeout: the exit code and the output."""
    import os

    run_group = load_script(ROOT / "tests" / "test_torch_gpu.py").run_group

    def gone(pid: int) -> bool:
        for _ in range(50):  # killed: gone, or a zombie until init reaps it
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            if Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z":
                return True
            time.sleep(0.1)
        return False

    for name, trap, how in (("agent", 'trap \'kill "$child"; exit 143\' TERM', "stopped by SIGTERM"),
                            ("stubborn", "trap '' TERM", "killed with its descendants")):
        pid_file = tmp_path / name
        script = f"{trap}; setsid sleep 60 & child=$!; echo $child > {pid_file}; echo started; wait; wait"
        t0 = time.monotonic()
        rc, out = run_group(["bash", "-c", script], dict(os.environ), 2, grace=2)
        assert rc == -9 and "started" in out and how in out, (name, out)
        assert time.monotonic() - t0 < 20, name
        assert gone(int(pid_file.read_text())), f"{name}: the rank-like child (own session) survived"
    assert run_group(["bash", "-c", "echo ok; exit 3"], dict(os.environ), 30) == (3, "ok\n")
