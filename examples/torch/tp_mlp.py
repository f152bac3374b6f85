"""A tensor-parallel MLP block (sequence parallel in and out) on tsgen's fused GEMMs, checked against
its torch-only twin. Run it under torchrun, one process per GPU:

    torchrun --nproc-per-node 2 examples/torch/tp_mlp.py [--tokens 8192] [--compile] [--iters 20]

Each rank holds S/W rows of the input and 1/W of both weights (W1 by columns, W2 by rows):

    x (S/W, H) --AG-GEMM: allgather(x) @ W1_r--> (S, F/W) --gelu--> --GEMM-RS: reduce_scatter(. @ W2_r)--> (S/W, H)

The tsgen block runs allgather_gemm and gemm_reduce_scatter (the gather / reduce-scatter fused
into the GEMM), paired: each is the other's backward (AG-GEMM's dX is a GEMM-RS of dY with W1^T,
GEMM-RS's dA an AG-GEMM of dY with W2^T; the weight gradients are local torch GEMMs,
tsgen/torch/grads.py). A second fused variant runs the same math on the ops' out= form in an
autograd.Function of its own (_FusedOut): outputs into the caller's tensors, the backward's gathered
dY left in the heap (no copy out). A GEMM spec fixes H and F/W at compile time, and the pair must be compiled
for mirrored shapes: at W = 2 the block uses examples/torch/specs/tp_mlp_{ag_gemm,gemm_rs}.yaml
(H 4096, F 16384), at W = 4 the shipped specs/allgather_gemm.yaml and gemm_reduce_scatter.yaml
(H 8192, F 8192); S is free (a multiple of W, here and for the kernels' row tiles any size).
A second tsgen variant runs tsgen's allgather and reduce_scatter around torch GEMMs (unfused). The
twin uses torch.distributed's all_gather_into_tensor / reduce_scatter_tensor (NCCL) in autograd
Functions of the same shape, with torch GEMMs. All start from the same weights and input; the
script checks the output and every gradient (x, W1, W2) of each tsgen variant against the twin's,
then times a forward + backward step of each (CUDA events, the same stream, after warm-up) and
prints them. With --compile it also runs the fused block under torch.compile(fullgraph=True) and
checks and times that. Lines starting CHECK / TIME are what tools/gpu_torch.sh collects; exit code
1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import ROOT, compare, finish, init, print_times, report, step, time_step, tt  # noqa: E402
from twins import AllGather, ReduceScatter  # noqa: E402

NAMES = ("y", "dx", "dW1", "dW2")
# the fused GEMM specs by world size: (allgather_gemm, gemm_reduce_scatter), compiled for mirrored shapes
FUSED_SPECS = {2: (HERE / "specs" / "tp_mlp_ag_gemm.yaml", HERE / "specs" / "tp_mlp_gemm_rs.yaml"),
               4: (ROOT / "specs" / "allgather_gemm.yaml", ROOT / "specs" / "gemm_reduce_scatter.yaml")}


def load_fused(world: int) -> tuple:
    """This rank's paired (allgather_gemm, gemm_reduce_scatter) ops and the (H, F) they were compiled for."""
    if world not in FUSED_SPECS:
        raise SystemExit(f"no fused GEMM specs for {world} ranks (FUSED_SPECS has {sorted(FUSED_SPECS)}): write an "
                         "allgather_gemm spec with k = H, n = F/W and a gemm_reduce_scatter spec with k = F, n = H")
    ag, rs = (tt.load(p) for p in FUSED_SPECS[world])
    tt.pair(ag, rs)
    (_, h), (_, f_local) = ag.signature.ins[1].dims  # B = W1_r: [K = H, N/P = F/W]
    return ag, rs, h, f_local * world


