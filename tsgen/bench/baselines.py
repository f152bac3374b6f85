"""The functions that time the baselines an op's family states (`family.bench.baselines`, each a
tsgen.ops.conventions.Baseline naming one of these functions), and the dispatch to them.

In this process, on the World's own streams and timed by the same core as tsgen's calls (a Step in,
a list of Measured out):
  memcpy_peer   cudaMemcpyPeerAsync moving the copy's bytes between the same GPUs
  cublas        the GEMM's product (M x K . K x N) through cuBLAS on rank 0's GPU
  cublas_whole  the whole M x K . K x N product of a grid GEMM on one GPU
  sdpa          attention through PyTorch SDPA (flash and cuDNN backends) on rank 0's GPU
  cudnn_frontend  attention through cuDNN's SDPA graph (cudnn-frontend) on rank 0's GPU
  flash_attn_4  attention through FlashAttention-4's CuTe DSL kernels (flash-attn-4) on rank 0's GPU
  moe_phases    tsgen's own MoE dispatch alone and combine alone (the row beside its pair)
One process per GPU (tsgen launch; the workers run the function the config names), after tsgen's
timings, rows of Measured from the workers' JSON:
  collectives   nccl, symm_mem: the collective through NCCL / SymmetricMemory (tsgen/bench/nccl.py)
  fused         cublas+nccl, torch_fused: the fused ops' baselines (tsgen/bench/torch_ops.py)
  torch_a2a     the Ulysses all-to-alls: all_to_all_single + permutes (tsgen/bench/ulysses.py)
  cp_sdpa       cp_attention's: all_gather_into_tensor of K and V + SDPA (naive), and causal
                zig-zag SDPA per chunk merged by LSE (attention_baselines.py)
  moe_a2a       MoE dispatch + combine through all_to_all_single (tsgen/bench/moe_torch.py)
  deepep        MoE dispatch, combine and the pair through DeepEP, with the peer-copy ceiling
                (tsgen/bench/moe_deepep.py; notes where deep_ep is not installed)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from ..ops.conventions import Baseline, BenchCase
from .sizes import BenchConfigError, calls_per_sample
from .timing import CupyClock, Sampler, Timing, time_calls
from .ulysses import torch_a2a_rows


@dataclass
class Measured:
    """One timed baseline result, before it becomes a table row."""

    impl: str
    size: int
    timing: Timing | None  # None: skipped (`skipped` says why)
    case: BenchCase | None = None  # what its guard bounds (None: the op's own case)
    compare: bool = True  # tsgen's rows get a ratio against it (components of a sum do not)
    role: str = ""
    pattern: str = ""
    extra: dict = field(default_factory=dict)
    skipped: str | None = None
    sampler: Sampler | None = None  # prepared, not yet timed: the bench times it in tsgen's rounds (interleave)
    after: Callable[[], list[str]] | None = None  # once its rounds are timed: the problems its own check finds


# ---------------------------------------------------------------------------
# in this process
# ---------------------------------------------------------------------------


def memcpy_peer(step) -> list[Measured]:
    w, cp, bufs, spec = step.world, step.world.cp, step.sets[0], step.spec
    nbytes, put, shift = step.case.size, step.family.direction == "put", spec.params.shift
    src, dst = bufs.by_name["src"].offset, bufs.by_name["dst"].offset

    def enqueue(i, ranks):
        for r in ranks:
            peer = (r + shift) % w.size
            s, d = (r, peer) if put else (peer, r)  # the same direction of data as the kernel
            with cp.cuda.Device(w.devices[r]):
                cp.cuda.runtime.memcpyPeerAsync(bufs.bases[d] + dst, w.devices[d], bufs.bases[s] + src,
                                                w.devices[s], nbytes, w.streams[r].ptr)

    t = time_calls(CupyClock(w), step.ranks, w.streams, enqueue, calls=step.iters, reps=step.reps,
                   warmup=step.warmup, graphs=False, label=f"memcpyPeer {step.label}")
    return [Measured("memcpyPeer", step.case.size, t, pattern=step.pattern)]


def cublas(step) -> list[Measured]:
    from .torch_ops import cublas as run

    p = step.spec.params
    impl, t = run(step.world, step.world.ranks[0], step.case.size, p.n, p.k, step.spec.dtype, iters=step.iters,
                  reps=step.reps, warmup=step.warmup, label=f"cuBLAS {step.label}")
    return [Measured(impl, step.case.size, t)]


def cublas_whole(step) -> list[Measured]:
    """cuBLAS of the whole M x K . K x N on rank 0's GPU: all the grid's FLOPs on one GPU."""
    from .torch_ops import cublas as run

    p, m = step.spec.params, step.case.size
    impl, t = run(step.world, step.world.ranks[0], m, p.n, p.k, step.spec.dtype, iters=step.iters,
                  reps=step.reps, warmup=step.warmup, label=f"cuBLAS whole {step.label}")
    case = BenchCase(m, m, flops=2.0 * m * p.n * p.k)
    return [Measured(f"{impl}, whole matrix on 1 GPU", m, t, case=case)]


def moe_phases(step) -> list[Measured]:
    """tsgen's own MoE dispatch alone and combine alone, beside its pair (tsgen/bench/moe_phases.py):
    rows with their phase's bytes and SM count, compared with nothing."""
    from .moe_phases import time_phases

    return [Measured(impl, step.case.size, timing, case=case, compare=False, role=fields["phase"], extra=fields,
                     skipped=fields.get("skipped")) for impl, timing, case, fields in time_phases(step)]


