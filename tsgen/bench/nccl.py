"""Reference timings for tsgen's collectives: NCCL and PyTorch SymmetricMemory.

tsgen's collectives are compared with what a user would otherwise call, timed on the same
machine in the same run (the ops state their conventions in tsgen/ops/collectives/bench.py):

  nccl                torch.distributed (NCCL backend): all_gather_into_tensor,
                      reduce_scatter_tensor, all_to_all_single, all_reduce, broadcast.
  nccl_cupy           (opt-in) the same NCCL collectives called directly through
                      cupy.cuda.nccl, without c10d in between; rows are skipped
                      with a reason where cupy.cuda.nccl is not usable.
  symm_mem_one_shot   torch.ops.symm_mem.one_shot_all_reduce   (all_reduce only)
  symm_mem_two_shot   torch.ops.symm_mem.two_shot_all_reduce_  (all_reduce only)
  ("symm_mem" names both symm_mem rows.)

NVLink multicast is never used: every worker runs with it forced off (tsgen/env.py), and no
multimem operation can be asked for (a name with "multimem", "nvls" or "multicast" in it
raises MulticastForbiddenError).

Method (one process per GPU, like nccl-tests):
  * `run_baselines` starts `world` workers under tsgen launch (tsgen/bench/workers.py), which
    meet through torch.distributed's env:// rendezvous. A worker that fails ends all of them
    and raises BaselineRunError with its traceback; so does the global timeout.
  * Sizes are in bytes, nccl-tests style (ops.collectives.bench.nccl_counts).
  * Buffers are allocated once per size. Below 64 MiB the calls rotate over several buffer
    slots, enough that the slots together exceed 2x the L2 (at most 4096 slots).
  * The first call per (backend, size) is checked against values computed from rank-seeded
    data (small integers, exact in every dtype); the number of wrong elements over all ranks
    goes into the row's "wrong".
  * Timing is tsgen's timing core (tsgen/bench/timing.py, TorchClock): `calls` back-to-back
    calls (a multiple of the slot count, >= iters) replayed as one CUDA graph where every rank
    captures (else eagerly, "mode"), events on the stream the calls run on, the witness and
    region checks; before each sample a barrier, a short GPU sleep (so every host has queued
    its work before the GPU reaches it), then a one-element NCCL all-reduce that lines the
    ranks up. Each sample's time is the MAX over ranks; time_us is the median of `reps`.
  * In-place ops (all_reduce, two_shot_all_reduce_, broadcast) keep operating on their own
    results while being timed, so the values grow (to inf for the float types); the time of
    these memory-bound ops does not depend on them.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ..ops import get_family
from ..ops.conventions import baseline_names
from ..ops.collectives.bench import ITEMSIZE as DTYPES
from ..ops.collectives.bench import NCCL_CALLS, nccl_counts
from ..ops.collectives.bench import busbw_factor as _busbw_factor
from .sizes import DEFAULT_L2_BYTES, BenchConfigError, calls_per_sample, parse_sizes, rotation_slots, slot_stride
from .timing import HostClock, Timing, TorchClock, _first_line, time_calls
from .workers import BaselineRunError, launch_workers

OPS = tuple(NCCL_CALLS)
BACKENDS = ("nccl", "nccl_cupy", "symm_mem_one_shot", "symm_mem_two_shot")
SYMM_MEM_OPS = {"one_shot": "one_shot_all_reduce", "two_shot": "two_shot_all_reduce_"}

CHECK_CHUNK = 1 << 26  # elements per chunk when filling / checking buffers
ROW_FIELDS = ("backend", "op", "dtype", "bytes", "world", "time_us", "algbw_GBps", "busbw_GBps")

_OP_ALIASES = {
    "allgather": "allgather", "reducescatter": "reduce_scatter", "alltoall": "all_to_all",
    "allreduce": "all_reduce", "broadcast": "broadcast", "bcast": "broadcast",
}
_DTYPE_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
    "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32",
    "int32": "int32", "i32": "int32", "int": "int32",
}
_FORBIDDEN = ("multimem", "nvls", "multicast")

BaselineConfigError = BenchConfigError  # bad op, dtype, size, world or backend: found before any process starts


class MulticastForbiddenError(BaselineConfigError):
    """A multimem / NVLS / multicast algorithm was asked for: never allowed here."""


# ---------------------------------------------------------------------------
# names, sizes, counts
# ---------------------------------------------------------------------------

def normalize_op(op: str) -> str:
    key = re.sub(r"[_\-\s]", "", str(op).lower())
    if key not in _OP_ALIASES:
        raise BaselineConfigError(f"op {op!r}: choose one of {', '.join(OPS)}")
    return _OP_ALIASES[key]


def normalize_dtype(dtype) -> str:
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise BaselineConfigError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return _DTYPE_ALIASES[key]


def itemsize(dtype: str) -> int:
    return DTYPES[normalize_dtype(dtype)]

def busbw_factor(op: str, world: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth."""
    if int(world) < 1:
        raise BaselineConfigError(f"world {world}: need at least 1 rank")
    return _busbw_factor(normalize_op(op), int(world))


