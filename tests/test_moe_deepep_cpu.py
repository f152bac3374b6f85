"""The DeepEP baseline's arithmetic and checkers (tsgen/bench/moe_deepep.py) on CPU tensors: the
byte counts DeepEP's tests use, the fp8 cast, and the checkers of the timed outputs, each shown
to catch a wrong output. The worker itself needs deep_ep and GPUs (tools/gpu_deepep.sh)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the DeepEP baseline checks torch tensors)")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

from tsgen.bench import moe_deepep as D  # noqa: E402
from tsgen.ops.moe import routing  # noqa: E402

WORLD, EXPERTS, TOPK, TOKENS, HIDDEN = 2, 16, 4, 24, 256


def inputs(rank: int):
    rng = np.random.default_rng([7, rank])
    idx = torch.from_numpy(routing("random", WORLD, EXPERTS, TOPK, TOKENS, rng, rank).astype(np.int64))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    w = torch.rand(TOKENS, TOPK, generator=g)
    return x, idx.reshape(TOKENS, TOPK), w


def test_normal_bytes_are_deepeps_formula():
    b = D.normal_bytes(100, 60, 7168, fp8=False)
    assert b == {"dispatch": 100 * 7168 * 2, "combine": 100 * 7168 * 2,
                 "link_dispatch": 60 * 7168 * 2, "link_combine": 60 * 7168 * 2}
    f = D.normal_bytes(100, 60, 7168, fp8=True)
    # test_intranode.py: fp8 bytes = bf16 bytes x (1 + 4 / 128) / 2; combine stays bf16
    assert f["dispatch"] == pytest.approx(b["dispatch"] * (1 + 4 / 128) / 2, rel=0, abs=0)
    assert f["combine"] == b["combine"] and f["link_dispatch"] == 60 * (7168 + 224)


def test_ll_bytes_count_selections():
    idx = torch.tensor([[0, 5, -1], [3, -1, -1]])
    remote = torch.tensor([[False, True, True], [True, False, False]])
    b = D.ll_bytes(idx, remote, 7168, fp8=True)
    assert b["dispatch"] == 3 * (7168 + 7168 // 128 * 4 + 16)  # test_low_latency.py's num_fp8_bytes
    assert b["combine"] == 3 * 7168 * 2
    assert b["link_dispatch"] == 2 * (7168 + 224 + 16) and b["link_combine"] == 2 * 7168 * 2  # -1 is never remote
    assert D.ll_bytes(idx, remote, 7168, fp8=False)["dispatch"] == 3 * (7168 * 2 + 16)


def test_ll_sms_as_deepeps_launchers_compute_them():
    assert D.ll_sms(64, 132) == 64 and D.ll_sms(64, 132, 128) == 128  # moe-w2's low-latency shape, H100 / H200
    assert D.ll_sms(288, 132) == 96 and D.ll_sms(288, 132, 128) == 128  # 3 warp groups: 96 blocks
    assert D.ll_sms(256, 132, 300) == 128 and D.ll_sms(64, 132, 600) == 120  # 5 tokens per block: 120


def test_fp8_cast_round_trip():
    x, _, _ = inputs(0)
    q, s = D.fp8_cast(torch, x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (TOKENS, HIDDEN // 128)
    amax = x.float().view(TOKENS, -1, 128).abs().amax(2)
    assert torch.equal(s, amax / 448.0)
    assert q.float().abs().amax() <= 448.0
    back = D.fp8_back(torch, q, s).float()
    assert ((back - x.float()).abs() <= x.float().abs() / 16 + s.repeat_interleave(128, 1) / 512).all()


def recv_by_loop(xs, idxs, me):
    """Normal-mode receive of rank `me`, written as plain loops (independent of expected_recv)."""
    local = EXPERTS // WORLD
    rows = []
    for x, idx in zip(xs, idxs):
        for t in range(TOKENS):
            if any(0 <= e < EXPERTS and e // local == me for e in idx[t].tolist()):
                rows.append(x[t])
    return torch.stack(rows)


@pytest.mark.parametrize("me", range(WORLD))
def test_expected_recv_and_count_wrong(me):
    xs, idxs, _ = zip(*(inputs(r) for r in range(WORLD)))
    masks = [D.destinations(torch, i, EXPERTS, WORLD) for i in idxs]
    want = D.expected_recv(torch, list(xs), masks, me)
    got = recv_by_loop(xs, idxs, me)
    assert D.count_wrong(torch, got, want) == 0
    bad = got.clone()
    bad[3, 7] += 1
    assert D.count_wrong(torch, bad, want) == 1
    swapped = got.clone()
    swapped[[0, 1]] = got[[1, 0]]
    assert D.count_wrong(torch, swapped, want) > 0
    assert D.count_wrong(torch, got[:-1], want) == want.numel()  # a missing row


def test_count_wrong_fp8_compares_bytes():
    x, _, _ = inputs(1)
    q, s = D.fp8_cast(torch, x)
    assert D.count_wrong(torch, (q, s), (q.clone(), s.clone())) == 0
    raw = q.view(torch.uint8).clone()
    raw[0, 0] ^= 1
    assert D.count_wrong(torch, (raw.view(torch.float8_e4m3fn), s), (q, s)) == 1


def test_normal_combine_ref_is_the_sum_over_destinations():
    x, idx, _ = inputs(0)
    mask = D.destinations(torch, idx, EXPERTS, WORLD)
    ref = D.normal_combine_ref(torch, x, mask)
    local = EXPERTS // WORLD
    for t in range(TOKENS):
        ranks = {e // local for e in idx[t].tolist() if 0 <= e < EXPERTS}
        assert torch.equal(ref[t], (x[t].float() * len(ranks)).to(torch.bfloat16))


def test_ll_combine_ref_and_count_far():
    x, idx, w = inputs(0)
    ref = D.ll_combine_ref(torch, x, idx, w)
    assert (idx < 0).any()  # the -1 slots weigh nothing
    for t in range(TOKENS):
        want = sum((w[t, k].item() * x[t].float() for k in range(TOPK) if idx[t, k] >= 0), torch.zeros(HIDDEN))
        assert torch.allclose(ref[t], want, rtol=1e-5, atol=1e-6)
    out = ref.to(torch.bfloat16)
    assert D.count_far(out, ref, 2 ** -7) == 0
    out[2, 3] = -out[2, 3] + 1
    assert D.count_far(out, ref, 2 ** -7) == 1


def packed_ll(xs, idxs, me, fp8=False):
    """A correct low-latency receive of rank `me` in DeepEP's layout: per local expert, the source
    ranks' rows one after another, inside one source in a shuffled order, src_info the token."""
    local = EXPERTS // WORLD
    cap = WORLD * TOKENS
    recv = torch.zeros(local, cap, HIDDEN, dtype=torch.bfloat16)
    src_info = torch.full((local, cap), -1, dtype=torch.int32)
    layout = torch.zeros(local, WORLD, dtype=torch.int64)
    counts = torch.zeros(local, dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    for i in range(local):
        n = 0
        for j, (x, idx) in enumerate(zip(xs, idxs)):
            tokens = torch.nonzero((idx == me * local + i).any(1)).flatten()
            tokens = tokens[torch.randperm(tokens.numel(), generator=g)]
            recv[i, n:n + tokens.numel()] = x[tokens]
            src_info[i, n:n + tokens.numel()] = tokens.int()
            layout[i, j] = (n << 32) | tokens.numel()
            n += tokens.numel()
        counts[i] = n
    if not fp8:
        return recv, None, counts, src_info, layout
    q, s = D.fp8_cast(torch, recv.view(-1, HIDDEN))
    return q.view(local, cap, HIDDEN), s.view(local, cap, -1), counts, src_info, layout


@pytest.mark.parametrize("fp8", [False, True])
def test_ll_dispatch_checker(fp8):
    xs, idxs, _ = zip(*(inputs(r) for r in range(WORLD)))
    me, local = 1, EXPERTS // WORLD
    recv, scales, counts, src_info, layout = packed_ll(xs, idxs, me, fp8)
    def check(r, c, s, lay):
        return D.ll_dispatch_wrong(torch, r, c, s, lay, list(xs), list(idxs), me, local, scales)

    assert check(recv, counts, src_info, layout) == 0
    bad = recv.clone()
    if fp8:
        bad.view(torch.uint8)[0, 0, :64] = 0x7E  # 448: far from the row
    else:
        bad[0, 0, 5] += 1
    assert check(bad, counts, src_info, layout) == 1
    wrong_src = src_info.clone()
    wrong_src[0, [0, 1]] = src_info[0, [1, 0]]  # rows no longer hold their tokens
    assert check(recv, counts, wrong_src, layout) > 0
    short = layout.clone()
    short[0, 0] -= 1  # a token missing from expert 0's first source
    assert check(recv, counts, src_info, short) > 0
    assert check(recv, counts + 1, src_info, layout) == local  # the counts disagree with the rows


def test_without_deep_ep_the_import_says_so():
    import importlib.util

    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("deep_ep is installed here")
    with pytest.raises(ImportError):
        D.import_deep_ep()
