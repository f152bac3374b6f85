"""The Ulysses all-to-alls' baseline: what a PyTorch user calls, one process per GPU.

`torch_a2a` (family.bench.baselines of ulysses_pre_a2a / ulysses_post_a2a) times, for each
sequence length S, the DeepSpeed-Ulysses recipe on the same tensors as tsgen's op:

  pre   x [batch, S/P, H, D] -> permute to [P, S/P, batch, H/P, D] (contiguous) ->
        torch.distributed.all_to_all_single (NCCL) -> permute to [batch, S, H/P, D]
        (bshd; bhsd: [batch, H/P, S, D]); packed QKV: q, k, v apart, KV heads first repeated
        to P heads where P > kv_heads (the replication Ulysses needs)
  post  the inverse, from [batch, S, H/P, D] (or bhsd) to [batch, S/P, H, D]

with tsgen's timing core (TorchClock: events on the stream the calls run on, the slowest
rank's time), eagerly (the permutes allocate). The first call is checked against the result
each rank computes alone from every rank's input (inputs are a function of rank and index),
and the count of wrong elements over all ranks goes into the row. Ranks sharing a GPU never
run it (tsgen bench times no baseline there: the runner says so).
"""

from __future__ import annotations

from .timing import TorchClock, time_calls
from .workers import launch_workers, nccl_process


IMPL = "torch all_to_all_single + permute"


def torch_a2a_rows(family, spec, world: int, sizes: list[int], iters: int, reps: int, warmup: int) -> list[dict]:
    """Rank 0's rows for each sequence length in `sizes` (one process per GPU); rows that say why
    they were skipped where PyTorch is not installed."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return [{"impl": IMPL, "size": s, "skipped": "PyTorch is not installed here (torch.distributed runs the "
                 "baseline)"} for s in sizes]
    p = spec.params
    cfg = {"worker": "tsgen.bench.ulysses:worker", "pre": family.pre, "sizes": sizes, "batch": p.batch,
           "heads": p.heads, "head_dim": p.head_dim, "layout": p.layout, "dtype": spec.dtype,
           "packed_qkv": bool(getattr(p, "packed_qkv", False)), "kv_heads": getattr(p, "kv_heads", None) or p.heads,
           "iters": iters, "reps": reps, "warmup": warmup}
    return launch_workers(cfg, world)


def _value(torch, rank: int, shape, dtype, dev):
    """Rank-dependent inputs that every rank can rebuild: small integers, exact in 16 bits."""
    n = 1
    for s in shape:
        n *= s
    idx = torch.arange(n, device=dev, dtype=torch.int64)
    return ((idx * 7 + rank * 131) % 251 - 125).to(dtype).reshape(shape)


def _to_heads(torch, x, world: int):
    """[b, s, P, h, d] -> [P, s, b, h, d], contiguous (the all_to_all_single chunks)."""
    return x.permute(2, 1, 0, 3, 4).contiguous()


def worker(cfg: dict, rank: int) -> list[dict]:
    torch, dist, dev, world = nccl_process(rank)
    clock = TorchClock(torch, dist, dev)
    dt = getattr(torch, cfg["dtype"])
    b, h, d, bhsd = cfg["batch"], cfg["heads"], cfg["head_dim"], cfg["layout"] == "bhsd"
    kv = cfg["kv_heads"]
    sync = torch.zeros(1, device=dev)

    def line_up():
        dist.barrier()
        torch.cuda.synchronize()
        dist.all_reduce(sync)

    def pre(x, heads):  # x [b, c, heads, d] -> [b, S, heads/P, d] (or bhsd)
        c = x.shape[1]
        send = _to_heads(torch, x.reshape(b, c, world, heads // world, d), world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)  # recv[j]: rank j's tokens of our heads, [P, c, b, hl, d]
        y = recv.permute(2, 0, 1, 3, 4).reshape(b, world * c, heads // world, d)
        return y.permute(0, 2, 1, 3).contiguous() if bhsd else y.contiguous()

    def post(y, heads):  # y [b, S, heads/P, d] (or bhsd) -> [b, c, heads, d]
        if bhsd:
            y = y.permute(0, 2, 1, 3)
        s = y.shape[1]
        c = s // world
        send = y.reshape(b, world, c, heads // world, d).permute(1, 2, 0, 3, 4).contiguous()  # [P, c, b, hl, d]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)  # recv[j]: our tokens of rank j's heads
        return recv.permute(2, 1, 0, 3, 4).reshape(b, c, heads, d).contiguous()

    def replicate(x):  # [b, c, kv, d] -> [b, c, max(kv, P), d]: KV head i on ranks i P/kv ..
        return x if kv >= world else x.repeat_interleave(world // kv, dim=2)

    rows = []
    for size in cfg["sizes"]:
        c = size // world
        impl = IMPL
        try:
            if cfg["pre"] and cfg["packed_qkv"]:
                qkv = _value(torch, rank, (b, c, h + 2 * kv, d), dt, dev)

                def call(qkv=qkv):
                    q, k, v = qkv[:, :, :h], qkv[:, :, h:h + kv], qkv[:, :, h + kv:]
                    return pre(q, h), pre(replicate(k), max(kv, world)), pre(replicate(v), max(kv, world))

                def want():
                    full = torch.cat([_value(torch, r, (b, c, h + 2 * kv, d), dt, dev) for r in range(world)], dim=1)
                    hl, kl = h // world, max(1, kv // world)
                    kb = rank * kv // world
                    parts = (full[:, :, rank * hl:(rank + 1) * hl], full[:, :, h + kb:h + kb + kl],
                             full[:, :, h + kv + kb:h + kv + kb + kl])
                    return tuple(x.permute(0, 2, 1, 3) if bhsd else x for x in parts)
            elif cfg["pre"]:
                x = _value(torch, rank, (b, c, h, d), dt, dev)

                def call(x=x):
                    return (pre(x, h),)

                def want():
                    full = torch.cat([_value(torch, r, (b, c, h, d), dt, dev) for r in range(world)], dim=1)
                    part = full[:, :, rank * (h // world):(rank + 1) * (h // world)]
                    return (part.permute(0, 2, 1, 3) if bhsd else part,)
            else:
                hl = h // world
                shape = (b, hl, world * c, d) if bhsd else (b, world * c, hl, d)
                y = _value(torch, rank, shape, dt, dev)

                def call(y=y):
                    return (post(y, h),)

                def want():
                    parts = [_value(torch, r, shape, dt, dev) for r in range(world)]
                    parts = [p.permute(0, 2, 1, 3) if bhsd else p for p in parts]
                    full = torch.cat(parts, dim=2)  # [b, S, h, d]
                    return (full[:, rank * c:(rank + 1) * c],)

            got = call()
            wrong = torch.zeros(1, device=dev, dtype=torch.int64)
            for g, w in zip(got, want()):
                wrong += (g != w).sum()
            dist.all_reduce(wrong)
            t = time_calls(clock, [rank], {rank: torch.cuda.current_stream()}, lambda i, _: call(),
                           calls=cfg["iters"], reps=cfg["reps"], warmup=cfg["warmup"], graphs=False,
                           before_sample=line_up, label=f"torch a2a S={size}")
            rows.append({"impl": impl, "size": size, **t.fields(), "samples_us": t.samples_us,
                         "problems": t.problems, "wrong": int(wrong.item()), "torch_version": torch.__version__})
        except Exception as e:  # noqa: BLE001 - a row that says why
            rows.append({"impl": impl, "size": size, "skipped": f"{type(e).__name__}: {str(e)[:200]}"})
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return rows