@dataclass(frozen=True)
class Counts:
    """Elements per rank for one call: input, output, and whether they are one
    buffer (in-place ops)."""

    n_in: int
    n_out: int
    in_place: bool

    def footprint(self, item: int) -> int:
        """Bytes a call touches in this rank's own buffers."""
        return (self.n_in + (0 if self.in_place else self.n_out)) * item

def elem_counts(op: str, nbytes: int, dtype: str, world: int) -> Counts:
    """Per-rank element counts for a size in bytes (nccl-tests convention: allgather's is the
    output, reduce_scatter's the input, all_to_all's, all_reduce's and broadcast's each rank's
    buffer)."""
    op, item, world, nbytes = normalize_op(op), itemsize(dtype), int(world), int(nbytes)
    if world < 1:
        raise BaselineConfigError(f"world {world}: need at least 1 rank")
    if nbytes <= 0:
        raise BaselineConfigError(f"size {nbytes}: must be positive")
    try:
        n_in, n_out = nccl_counts(op, nbytes, item, world)
    except ValueError as e:
        raise BaselineConfigError(str(e)) from None
    return Counts(n_in, n_out, op in ("all_reduce", "broadcast"))


# ---------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------


def _check_not_multicast(name: str) -> None:
    low = str(name).lower()
    if any(word in low for word in _FORBIDDEN):
        raise MulticastForbiddenError(
            f"{name!r}: multimem / NVLS / multicast algorithms are never used here "
            "(they can put the host's shared GPUs out of service); use symm_mem_one_shot, "
            "symm_mem_two_shot or nccl")


def symm_mem_op_name(algo: str) -> str:
    """The torch.ops.symm_mem operator for an algorithm: one_shot -> one_shot_all_reduce,
    two_shot -> two_shot_all_reduce_. Anything multimem raises."""
    _check_not_multicast(algo)
    key = str(algo).lower().removeprefix("symm_mem_")
    if key not in SYMM_MEM_OPS:
        raise BaselineConfigError(f"symm_mem algorithm {algo!r}: choose one of {', '.join(SYMM_MEM_OPS)}")
    name = SYMM_MEM_OPS[key]
    _check_not_multicast(name)
    return name


def resolve_backends(op: str, backends: Iterable[str] | None = None) -> list[str]:
    """Expand and check backend names. None means the op family's baselines (bench.baselines:
    nccl, plus, for all_reduce, symm_mem: both its algorithms). "symm_mem" expands to symm_mem_one_shot and
    symm_mem_two_shot. Multimem names raise MulticastForbiddenError."""
    op = normalize_op(op)
    if backends is None:
        backends = baseline_names(get_family(op).bench.baselines)
    if isinstance(backends, str):
        backends = [b for b in backends.split(",") if b.strip()]
    out: list[str] = []
    for raw in backends:
        name = str(raw).strip().lower()
        _check_not_multicast(name)
        expanded = ["symm_mem_one_shot", "symm_mem_two_shot"] if name == "symm_mem" else [name]
        for b in expanded:
            if b not in BACKENDS:
                raise BaselineConfigError(f"backend {raw!r}: choose from nccl, nccl_cupy, symm_mem, "
                                          "symm_mem_one_shot, symm_mem_two_shot")
            if b.startswith("symm_mem_"):
                symm_mem_op_name(b)
            if b not in out:
                out.append(b)
    if not out:
        raise BaselineConfigError("backends: none given")
    return out