def _candidates(step, found) -> list[Measured]:
    """Measured of each (impl, call, why) of rank 0: a Sampler for tsgen's interleaved rounds
    where the op's conventions say `interleave`, else timed now; skipped with its reason."""
    w, rank, out = step.world, step.world.ranks[0], []
    for impl, call, why in found:
        if call is None:
            out.append(Measured(impl, step.case.size, None, skipped=why))
            continue
        kw = dict(calls=step.iters, warmup=step.warmup, graphs=False, label=f"{impl} {step.label}")
        enqueue = lambda i, _, call=call: call()  # noqa: E731
        if step.conv.interleave:
            # lineup: one untimed call before each sample, so a baseline's host-side cost per call (FA4's
            # Python dispatch, tens of us) is not in the first timed call: the GPU is busy meanwhile
            sampler = Sampler(CupyClock(w), [rank], w.streams, enqueue, lineup=True, **kw)
            out.append(Measured(impl, step.case.size, None, sampler=sampler))
        else:
            timing = time_calls(CupyClock(w), [rank], w.streams, enqueue, reps=step.reps, **kw)
            out.append(Measured(impl, step.case.size, timing))
    return out


def sdpa(step) -> list[Measured]:
    """The attention op's: PyTorch SDPA (flash and cuDNN backends) of the same shape on rank 0's
    GPU and stream (tsgen/bench/attention_baselines.py)."""
    from .attention_baselines import sdpa as found

    return _candidates(step, found(step.world, step.world.ranks[0], step.spec, step.case.size))


def cudnn_frontend(step) -> list[Measured]:
    """The attention op's: cuDNN's SDPA graph through cudnn-frontend on rank 0's GPU and stream."""
    from .attention_baselines import cudnn_frontend as found

    return _candidates(step, found(step.world, step.world.ranks[0], step.spec, step.case.size))


def flash_attn_4(step) -> list[Measured]:
    """The attention op's: FlashAttention-4's forward (flash_attn.cute.flash_attn_func) on rank 0's
    GPU and stream; a note where flash-attn-4 is not installed or does not run."""
    from .attention_baselines import flash_attn_4 as found

    return _candidates(step, found(step.world, step.world.ranks[0], step.spec, step.case.size))


# ---------------------------------------------------------------------------
# one process per GPU
# ---------------------------------------------------------------------------


def _timing(row: dict) -> Timing | None:
    samples = row.get("samples_us")
    if row.get("skipped") or not row.get("time_us"):
        return None
    samples = samples or [row["time_us"]]
    return Timing(list(samples), int(row.get("calls") or 0), row.get("mode", "?"), row.get("note"),
                  list(row.get("problems") or []))


