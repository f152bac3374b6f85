"""DeepEP as a same-run baseline of the moe family (baseline "deepep", tsgen.bench.baselines.deepep):
its worker `deepep_worker`, one process per GPU under the bench's NCCL process group
(tsgen.bench.workers).

DeepEP (github.com/deepseek-ai/DeepEP, tag v1.2.1, classic `deep_ep.Buffer`) is not a dependency:
its wheel is built against the GPU machine's torch and NVSHMEM and carried there
(docs/lab/deepep.md). Without it every row says why it was not timed.

On the routing of tsgen's moe family (tsgen.ops.moe.routing, the seeds of moe_torch.py) and the
spec's shape, per rank `tokens` tokens:
  normal mode (intranode, CUDA IPC)   timed separately:
    dispatch          DeepEP's cached-layout dispatch (the handle of a first dispatch reused; what
                      its own test_intranode.py times); bf16 rows, or fp8 rows with one fp32 scale
                      per 128 channels quantized before the call (DeepEP's fp8 dispatch takes
                      (x_fp8, scales)), the spec's payload
    layout+dispatch   get_dispatch_layout + dispatch from topk_idx with num_worst_tokens (no host
                      sync): the work tsgen's dispatch does from the routing
    combine           the received bf16 rows back, summed per token (no weights)
    pair              cached dispatch, (fp8: the rows dequantized by torch,) combine
  low-latency mode (NVSHMEM, NVLink)  dispatch (bf16, and fp8 as DeepEP quantizes in the kernel),
                      combine (bf16, weighted by topk_weights), the pair
  ceiling             cudaMemcpyPeerAsync of a large buffer to the next rank, every rank at once
                      (both directions at W 2): the measured peer-copy bandwidth per direction
Timing: tsgen's timing core (TorchClock, time_calls), eagerly (DeepEP's calls allocate their outputs),
async_finish=False so the calling stream waits for DeepEP's comm stream: events on the calling
stream bracket the kernels; the slowest rank's time. Bytes as DeepEP's tests count them
(`deepep_bytes`; normal mode: the rows a rank receives in dispatch and sends in combine, its own
included; low latency: per (token, expert) selection) and the rows to or from other ranks alone
(`link_bytes`); GB/s = deepep_bytes / time, the bottleneck (most bytes) rank. The timed call's
outputs are checked against what the routing says (`wrong`: elements or rows that differ).
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os

import numpy as np

from .timing import TorchClock, time_calls
from .workers import BaselineRunError, nccl_process

NVL_BUFFER_BYTES = int(1e9)  # DeepEP's intranode buffer per rank (its tests use 1-2 GB)
# Normal mode is timed at each of these SM counts (24: DeepEP's test_intranode.py and its published
# intranode numbers; Buffer.set_num_sms: DeepEP's configs for a world
# size scale their channels with it; even counts only) and tsgen's pair is compared with the
# fastest: 24 is tuned for 8 ranks, and at 2 ranks it used less than half the link (docs/lab/deepep.md).
NORMAL_SMS_SWEEP = (24, 48, 64)


def sms_from_env(value: str | None) -> list[int] | None:
    """TSGEN_DEEPEP_SMS ("64" or "48,64"): the SM counts DeepEP's normal mode is timed at instead of
    NORMAL_SMS_SWEEP (a shorter run when its fastest count is known); None where unset or empty."""
    if not value or not value.strip():
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"TSGEN_DEEPEP_SMS={value!r}: give even SM counts separated by commas, e.g. 64 or 48,64") from None


def sms_sweep(cfg: dict) -> tuple[int, ...]:
    """The normal-mode SM counts to time: cfg["sms"] (a count or a list), else TSGEN_DEEPEP_SMS
    (the workers inherit the environment), else NORMAL_SMS_SWEEP; each even and positive (DeepEP
    runs a channel on each pair of SMs)."""
    asked = cfg.get("sms")
    if asked is None:
        asked = sms_from_env(os.environ.get("TSGEN_DEEPEP_SMS"))
    asked = NORMAL_SMS_SWEEP if asked is None else asked
    counts = tuple(dict.fromkeys(asked if isinstance(asked, (list, tuple)) else (asked,)))
    bad = [n for n in counts if not isinstance(n, int) or isinstance(n, bool) or n <= 0 or n % 2]
    if bad:
        raise ValueError(f"DeepEP SM counts must be even positive integers; got {bad}")
    return counts
CEILING_BYTES = 256 << 20
FP8_MAX = 448.0  # e4m3


# ---------------------------------------------------------------------------
# pure functions (tests/test_moe_deepep_cpu.py runs them on CPU tensors)
# ---------------------------------------------------------------------------


def normal_bytes(recv_rows: int, remote_rows: int, hidden: int, fp8: bool) -> dict:
    """DeepEP normal mode's byte counts (test_intranode.py at v1.2.1): dispatch = the rows
    a rank receives x hidden x 2 (bf16), x (1 + 4 / 128) / 2 for fp8 (1 byte per channel + an
    fp32 scale per 128); combine = the same rows sent back in bf16. `link_*`: the rows from / to
    other ranks only (what crosses NVLink)."""
    drow = hidden + hidden // 128 * 4 if fp8 else 2 * hidden
    crow = 2 * hidden
    return {"dispatch": recv_rows * drow, "combine": recv_rows * crow,
            "link_dispatch": remote_rows * drow, "link_combine": remote_rows * crow}


def ll_bytes(topk_idx, remote, hidden: int, fp8: bool) -> dict:
    """DeepEP low-latency mode's byte counts (test_low_latency.py at v1.2.1), per
    (token, expert) selection: dispatch fp8 hidden + hidden / 128 x 4 + 16 (the message's
    header), bf16 2 x hidden + 16 (its message: the same header, bf16 rows; DeepEP's test only
    counts fp8); combine 2 x hidden. `remote` [tokens, topk] bool: the selection's expert lives on
    another rank (`link_*`)."""
    drow = hidden + hidden // 128 * 4 + 16 if fp8 else 2 * hidden + 16
    crow = 2 * hidden
    sel = int((topk_idx >= 0).sum())
    far = int(((topk_idx >= 0) & remote).sum())
    return {"dispatch": sel * drow, "combine": sel * crow, "link_dispatch": far * drow, "link_combine": far * crow}


def ll_sms(experts: int, device_sms: int, combine_tokens: int | None = None) -> int:
    """SMs (blocks) of DeepEP's low-latency kernels at v1.2.1 (internode_ll.cu's launchers): warp
    groups = ceil(E / device SMs), dispatch ceil(E / groups) blocks; combine at least as many, and
    enough for `combine_tokens` tokens at ceil(tokens / device SMs) per block."""
    groups = -(-experts // device_sms)
    sms = -(-experts // groups)
    if combine_tokens:
        per = -(-combine_tokens // device_sms)
        sms = max(sms, -(-combine_tokens // per))
    return sms


def fp8_cast(torch, x):
    """(e4m3 [T, H], fp32 scales [T, H / 128]): scale = max(amax of 128 channels, 1e-4) / 448,
    q = e4m3(x / scale), the quantization DeepEP's tests feed its fp8 dispatch."""
    t, h = x.shape
    blocks = x.float().view(t, h // 128, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    q = (blocks * (FP8_MAX / amax).unsqueeze(2)).to(torch.float8_e4m3fn).view(t, h)
    return q, amax / FP8_MAX


def fp8_back(torch, q, scales):
    """bf16 rows of (e4m3 [T, H], fp32 scales [T, H / 128])."""
    t, h = q.shape
    return (q.float().view(t, h // 128, 128) * scales.float().unsqueeze(2)).view(t, h).to(torch.bfloat16)


def destinations(torch, topk_idx, experts: int, world: int):
    """[tokens, world] bool: the ranks holding one of the token's experts (ids outside [0, E): none)."""
    valid = (topk_idx >= 0) & (topk_idx < experts)
    dest = torch.where(valid, topk_idx // (experts // world), world)
    mask = torch.zeros(topk_idx.shape[0], world + 1, dtype=torch.bool, device=topk_idx.device)
    mask.scatter_(1, dest, True)
    return mask[:, :world]


def expected_recv(torch, xs, masks, me: int):
    """What rank `me` receives in normal mode: every source rank's rows (rank 0's first) whose
    token goes to `me`, in source token order. xs[s]: rank s's rows (a tensor, or a tuple of
    tensors cut alike), masks[s]: its destinations()."""
    if isinstance(xs[0], tuple):
        return tuple(expected_recv(torch, [x[i] for x in xs], masks, me) for i in range(len(xs[0])))
    return torch.cat([x[m[:, me]] for x, m in zip(xs, masks, strict=True)])


def count_wrong(torch, got, want) -> int:
    """Elements that differ bit for bit (a shape or dtype mismatch: every element of the larger)."""
    if isinstance(got, tuple):
        return sum(count_wrong(torch, g, w) for g, w in zip(got, want, strict=True))
    if got.shape != want.shape or got.dtype != want.dtype:
        return max(got.numel(), want.numel())
    if got.element_size() == 1 and got.dtype != torch.bool:  # fp8: compare the bytes
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    return int((got != want).sum().item())


def normal_combine_ref(torch, x, mask):
    """DeepEP normal combine of the received rows as they are (identity expert, no weights):
    token t comes back once per destination rank, out[t] = bf16(n_t x[t]) (exact: n_t <= 8)."""
    return (x.float() * mask.sum(1, dtype=torch.float32)[:, None]).to(torch.bfloat16)


def ll_combine_ref(torch, x, topk_idx, topk_weights):
    """DeepEP low-latency combine of the dispatched rows as they are (identity expert): the
    token's rows weighted by its top-k weights (none where the slot is -1), summed."""
    w = topk_weights.masked_fill(topk_idx < 0, 0).sum(1)
    return x.float() * w[:, None]


def count_far(got, ref, rel: float, floor=0.0) -> int:
    """Elements of `got` farther from the fp32 `ref` than rel |ref| + floor."""
    return int(((got.float() - ref).abs() > rel * ref.abs() + floor).sum().item())


def ll_dispatch_wrong(torch, recv, counts, src_info, layout_range, xs, idxs, me: int, local: int,
                      fp8_scales=None) -> int:
    """Low-latency dispatch checked: for local expert i and source rank j, the rows
    [begin, begin + count) (layout_range: begin << 32 | count) are rank j's tokens with expert
    me * local + i (each once), row r holding x_j[src_info[i, r]]; bf16 rows bit for bit, fp8
    (recv e4m3, fp8_scales [local, rows, H / 128]) dequantized within half an e4m3 step.
    Returns the wrong rows (wrong counts: a row per missing or extra token)."""
    wrong = 0
    for i in range(local):
        expert = me * local + i
        total = 0
        for j, (x, idx) in enumerate(zip(xs, idxs)):
            begin, count = int(layout_range[i, j].item()) >> 32, int(layout_range[i, j].item()) & 0xFFFFFFFF
            want = torch.nonzero((idx == expert).any(1)).flatten()
            src = src_info[i, begin:begin + count].long()
            total += count
            if count != want.numel() or not torch.equal(torch.sort(src).values, want):
                wrong += abs(count - want.numel()) or count
                continue
            rows = recv[i, begin:begin + count]
            if fp8_scales is None:
                wrong += int((rows != x[src]).any(1).sum().item())
            else:
                h = x.shape[1]
                scale = fp8_scales[i, begin:begin + count]
                dq = rows.float().view(count, h // 128, 128) * scale.float().unsqueeze(2)
                ref = x[src].float().view(count, h // 128, 128)
                amax = ref.abs().amax(2, keepdim=True).clamp(min=1e-4)
                bad = (dq - ref).abs() > ref.abs() / 16 + amax / FP8_MAX / 512
                wrong += int(bad.flatten(1).any(1).sum().item())
        wrong += abs(int(counts[i].item()) - total)
    return wrong


# ---------------------------------------------------------------------------
# the worker
# ---------------------------------------------------------------------------


def import_deep_ep():
    """deep_ep, with the NVSHMEM host library it names made loadable first: the wheel's rpath
    points into the build machine's site-packages, so this machine's copy (the nvidia-nvshmem-cu13
    package) is loaded by path, RTLD_GLOBAL, before deep_ep_cpp. Raises ImportError saying what
    is missing."""
    import torch  # noqa: F401 - deep_ep_cpp needs torch's libraries loaded first

    spec = importlib.util.find_spec("nvidia.nvshmem")
    if spec is not None and spec.submodule_search_locations:
        libs = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "lib", "libnvshmem_host.so.*")))
        if libs:
            ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)
    import deep_ep

    return deep_ep


def _peer_copy(torch, dev, rank: int, world: int, nbytes: int):
    """(enqueue, check) of cudaMemcpyPeerAsync: this rank's buffer to the next rank's GPU, peer
    access enabled first (without it the copy is staged through the host)."""
    cudart = ctypes.CDLL("libcudart.so." + torch.version.cuda.split(".")[0])  # torch's, already loaded
    peer = (rank + 1) % world
    err = cudart.cudaDeviceEnablePeerAccess(peer, 0)  # on this rank's (current) device
    if err not in (0, 704):  # 704: cudaErrorPeerAccessAlreadyEnabled
        raise RuntimeError(f"cudaDeviceEnablePeerAccess({peer}) from GPU {dev.index} returned {err}")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", peer))
    stream = torch.cuda.current_stream()
    fn = cudart.cudaMemcpyPeerAsync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]

    def enqueue(i, _):
        err = fn(dst.data_ptr(), peer, src.data_ptr(), dev.index, nbytes, stream.cuda_stream)
        if err:
            raise RuntimeError(f"cudaMemcpyPeerAsync returned {err}")

    def wrong():
        torch.cuda.synchronize()
        return int((dst.to(dev) != src).sum().item())

    return enqueue, wrong


class _Run:
    """One rank's state: the process group, timing and the row writer."""

    def __init__(self, cfg, rank):
        self.torch, self.dist, self.dev, self.world = nccl_process(rank)
        self.cfg, self.rank = cfg, rank
        self.clock = TorchClock(self.torch, self.dist, self.dev)
        self.sync = self.torch.zeros(1, device=self.dev)

    def line_up(self):
        self.dist.barrier()
        self.torch.cuda.synchronize()
        self.dist.all_reduce(self.sync)

    def time(self, enqueue, label):
        cfg, stream = self.cfg, self.torch.cuda.current_stream()
        return time_calls(self.clock, [self.rank], {self.rank: stream}, enqueue, calls=cfg["iters"], reps=cfg["reps"],
                          warmup=cfg["warmup"], graphs=False, before_sample=self.line_up, label=label)

    def total(self, n: int, op=None) -> int:
        t = self.torch.tensor([n], dtype=self.torch.int64, device=self.dev)
        self.dist.all_reduce(t, op=op or self.dist.ReduceOp.SUM)
        return int(t.item())

    def row(self, phase, tokens, timing, wrong, nbytes=None, link=None, **extra):
        """A row: the slowest rank's time, the bottleneck rank's bytes, wrong summed over ranks."""
        mx = self.dist.ReduceOp.MAX
        r = {"phase": phase, "tokens": tokens, **timing.fields(), "samples_us": timing.samples_us,
             "problems": timing.problems, "wrong": self.total(wrong), **extra}
        if nbytes is not None:
            r["deepep_bytes"], r["link_bytes"] = self.total(nbytes, mx), self.total(link, mx)
            r["deepep_GBps"] = r["deepep_bytes"] / (r["time_us"] * 1e3)
            r["link_GBps"] = r["link_bytes"] / (r["time_us"] * 1e3)
        return r

    def gather(self, t):
        """Every rank's tensor (same shape on every rank)."""
        out = [self.torch.empty_like(t) for _ in range(self.world)]
        self.dist.all_gather(out, t.contiguous())
        return out


def _routing(torch, dev, rank, world, experts, topk, tokens):
    from ..ops.moe import routing

    rng = np.random.default_rng([12345, rank])  # moe_torch.py's seeds
    idx = routing("random", world, experts, topk, tokens, rng, rank).astype(np.int64).reshape(tokens, topk)
    weights = rng.random((tokens, topk)).astype(np.float32)
    return torch.from_numpy(idx).to(dev), torch.from_numpy(weights).to(dev)


def _normal(run: _Run, deep_ep, tokens: int) -> list[dict]:
    """Normal mode's rows at every SM count of the sweep, a buffer of its own for each."""
    return [r for sms in sms_sweep(run.cfg) for r in _normal_at(run, deep_ep, tokens, sms)]


def _normal_at(run: _Run, deep_ep, tokens: int, sms: int) -> list[dict]:
    torch, dev, world, cfg, me = run.torch, run.dev, run.world, run.cfg, run.rank
    experts, hidden, fp8 = cfg["experts"], cfg["hidden"], cfg["payload"] == "fp8"
    deep_ep.Buffer.set_num_sms(sms)
    buffer = deep_ep.Buffer(run.dist.group.WORLD, NVL_BUFFER_BYTES, 0, explicitly_destroy=True)
    dcfg, ccfg = deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)
    idx, weights = _routing(torch, dev, me, world, experts, cfg["topk"], tokens)
    torch.manual_seed(1000 + me)
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
    xin = fp8_cast(torch, x) if fp8 else x
    if fp8:  # DeepEP's tests pass the scales column-major (the layout its fp8 GEMMs read)
        xin = (xin[0], xin[1].T.contiguous().T)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, experts)
    mask = destinations(torch, idx, experts, world)
    layout_wrong = count_wrong(torch, in_rank, mask)
    recv, recv_idx, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, topk_idx=idx,
                                                      topk_weights=weights, config=dcfg)
    masks = run.gather(mask)
    want = expected_recv(torch, run.gather(x), masks, me)
    want_in = want
    if fp8:  # gathered as bytes (NCCL needs no fp8 type for that)
        qs = [q.view(torch.float8_e4m3fn) for q in run.gather(xin[0].view(torch.uint8))]
        want_in = expected_recv(torch, list(zip(qs, run.gather(xin[1]), strict=True)), masks, me)
    local = experts // world
    want_idx = expected_recv(torch, run.gather(idx), masks, me)
    want_idx = torch.where((want_idx >= me * local) & (want_idx < (me + 1) * local), want_idx - me * local, -1)
    rows, remote = want.shape[0], want.shape[0] - int(mask[:, me].sum())
    nb = normal_bytes(rows, remote, hidden, fp8)
    pay = "fp8" if fp8 else "bf16"
    common = {"ep_mode": "normal", "payload": pay, "sms": sms, "impl_note": "cached layout (handle reused)"}
    out = []

    got = {}

    def dispatch(i, _):
        got["d"] = buffer.dispatch(xin, handle=handle, config=dcfg)[0]

    t = run.time(dispatch, f"DeepEP dispatch {pay} {tokens}")
    wrong = (count_wrong(torch, got["d"], want_in) + count_wrong(torch, recv, want)
             + count_wrong(torch, recv_idx, want_idx) + layout_wrong)
    out.append(run.row("dispatch", tokens, t, wrong, nb["dispatch"], nb["link_dispatch"],
                       config=_config("dispatch", world, sms), **common))

    worst = world * tokens

    def layout_dispatch(i, _):
        pr, _, pe, ir, _ = buffer.get_dispatch_layout(idx, experts)
        got["w"] = buffer.dispatch(xin, num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe,
                                   topk_idx=idx, topk_weights=weights, num_worst_tokens=worst, config=dcfg)

    t = run.time(layout_dispatch, f"DeepEP layout+dispatch {pay} {tokens}")
    wx, widx = got["w"][0], got["w"][1]
    wrong = (count_wrong(torch, tuple(a[:rows] for a in wx) if fp8 else wx[:rows], want_in)
             + count_wrong(torch, widx[:rows], want_idx) + int((widx[rows:] != -1).sum().item()))
    out.append(run.row("layout+dispatch", tokens, t, wrong, nb["dispatch"], nb["link_dispatch"],
                       config=_config("dispatch", world, sms),
                       **dict(common, impl_note="layout from topk_idx, num_worst_tokens")))

    def combine(i, _):
        got["c"] = buffer.combine(recv, handle, config=ccfg)[0]

    t = run.time(combine, f"DeepEP combine {tokens}")
    ref = normal_combine_ref(torch, x, mask)
    out.append(run.row("combine", tokens, t, count_wrong(torch, got["c"], ref), nb["combine"], nb["link_combine"],
                       config=_config("combine", world, sms), **dict(common, payload="bf16")))

    def pair(i, _):
        r = buffer.dispatch(xin, handle=handle, config=dcfg)[0]
        got["p"] = buffer.combine(fp8_back(torch, *r) if fp8 else r, handle, config=ccfg)[0]

    t = run.time(pair, f"DeepEP dispatch+combine {pay} {tokens}")
    pref = normal_combine_ref(torch, fp8_back(torch, *xin), mask) if fp8 else ref
    out.append(run.row("pair", tokens, t, count_wrong(torch, got["p"], pref), nb["dispatch"] + nb["combine"],
                       nb["link_dispatch"] + nb["link_combine"],
                       **dict(common, impl_note="cached layout" + (", rows dequantized by torch" if fp8 else ""))))
    torch.cuda.synchronize()
    run.dist.barrier()
    buffer.destroy()
    return out


