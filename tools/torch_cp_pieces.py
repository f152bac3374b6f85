"""Where the time of tsgen.torch.cp_attention's step goes, one process per GPU (torchrun):

    S=8192 torchrun --standalone --nproc-per-node 2 tools/torch_cp_pieces.py

For tests/torch_checks.py's cp cases (zig-zag causal GQA, contiguous MHA): the whole step (forward +
backward), then each piece alone (the gather with and without its reorder, the forward and backward
kernels at this rank's positions, the scatter with and without its reorder, and the single-GPU
kernels over the whole sequence divided by W: the ideal), each 3 calls of warm-up then 10 between
CUDA events on the current stream, GPU ms and host ms per call; then torch.profiler's table of two
steps on rank 0. A lab tool (tools/gpu_torch.sh TORCH_STEPS=cp_pieces): no check, no results file
of its own; results/torch/2026-11-27-9665d53-cp-profile.md is its first output."""
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples" / "torch"))
import tsgen.torch as tt  # noqa: E402
from torch_checks import ATTENTION_PAIRS, attention_inputs, step_ms  # noqa: E402

local = int(os.environ.get("LOCAL_RANK", "0"))
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timedelta(seconds=180))
w, r = dist.get_world_size(), dist.get_rank()
gen = torch.Generator(device="cuda").manual_seed(35)
S = int(os.environ.get("S", "8192"))


def timed(fn):
    """(GPU ms, host ms) per call: tests/torch_checks.py step_ms on the default group."""
    return step_ms(fn, None)


for name, layout in (("hd128_causal_gqa", "zigzag"), ("hd128", "contiguous")):
    fwd, bwd = ATTENTION_PAIRS[name]
    cp = tt.cp_attention(ROOT / fwd, ROOT / bwd, ROOT / "specs" / "allgather.yaml", ROOT / "specs" / "reduce_scatter.yaml",
                         layout=layout)
    sig = cp.attention.signature
    n = S // w
    q, k, v, do = attention_inputs(sig, 1, n, n, gen)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    pos = cp.positions(q, k, v)
    F = getattr(torch.ops.tsgen, f"{cp.attention.forward.name}_at")
    B = getattr(torch.ops.tsgen, f"{cp.attention.backward.name}_at")
    with torch.no_grad():
        kf, vf = cp.gather(k), cp.gather(v)
        o, lse = F(q, kf, vf, *pos)
        dq, dkf, dvf = B(q, kf, vf, o, do, lse, *pos)
    from tsgen.torch.cp_attention_op import _seq_first, gather_order
    order = gather_order(cp.layout, cp.causal, w, n)
    rows = {}

    def step():
        for t in (q, k, v):
            t.grad = None
        cp(q, k, v).backward(do)

    rows["step (fwd+bwd)"] = timed(step)
    with torch.no_grad():
        rows["gather k (allgather + reorder)"] = timed(lambda: cp.gather(k))
        rows["allgather k alone"] = timed(lambda: cp._allgather(_seq_first(k, sig.layout)))
        if order is not None:
            rows["torch.tensor(order) to GPU"] = timed(lambda: torch.tensor(order, device="cuda"))
        rows["forward kernel _at"] = timed(lambda: F(q, kf, vf, *pos))
        rows["backward kernel _at"] = timed(lambda: B(q, kf, vf, o, do, lse, *pos))
        rows["scatter dk (reorder + reduce_scatter)"] = timed(lambda: cp.scatter(dkf))
        rows["reduce_scatter dk alone"] = timed(lambda: cp._reduce_scatter(_seq_first(dkf, sig.layout)))
        qf, kf1, vf1, dof = attention_inputs(sig, 1, S, S, gen)
        Ff = getattr(torch.ops.tsgen, f"{cp.attention.forward.name}_at")
        of, lsef = Ff(qf, kf1, vf1, 0, S, 0, 0)
        rows["ideal fwd kernel (S, one GPU) / W"] = tuple(x / w for x in timed(lambda: Ff(qf, kf1, vf1, 0, S, 0, 0)))
        rows["ideal bwd kernel (S, one GPU) / W"] = tuple(x / w for x in timed(lambda: B(qf, kf1, vf1, of, dof, lsef, 0, S, 0, 0)))
    if r == 0:
        print(f"== {name} {layout} W {w} S {S} (n {n}, pos {pos})")
        for k_, (g, c) in rows.items():
            print(f"  {k_:42s} GPU {g:8.3f} ms   host {c:8.3f} ms")
    from torch.profiler import ProfilerActivity, profile
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    if r == 0:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    sys.stdout.flush()
    cp.close()
tt.close_all()
dist.barrier()
dist.destroy_process_group()