def skip_reason(backend: str, op: str) -> str | None:
    """Why a backend has no rows for an op, known before running (else None)."""
    if backend.startswith("symm_mem_") and "symm_mem" not in baseline_names(get_family(normalize_op(op)).bench.baselines):
        return "symm_mem baselines cover all_reduce only"
    return None


# ---------------------------------------------------------------------------
# rank-seeded data: small integers, exact in bf16/fp16/fp32/int32, and what each output
# must then hold: both from the op's statement (its family's `semantics`,
# tsgen/ops/collectives/semantics.py). idx: NumPy arrays or torch tensors alike.
# ---------------------------------------------------------------------------


def input_values(op: str, rank: int, world: int, idx, n_in: int):
    """Rank `rank`'s input element values at indices `idx` (0 <= idx < n_in)."""
    sem = get_family(normalize_op(op)).semantics
    return sem.values(world, rank, idx, n_in // sem.n_in(world))


def expected_values(op: str, rank: int, world: int, idx, n_out: int):
    """What rank `rank`'s output must hold at indices `idx` (0 <= idx < n_out); broadcast's root is 0."""
    sem = get_family(normalize_op(op)).semantics
    return sem.expected_values(world, rank, idx, n_out // sem.n_out(world))


OUTPUT_SENTINEL = -1  # never a valid output value


# ---------------------------------------------------------------------------
# rows and table
# ---------------------------------------------------------------------------


def make_row(backend: str, op: str, dtype: str, nbytes: int, world: int,
             samples_us: Sequence[float] | None, wrong: int | None = 0,
             skipped: str | None = None, **extra) -> dict:
    """One result row. `samples_us`: per-sample times (already the max over
    ranks); time_us is their median."""
    op, dtype = normalize_op(op), normalize_dtype(dtype)
    row = {"backend": backend, "op": op, "dtype": dtype, "bytes": int(nbytes), "world": int(world),
           "time_us": None, "algbw_GBps": None, "busbw_GBps": None,
           "wrong": wrong, "skipped": skipped}
    if skipped is None and samples_us:
        t = float(statistics.median(samples_us))
        row["time_us"] = t
        row["time_us_min"] = float(min(samples_us))
        if t > 0:
            algbw = nbytes / (t * 1e-6) / 1e9
            row["algbw_GBps"] = algbw
            row["busbw_GBps"] = algbw * busbw_factor(op, world)
    row.update(extra)
    return row


# ---------------------------------------------------------------------------

def run_baselines(op: str, dtype: str, sizes, world: int, backends: Iterable[str] | None = None,
                  iters: int = 20, warmup: int = 5, reps: int = 10, timeout: float = 300.0,
                  use_graphs: bool = True, rotate: bool = True,
                  devices: Sequence[int] | None = None, device_type: str = "cuda",
                  configs: Sequence[dict] | None = None) -> list[dict]:
    """Time the reference implementations of `op` for each size (bytes) on
    `world` GPUs, one process each. Returns rank 0's rows, sorted by size then
    backend, each with at least: backend, op, dtype, bytes, world, time_us,
    algbw_GBps, busbw_GBps, wrong, skipped (None, or why the row has no time),
    and mode ('graph' or 'eager'), slots, calls, reps, time_us_min.

    backends: see resolve_backends (None: nccl, plus both symm_mem algorithms
    for all_reduce). devices: the GPU index for each rank (default 0..world-1).
    device_type "cpu" is a dry run of this harness on CPU tensors over gloo
    (checks, rows, process handling; the times mean nothing), for tests.
    configs: several {"use_graphs", "rotate"} settings timed one after the other by the same
    processes and communicators (one launch); each row then says which in "config_index".
    """
    op, dtype = normalize_op(op), normalize_dtype(dtype)
    if isinstance(sizes, str):
        sizes = parse_sizes(sizes)
    sizes = [int(s) for s in sizes]
    world = int(world)
    if world < 2:
        raise BaselineConfigError(f"world {world}: collectives need at least 2 ranks")
    if not sizes:
        raise BaselineConfigError("sizes: none given")
    for s in sizes:
        elem_counts(op, s, dtype, world)  # raises on sizes that don't divide
    names = resolve_backends(op, backends)
    devices = list(range(world)) if devices is None else [int(d) for d in devices]
    if len(devices) != world or len(set(devices)) != world:
        raise BaselineConfigError(f"devices {devices}: need {world} distinct GPU indices")
    if device_type not in ("cuda", "cpu"):
        raise BaselineConfigError(f"device_type {device_type!r}: cuda or cpu")
    if iters < 1 or reps < 1 or warmup < 0:
        raise BaselineConfigError("need iters >= 1, reps >= 1, warmup >= 0")
    cfg = {"op": op, "dtype": dtype, "sizes": sizes, "world": world, "backends": names,
           "iters": int(iters), "warmup": int(warmup), "reps": int(reps), "timeout": float(timeout),
           "use_graphs": bool(use_graphs), "rotate": bool(rotate), "devices": devices,
           "device_type": device_type,
           "configs": [{"use_graphs": bool(c["use_graphs"]), "rotate": bool(c["rotate"])} for c in configs]
           if configs else None}
    cfg["worker"], cfg["init_method"] = "tsgen.bench.nccl:worker", "env://"  # tsgen launch sets MASTER_ADDR / MASTER_PORT
    for attempt in range(2):
        try:
            rows = launch_workers(cfg, world, timeout=timeout)
            break
        except BaselineRunError as e:  # the free port was taken in between: once more
            if attempt == 0 and re.search(r"address already in use|EADDRINUSE", str(e), re.IGNORECASE):
                continue
            raise
    order = {b: i for i, b in enumerate(names)}
    rows.sort(key=lambda r: (r["bytes"], order.get(r["backend"], 99)))
    return rows


# ---------------------------------------------------------------------------
def best_baselines(op: str, dtype: str, sizes: list[int], world: int, backends=None, timeout: float = 400,
                   **kw) -> list[dict]:
    """The baselines at their best: the faster of CUDA graphs over rotated buffers and an eager
    loop on one buffer (hot L2, as nccl-tests runs), per backend and size. Graph capture with
    thousands of distinct buffers made NCCL's small sizes 3-5x slower than its eager loop
    (results/archive/tuning), so both are timed, by the same processes (one launch: starting
    the workers and their communicators twice cost more than the timing on 2 x H200)."""
    configs = ({"use_graphs": True, "rotate": True}, {"use_graphs": False, "rotate": False})
    names = ("graph+rotate", "eager, one buffer")
    best: dict = {}
    for r in run_baselines(op, dtype, sizes, world, backends=backends, timeout=timeout, configs=configs, **kw):
        r["config"] = names[r.pop("config_index", 0)]
        key = (r["backend"], r["bytes"])
        old = best.get(key)
        if old is None or (r.get("time_us") and (not old.get("time_us") or r["time_us"] < old["time_us"])):
            best[key] = r
    return list(best.values())


# ---------------------------------------------------------------------------
# the worker (one process per GPU, started by tsgen.bench.workers)
# ---------------------------------------------------------------------------


class _Ctx:
    """What the per-size code needs: torch modules, device, group, config."""

    def __init__(self, cfg: dict, rank: int):
        import torch
        import torch.distributed as dist
        from datetime import timedelta

        self.torch, self.dist, self.cfg, self.rank = torch, dist, cfg, rank
        self.world = cfg["world"]
        self.op, self.dtype_name = cfg["op"], cfg["dtype"]
        self.item = DTYPES[self.dtype_name]
        self.dtype = getattr(torch, self.dtype_name)
        self.cpu = cfg.get("device_type", "cuda") == "cpu"  # gloo dry run of this harness (tests)
        kw = dict(backend="gloo" if self.cpu else "nccl", init_method=cfg["init_method"], rank=rank,
                  world_size=self.world, timeout=timedelta(seconds=max(30.0, cfg["timeout"])))
        self.dev_index = cfg["devices"][rank]
        if self.cpu:
            self.device = torch.device("cpu")
            dist.init_process_group(**kw)
            self.l2, self.device_name, self.nccl_version = DEFAULT_L2_BYTES, "cpu (gloo dry run)", None
        else:
            if torch.cuda.device_count() < max(cfg["devices"]) + 1:
                raise RuntimeError(f"need GPU {max(cfg['devices'])}; torch sees {torch.cuda.device_count()} GPUs")
            torch.cuda.set_device(self.dev_index)
            self.device = torch.device("cuda", self.dev_index)
            try:
                dist.init_process_group(**kw, device_id=self.device)
            except TypeError:  # torch without device_id
                dist.init_process_group(**kw)
            props = torch.cuda.get_device_properties(self.device)
            self.l2 = int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)
            self.device_name = props.name
            try:
                v = torch.cuda.nccl.version()
                self.nccl_version = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
            except Exception:  # noqa: BLE001
                self.nccl_version = None
        self.group = dist.group.WORLD
        self.sync = torch.zeros(1, dtype=torch.float32, device=self.device)

    def synchronize(self) -> None:
        if not self.cpu:
            self.torch.cuda.synchronize()

    def line_up(self) -> None:
        """Before a sample: a barrier, a short GPU sleep (every host queues its work before the
        GPU gets there), then a one-element all-reduce the timed calls follow on the device."""
        self.dist.barrier()
        self.synchronize()
        sleep = None if self.cpu else getattr(self.torch.cuda, "_sleep", None)
        if sleep is not None:
            sleep(200_000)  # ~100 us
        self.dist.all_reduce(self.sync)

    def agree(self, err: str | None) -> str | None:
        """All ranks learn whether any rank failed a step; returns the first
        rank's error text (None if every rank succeeded)."""
        got = [None] * self.world
        self.dist.all_gather_object(got, err)
        for r, e in enumerate(got):
            if e:
                return f"rank {r}: {e}"
        return None


class _Slots:
    """Rotation slots carved out of one flat input (and output) tensor."""

    def __init__(self, inp, out, n_in: int, n_out: int, stride_in: int, stride_out: int, slots: int):
        self.inp, self.out = inp, out
        self.n_in, self.n_out, self.si, self.so, self.slots = n_in, n_out, stride_in, stride_out, slots

    def i(self, k: int):
        return self.inp[k * self.si: k * self.si + self.n_in]

    def o(self, k: int):
        return self.out[k * self.so: k * self.so + self.n_out]


def _fill(ctx: _Ctx, slots: _Slots, counts: Counts) -> None:
    """Rank-seeded input in every slot; the output (if separate) set to a value
    no correct result has."""
    torch = ctx.torch
    first = slots.i(0)
    for s in range(0, counts.n_in, CHECK_CHUNK):
        e = min(counts.n_in, s + CHECK_CHUNK)
        idx = torch.arange(s, e, dtype=torch.int64, device=ctx.device)
        first[s:e].copy_(input_values(ctx.op, ctx.rank, ctx.world, idx, counts.n_in))
    if slots.slots > 1:
        grid = slots.inp[: slots.slots * slots.si].view(slots.slots, slots.si)
        grid[1:, : counts.n_in].copy_(grid[0:1, : counts.n_in].expand(slots.slots - 1, counts.n_in))
    if not counts.in_place:
        slots.out.fill_(OUTPUT_SENTINEL)


def _count_wrong(ctx: _Ctx, result, counts: Counts) -> int:
    torch = ctx.torch
    wrong = 0
    for s in range(0, counts.n_out, CHECK_CHUNK):
        e = min(counts.n_out, s + CHECK_CHUNK)
        idx = torch.arange(s, e, dtype=torch.int64, device=ctx.device)
        want = expected_values(ctx.op, ctx.rank, ctx.world, idx, counts.n_out).to(ctx.dtype)
        wrong += int((result[s:e] != want).sum().item())
    return wrong


def _nccl_call(ctx: _Ctx, slots: _Slots) -> Callable[[int], object]:
    dist, op = ctx.dist, ctx.op
    if op == "all_reduce":
        return lambda k: dist.all_reduce(slots.i(k))
    if op == "broadcast":
        return lambda k: dist.broadcast(slots.i(k), src=0)
    if op == "allgather":
        return lambda k: dist.all_gather_into_tensor(slots.o(k), slots.i(k))
    if op == "reduce_scatter":
        return lambda k: dist.reduce_scatter_tensor(slots.o(k), slots.i(k))
    return lambda k: dist.all_to_all_single(slots.o(k), slots.i(k))


_NCCL_TYPES = {"int32": ("NCCL_INT32", 2), "float16": ("NCCL_FLOAT16", 6),
               "float32": ("NCCL_FLOAT32", 7), "bfloat16": ("NCCL_BFLOAT16", 9)}


class _CupyNccl:
    """A raw NCCL communicator through cupy.cuda.nccl (opt-in backend)."""

    def __init__(self, ctx: _Ctx):
        err, uid = None, None
        try:
            import cupy
            from cupy.cuda import nccl

            if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
                raise RuntimeError("cupy.cuda.nccl is present but reports NCCL unavailable")
            if ctx.rank == 0:
                uid = nccl.get_unique_id()
        except Exception as e:  # noqa: BLE001
            err = _first_line(e)
        bad = ctx.agree(err)
        if bad:
            raise _Skip(f"cupy.cuda.nccl not usable: {bad}")
        box = [uid]
        ctx.dist.broadcast_object_list(box, src=0)
        with cupy.cuda.Device(ctx.dev_index):
            self.comm = nccl.NcclCommunicator(ctx.world, tuple(box[0]), ctx.rank)
        self.nccl, self.ctx = nccl, ctx
        name, code = _NCCL_TYPES[ctx.dtype_name]
        self.dt = int(getattr(nccl, name, code))
        self.sum = int(getattr(nccl, "NCCL_SUM", 0))
        try:
            v = int(nccl.get_version())
            self.version = f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else str(v)
        except Exception:  # noqa: BLE001
            self.version = None

    def call(self, slots: _Slots) -> Callable[[int], object]:
        torch, comm, nccl, dt, op, w = self.ctx.torch, self.comm, self.nccl, self.dt, self.ctx.op, self.ctx.world
        item = self.ctx.item

        def stream():
            return torch.cuda.current_stream().cuda_stream

        if op == "all_reduce":
            return lambda k: comm.allReduce(slots.i(k).data_ptr(), slots.i(k).data_ptr(), slots.n_in, dt,
                                            self.sum, stream())
        if op == "broadcast":
            return lambda k: comm.broadcast(slots.i(k).data_ptr(), slots.i(k).data_ptr(), slots.n_in, dt, 0,
                                            stream())
        if op == "allgather":
            return lambda k: comm.allGather(slots.i(k).data_ptr(), slots.o(k).data_ptr(), slots.n_in, dt, stream())
        if op == "reduce_scatter":
            return lambda k: comm.reduceScatter(slots.i(k).data_ptr(), slots.o(k).data_ptr(), slots.n_out, dt,
                                                self.sum, stream())
        chunk = slots.n_in // w

        def a2a(k):
            s, src, dst = stream(), slots.i(k).data_ptr(), slots.o(k).data_ptr()
            nccl.groupStart()
            try:
                for peer in range(w):
                    comm.send(src + peer * chunk * item, chunk, dt, peer, s)
                    comm.recv(dst + peer * chunk * item, chunk, dt, peer, s)
            finally:
                nccl.groupEnd()

        return a2a

    def close(self):
        try:
            self.comm.destroy()
        except Exception:  # noqa: BLE001
            pass


class _Symm:
    """One symmetric-memory buffer, rendezvoused once, sliced into slots."""

    def __init__(self, ctx: _Ctx, elems: int):
        torch = ctx.torch
        err = None
        self.buf = None
        try:
            import warnings

            import torch.distributed._symmetric_memory as symm_mem

            try:  # the CUDA (cuMem + P2P) backend; NVSHMEM / NCCL backends not wanted here
                symm_mem.set_backend("CUDA")
            except Exception:  # noqa: BLE001
                pass
            self.group_name = ctx.group.group_name
            self.buf = symm_mem.empty(elems, dtype=ctx.dtype, device=ctx.device)
            try:
                handle = symm_mem.rendezvous(self.buf, self.group_name)
            except Exception:  # noqa: BLE001 - older torch wants the group enabled first
                if not hasattr(symm_mem, "enable_symm_mem_for_group"):
                    raise
                with warnings.catch_warnings():  # deprecated (and unneeded) in newer torch
                    warnings.simplefilter("ignore")
                    symm_mem.enable_symm_mem_for_group(self.group_name)
                handle = symm_mem.rendezvous(self.buf, self.group_name)
            try:
                mc = int(getattr(handle, "multicast_ptr", 0) or 0)
            except Exception:  # noqa: BLE001
                mc = 0
            if mc:
                raise RuntimeError("symmetric memory set up NVLink multicast although "
                                   "TORCH_SYMM_MEM_DISABLE_MULTICAST=1; refusing to go on")
            self.handle = handle
        except Exception as e:  # noqa: BLE001
            err = _first_line(e)
        bad = ctx.agree(err)
        if bad:
            self.buf = None
            raise _Skip(f"symmetric memory setup failed: {bad}")
        self.ops = {}
        for algo in ("one_shot", "two_shot"):
            name = symm_mem_op_name(algo)
            self.ops[algo] = getattr(torch.ops.symm_mem, name)

    def call(self, algo: str, slots: _Slots) -> Callable[[int], object]:
        """one_shot_all_reduce(x, "sum", group) returns a new tensor;
        two_shot_all_reduce_(x, "sum", group) reduces x in place."""
        fn, g = self.ops[algo], self.group_name
        return lambda k: fn(slots.i(k), "sum", g)


class _Skip(Exception):
    """A backend can't run (all ranks agree); its rows carry the reason."""

def _bench_one(ctx: _Ctx, backend: str, call: Callable[[int], object], result_of: Callable,
               slots: _Slots, counts: Counts, nbytes: int, extra: dict) -> dict:
    """Check the first call, warm up, capture (or not), time. All ranks call it
    in step; the row is meaningful on rank 0."""
    torch, dist, cfg = ctx.torch, ctx.dist, ctx.cfg
    _fill(ctx, slots, counts)
    ctx.synchronize()
    dist.barrier()
    err, ret = None, None
    try:
        ret = call(0)
        ctx.synchronize()
    except Exception as e:  # noqa: BLE001 - e.g. a dtype or alignment the op refuses
        err = _first_line(e)
    bad = ctx.agree(err)
    if bad:
        return make_row(backend, ctx.op, ctx.dtype_name, nbytes, ctx.world, None, None,
                        skipped=f"refused: {bad}", **extra)
    wrong = torch.tensor([_count_wrong(ctx, result_of(ret), counts)], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(wrong)
    calls = calls_per_sample(cfg["iters"], slots.slots)
    clock = HostClock(torch, dist) if ctx.cpu else TorchClock(torch, dist, ctx.device)
    stream = None if ctx.cpu else torch.cuda.current_stream()
    timing: Timing = time_calls(clock, [ctx.rank], {ctx.rank: stream}, lambda i, _: call((i + 1) % slots.slots),
                                calls=calls, reps=cfg["reps"], warmup=cfg["warmup"],
                                graphs=cfg["use_graphs"] and not ctx.cpu, before_sample=ctx.line_up,
                                label=f"{backend} {ctx.op} {nbytes} B")
    ctx.synchronize()
    samples, mode, note = timing.samples_us, timing.mode, timing.note
    row = make_row(backend, ctx.op, ctx.dtype_name, nbytes, ctx.world, samples, int(wrong.item()),
                   mode=mode, calls=calls, reps=cfg["reps"], **extra)
    if note:
        row["note"] = note
    if timing.problems:
        row["problems"] = timing.problems
    return row


def worker(cfg: dict, rank: int) -> list[dict]:
    """One rank of the collective baselines (tsgen.bench.workers runs it): rank 0's rows. With
    cfg["configs"], every configuration in turn on the same communicators, each row tagged with
    its index (config_index)."""
    ctx = _Ctx(cfg, rank)
    torch = ctx.torch
    configs = cfg.get("configs") or [{"use_graphs": cfg["use_graphs"], "rotate": cfg["rotate"]}]
    plans_of = []
    for c in configs:
        plans = []
        for nbytes in cfg["sizes"]:
            counts = elem_counts(ctx.op, nbytes, ctx.dtype_name, ctx.world)
            plans.append((nbytes, counts, rotation_slots(nbytes, counts.footprint(ctx.item), ctx.l2, c["rotate"])))
        plans_of.append(plans)
    base = {"nccl_version": ctx.nccl_version, "device": ctx.device_name, "l2_bytes": ctx.l2,
            "torch_version": torch.__version__}

    symm, symm_skip = None, None
    symm_wanted = [b for b in cfg["backends"] if b.startswith("symm_mem_") and skip_reason(b, ctx.op) is None]
    if symm_wanted and ctx.cpu:
        symm_skip = "symm_mem needs CUDA (gloo dry run)"
    elif symm_wanted:
        elems = max(s * slot_stride(c.n_in, ctx.item) for plans in plans_of for _, c, s in plans)
        try:
            symm = _Symm(ctx, elems)
        except _Skip as e:
            symm_skip = str(e)
    cupy_nccl, cupy_skip = None, None
    if "nccl_cupy" in cfg["backends"] and ctx.cpu:
        cupy_skip = "nccl_cupy needs CUDA (gloo dry run)"
    elif "nccl_cupy" in cfg["backends"]:
        try:
            cupy_nccl = _CupyNccl(ctx)
        except _Skip as e:
            cupy_skip = str(e)

    rows: list[dict] = []
    try:
        for index, (config, plans) in enumerate(zip(configs, plans_of)):
            ctx.cfg = dict(cfg, **config)  # what _bench_one reads (use_graphs)
            tag = {"config_index": index} if cfg.get("configs") else {}
            rows += _time_plans(ctx, plans, dict(base, **tag), symm, symm_skip, cupy_nccl, cupy_skip)
    finally:
        if cupy_nccl is not None:
            cupy_nccl.close()
        symm = None
        try:
            ctx.synchronize()
            ctx.dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return rows


def _time_plans(ctx: _Ctx, plans: list, base: dict, symm, symm_skip, cupy_nccl, cupy_skip) -> list[dict]:
    """Every backend at every (size, counts, slots) of `plans` under ctx.cfg: rank 0's rows."""
    torch, cfg, rows = ctx.torch, ctx.cfg, []
    for nbytes, counts, nslots in plans:
        si, so = slot_stride(counts.n_in, ctx.item), slot_stride(counts.n_out, ctx.item)
        extra = dict(base, slots=nslots)
        plain = None
        for backend in cfg["backends"]:
            reason = skip_reason(backend, ctx.op)
            if reason is None and backend.startswith("symm_mem_"):
                reason = symm_skip
            if reason is None and backend == "nccl_cupy":
                reason = cupy_skip
            if reason is not None:
                rows.append(make_row(backend, ctx.op, ctx.dtype_name, nbytes, ctx.world, None, None,
                                     skipped=reason, **extra))
                continue
            if backend.startswith("symm_mem_"):
                inp = symm.buf[: nslots * si]
                slots = _Slots(inp, inp, counts.n_in, counts.n_out, si, si, nslots)
                algo = backend.removeprefix("symm_mem_")
                call = symm.call(algo, slots)
                if algo == "one_shot":
                    def result_of(ret):
                        return ret
                else:
                    def result_of(ret, slots=slots):
                        return slots.i(0)
                row_extra = extra
            else:
                if plain is None:
                    inp = torch.empty(nslots * si, dtype=ctx.dtype, device=ctx.device)
                    out = inp if counts.in_place else torch.empty(nslots * so, dtype=ctx.dtype,
                                                                  device=ctx.device)
                    plain = _Slots(inp, out, counts.n_in, counts.n_out, si, so if not counts.in_place else si,
                                   nslots)
                slots = plain
                if backend == "nccl":
                    call = _nccl_call(ctx, slots)
                    row_extra = extra
                else:
                    call = cupy_nccl.call(slots)
                    row_extra = dict(extra, nccl_version=cupy_nccl.version)

                def result_of(ret, slots=slots):
                    return slots.o(0)
            rows.append(_bench_one(ctx, backend, call, result_of, slots, counts, nbytes, row_extra))
        plain = None
        ctx.synchronize()
        if not ctx.cpu:
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------