def _config(kind: str, world: int, sms: int) -> str:
    """The config a row ran with: DeepEP's recommended one for the world size (v1.2.1 does not
    expose a Config's fields to Python; its buffer.py has the table)."""
    return f"deep_ep.Buffer.get_{kind}_config({world}) at {sms} SMs"


def _low_latency(run: _Run, deep_ep, tokens: int) -> list[dict]:
    torch, dev, world, cfg, me = run.torch, run.dev, run.world, run.cfg, run.rank
    experts, hidden = cfg["experts"], cfg["hidden"]
    local = experts // world
    nbytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, world, experts)
    # intranode over NVLink (allow_nvlink_for_low_latency_mode), one QP per local expert as its
    # test_low_latency.py sets; Buffer itself sets NVSHMEM_DISABLE_NVLS=1
    buffer = deep_ep.Buffer(run.dist.group.WORLD, 0, nbytes, low_latency_mode=True, num_qps_per_rank=local,
                            allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True)
    idx, weights = _routing(torch, dev, me, world, experts, cfg["topk"], tokens)
    torch.manual_seed(2000 + me)
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
    xs, idxs = run.gather(x), run.gather(idx)
    remote = (idx // local) != me
    out, got = [], {}
    device_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sms, combine_sms = ll_sms(experts, device_sms), ll_sms(experts, device_sms, tokens)
    for fp8 in (False, True):
        pay = "fp8" if fp8 else "bf16"
        nb = ll_bytes(idx, remote, hidden, fp8)

        def dispatch(i, _, fp8=fp8):
            got["d"] = buffer.low_latency_dispatch(x, idx, tokens, experts, use_fp8=fp8)

        t = run.time(dispatch, f"DeepEP low-latency dispatch {pay} {tokens}")
        recv, counts, handle = got["d"][0], got["d"][1], got["d"][2]
        q, scales = (recv if fp8 else (recv, None))
        wrong = ll_dispatch_wrong(torch, q, counts, handle[0], handle[1], xs, idxs, me, local, scales)
        out.append(run.row("dispatch", tokens, t, wrong, nb["dispatch"], nb["link_dispatch"], ep_mode="low_latency",
                           payload=pay, sms=sms))
    nb = ll_bytes(idx, remote, hidden, False)
    recv, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, tokens, experts, use_fp8=False)
    y = recv.clone()  # the identity expert's outputs

    def combine(i, _):
        got["c"] = buffer.low_latency_combine(y, idx, weights, handle)[0]

    t = run.time(combine, f"DeepEP low-latency combine {tokens}")
    ref = ll_combine_ref(torch, x, idx, weights)
    out.append(run.row("combine", tokens, t, count_far(got["c"], ref, 2 ** -7), nb["combine"], nb["link_combine"],
                       ep_mode="low_latency", payload="bf16", sms=combine_sms))

    def pair(i, _):
        r, _, h, _, _ = buffer.low_latency_dispatch(x, idx, tokens, experts, use_fp8=False)
        got["p"] = buffer.low_latency_combine(r, idx, weights, h)[0]

    t = run.time(pair, f"DeepEP low-latency dispatch+combine {tokens}")
    out.append(run.row("pair", tokens, t, count_far(got["p"], ref, 2 ** -7), nb["dispatch"] + nb["combine"],
                       nb["link_dispatch"] + nb["link_combine"], ep_mode="low_latency", payload="bf16",
                       sms=max(sms, combine_sms)))
    torch.cuda.synchronize()
    run.dist.barrier()
    buffer.destroy()
    return out