class TPMLP(torch.nn.Module):
    """allgather -> x @ W1 -> gelu -> @ W2 -> reduce_scatter, with the collectives passed in."""

    def __init__(self, gather, scatter, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.gather, self.scatter = gather, scatter
        self.w1 = torch.nn.Parameter(w1.clone())
        self.w2 = torch.nn.Parameter(w2.clone())

    def forward(self, x):
        h = torch.nn.functional.gelu(self.gather(x) @ self.w1, approximate="tanh")
        return self.scatter(h @ self.w2)


class FusedTPMLP(TPMLP):
    """AG-GEMM -> gelu -> GEMM-RS: the same block with the communication inside the GEMMs."""

    def forward(self, x):
        h, _ = self.gather(x, self.w1)  # (C, the gathered x): the second output is for the backward
        return self.scatter(torch.nn.functional.gelu(h, approximate="tanh"), self.w2)


class _FusedOut(torch.autograd.Function):
    """The fused block's forward and backward on the ops' out= form (no autograd of its own: this
    Function says what the backward runs, the formulas of tsgen/torch/grads.py). The GEMMs' C goes
    straight into the tensors passed (written in place: a local output). The forward's gathered x
    is kept for dW1, so it goes to a tensor of its own (a copy out of the heap: the backward's
    AG-GEMM of dY reuses that heap slot before dW1 is computed); the backward's gathered dY is used
    at once (dW2), so it stays in the heap slot empty_out gives: no copy out."""

    @staticmethod
    def forward(ctx, x, w1, w2, ag, rs):
        s, h = x.shape[0] * ag.world, x.shape[1]
        c = torch.empty(s, w1.shape[1], dtype=x.dtype, device=x.device)
        x_full = torch.empty(s, h, dtype=x.dtype, device=x.device)
        ag(x, w1, out=(c, x_full))
        act = torch.nn.functional.gelu(c, approximate="tanh")
        y = torch.empty_like(x)
        rs(act, w2, out=y)
        ctx.ops = ag, rs
        ctx.save_for_backward(w1, w2, c, act, x_full)
        return y

    @staticmethod
    def backward(ctx, dy):
        ag, rs = ctx.ops
        w1, w2, c, act, x_full = ctx.saved_tensors
        dy = dy.contiguous()
        d_act, dy_full = ag.empty_out(dy.shape)  # dA of GEMM-RS (in place) and the gathered dY (the heap slot)
        ag(dy, w2.t().contiguous(), out=(d_act, dy_full))
        dw2 = act.t() @ dy_full  # before the next AG-GEMM call of this count reuses the slot
        dc = torch.ops.aten.gelu_backward(d_act, c, approximate="tanh")
        dx = torch.empty_like(dy)
        rs(dc, w1.t().contiguous(), out=dx)
        return dx, x_full.t() @ dc, dw2, None, None


class FusedOutTPMLP(TPMLP):
    """The fused block on the out= form (_FusedOut): the same math, fewer copies out of the heaps."""

    def forward(self, x):
        return _FusedOut.apply(x, self.w1, self.w2, self.gather, self.scatter)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="S: sequence length over all ranks")
    ap.add_argument("--iters", type=int, default=20, help="timed forward + backward steps per variant")
    ap.add_argument("--compile", action="store_true", help="also the fused block under torch.compile(fullgraph=True)")
    args = ap.parse_args()

    rank, w, dev = init()
    S = args.tokens
    if S % w:
        raise SystemExit(f"--tokens {S} must be a multiple of the world size {w}")
    ag_gemm, gemm_rs, H, F = load_fused(w)
    ag = tt.load(ROOT / "specs" / "allgather.yaml")
    rs = tt.load(ROOT / "specs" / "reduce_scatter.yaml")
    tt.pair(ag, rs)

    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    bf16 = torch.bfloat16
    w1 = (torch.randn(H, F // w, generator=g, device=dev) / H ** 0.5).to(bf16)
    w2 = (torch.randn(F // w, H, generator=g, device=dev) / (F ** 0.5)).to(bf16)
    x = torch.randn(S // w, H, generator=g, device=dev).to(bf16)
    dy = torch.randn(S // w, H, generator=g, device=dev).to(bf16)

    twin = "twin (NCCL + torch GEMMs)"
    blocks = {twin: TPMLP(AllGather.apply, ReduceScatter.apply, w1, w2),
              "tsgen AG-GEMM / GEMM-RS eager": FusedTPMLP(ag_gemm, gemm_rs, w1, w2),
              "tsgen AG-GEMM / GEMM-RS eager, out=": FusedOutTPMLP(ag_gemm, gemm_rs, w1, w2),
              "tsgen allgather / reduce_scatter + torch GEMMs": TPMLP(ag, rs, w1, w2)}
    if args.compile:
        compiled = FusedTPMLP(ag_gemm, gemm_rs, w1, w2)
        compiled.forward = torch.compile(compiled.forward, fullgraph=True)
        blocks["tsgen AG-GEMM / GEMM-RS compiled"] = compiled
    checks = {"tsgen AG-GEMM / GEMM-RS eager": "tp_mlp_fused_fwd_bwd",
              "tsgen AG-GEMM / GEMM-RS eager, out=": "tp_mlp_fused_out_fwd_bwd",
              "tsgen allgather / reduce_scatter + torch GEMMs": "tp_mlp_collectives_fwd_bwd",
              "tsgen AG-GEMM / GEMM-RS compiled": "tp_mlp_fused_compiled_fwd_bwd"}
    want = step(blocks[twin], x, dy)
    ok = True
    for name, block in blocks.items():
        if name == twin:
            continue
        got = step(block, x, dy)
        tt.synchronize()
        ok &= report(checks[name], *compare(NAMES, got, want, rank))
    times = {name: time_step(block, x, dy, args.iters) for name, block in blocks.items()}
    print_times(f"tp_mlp S={S} H={H} F={F} W={w}", times, twin)
    return finish(ok)


if __name__ == "__main__":
    sys.exit(main())