def collectives(names, family, spec, world: int, sizes: list[int], iters: int, reps: int, warmup: int) -> list[Measured]:
    from .nccl import best_baselines

    backends = [n for n in names if n in ("nccl", "symm_mem")]
    op = family.bench.nccl_op(family)
    out = []
    for r in best_baselines(op, spec.dtype, sizes, world, backends=backends, iters=iters, reps=reps,
                            warmup=warmup):
        extra = {k: r[k] for k in ("config", "nccl_version", "torch_version", "wrong", "slots") if k in r}
        out.append(Measured(r["backend"], r["bytes"], _timing(r), extra=extra, skipped=r.get("skipped")))
    return out


def fused(names, family, spec, world: int, sizes: list[int], iters: int, reps: int, warmup: int) -> list[Measured]:
    from .torch_ops import run_fused

    conv = family.bench
    rows = run_fused(conv, spec.op, spec.params, spec.dtype, world, sizes, iters=iters, reps=reps, warmup=warmup)
    impls = {"gemm": "cuBLAS (GEMM alone)", "comm": f"NCCL {conv.comm_call} (alone)",
             "sequential": "cuBLAS + NCCL", "fused": f"torch {conv.fused_call}"}
    out = []
    for r in rows:
        size, role = r["m"], r["role"]
        case = conv.case(family, spec, world, size)
        if role == "gemm":
            case = dataclasses.replace(case, link_bytes=0.0)
        elif role == "comm":
            case = dataclasses.replace(case, flops=0.0)
        extra = {"rel_err": r["rel_err"]} if "rel_err" in r else {}
        out.append(Measured(impls[role], size, _timing(r), case=case, compare=role in ("sequential", "fused"),
                            role=role, extra=extra, skipped=r.get("skipped")))
    return out


def cp_sdpa(names, family, spec, world: int, sizes: list[int], iters: int, reps: int, warmup: int) -> list[Measured]:
    """cp_attention's baselines: all_gather_into_tensor of K and V + SDPA (the naive one), and for
    causal zig-zag the zig-zag SDPA per chunk pair merged by LSE (tsgen/bench/attention_baselines.py)."""
    from .attention_baselines import run_cp

    rows = run_cp(spec.params, spec.dtype, world, sizes, iters=iters, reps=reps, warmup=warmup)
    return [Measured(r["impl"], r["s"], _timing(r), case=family.bench.case(family, spec, world, r["s"]),
                     extra={k: r[k] for k in ("rel_err_vs_naive",) if k in r}, skipped=r.get("skipped")) for r in rows]


def torch_a2a(names, family, spec, world: int, sizes: list[int], iters: int, reps: int, warmup: int) -> list[Measured]:
    """The Ulysses all-to-alls' baseline: all_to_all_single + permutes (tsgen/bench/ulysses.py)."""
    return [Measured(r["impl"], r["size"], _timing(r), extra={k: r[k] for k in ("wrong", "torch_version") if k in r},
                     skipped=r.get("skipped")) for r in torch_a2a_rows(family, spec, world, sizes, iters, reps, warmup)]


def moe_a2a(names, family, spec, world: int, sizes: list[int], iters: int, reps: int, warmup: int) -> list[Measured]:
    """MoE dispatch + combine's baseline: counts exchange, permute, all_to_all_single, unpermute
    (tsgen/bench/moe_torch.py); size = tokens per rank."""
    from .workers import launch_workers

    p = spec.params
    cfg = {"worker": "tsgen.bench.moe_torch:moe_worker", "sizes": sizes, "experts": p.experts, "topk": p.topk, "hidden": p.hidden,
           "iters": iters, "reps": reps, "warmup": warmup}
    impl = "torch all_to_all_single dispatch+combine" + (" (bf16 rows)" if p.payload == "fp8" else "")
    return [Measured(impl, r["tokens"], _timing(r), extra={k: r[k] for k in ("wrong", "torch_version") if k in r},
                     skipped=r.get("skipped")) for r in launch_workers(cfg, world)]


DEEPEP_FIELDS = ("wrong", "phase", "ep_mode", "payload", "sms", "config", "impl_note", "deepep_bytes", "link_bytes",
                 "link_GBps", "deep_ep_version", "torch_version")


