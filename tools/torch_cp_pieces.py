"""Where the time of tsgen.torch.cp_attention's step goes, one process per GPU (torchrun):

    S=8192 torchrun --standalone --nproc-per-node 2 tools/torch_cp_pieces.py

For tests/torch_checks.py's cp cases (zig-zag causal GQA, contiguous MHA): the whole step (forward +
backward; also with kv_together: K and V in one all-gather, dK and dV in one reduce-scatter; and with
overlap_backward: the backward by runs of key rows, the peers' reduce-scatter beside the own rows'
kernels; and with push=: the kv_push backward), then each piece alone (the gather with and without its reorder,
the forward and backward kernels at this rank's positions, the composed backward (the kernel and the scatters of
dK, dV) beside the kv_push backward's one call, overlap_backward's backward alone and the backward kernel on each
run of key rows of every rank (backward_runs, at that rank's positions: on rank 0's data, the same
shapes and masks), the scatter with and without its reorder, and the single-GPU
kernels over the whole sequence divided by W: the ideal), each 3 calls of warm-up then 10 between
CUDA events on the current stream, GPU ms and host ms per call; then torch.profiler's table of two
steps on rank 0; then one allgather call's host time by part (host_split). A lab tool (tools/gpu_torch.sh TORCH_STEPS=cp_pieces): no check, no results file
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


def host_split(op, x, calls: int = 50) -> dict:
    """Where the host time of `calls` calls of TorchOp `op` on `x` goes, in us per call: the whole call
    through torch.ops (the dispatcher and the autograd wrapper included), the op's _forward, and inside it
    the argument checks, plan_call, the launcher (ctypes and the launch), the copies in and out (CUDA
    copies launched, not waited for), the rest (Python). Wrappers on the op and the module, removed after;
    a synchronize before and after, none between the calls (the host's own time, as in a step)."""
    import time as time_mod

    from tsgen.torch import ops as ops_mod

    spent = {"checks (_check)": 0.0, "plan_call": 0.0, "launcher (ctypes + launch)": 0.0}

    def clock(key, fn):
        def wrapped(*a, **kw):
            t0 = time_mod.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time_mod.perf_counter() - t0
        return wrapped

    saved = (op._check, op._launcher, op._forward, ops_mod.plan_call)
    inner = [0.0]
    op._check = clock("checks (_check)", op._check)
    op._launcher = clock("launcher (ctypes + launch)", op._launcher)
    ops_mod.plan_call = clock("plan_call", ops_mod.plan_call)
    forward = op._forward

    def timed_forward(*a, **kw):
        t0 = time_mod.perf_counter()
        try:
            return forward(*a, **kw)
        finally:
            inner[0] += time_mod.perf_counter() - t0
    op._forward = timed_forward
    try:
        op(x)  # once outside the count
        for key in spent:
            spent[key] = 0.0
        inner[0] = 0.0
        torch.cuda.synchronize()
        t0 = time_mod.perf_counter()
        for _ in range(calls):
            op(x)
        total = time_mod.perf_counter() - t0
        torch.cuda.synchronize()
    finally:  # the op's own methods back (the wrappers were instance attributes), the launcher and plan_call
        op.__dict__.pop("_check", None)
        op.__dict__.pop("_forward", None)
        op._launcher, ops_mod.plan_call = saved[1], saved[3]
    out = {"whole call (torch.ops dispatch included)": total, "dispatch and wrappers (whole - _forward)": total - inner[0],
           "_forward": inner[0], **spent,
           "copies and the rest of _forward": inner[0] - sum(spent.values())}
    return {k_: 1e6 * v_ / calls for k_, v_ in out.items()}


# each case's params.kv_push backward (cp_attention's push=): tests/torch_checks.py CP_PUSH
from torch_checks import CP_PUSH  # noqa: E402

for name, layout in (("hd128_causal_gqa", "zigzag"), ("hd128", "contiguous")):
    fwd, bwd = ATTENTION_PAIRS[name]
    def make_cp(**kw):
        return tt.cp_attention(ROOT / fwd, ROOT / bwd, ROOT / "specs" / "allgather.yaml",
                               ROOT / "specs" / "reduce_scatter.yaml", layout=layout, **kw)

    cp = make_cp()
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

    def step_of(op):  # forward + backward of one training step through `op`
        def step():
            for t in (q, k, v):
                t.grad = None
            op(q, k, v).backward(do)
        return step

    cp_kv, cp_ov = make_cp(kv_together=True), make_cp(overlap_backward=True)
    cp_push = make_cp(push=ROOT / CP_PUSH[(name, layout)])
    rows["step (fwd+bwd)"] = timed(step_of(cp))
    rows["step, push (kv_push backward)"] = timed(step_of(cp_push))
    rows["step, kv_together (one gather, one scatter)"] = timed(step_of(cp_kv))
    rows["step, overlap_backward"] = timed(step_of(cp_ov))
    with torch.no_grad():
        rows["gather k (allgather + reorder)"] = timed(lambda: cp.gather(k))
        rows["allgather k alone"] = timed(lambda: cp._allgather(_seq_first(k, sig.layout)))
        rows["gather k and v together (kv_together)"] = timed(lambda: cp_kv.gather_kv(k, v))
        if order is not None:
            rows["torch.tensor(order) to GPU"] = timed(lambda: torch.tensor(order, device="cuda"))
        rows["forward kernel _at"] = timed(lambda: F(q, kf, vf, *pos))
        rows["backward kernel _at"] = timed(lambda: B(q, kf, vf, o, do, lse, *pos))
        rows["overlap_backward's backward (runs + scatter)"] = timed(
            lambda: cp_ov.backward_overlapped(q, kf, vf, o, do, lse, pos))
        from tsgen.torch.cp_attention_op import backward_runs, cp_positions
        for x in range(w):  # every rank's runs, at its positions (the kernels' work is the masks')
            peers, own = backward_runs(cp.layout, cp.causal, w, n, x)
            pos_x = cp_positions(cp.layout, w, n, x)[:3]
            for what, runs in (("peers'", peers), ("own", own)):
                for a, b in runs:
                    rows[f"  rank {x} {what} run {a}-{b}: kernel _at"] = timed(
                        lambda a=a, b=b, pos_x=pos_x: B(q, kf[:, a:b], vf[:, a:b], o, do, lse, *pos_x, a))
        rows["composed backward (kernel _at + scatter of dk, dv)"] = timed(
            lambda: cp.scatter_kv(*B(q, kf, vf, o, do, lse, *pos)[1:]))
        rows["push backward (backward_push: kernel, wait, reduce)"] = timed(
            lambda: cp_push.backward_push(q, kf, vf, o, do, lse, pos))
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
    with torch.no_grad():
        split = host_split(cp._allgather, _seq_first(k, sig.layout))
    if r == 0:
        print("  host time of one allgather call, by part (us per call, 50 calls back to back, no sync between):")
        for k_, us in split.items():
            print(f"    {k_:40s} {us:8.1f} us")
    from torch.profiler import ProfilerActivity, profile
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step_of(cp)()
        torch.cuda.synchronize()
    if r == 0:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    sys.stdout.flush()
    cp_push.close()
    cp.close()
tt.close_all()
dist.barrier()
dist.destroy_process_group()
