"""A Ulysses (sequence-parallel) attention layer on tsgen's all-to-alls, checked against its
torch-only twin. Run it under torchrun, one process per GPU:

    torchrun --nproc-per-node 2 examples/torch/ulysses_attention.py [--tokens 16384] [--iters 20]

Each rank holds S/P tokens of B sequences (the sequence-sharded side) and the whole (replicated)
projection weights:

    x [B, S/P, hidden] @ Wqkv -> q, k, v [B, S/P, H, D] --pre all-to-all--> [B, S, H/P, D]
      --attention over the whole sequence, H/P heads--> [B, S, H/P, D]
      --post all-to-all--> [B, S/P, H, D] -> @ Wo -> [B, S/P, hidden]

The tsgen layer runs specs/ulysses_pre_a2a.yaml (three calls: q, k, v) and
specs/ulysses_post_a2a.yaml (paired: each is the other's backward, so the backward runs them the
other way round); those specs fix B = 2, H = 24 heads and D = 128 (hidden = 3072) at compile time,
S is free (a multiple of P). The twin runs torch.distributed's all_to_all_single (NCCL, with its own
autograd) and the permutes around it (examples/torch/twins.py). The local attention is torch's
scaled_dot_product_attention (causal) in both: tsgen's attention kernel has no backward yet
(issue 35), so it cannot sit in a layer that trains. The script checks the output and every
gradient (x, Wqkv, Wo) against the twin's, then times a forward + backward step of each and prints
both. Lines starting CHECK / TIME are what tools/gpu_torch.sh collects; exit code 1 when a check
fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import ROOT, compare, finish, init, print_times, report, step, time_step, tt  # noqa: E402
from twins import ulysses_post, ulysses_pre  # noqa: E402

NAMES = ("y", "dx", "dWqkv", "dWo")


class UlyssesAttention(torch.nn.Module):
    """qkv projection -> pre all-to-all -> causal attention over the whole sequence -> post all-to-all -> out projection."""

    def __init__(self, pre, post, heads: int, head_dim: int, wqkv: torch.Tensor, wo: torch.Tensor):
        super().__init__()
        self.pre, self.post, self.heads, self.head_dim = pre, post, heads, head_dim
        self.wqkv = torch.nn.Parameter(wqkv.clone())
        self.wo = torch.nn.Parameter(wo.clone())

    def forward(self, x):
        b, s, _ = x.shape
        qkv = (x @ self.wqkv).view(b, s, 3, self.heads, self.head_dim)
        # [B, S/P, H, D] each -> [B, S, H/P, D] -> SDPA's [B, H/P, S, D]
        q, k, v = (self.pre(qkv[:, :, i].contiguous()).transpose(1, 2) for i in range(3))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = self.post(o.transpose(1, 2).contiguous())  # [B, S, H/P, D] -> [B, S/P, H, D]
        return o.reshape(b, s, self.heads * self.head_dim) @ self.wo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="S: sequence length over all ranks")
    ap.add_argument("--iters", type=int, default=20, help="timed forward + backward steps per variant")
    args = ap.parse_args()

    rank, w, dev = init()
    pre = tt.load(ROOT / "specs" / "ulysses_pre_a2a.yaml")
    post = tt.load(ROOT / "specs" / "ulysses_post_a2a.yaml")
    tt.pair(pre, post)
    layout = pre.signature.ins[0].dims  # batch, S/P, heads, head_dim: what the specs were compiled for
    B, H, D = layout[0][1], layout[2][1], layout[3][1]
    S = args.tokens
    if S % w:
        raise SystemExit(f"--tokens {S} must be a multiple of the world size {w}")
    hidden = H * D

    g = torch.Generator(device="cuda").manual_seed(4321)  # the same weights on every rank
    bf16 = torch.bfloat16
    wqkv = (torch.randn(hidden, 3 * hidden, generator=g, device=dev) / hidden ** 0.5).to(bf16)
    wo = (torch.randn(hidden, hidden, generator=g, device=dev) / hidden ** 0.5).to(bf16)
    g.manual_seed(100 + rank)  # each rank's own tokens
    x = torch.randn(B, S // w, hidden, generator=g, device=dev).to(bf16)
    dy = torch.randn(B, S // w, hidden, generator=g, device=dev).to(bf16)

    tsgen_layer = UlyssesAttention(pre, post, H, D, wqkv, wo)
    twin_layer = UlyssesAttention(ulysses_pre, ulysses_post, H, D, wqkv, wo)
    want = step(twin_layer, x, dy)
    got = step(tsgen_layer, x, dy)
    tt.synchronize()
    ok = report("ulysses_attention_fwd_bwd", *compare(NAMES, got, want, rank))

    times = {"twin (NCCL all_to_all_single + permutes)": time_step(twin_layer, x, dy, args.iters),
             "tsgen": time_step(tsgen_layer, x, dy, args.iters)}
    print_times(f"ulysses_attention B={B} S={S} H={H} D={D} W={w}", times, "twin (NCCL all_to_all_single + permutes)")
    return finish(ok)


if __name__ == "__main__":
    sys.exit(main())