def deepep(names, family, spec, world: int, sizes: list[int], iters: int, reps: int, warmup: int) -> list[Measured]:
    """MoE dispatch, combine and the pair through DeepEP, and the peer-copy ceiling
    (tsgen/bench/moe_deepep.py), each row with its own bytes (DeepEP's count as the bandwidth
    bytes, the rows over the link as the guard's); normal mode at each SM count of its sweep
    (moe_deepep.NORMAL_SMS_SWEEP), the fastest pair compared with tsgen's pair, the other pairs, the
    phases and the ceiling rows beside it. Without deep_ep: notes, and the ceiling."""
    from .workers import launch_workers

    p = spec.params
    cfg = {"worker": "tsgen.bench.moe_deepep:deepep_worker", "sizes": sizes, "experts": p.experts, "topk": p.topk,
           "hidden": p.hidden, "mode": p.mode, "payload": p.payload, "iters": iters, "reps": reps, "warmup": warmup}
    out = []
    rows = launch_workers(cfg, world)
    best = _fastest_pairs(rows)
    for r in rows:
        size = r["tokens"] or sizes[0]  # the ceiling row sits beside the first size
        if r.get("skipped"):
            out.append(Measured("DeepEP", size, None, skipped=r["skipped"]))
            continue
        phase = r["phase"]
        if phase == "ceiling":
            impl = f"peer copy ceiling (cudaMemcpyPeerAsync {r['deepep_bytes'] >> 20} MiB per rank, all at once)"
        else:
            impl = (f"DeepEP {r['ep_mode'].replace('_', '-')} {'dispatch+combine' if phase == 'pair' else phase} "
                    f"({r['payload']}, {r['sms']} SMs)")
        # the GB/s column: the bytes a rank sends to other ranks, as tsgen's phase rows and the ceiling count
        # them (DeepEP's own count, its rows to itself included, stays in the row's deepep_bytes)
        case = BenchCase(size, size, link_bytes=float(r["link_bytes"]), bw_bytes=float(r["link_bytes"]),
                         note="bytes: to other ranks, the rank that moves most (DeepEP's count: deepep_bytes)")
        compared = phase == "pair" and id(r) in best
        out.append(Measured(impl, size, _timing(r), case=case, compare=compared,
                            role="" if compared else ("pair" if phase == "pair" else phase),
                            extra={k: r[k] for k in DEEPEP_FIELDS if k in r}))
    return out


def _fastest_pairs(rows: list[dict]) -> set[int]:
    """The ids of the pair rows tsgen is compared with: per size and mode, the fastest of DeepEP's
    SM counts (the others stay rows beside it, with their SM count in the name)."""
    fastest: dict[tuple, dict] = {}
    for r in rows:
        if r.get("skipped") or r.get("phase") != "pair" or r.get("time_us") is None:
            continue
        key = (r["tokens"], r.get("ep_mode"))
        if key not in fastest or r["time_us"] < fastest[key]["time_us"]:
            fastest[key] = r
    return {id(r) for r in fastest.values()}


def runner(baseline: Baseline):
    """The function of this module that times `baseline` (looked up when called, so a test can
    replace it); BenchConfigError when there is none."""
    fn = globals().get(baseline.runner)
    if not callable(fn) or baseline.runner.startswith("_"):
        raise BenchConfigError(f"baseline {baseline.name!r}: tsgen/bench/baselines.py has no function "
                               f"{baseline.runner!r} to time it")
    return fn


def check_baselines(baselines) -> None:
    for b in baselines:
        runner(b)


def run_in_process(baselines, step) -> list[Measured]:
    """The in-process baselines of one size (and pattern)."""
    return [m for b in baselines if b.in_process for m in runner(b)(step)]


def run_multiprocess(baselines, family, spec, world: int, sizes: list[int], iters: int, reps: int,
                     warmup: int) -> list[Measured]:
    """Each multi-process function once, with the names of all the op's baselines."""
    names = [b.name for b in baselines]
    out, done = [], set()
    for b in baselines:
        if b.in_process or b.runner in done:
            continue
        done.add(b.runner)
        out += runner(b)(names, family, spec, world, sizes, calls_per_sample(iters, 1), reps, warmup)
    return out
