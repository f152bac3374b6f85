"""The MoE baseline: dispatch and combine through PyTorch's all_to_all_single (NCCL), one process
per GPU (worker kind "moe", started by tsgen.bench.workers).

Per call, on each rank with `tokens` tokens routed as the family's make_inputs routes them:
  dispatch  destination mask from topk_idx (expert // (E / W)); rows permuted into destination
            order (token order inside one destination); the per-destination counts exchanged with
            all_to_all_single; the counts read on the host (all_to_all_single takes its split sizes
            from the host: the synchronization tsgen's kernels do without); the rows exchanged
  combine   the received rows sent back with the splits reversed, then summed per token in fp32
            with index_add_ and rounded to bf16
timed with the same core as tsgen's calls (TorchClock), the slowest rank's time; the last timed
output is checked (the count of wrong elements over all ranks goes into the row). fp8 payloads are
timed as bf16 rows (PyTorch has no fp8 all-to-all of its own), said in the row's impl.
"""

from __future__ import annotations

import numpy as np

from .timing import TorchClock, time_calls
from .workers import nccl_process


def moe_worker(cfg: dict, rank: int) -> list[dict]:
    from ..ops.moe import routing

    torch, dist, dev, world = nccl_process(rank)
    clock = TorchClock(torch, dist, dev)
    experts, topk, hidden = cfg["experts"], cfg["topk"], cfg["hidden"]
    per_rank = experts // world
    sync = torch.zeros(1, device=dev)

    def line_up():
        dist.barrier()
        torch.cuda.synchronize()
        dist.all_reduce(sync)

    rows = []
    for tokens in cfg["sizes"]:
        rng = np.random.default_rng([12345, rank])
        idx = torch.from_numpy(routing("random", world, experts, topk, tokens, rng, rank).astype(np.int64))
        idx = idx.reshape(tokens, topk).to(dev)
        x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
        out = torch.empty(tokens, hidden, device=dev, dtype=torch.bfloat16)

        def destinations():
            """[tokens, world] bool: the ranks holding one of the token's experts (each once)."""
            dest = torch.where(idx >= 0, idx // per_rank, world)  # world: no destination
            mask = torch.zeros(tokens, world + 1, dtype=torch.bool, device=dev)
            mask.scatter_(1, dest, True)
            return mask[:, :world]

        def call():
            d, t = destinations().t().nonzero(as_tuple=True)  # by destination, then token
            send_counts = torch.bincount(d, minlength=world)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts)
            send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
            send = x.index_select(0, t)
            recv = torch.empty(sum(recv_split), hidden, device=dev, dtype=torch.bfloat16)
            dist.all_to_all_single(recv, send, recv_split, send_split)
            back = torch.empty_like(send)
            dist.all_to_all_single(back, recv, send_split, recv_split)  # the identity expert's rows home
            acc = torch.zeros(tokens, hidden, device=dev, dtype=torch.float32)
            acc.index_add_(0, t, back.float())
            out.copy_(acc)

        stream = torch.cuda.current_stream()
        timing = time_calls(clock, [rank], {rank: stream}, lambda i, _: call(), calls=cfg["iters"], reps=cfg["reps"],
                            warmup=cfg["warmup"], graphs=False, before_sample=line_up,
                            label=f"torch all_to_all_single moe {tokens}")
        # the timed output, checked: with the identity expert, token t's row comes back once per
        # destination rank, so out[t] = bf16(n_t * x[t]) exactly (n_t <= 8: the fp32 sum is exact)
        n = destinations().sum(1, dtype=torch.float32)
        wrong = (out != (x.float() * n[:, None]).to(torch.bfloat16)).sum().reshape(1)
        dist.all_reduce(wrong)
        rows.append({"tokens": tokens, **timing.fields(), "samples_us": timing.samples_us,
                     "problems": timing.problems, "wrong": int(wrong.item()), "torch_version": torch.__version__})
    dist.barrier()
    dist.destroy_process_group()
    return rows
