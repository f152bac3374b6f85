"""What the examples share: the process group under torchrun, one forward + backward step, its
time, the comparison of a tsgen model's outputs and gradients with its torch-only twin's, and the
CHECK lines tools/gpu_torch.sh collects. Each example puts its own folder on sys.path and imports
this first; this puts the checkout on it, so the examples run from a checkout uninstalled."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tsgen importable from it uninstalled too
sys.path.insert(0, str(ROOT))

import tsgen.torch as tt  # noqa: E402


def init() -> tuple[int, int, torch.device]:
    """One process per GPU under torchrun: (rank, world size, this rank's device), NCCL group."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev, timeout=timedelta(seconds=120))
    return dist.get_rank(), dist.get_world_size(), dev


def finish(ok: bool) -> int:
    tt.close_all()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def step(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple:
    """One forward + backward: (y, dx, then each parameter's gradient in model.parameters() order)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y = model(x)
    y.backward(dy)
    return (y.detach(), x.grad, *(p.grad for p in model.parameters()))


def time_step(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, iters: int, warmup: int = 3) -> float:
    """Milliseconds per forward + backward step (CUDA events around `iters` steps, ranks lined up first)."""
    for _ in range(warmup):
        step(model, x, dy)
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step(model, x, dy)
    end.record()
    tt.synchronize()
    return start.elapsed_time(end) / iters


def compare(names: tuple[str, ...], got: tuple, want: tuple, rank: int, rel: float = 2e-2) -> tuple[bool, str]:
    """bf16 results of the same math with differently ordered sums: close (max |diff| <= rel x max
    |twin|, every value finite), not equal."""
    worst, ok = [], True
    for n, a, b in zip(names, got, want):
        scale = b.float().abs().max().item() or 1.0
        diff = (a.float() - b.float()).abs().max().item()
        worst.append(f"{n} {diff / scale:.1e}")
        ok &= bool(torch.isfinite(a).all().item()) and diff <= rel * scale
    return ok, f"rank {rank}: max |diff| / max |twin|: " + ", ".join(worst)


def report(name: str, ok: bool, detail: str) -> bool:
    """Every rank's (ok, detail); rank 0 prints one CHECK line."""
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, (ok, detail))
    all_ok = all(r[0] for r in results)
    if dist.get_rank() == 0:
        print(f"CHECK {name} {'PASS' if all_ok else 'FAIL'} " + "; ".join(r[1] for r in results), flush=True)
    return all_ok


def print_times(label: str, times: dict[str, float], base: str) -> None:
    """TIME lines on rank 0: each variant's ms per step and its speed against `base` (the twin)."""
    if dist.get_rank() == 0:
        for name, ms in times.items():
            print(f"TIME {label} {name}: {ms:.3f} ms/step ({times[base] / ms:.2f}x the twin)", flush=True)