def _ceiling(run: _Run) -> dict:
    nbytes = run.cfg.get("ceiling_bytes") or CEILING_BYTES
    enqueue, wrong = _peer_copy(run.torch, run.dev, run.rank, run.world, nbytes)
    t = run.time(enqueue, f"cudaMemcpyPeerAsync {nbytes} B")
    r = run.row("ceiling", 0, t, wrong(), nbytes, nbytes, ep_mode="peer copy", payload="bytes",
                impl_note="cudaMemcpyPeerAsync to the next rank, every rank at once")
    return r


def deepep_worker(cfg: dict, rank: int) -> list[dict]:
    """Rows of the moe spec's mode and payload (cfg: experts, hidden, topk, mode, payload, sizes,
    iters, reps, warmup), then the peer-copy ceiling; without deep_ep, one skipped row saying why."""
    run = _Run(cfg, rank)
    rows = []
    try:
        deep_ep = import_deep_ep()
    except ImportError as e:
        why = f"deep_ep cannot be imported ({e}); docs/lab/deepep.md says how to build and carry its wheel"
        rows = [{"phase": "all", "tokens": n, "skipped": why} for n in cfg["sizes"]]
    else:
        version = getattr(deep_ep, "__version__", None) or _dist_version("deep_ep")
        for tokens in cfg["sizes"]:
            part = _low_latency if cfg["mode"] == "low_latency" else _normal
            rows += [dict(r, deep_ep_version=version) for r in part(run, deep_ep, tokens)]
    rows.append(_ceiling(run))
    for r in rows:
        r["torch_version"] = run.torch.__version__
    run.dist.barrier()
    run.dist.destroy_process_group()
    return rows


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------
# alone: `python -m tsgen.bench.moe_deepep` (tools/gpu_deepep.sh)
# ---------------------------------------------------------------------------


