"""Which tsgen.torch op gives wrong results when captured in a CUDA graph, one process per GPU (torchrun):

    S=8192 torchrun --standalone --nproc-per-node 2 tools/torch_graph_probe.py

tests/torch_checks.py's cp_step_times captured the whole cp_attention step (forward + backward) in one
CUDA graph at 6289cec (2 x H200) and its replays gave wrong O, dQ, dK, dV (some elements never written).
(The cause was the check's own: nothing kept the leaves it had cloned and captured, and later eager
steps reused their memory; fixed at dde8953.) This probe captures smaller pieces the same way (warm-up on
a side stream, capture on a fresh torch.cuda.graph, the static outputs poisoned with NaN, one replay),
its inputs views of tensors that live for the whole run (so it cannot show that failure) and compares each replay with the
same piece run eagerly on the same inputs (bit for bit where the piece is deterministic, else the
relative error in norm): the allgather alone, the single-GPU attention forward, its forward +
backward, the cp forward alone, the cp forward + backward; each with the capture on the warm-up's
stream too (the second line of each), to tell a per-stream state (the persistent schedule's per-stream
tile counter, tsgen::attention::work_slot) from the rest. A lab tool: prints one line per piece, no
results file."""
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import tsgen.torch as tt  # noqa: E402
from torch_checks import ATTENTION_PAIRS, attention_inputs  # noqa: E402

local = int(os.environ.get("LOCAL_RANK", "0"))
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timedelta(seconds=180))
w, r = dist.get_world_size(), dist.get_rank()
S = int(os.environ.get("S", "8192"))


def captured(fn, same_stream: bool):
    """(replay, outputs): fn() warmed up 3 times on a side stream, then captured; same_stream: the capture
    on that side stream (torch.cuda.graph(stream=...)), else on the graph's own."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side if same_stream else None):
        outs = fn()
    return graph.replay, outs


def compare(name: str, fn) -> None:
    for same in (False, True):
        eager = [x.detach().clone() for x in fn()]
        torch.cuda.synchronize()
        dist.barrier()
        replay, outs = captured(fn, same)
        for x in outs:
            x.detach().fill_(float("nan"))
        dist.barrier()
        replay()
        torch.cuda.synchronize()
        notes = []
        for i, (got, want) in enumerate(zip(outs, eager)):
            got, want = got.detach().float(), want.float()
            nan = int(torch.isnan(got).sum())
            rel = float((got.nan_to_num() - want).norm() / want.norm().clamp_min(1e-30))
            notes.append(f"out{i} {'equal' if torch.equal(got, want) else f'rel {rel:.1e}'}"
                         f"{f' NaN {nan}' if nan else ''}")
        print(f"GRAPH r{r} {name}{' (capture on the warm-up stream)' if same else ''}: {', '.join(notes)}",
              flush=True)
        dist.barrier()


gen = torch.Generator(device="cuda").manual_seed(35)
fwd, bwd = ATTENTION_PAIRS["hd128_causal_gqa"]
attn = tt.attention(ROOT / fwd, ROOT / bwd)
ag = tt.load(ROOT / "specs" / "allgather.yaml")
cp = tt.cp_attention(ROOT / fwd, ROOT / bwd, ROOT / "specs" / "allgather.yaml", ROOT / "specs" / "reduce_scatter.yaml",
                     layout="zigzag")
sig = attn.signature
q, k, v, do = attention_inputs(sig, 1, S, S, gen)  # the same on every rank
n = S // w
ql, kl, vl, dol = (x[:, r * n:(r + 1) * n].contiguous() for x in (q, k, v, do))

def step_of(op, inputs, dout):
    """One forward + backward of `op` on leaves viewing `inputs`: (O, the leaves' grads)."""
    def step():
        leaves = [x.detach().requires_grad_(True) for x in inputs]
        o = op(*leaves)
        o.backward(dout)
        return (o, *(x.grad for x in leaves))
    return step


compare("allgather", lambda: (ag(kl.transpose(0, 1).contiguous()),))
compare("attention forward", lambda: tuple(attn(q, k, v, return_lse=True)))
compare("attention forward + backward", step_of(attn, (q, k, v), do))
compare("cp forward", lambda: tuple(cp(ql, kl, vl, return_lse=True)))
compare("cp forward + backward", step_of(cp, (ql, kl, vl), dol))
dist.destroy_process_group()
