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


def cuda_torch():
    """(torch, None) when torch is installed and sees a CUDA GPU, else (None, why): a torch without
    CUDA (a CPU build) cannot time anything here, so the baselines say why they did not run and
    cuBLAS falls back to CuPy."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} sees no CUDA GPU"
    return torch, None


def cublas(world, rank: int, m: int, n: int, k: int, dtype: str, *, iters: int, reps: int, warmup: int,
           label: str) -> tuple[str, Timing]:
    """C (m x n) = A (m x k) . B (k x n) on rank's GPU and stream, random inputs."""
    from .timing import CupyClock

    cp, stream, dev = world.cp, world.streams[rank], world.devices[rank]
    torch, _ = cuda_torch()
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

        impl = "cuBLAS (cupy.matmul, float16: no torch with CUDA)"
    timing = time_calls(CupyClock(world), [rank], world.streams, enqueue, calls=iters, reps=reps, warmup=warmup,
                        graphs=False, label=label)
    return impl, timing


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
