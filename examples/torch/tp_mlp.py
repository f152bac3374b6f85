"""A tensor-parallel MLP block (sequence parallel in and out) on tsgen ops, checked against its
torch-only twin. Run it under torchrun, one process per GPU:

    torchrun --nproc-per-node 2 examples/torch/tp_mlp.py [--tokens 8192 --hidden 4096 --ffn 16384]
             [--compile] [--iters 20]

Each rank holds tokens/W rows of the input and 1/W of both weights (W1 by columns, W2 by rows):

    x (S/W, H) --allgather--> (S, H) @ W1_r (H, F/W) --gelu--> @ W2_r (F/W, H) --reduce_scatter--> (S/W, H)

The tsgen block uses tsgen.torch's allgather and reduce_scatter (paired: each is the other's
backward); the twin uses torch.distributed's all_gather_into_tensor / reduce_scatter_tensor (NCCL)
in autograd Functions of the same shape. Both start from the same weights and input; the script
checks the output and every gradient (input, W1, W2) of the tsgen block against the twin's, then
times a forward + backward step of each (CUDA events, the same stream, after warm-up) and prints
both. With --compile it also runs the tsgen block under torch.compile(fullgraph=True) and checks
and times that. Lines starting CHECK / TIME are what tools/gpu_torch.sh collects; exit code 1
when a check fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import tsgen.torch as tt  # noqa: E402
from common import compare, finish, init, print_times, report, step, time_step  # noqa: E402
from twins import AllGather, ReduceScatter  # noqa: E402

NAMES = ("y", "dx", "dW1", "dW2")


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="S: sequence length over all ranks")
    ap.add_argument("--hidden", type=int, default=4096, help="H")
    ap.add_argument("--ffn", type=int, default=16384, help="F: the MLP's inner size over all ranks")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="also the tsgen block under torch.compile(fullgraph=True)")
    args = ap.parse_args()

    rank, w, dev = init()
    S, H, F = args.tokens, args.hidden, args.ffn
    if S % w or F % w:
        raise SystemExit(f"--tokens {S} and --ffn {F} must be multiples of the world size {w}")

    ag = tt.load(ROOT / "specs" / "allgather.yaml")
    rs = tt.load(ROOT / "specs" / "reduce_scatter.yaml")
    tt.pair(ag, rs)

    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    bf16 = torch.bfloat16
    w1 = (torch.randn(H, F // w, generator=g, device=dev) / H ** 0.5).to(bf16)
    w2 = (torch.randn(F // w, H, generator=g, device=dev) / (F ** 0.5)).to(bf16)
    x = torch.randn(S // w, H, generator=g, device=dev).to(bf16)
    dy = torch.randn(S // w, H, generator=g, device=dev).to(bf16)

    tsgen_block = TPMLP(ag, rs, w1, w2)
    twin_block = TPMLP(AllGather.apply, ReduceScatter.apply, w1, w2)
    ok = True
    want = step(twin_block, x, dy)
    got = step(tsgen_block, x, dy)
    tt.synchronize()
    ok &= report("tp_mlp_eager_fwd_bwd", *compare(NAMES, got, want, rank))

    times = {"twin (NCCL) eager": time_step(twin_block, x, dy, args.iters),
             "tsgen eager": time_step(tsgen_block, x, dy, args.iters)}
    if args.compile:
        compiled = TPMLP(ag, rs, w1, w2)
        compiled.forward = torch.compile(compiled.forward, fullgraph=True)
        got_c = step(compiled, x, dy)
        tt.synchronize()
        ok &= report("tp_mlp_compiled_fwd_bwd", *compare(NAMES, got_c, want, rank))
        times["tsgen compiled"] = time_step(compiled, x, dy, args.iters)
    print_times(f"tp_mlp S={S} H={H} F={F} W={w}", times, "twin (NCCL) eager")
    return finish(ok)


if __name__ == "__main__":
    sys.exit(main())