def main(argv=None) -> int:
    """The DeepEP baseline of every moe entry of a suite, without tsgen's kernels: one launch of
    `gpus` workers per entry; a row per line into --jsonl, a table last. Exit 1 when a row failed
    its check or timing problems were found, 2 when nothing was timed."""
    import argparse
    import json

    from ..spec import load_spec, spec_variant
    from .baselines import deepep
    from .sizes import parse_sizes
    from .suites import load_suite

    ap = argparse.ArgumentParser(prog="python -m tsgen.bench.moe_deepep", description=main.__doc__)
    ap.add_argument("--suite", default="moe-w2", help="suites/NAME.yaml whose moe entries are timed")
    ap.add_argument("--gpus", type=int, default=None, help="world size (default: the suite's)")
    ap.add_argument("--iters", type=int, default=20, help="calls per sample")
    ap.add_argument("--reps", type=int, default=7, help="samples; the median is reported")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls before the samples")
    ap.add_argument("--jsonl", default=None, help="append the rows here")
    args = ap.parse_args(argv)
    table, bad, timed = [], 0, 0
    for e in load_suite(args.suite).entries:
        spec = spec_variant(load_spec(e.spec), e.variant).model
        if spec.op != "moe":
            continue
        label = e.label or spec.name
        world = args.gpus or e.gpus or 2
        sizes = parse_sizes(e.sizes) if e.sizes is not None else [spec.test.count]
        print(f"{label}: DeepEP at world {world}, {sizes} tokens per rank ...", flush=True)
        try:
            got = deepep(["deepep"], None, spec, world, sizes, args.iters, args.reps, args.warmup)
        except BaselineRunError as err:  # this entry's workers failed: said, and the next entry runs
            print(err, flush=True)
            table.append({"label": label, "impl": "DeepEP", "tokens": sizes[0], "skipped": str(err).splitlines()[0]})
            bad += 1
            continue
        for m in got:
            row = {"label": label, "world": world, "impl": m.impl, "tokens": m.size, **m.extra}
            if m.timing is None:
                row["skipped"] = m.skipped
            else:
                timed += 1
                row.update(m.timing.fields(), problems=m.timing.problems,
                           deepep_GBps=m.case.bw_bytes / (m.timing.median_us * 1e3))
                bad += bool(row.get("wrong") or m.timing.problems)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
            table.append(row)
    print(f"\n{'entry':<14} {'impl':<58} {'tokens':>6} {'us':>8} {'GB/s':>7} {'link GB/s':>9} {'wrong':>6}")
    for r in table:
        if "skipped" in r:
            print(f"{r['label']:<14} {r['impl']:<58} {r['tokens']:>6} not timed: {r['skipped']}")
            continue
        flag = " PROBLEM: " + "; ".join(r["problems"]) if r["problems"] else ""
        print(f"{r['label']:<14} {r['impl']:<58} {r['tokens']:>6} {r['time_us']:>8.1f} {r['deepep_GBps']:>7.1f} "
              f"{r.get('link_GBps', 0):>9.1f} {r.get('wrong', 0):>6}{flag}")
    return 2 if not timed else 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
