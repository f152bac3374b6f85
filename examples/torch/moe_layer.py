"""An expert-parallel MoE layer on tsgen's dispatch and combine, checked against its torch-only twin.
Run it under torchrun, one process per GPU:

    torchrun --nproc-per-node 2 examples/torch/moe_layer.py [--tokens 256] [--ffn 1024] [--iters 20]

specs/moe.yaml fixes E = 64 experts (E/W on each rank, in runs), top-8 routing, hidden 2048 and at
most 256 tokens per rank (params.capacity) at compile time. Each rank routes its tokens (random
distinct experts, one slot in ten empty, softmax gate weights), then

    x [T, hidden] --dispatch--> the rows this rank's experts need (grouped by source rank), with each
      row's local expert ids and gate weights --per-expert torch GEMMs (gelu MLP, hidden -> ffn ->
      hidden), weighted, summed per row--> y --combine--> [T, hidden]: each token's rows summed

The tsgen layer calls tsgen.torch.load("specs/moe.yaml").dispatch / .combine (paired: combine's
backward is a dispatch of the output's gradient, dispatch's a combine; the routing indices and the
gate weights carry no gradient here: the weights travel with the rows, docs/torch.md). The twin
sends the same rows with torch.distributed's all_to_all_single (splits exchanged first and read on
the host, as torch needs them) and sums them back with index_add (examples/torch/twins.py:
MoeRoute). The expert computation is the same code in both. The script checks the output and
the gradients (x, both expert weights) against the twin's, then times a forward + backward step
of each and prints both. Lines starting CHECK / TIME are what tools/gpu_torch.sh collects; exit
code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import ROOT, compare, finish, init, print_times, report, step, time_step, tt  # noqa: E402
from tsgen.ops.moe import routing  # noqa: E402
from twins import MoeRoute  # noqa: E402

NAMES = ("y", "dx", "dW1", "dW2")


class MoeLayer(torch.nn.Module):
    """dispatch -> this rank's experts -> combine; `route(idx, weights)` sets the tokens' routing."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, moe=None, experts: int = 0):
        super().__init__()
        self.w1 = torch.nn.Parameter(w1.clone())  # [L, hidden, ffn]: this rank's experts
        self.w2 = torch.nn.Parameter(w2.clone())  # [L, ffn, hidden]
        self.moe, self.experts = moe, experts

    def route(self, idx: torch.Tensor, weights: torch.Tensor) -> None:
        self.idx, self.weights = idx, weights

    def expert_rows(self, rx: torch.Tensor, ridx: torch.Tensor, rw: torch.Tensor) -> torch.Tensor:
        """Each received row through each of its local experts (ridx >= 0), weighted, summed per row."""
        row, slot = (ridx >= 0).nonzero(as_tuple=True)
        e = ridx[row, slot].long()
        order = torch.argsort(e, stable=True)
        row, slot, e = row[order], slot[order], e[order]
        counts = torch.bincount(e, minlength=self.w1.shape[0]).tolist()
        parts = torch.split(rx.index_select(0, row), counts)
        h = torch.cat([torch.nn.functional.gelu(p @ self.w1[i]) @ self.w2[i] for i, p in enumerate(parts)])
        h = h * rw[row, slot].to(h.dtype).unsqueeze(1)
        return torch.zeros_like(rx).index_add(0, row, h)

    def forward(self, x):
        if self.moe is None:  # the twin: all_to_all_single with the routing's splits
            route = MoeRoute(self.idx, self.weights, self.experts)
            return route.combine(self.expert_rows(route.dispatch(x), route.recv_idx, route.recv_w))
        rx, ridx, rw, counts = self.moe.dispatch(x, self.idx, self.weights)
        n, flags = counts[:2].tolist()  # rows received (the buffers hold capacity rows); overflow flags
        if flags:
            raise RuntimeError(f"moe dispatch: receive capacity exceeded (flags {flags})")
        y = self.expert_rows(rx[:n], ridx[:n], rw[:n])
        return self.moe.combine(torch.cat([y, y.new_zeros(rx.shape[0] - n, y.shape[1])]), self.idx)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank (at most the spec's capacity)")
    ap.add_argument("--ffn", type=int, default=1024, help="each expert's inner size")
    ap.add_argument("--iters", type=int, default=20, help="timed forward + backward steps per variant")
    args = ap.parse_args()

    rank, w, dev = init()
    moe = tt.load(ROOT / "specs" / "moe.yaml")
    c = moe.dispatch.manifest.constants
    E, K, hidden = c["EXPERTS"], c["TOPK"], c["HIDDEN"]
    L, T = E // w, args.tokens

    g = torch.Generator(device="cuda").manual_seed(2024 + rank)
    bf16 = torch.bfloat16
    w1 = (torch.randn(L, hidden, args.ffn, generator=g, device=dev) / hidden ** 0.5).to(bf16)
    w2 = (torch.randn(L, args.ffn, hidden, generator=g, device=dev) / args.ffn ** 0.5).to(bf16)
    x = torch.randn(T, hidden, generator=g, device=dev).to(bf16)
    dy = torch.randn(T, hidden, generator=g, device=dev).to(bf16)
    idx = torch.from_numpy(routing("random", w, E, K, T, np.random.default_rng([7, rank]), rank).reshape(T, K))
    idx = idx.to(dev)
    logits = torch.randn(T, K, generator=g, device=dev).masked_fill(idx < 0, float("-inf"))
    weights = torch.softmax(logits, dim=1)

    twin_layer, tsgen_layer = MoeLayer(w1, w2, experts=E), MoeLayer(w1, w2, moe=moe)
    for layer in (twin_layer, tsgen_layer):
        layer.route(idx, weights)
    want = step(twin_layer, x, dy)
    got = step(tsgen_layer, x, dy)
    tt.synchronize()
    ok = report("moe_layer_fwd_bwd", *compare(NAMES, got, want, rank))

    twin = "twin (NCCL all_to_all_single + index_add)"
    times = {twin: time_step(twin_layer, x, dy, args.iters), "tsgen": time_step(tsgen_layer, x, dy, args.iters)}
    print_times(f"moe_layer T={T}/rank E={E} top{K} hidden={hidden} ffn={args.ffn} W={w}", times, twin)
    return finish(ok)


if __name__ == "__main__":
    sys.exit(main())
