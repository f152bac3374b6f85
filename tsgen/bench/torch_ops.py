"""Baselines through PyTorch: cuBLAS in this process, and the fused ops' baselines (cuBLAS,
NCCL, the two one after the other, SymmetricMemory's fused op) one process per GPU.

cuBLAS runs on the World's own stream of the rank (torch.cuda.ExternalStream), so the timing
core's events sit on the stream the product runs on. Without torch, cupy.matmul (cuBLAS, in
float16: CuPy has no bfloat16 product) on that stream, labelled so.
The fused workers (kind "fused", started by tsgen.bench.workers) time, for each M:
  gemm        the local product alone (allgather_gemm: gathered A . B_r; gemm_reduce_scatter:
              A_r . B_r, M x N)
  comm        the NCCL collective alone (all_gather_into_tensor / reduce_scatter_tensor)
  sequential  the two one after the other ("cuBLAS + NCCL")
  fused       torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter
each with the timing core (TorchClock), the slowest rank's time.
"""

from __future__ import annotations

from .timing import Timing, TorchClock, time_calls
from .workers import launch_workers, nccl_process


def _torch():
    try:
        import torch

        return torch
    except ImportError:
        return None


def cublas(world, rank: int, m: int, n: int, k: int, dtype: str, *, iters: int, reps: int, warmup: int,
           label: str) -> tuple[str, Timing]:
    """C (m x n) = A (m x k) . B (k x n) on rank's GPU and stream, random inputs."""
    from .timing import CupyClock

    cp, stream, dev = world.cp, world.streams[rank], world.devices[rank]
    torch = _torch()
    if torch is not None:
        tdt = getattr(torch, dtype)
        with torch.cuda.device(dev):
            a = torch.randn(m, k, device=f"cuda:{dev}", dtype=tdt)
            b = torch.randn(k, n, device=f"cuda:{dev}", dtype=tdt)
            c = torch.empty(m, n, device=f"cuda:{dev}", dtype=tdt)
            ext = torch.cuda.ExternalStream(stream.ptr, device=f"cuda:{dev}")
            torch.cuda.synchronize()

        def enqueue(i, _):
            with torch.cuda.device(dev), torch.cuda.stream(ext):
                torch.matmul(a, b, out=c)

        impl = f"cuBLAS (torch {torch.__version__} matmul, {dtype})"
    else:
        with cp.cuda.Device(dev):
            a = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
            b = cp.random.standard_normal((k, n), dtype=cp.float32).astype(cp.float16)
            c = cp.empty((m, n), dtype=cp.float16)

        def enqueue(i, _):
            with cp.cuda.Device(dev), stream:
                cp.matmul(a, b, out=c)

        impl = "cuBLAS (cupy.matmul, float16: no torch)"
    timing = time_calls(CupyClock(world), [rank], world.streams, enqueue, calls=iters, reps=reps, warmup=warmup,
                        graphs=False, label=label)
    return impl, timing


def sdpa(world, rank: int, spec, seq: int, *, iters: int, reps: int, warmup: int,
         label: str) -> list[tuple[str, Timing | None, str | None]]:
    """PyTorch's scaled_dot_product_attention of the attention spec's shape at sequence length
    `seq` on rank's GPU and stream, once with each of its flash and cuDNN backends: (impl, timing,
    None) per backend that runs here, (impl, None, why) per one that does not. Q, K and V are
    [batch, heads, seq, head_dim] and contiguous (SDPA's own layout: its best case); grouped-query
    heads through enable_gqa, else K and V expanded to every query head (said in the impl)."""
    from .timing import CupyClock

    torch = _torch()
    if torch is None:
        return [("torch SDPA", None, "torch is not installed")]
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..ops.attention import scale_of

    p, dev, stream = spec.params, world.devices[rank], world.streams[rank]
    tdt = getattr(torch, spec.dtype)
    scale = scale_of(spec)
    with torch.cuda.device(dev):
        q = torch.randn(p.batch, p.heads, seq, p.head_dim, device=f"cuda:{dev}", dtype=tdt)
        k = torch.randn(p.batch, p.kv_heads, seq, p.head_dim, device=f"cuda:{dev}", dtype=tdt)
        v = torch.randn(p.batch, p.kv_heads, seq, p.head_dim, device=f"cuda:{dev}", dtype=tdt)
        ext = torch.cuda.ExternalStream(stream.ptr, device=f"cuda:{dev}")
        torch.cuda.synchronize()
    out = []
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION)):
        impl, why = f"torch {torch.__version__} SDPA {name}", None
        for expand in ((False, True) if p.kv_heads != p.heads else (False,)):
            kk, vv = (k.repeat_interleave(p.heads // p.kv_heads, 1), v.repeat_interleave(p.heads // p.kv_heads, 1)) \
                if expand else (k, v)

            def call(kk=kk, vv=vv, expand=expand):
                with torch.cuda.device(dev), torch.cuda.stream(ext), sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, kk, vv, is_causal=p.causal, scale=scale,
                                                   enable_gqa=p.kv_heads != p.heads and not expand)

            try:
                call()
                torch.cuda.synchronize(dev)
            except RuntimeError as e:  # this backend refuses the shape (or is not built): say why
                why = f"{impl} does not run here: {str(e).splitlines()[0][:160]}"
                continue
            why = None
            timing = time_calls(CupyClock(world), [rank], world.streams, lambda i, _: call(), calls=iters, reps=reps,
                                warmup=warmup, graphs=False, label=f"{impl} {label}")
            out.append((impl + (" (K / V expanded to every head)" if expand else ""), timing, None))
            break
        if why:
            out.append((impl, None, why))
    return out


def run_fused(conv, op: str, params, dtype: str, world: int, sizes: list[int], *, iters: int, reps: int,
              warmup: int, timeout: float = 300) -> list[dict]:
    """The fused ops' baselines for each total M in `sizes`, one process per GPU; rank 0's rows."""
    cfg = {"worker": "tsgen.bench.torch_ops:fused_worker", "op": op, "ms": sizes, "k": params.k, "n": params.n, "dtype": dtype, "iters": iters,
           "reps": reps, "warmup": warmup, "comm_call": conv.comm_call, "fused_call": conv.fused_call}
    return launch_workers(cfg, world, timeout=timeout)


def fused_worker(cfg: dict, rank: int) -> list[dict]:
    torch, dist, dev, world = nccl_process(rank)
    group = dist.group.WORLD
    fused, fused_err = None, ""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        try:
            symm_mem.enable_symm_mem_for_group(group.group_name)
        except Exception:  # noqa: BLE001 - newer torch needs no enabling
            pass
        fused = getattr(torch.ops.symm_mem, cfg["fused_call"])
    except Exception as e:  # noqa: BLE001
        fused_err = f"{type(e).__name__}: {e}"
    clock = TorchClock(torch, dist, dev)
    tdt = getattr(torch, cfg["dtype"])
    sync = torch.zeros(1, device=dev)
    k, n, gather = cfg["k"], cfg["n"], cfg["op"] == "allgather_gemm"

    def line_up():
        dist.barrier()
        torch.cuda.synchronize()
        dist.all_reduce(sync)

    def timed(role: str, m: int, fn) -> dict:
        stream = torch.cuda.current_stream()
        t = time_calls(clock, [rank], {rank: stream}, lambda i, _: fn(), calls=cfg["iters"], reps=cfg["reps"],
                       warmup=cfg["warmup"], graphs=False, before_sample=line_up, label=f"{role} M={m}")
        return {"m": m, "role": role, **t.fields(), "samples_us": t.samples_us, "problems": t.problems}

    rows = []
    for m in cfg["ms"]:
        if gather:  # A row-sharded (m/world x K), B_r (K x n_local), C_r = allgather(A) . B_r
            a = torch.randn(m // world, k, device=dev, dtype=tdt)
            b = torch.randn(k, n, device=dev, dtype=tdt)
            full = torch.empty(m, k, device=dev, dtype=tdt)

            def gemm(full=full, b=b):
                return torch.matmul(full, b)

            def comm(full=full, a=a):
                dist.all_gather_into_tensor(full, a, group=group)

            def call_fused(a=a, b=b):
                return fused(a, [b], 0, group.group_name)[1][0]

            def sequential(gemm=gemm, comm=comm):
                comm()
                return gemm()
        else:  # A_r (m x K/world), B_r (K/world x N), C_r = rows r of sum_s A_s . B_s
            a = torch.randn(m, k // world, device=dev, dtype=tdt)
            b = torch.randn(k // world, n, device=dev, dtype=tdt)
            part = torch.matmul(a, b)
            out = torch.empty(m // world, n, device=dev, dtype=tdt)

            def gemm(a=a, b=b):
                return torch.matmul(a, b)

            def comm(out=out, part=part):
                dist.reduce_scatter_tensor(out, part, group=group)

            def call_fused(a=a, b=b):
                return fused(a, b, "sum", 0, group.group_name)

            def sequential(gemm=gemm, out=out):
                dist.reduce_scatter_tensor(out, gemm(), group=group)
                return out

        rows += [timed("gemm", m, gemm), timed("comm", m, comm), timed("sequential", m, sequential)]
        if fused is not None:
            try:
                ref, got = sequential().float(), call_fused().float()
                err = float((got - ref).norm() / ref.norm())
                rows.append(dict(timed("fused", m, call_fused), rel_err=err))
            except Exception as e:  # noqa: BLE001
                rows.append({"m": m, "role": "fused", "skipped": f"{type(e).__name__}: {str(e)[:200]}"})
        else:
            rows.append({"m": m, "role": "fused", "skipped": fused_err})
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return rows


def run_cp(params, dtype: str, world: int, sizes: list[int], *, iters: int, reps: int, warmup: int,
           timeout: float = 300) -> list[dict]:
    """cp_attention's baseline for each whole sequence S in `sizes`, one process per GPU; rank 0's rows."""
    cfg = {"worker": "tsgen.bench.torch_ops:cp_worker", "sizes": sizes, "heads": params.heads, "kv_heads": params.kv_heads,
           "head_dim": params.head_dim, "batch": params.batch, "causal": params.causal, "layout": params.layout,
           "dtype": dtype, "iters": iters, "reps": reps, "warmup": warmup}
    return launch_workers(cfg, world, timeout=timeout)


def cp_worker(cfg: dict, rank: int) -> list[dict]:
    """Per S: this rank's S / world queries, K and V ([batch, S / world, heads, d]); K and V
    gathered with all_gather_into_tensor (rank order), then SDPA of the local queries over the
    whole sequence (causal: a boolean mask of the gathered keys' positions, zig-zag included)."""
    import torch.nn.functional as F

    from ..ops.cp_attention import positions

    torch, dist, dev, world = nccl_process(rank)
    clock = TorchClock(torch, dist, dev)
    tdt = getattr(torch, cfg["dtype"])
    sync = torch.zeros(1, device=dev)
    b, h, hkv, d = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]

    def line_up():
        dist.barrier()
        torch.cuda.synchronize()
        dist.all_reduce(sync)

    rows = []
    for size in cfg["sizes"]:
        n = size // world
        q = torch.randn(b, h, n, d, device=dev, dtype=tdt)
        k = torch.randn(world, b, hkv, n, d, device=dev, dtype=tdt)[rank]
        v = torch.randn_like(k)
        k_all = torch.empty(world, b, hkv, n, d, device=dev, dtype=tdt)
        v_all = torch.empty_like(k_all)
        mask = None
        if cfg["causal"]:
            kpos = torch.cat([torch.as_tensor(positions(cfg["layout"], world, n, s)) for s in range(world)]).to(dev)
            qpos = torch.as_tensor(positions(cfg["layout"], world, n, rank)).to(dev)
            mask = kpos[None, :] <= qpos[:, None]

        def call(q=q, k=k, v=v, k_all=k_all, v_all=v_all, mask=mask, n=n):
            dist.all_gather_into_tensor(k_all, k, group=dist.group.WORLD)
            dist.all_gather_into_tensor(v_all, v, group=dist.group.WORLD)
            kf = k_all.permute(1, 2, 0, 3, 4).reshape(b, hkv, world * n, d)
            vf = v_all.permute(1, 2, 0, 3, 4).reshape(b, hkv, world * n, d)
            return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, enable_gqa=h != hkv)

        stream = torch.cuda.current_stream()
        try:
            t = time_calls(clock, [rank], {rank: stream}, lambda i, _: call(), calls=cfg["iters"], reps=cfg["reps"],
                           warmup=cfg["warmup"], graphs=False, before_sample=line_up, label=f"SDPA S={size}")
            rows.append({"s": size, **t.fields(), "samples_us": t.samples_us, "problems": t.problems,
                         "impl": f"torch {torch.__version__} all_gather_into_tensor + SDPA"})
        except Exception as e:  # noqa: BLE001
            rows.append({"s": size, "skipped": f"{type(e).__name__}: {str(e)[:200]}"})
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return rows
