"""The attention families' baselines: what tsgen's attention and cp_attention are timed against.

attention (one GPU, in tsgen's process, on the World's stream of rank 0; timed in the same
interleaved rounds as tsgen, AttentionBench.interleave):
  sdpa            PyTorch scaled_dot_product_attention, once with its flash and once with its
                  cuDNN backend (a backend that refuses the shape: a note saying why)
  cudnn_frontend  cuDNN's SDPA forward graph built through the cudnn-frontend Python package
                  (`nvidia-cudnn-frontend`, over the cuDNN library torch loaded): bf16 in and
                  out, fp32 softmax and accumulation, no statistics output (inference), causal
                  as a top-left diagonal band with right bound 0, grouped-query heads as K / V
                  with fewer heads; one graph and plan per shape, built once
  flash_attn_4    FlashAttention-4's CuTe DSL kernels (`flash-attn-4` over `nvidia-cutlass-dsl`; its
                  Hopper forward on sm_90) through flash_attn.cute.flash_attn_func: bf16, causal,
                  grouped-query heads as K / V with fewer heads, no LSE output; compiled by the DSL at
                  its first call (before the timed calls); not installed or refused: a note
All but FlashAttention-4 in SDPA's own layout ([batch, heads, seq, head_dim], contiguous: their best
case); FlashAttention-4 in its own, [batch, seq, heads, head_dim] contiguous, made once before timing.

cp_attention (one process per GPU, NCCL, after tsgen's timings; `cp_worker`):
  naive   all_gather_into_tensor of K and V, then one SDPA of the local queries over the
          whole sequence; causal through an explicit boolean mask of the positions, which
          rules out SDPA's flash and cuDNN paths (hence "naive")
  zig-zag (causal zig-zag only) what ring-flash-attention and USP do: K and V gathered and put
          in position order, then for each of the rank's two query chunks (r and 2W-1-r) one
          SDPA over its diagonal chunk (causal) and one over every earlier chunk (not causal),
          merged by log-sum-exp (`merge_lse`); through the SDPA op that returns the LSE
          (cuDNN's, else flash's), checked against the naive output before it is timed.
"""

from __future__ import annotations

from typing import Callable

from .timing import TorchClock, time_calls
from .torch_ops import cuda_torch
from .workers import launch_workers, nccl_process

# the zig-zag baseline's output against the naive one (both bf16 attention of the same inputs)
CP_MAX_REL_ERR = 2e-2
# a one-GPU baseline's output against torch SDPA's before it is timed (bf16 attention of the same inputs)
BASELINE_MAX_REL_ERR = 2e-2


# ---------------------------------------------------------------------------
# attention, one GPU: SDPA backends and cudnn-frontend
# ---------------------------------------------------------------------------

# (impl, call, why): a call that runs one attention on the stream it was built for, or None and why not
Candidate = tuple[str, "Callable[[], None] | None", "str | None"]


def same_kernel_pair(impls) -> tuple[str, str] | None:
    """(SDPA cuDNN's impl, cudnn-frontend's impl) where both are among `impls`: two callers of one cuDNN SDPA
    kernel (the profile names the same kernel under both), whose paired ratio in the same rounds is the
    bench method's control, 1.00 unless the round order favours one (docs/benchmarks.md). SDPA cuDNN with
    K / V expanded to every head runs another problem and does not count."""
    sdpa = next((i for i in impls if i.endswith(" SDPA cuDNN") and i.startswith("torch ")), None)
    fe = next((i for i in impls if " via cudnn-frontend " in i and i.endswith(" SDPA")), None)
    return (sdpa, fe) if sdpa and fe else None


def _inputs(torch, spec, seq: int, dev: int):
    p, tdt = spec.params, getattr(torch, spec.dtype)
    with torch.cuda.device(dev):
        q = torch.randn(p.batch, p.heads, seq, p.head_dim, device=f"cuda:{dev}", dtype=tdt)
        k = torch.randn(p.batch, p.kv_heads, seq, p.head_dim, device=f"cuda:{dev}", dtype=tdt)
        v = torch.randn(p.batch, p.kv_heads, seq, p.head_dim, device=f"cuda:{dev}", dtype=tdt)
    return q, k, v


def sdpa(world, rank: int, spec, seq: int) -> list[Candidate]:
    """PyTorch's scaled_dot_product_attention of the attention spec's shape at sequence length
    `seq` on rank's GPU and stream, once with each of its flash and cuDNN backends. Grouped-query
    heads through enable_gqa, else K and V expanded to every query head (said in the impl)."""
    torch, why = cuda_torch()
    if torch is None:
        return [("torch SDPA", None, why)]
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..ops.attention import scale_of

    p, dev, stream = spec.params, world.devices[rank], world.streams[rank]
    scale = scale_of(spec)
    q, k, v = _inputs(torch, spec, seq, dev)
    ext = torch.cuda.ExternalStream(stream.ptr, device=f"cuda:{dev}")
    torch.cuda.synchronize(dev)
    out: list[Candidate] = []
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION)):
        impl, why = f"torch {torch.__version__} SDPA {name}", None
        for expand in ((False, True) if p.kv_heads != p.heads else (False,)):
            kk, vv = (k.repeat_interleave(p.heads // p.kv_heads, 1), v.repeat_interleave(p.heads // p.kv_heads, 1)) \
                if expand else (k, v)

            def call(kk=kk, vv=vv, expand=expand, backend=backend):
                with torch.cuda.device(dev), torch.cuda.stream(ext), sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, kk, vv, is_causal=p.causal, scale=scale,
                                                   enable_gqa=p.kv_heads != p.heads and not expand)

            try:
                call()
                torch.cuda.synchronize(dev)
            except RuntimeError as e:  # this backend refuses the shape (or is not built): say why
                why = f"{impl} does not run here: {str(e).splitlines()[0][:160]}"
                continue
            out.append((impl + (" (K / V expanded to every head)" if expand else ""), call, None))
            why = None
            break
        if why:
            out.append((impl, None, why))
    return out


def cudnn_sdpa_args(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, scale: float,
                    causal: bool) -> dict:
    """What the cudnn-frontend SDPA forward graph is built from (pure: no cuDNN here): each
    tensor's dims and strides ([batch, heads, seq, head_dim], contiguous), and the sdpa node's
    keyword arguments, enums by name. Causal is the top-left aligned diagonal band with right
    bound 0 (key j visible to query i iff j <= i; q_len = kv_len); no statistics output
    (generate_stats False: cudnn-frontend >= 1.13's name for is_inference True)."""

    def bhsd(h: int) -> dict:
        return {"dim": [batch, h, seq, head_dim], "stride": [h * seq * head_dim, seq * head_dim, head_dim, 1]}

    node = {"attn_scale": float(scale), "generate_stats": False}
    if causal:
        node.update(diagonal_alignment="TOP_LEFT", diagonal_band_right_bound=0)
    return {"q": bhsd(heads), "k": bhsd(kv_heads), "v": bhsd(kv_heads), "o": bhsd(heads), "sdpa": node}


def cudnn_versions(cudnn) -> str:
    """cuDNN's library version and the frontend's, as the impl names them."""
    fn = getattr(cudnn, "backend_version_string", None)
    lib = fn() if callable(fn) else str(cudnn.backend_version())
    return f"cuDNN {lib} via cudnn-frontend {cudnn.__version__}"


_GRAPHS: dict = {}  # (device, shape, scale, causal) -> built graph and its tensors: one build per shape


def _cudnn_graph(cudnn, torch, dev: int, args: dict):
    key = (dev, repr(sorted((k, repr(v)) for k, v in args.items())))
    if key in _GRAPHS:
        return _GRAPHS[key]
    bf16 = cudnn.data_type.BFLOAT16
    with torch.cuda.device(dev):
        handle = cudnn.create_handle()
        g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        ts = {n: g.tensor(name=n, dim=args[n]["dim"], stride=args[n]["stride"], data_type=bf16) for n in "qkv"}
        node = dict(args["sdpa"])
        if "diagonal_alignment" in node:
            node["diagonal_alignment"] = getattr(cudnn.diagonal_alignment, node["diagonal_alignment"])
        o, _stats = g.sdpa(name="sdpa", q=ts["q"], k=ts["k"], v=ts["v"], **node)
        o.set_output(True).set_dim(args["o"]["dim"]).set_stride(args["o"]["stride"]).set_data_type(bf16)
        ts["o"] = o
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        ws = torch.empty(max(int(g.get_workspace_size()), 1), dtype=torch.uint8, device=f"cuda:{dev}")
    _GRAPHS[key] = (handle, g, ts, ws)
    return _GRAPHS[key]


def cudnn_frontend(world, rank: int, spec, seq: int) -> list[Candidate]:
    """cuDNN's SDPA forward through cudnn-frontend on rank's GPU and stream (the handle's stream
    is the World's); its output checked once against torch SDPA before it is timed."""
    torch, why = cuda_torch()
    if torch is None:
        return [("cudnn-frontend SDPA", None, f"{why} (cudnn-frontend runs on torch's cuDNN)")]
    try:
        import cudnn
    except Exception as e:  # noqa: BLE001 - not installed, or no cuDNN library to load
        return [("cudnn-frontend SDPA", None, f"cudnn-frontend does not import: {type(e).__name__}: {str(e)[:160]}")]
    from ..ops.attention import scale_of

    p, dev, stream = spec.params, world.devices[rank], world.streams[rank]
    if spec.dtype != "bfloat16":
        return [("cudnn-frontend SDPA", None, f"the baseline is built for bfloat16, not {spec.dtype}")]
    scale = scale_of(spec)
    try:
        impl = f"{cudnn_versions(cudnn)} SDPA"
        args = cudnn_sdpa_args(p.batch, p.heads, p.kv_heads, seq, p.head_dim, scale, p.causal)
        q, k, v = _inputs(torch, spec, seq, dev)
        o = torch.empty_like(q)
        handle, g, ts, ws = _cudnn_graph(cudnn, torch, dev, args)
        cudnn.set_stream(handle=handle, stream=stream.ptr)
        buffers = {ts["q"]: q, ts["k"]: k, ts["v"]: v, ts["o"]: o}
    except Exception as e:  # noqa: BLE001 - the frontend cannot express or build the shape: say why
        return [("cudnn-frontend SDPA", None, f"cudnn-frontend cannot build this shape: {type(e).__name__}: "
                 f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}")]

    def call():
        with torch.cuda.device(dev):
            g.execute(buffers, ws, handle=handle)

    try:
        call()
        torch.cuda.synchronize(dev)
        with torch.cuda.device(dev):
            err = rel_err_vs_sdpa(torch, o, q, k, v, p.causal, scale)
    except Exception as e:  # noqa: BLE001
        return [(impl, None, f"{impl} does not run here: {type(e).__name__}: {str(e)[:200]}")]
    if not err <= BASELINE_MAX_REL_ERR:
        return [(impl, None, f"{impl}: its output differs from torch SDPA's by {err:.2e} (relative): not timed")]
    return [(impl, call, None)]


def cudnn_sdpa_backward_args(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, scale: float,
                             causal: bool) -> dict:
    """What cudnn-frontend's SDPA forward (with its softmax statistics) and backward graphs are built
    from for the backward bench (pure: no cuDNN here): Q, K, V, O, dO as [batch, heads, seq, head_dim]
    with the strides of the bench's [batch, seq, heads, head_dim] buffers (no copies), the statistics
    fp32 [batch, heads, seq, 1]; the forward node's and the backward node's keyword arguments, enums by
    name. Causal as the forward's: the top-left diagonal band, right bound 0 (q_len = kv_len)."""

    def bshd(h: int) -> dict:
        return {"dim": [batch, h, seq, head_dim], "stride": [seq * h * head_dim, head_dim, h * head_dim, 1]}

    mask = {"diagonal_alignment": "TOP_LEFT", "diagonal_band_right_bound": 0} if causal else {}
    return {"q": bshd(heads), "k": bshd(kv_heads), "v": bshd(kv_heads), "o": bshd(heads), "do": bshd(heads),
            "stats": {"dim": [batch, heads, seq, 1], "stride": [heads * seq, seq, 1, 1]},
            "forward": {"attn_scale": float(scale), "generate_stats": True, **mask},
            "backward": {"attn_scale": float(scale), **mask}}


def cudnn_backward(cudnn, torch, q, k, v, do, causal: bool, scale: float, stream_ptr: int):
    """cuDNN's SDPA backward through cudnn-frontend on [batch, seq, heads, head_dim] tensors: the
    forward graph run once for O and the softmax statistics the backward reads, then the backward
    graph built; returns (call, (dQ, dK, dV)): each call runs the backward on the handle's stream
    (`stream_ptr`) into those tensors. Raises what cudnn-frontend raises for a shape it cannot build."""
    dt = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[q.dtype]
    f32 = cudnn.data_type.FLOAT
    batch, seq, heads, head_dim = q.shape
    args = cudnn_sdpa_backward_args(batch, heads, k.shape[2], seq, head_dim, scale, causal)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=stream_ptr)

    def node(kind: str) -> dict:
        n = dict(args[kind])
        if "diagonal_alignment" in n:
            n["diagonal_alignment"] = getattr(cudnn.diagonal_alignment, n["diagonal_alignment"])
        return n

    def graph(names):
        g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        ts = {n: g.tensor(name=n, dim=args[n]["dim"], stride=args[n]["stride"],
                          data_type=f32 if n == "stats" else dt) for n in names}
        return g, ts

    def output(t, like: str, data_type):
        t.set_output(True).set_dim(args[like]["dim"]).set_stride(args[like]["stride"]).set_data_type(data_type)

    def built(g):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return torch.empty(max(int(g.get_workspace_size()), 1), dtype=torch.uint8, device=q.device)

    fg, ft = graph(("q", "k", "v"))
    o_t, stats_t = fg.sdpa(name="sdpa", q=ft["q"], k=ft["k"], v=ft["v"], **node("forward"))
    output(o_t, "o", dt)
    output(stats_t, "stats", f32)
    fws = built(fg)
    o = torch.empty_like(q)
    stats = torch.empty(batch, heads, seq, 1, dtype=torch.float32, device=q.device)
    fg.execute({ft["q"]: q, ft["k"]: k, ft["v"]: v, o_t: o, stats_t: stats}, fws, handle=handle)
    bg, bt = graph(("q", "k", "v", "o", "do", "stats"))
    dq_t, dk_t, dv_t = bg.sdpa_backward(name="sdpa_backward", q=bt["q"], k=bt["k"], v=bt["v"], o=bt["o"],
                                        dO=bt["do"], stats=bt["stats"], **node("backward"))
    for t, like in ((dq_t, "q"), (dk_t, "k"), (dv_t, "v")):
        output(t, like, dt)
    bws = built(bg)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    pack = {bt["q"]: q, bt["k"]: k, bt["v"]: v, bt["o"]: o, bt["do"]: do, bt["stats"]: stats,
            dq_t: grads[0], dk_t: grads[1], dv_t: grads[2]}

    def call():
        bg.execute(pack, bws, handle=handle)

    return call, grads


def tensor_rel_err(got, ref) -> float:
    """||got - ref|| / ||ref|| of two torch tensors, in float32 (a baseline's output against its reference)."""
    ref = ref.float()
    return float((got.float() - ref).norm() / ref.norm())


def rel_err_vs_sdpa(torch, o, q, k, v, causal: bool, scale: float) -> float:
    """||o - SDPA(q, k, v)|| / ||SDPA(q, k, v)||, all [batch, heads, seq, head_dim] (K / V with fewer
    heads: grouped-query), the reference in float32 of torch's SDPA on the same device."""
    import torch.nn.functional as F

    return tensor_rel_err(o, F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                            enable_gqa=k.shape[1] != q.shape[1]))


# ---------------------------------------------------------------------------
# attention, one GPU: FlashAttention-4 (flash-attn-4's CuTe DSL kernels)
# ---------------------------------------------------------------------------

FA4_DIST, CUTLASS_DSL_DIST = "flash-attn-4", "nvidia-cutlass-dsl"
FA4_IMPL = "flash-attn-4"  # the row's name while the versions are unknown (a note)
FA4_PREPARE_CALLS = 2  # calls before the check: the first compiles (the DSL's JIT), the second reuses it


def _dsl_packages_on_path() -> None:
    """What the .pth file nvidia-cutlass-dsl installs does at start-up, for a --target folder on
    PYTHONPATH (Python reads .pth files in site-packages folders only): its dsl_packages folder,
    where `cutlass` is, put on sys.path once `nvidia_cutlass_dsl` itself imports."""
    import importlib.util
    import os
    import sys

    if importlib.util.find_spec("cutlass") is not None:
        return
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(base, "dsl_packages")
        if os.path.isdir(path) and path not in sys.path:
            sys.path.insert(0, path)


def import_fa4():
    """(flash_attn.cute, None), or (None, why it does not import: not installed, or the DSL's
    libraries do not load here)."""
    try:
        _dsl_packages_on_path()
        import flash_attn.cute as fa4
    except Exception as e:  # noqa: BLE001 - not installed, or cutlass / its CUDA libraries do not load
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        return None, (f"{FA4_DIST} does not import (flash_attn.cute): {type(e).__name__}: {msg}"
                      " (its wheels travel in parts: tools/fa4_wheels.sh)")
    if not callable(getattr(fa4, "flash_attn_func", None)):
        return None, f"{FA4_DIST}: flash_attn.cute has no flash_attn_func"
    return fa4, None


def fa4_versions(version=None) -> str:
    """The row's name: flash-attn-4's and nvidia-cutlass-dsl's versions as installed (the
    distributions' metadata; flash_attn.cute.__version__ looks up a distribution named "fa4", which
    the wheel is not: 0.0.0). `version(dist)` -> str, importlib.metadata.version by default."""
    if version is None:
        from importlib.metadata import version

    def of(dist):
        try:
            return version(dist)
        except Exception:  # noqa: BLE001 - not installed as a distribution (a source tree on the path)
            return "(version unknown)"

    return f"{FA4_DIST} {of(FA4_DIST)} (CuTe DSL {CUTLASS_DSL_DIST} {of(CUTLASS_DSL_DIST)}) flash_attn_func"


def to_fa4_layout(x):
    """[batch, heads, seq, head_dim] -> FlashAttention-4's [batch, seq, heads, head_dim], contiguous
    (a copy, made once before timing)."""
    return x.transpose(1, 2).contiguous()


def fa4_call(fa4, q, k, v, causal: bool, scale: float):
    """(call, output): call() runs flash_attn_func once on q, k, v given in SDPA's layout
    [batch, heads, seq, head_dim] (copied once into FA4's [batch, seq, heads, head_dim]; K / V with
    fewer heads as they are: FA4 groups the query heads itself), on the current stream, with the
    softmax scale and causal flag (q_len = kv_len: FA4's bottom-right diagonal is the top-left one);
    output() is the last call's output, viewed back as [batch, heads, seq, head_dim]."""
    qf, kf, vf = (to_fa4_layout(t) for t in (q, k, v))
    last = {}

    def call():
        out = fa4.flash_attn_func(qf, kf, vf, softmax_scale=scale, causal=causal)
        last["o"] = out[0] if isinstance(out, (tuple, list)) else out  # (out, lse); lse None (not asked)

    def output():
        return last["o"].transpose(1, 2)

    return call, output


def fa4_stream(torch, stream):
    """A context that makes `stream` torch's current stream and apache-tvm-ffi's environment stream,
    the one FA4's compiled kernels launch on (tvm_ffi.use_torch_stream, where this tvm_ffi has it;
    else torch's alone)."""
    try:
        import tvm_ffi

        use = getattr(tvm_ffi, "use_torch_stream", None)
    except Exception:  # noqa: BLE001 - no tvm_ffi: FA4 did not import either
        use = None
    ctx = torch.cuda.stream(stream)
    return use(ctx) if callable(use) else ctx


def flash_attn_4(world, rank: int, spec, seq: int) -> list[Candidate]:
    """FlashAttention-4's forward (flash_attn.cute.flash_attn_func) on rank's GPU and stream: its
    inputs in its own layout made once, FA4_PREPARE_CALLS calls (the DSL compiles the kernel at the
    first: outside the timed calls) and its output checked against torch SDPA before it is timed.
    Not installed, an arch FA4 refuses, a shape it cannot run or a compile that fails: a note."""
    torch, why = cuda_torch()
    if torch is None:
        return [(FA4_IMPL, None, f"{why} (flash-attn-4 runs on torch tensors)")]
    fa4, why = import_fa4()
    if fa4 is None:
        return [(FA4_IMPL, None, why)]
    from ..ops.attention import scale_of

    p, dev, stream = spec.params, world.devices[rank], world.streams[rank]
    if spec.dtype != "bfloat16":
        return [(FA4_IMPL, None, f"the baseline is built for bfloat16, not {spec.dtype}")]
    impl, scale = fa4_versions(), scale_of(spec)
    ext = torch.cuda.ExternalStream(stream.ptr, device=f"cuda:{dev}")
    cc = "sm_%d%d" % torch.cuda.get_device_capability(dev)
    try:
        q, k, v = _inputs(torch, spec, seq, dev)
        with torch.cuda.device(dev):
            run, output = fa4_call(fa4, q, k, v, p.causal, scale)
        torch.cuda.synchronize(dev)

        def call():
            with torch.cuda.device(dev), fa4_stream(torch, ext):
                run()

        for _ in range(FA4_PREPARE_CALLS):
            call()
        torch.cuda.synchronize(dev)
        with torch.cuda.device(dev):
            err = rel_err_vs_sdpa(torch, output(), q, k, v, p.causal, scale)
    except Exception as e:  # noqa: BLE001 - an arch or shape FA4 refuses, or the DSL's compile fails
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        return [(impl, None, f"{impl} does not run here ({cc}): {type(e).__name__}: {msg}")]
    if not err <= BASELINE_MAX_REL_ERR:
        return [(impl, None, f"{impl}: its output differs from torch SDPA's by {err:.2e} (relative): not timed")]
    return [(impl, call, None)]


# ---------------------------------------------------------------------------
# cp_attention: zig-zag chunks, LSE merge, the workers
# ---------------------------------------------------------------------------


def zigzag_query_chunks(world: int, rank: int) -> tuple[int, int]:
    """The two global chunks (of 2 x world) whose queries rank holds, in its row order
    (tsgen/ops/cp_attention.py positions, layout zigzag)."""
    return rank, 2 * world - 1 - rank


def zigzag_pieces(world: int, rank: int, half: int) -> list[tuple[int, int, int, int]]:
    """What rank's zig-zag baseline computes: per query chunk, (local first row, global chunk,
    end of the full keys, end of the diagonal keys) in position-ordered K / V: the chunk's queries
    see keys [0, c half) whole and [c half, (c + 1) half) causally."""
    return [(i * half, c, c * half, (c + 1) * half) for i, c in enumerate(zigzag_query_chunks(world, rank))]


def to_position_order(torch, gathered, world: int):
    """K or V gathered in rank order, [world, batch, heads, count, d] with each rank's zig-zag rows
    (chunk r, then chunk 2 world - 1 - r), -> [batch, heads, world x count, d] in position order."""
    w, b, h, n, d = gathered.shape
    halves = gathered.view(w, b, h, 2, n // 2, d)
    chunks = torch.cat([halves[:, :, :, 0], halves[:, :, :, 1].flip(0)], 0)  # chunk j at index j
    return chunks.permute(1, 2, 0, 3, 4).reshape(b, h, w * n, d)


def merge_lse(torch, o1, lse1, o2, lse2):
    """Two attentions of the same queries over disjoint key sets -> the attention over their union:
    o = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2), lse = log(e^lse1 + e^lse2); o [..., s, d] in
    any float type (merged in at least fp32), lse [..., s] (natural log)."""
    acc = torch.promote_types(o1.dtype, torch.float32)  # bf16 outputs merge in fp32
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = torch.exp(lse1 - lse).unsqueeze(-1), torch.exp(lse2 - lse).unsqueeze(-1)
    return (o1.to(acc) * w1 + o2.to(acc) * w2).to(o1.dtype), lse


def zigzag_attention(torch, q, k_pos, v_pos, world: int, rank: int, attend):
    """Rank's zig-zag causal attention: q [b, h, count, d] (its rows: chunk r, then 2 world - 1 - r);
    k_pos, v_pos [b, hkv, S, d] in position order. attend(q, k, v, causal) -> (o, lse [b, h, s]).
    Each query chunk: its diagonal chunk causal, every earlier chunk in one call not causal, merged."""
    half = q.shape[2] // 2
    outs = []
    for row, _c, full, diag in zigzag_pieces(world, rank, half):
        qc = q[:, :, row:row + half]
        o, lse = attend(qc, k_pos[:, :, full:diag], v_pos[:, :, full:diag], True)
        if full:
            o2, lse2 = attend(qc, k_pos[:, :, :full], v_pos[:, :, :full], False)
            o, lse = merge_lse(torch, o, lse, o2, lse2)
        outs.append(o)
    return torch.cat(outs, 2)


def lse_attend(torch, backend: str, scale: float, group: int, expand: bool = False):
    """attend(q, k, v, causal) -> (o, lse [b, h, s] float32) through the aten SDPA op of `backend`
    that returns the log-sum-exp: "cuDNN" (_scaled_dot_product_cudnn_attention with
    compute_log_sumexp) or "flash" (_scaled_dot_product_flash_attention). K and V with fewer
    heads (group > 1) go to the op as they are, or expanded to every head (`expand`)."""
    aten = torch.ops.aten

    def attend(q, k, v, causal):
        if expand and group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        if backend == "cuDNN":
            out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        else:
            out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out[0], out[1].reshape(q.shape[0], q.shape[1], q.shape[2]).float()

    return attend


def run_cp(params, dtype: str, world: int, sizes: list[int], *, iters: int, reps: int, warmup: int,
           timeout: float = 300) -> list[dict]:
    """cp_attention's baselines for each whole sequence S in `sizes`, one process per GPU; rank 0's rows."""
    cfg = {"worker": "tsgen.bench.attention_baselines:cp_worker", "sizes": sizes, "heads": params.heads,
           "kv_heads": params.kv_heads, "head_dim": params.head_dim, "batch": params.batch, "causal": params.causal,
           "layout": params.layout, "dtype": dtype, "iters": iters, "reps": reps, "warmup": warmup}
    return launch_workers(cfg, world, timeout=timeout)


def naive_impl(version: str, causal: bool) -> str:
    what = "SDPA with a position mask (naive: the mask rules out flash and cuDNN)" if causal else "SDPA"
    return f"torch {version} all_gather_into_tensor + {what}"


def zigzag_impl(version: str, backend: str) -> str:
    return f"torch {version} zig-zag: all_gather_into_tensor + SDPA {backend} per chunk, LSE merge"


def cp_worker(cfg: dict, rank: int) -> list[dict]:
    """Per S: this rank's S / world queries, K and V ([batch, heads, S / world, d]); the naive
    baseline (K and V gathered in rank order, one SDPA, causal by a mask of the gathered keys'
    positions); for causal zig-zag also the zig-zag baseline, its output checked against the
    naive one's first."""
    import torch.nn.functional as F

    from ..ops.cp_attention import positions

    torch, dist, dev, world = nccl_process(rank)
    clock = TorchClock(torch, dist, dev)
    tdt = getattr(torch, cfg["dtype"])
    sync = torch.zeros(1, device=dev)
    b, h, hkv, d = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    scale = d ** -0.5
    zigzag = cfg["causal"] and cfg["layout"] == "zigzag"

    def line_up():
        dist.barrier()
        torch.cuda.synchronize()
        dist.all_reduce(sync)

    def timed(label: str, fn) -> dict:
        t = time_calls(clock, [rank], {rank: torch.cuda.current_stream()}, lambda i, _: fn(), calls=cfg["iters"],
                       reps=cfg["reps"], warmup=cfg["warmup"], graphs=False, before_sample=line_up, label=label)
        return {**t.fields(), "samples_us": t.samples_us, "problems": t.problems}

    rows, chosen = [], {}  # chosen: the zig-zag's SDPA op, once one matched the naive output
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

        def gather(k=k, v=v, k_all=k_all, v_all=v_all):
            dist.all_gather_into_tensor(k_all, k, group=dist.group.WORLD)
            dist.all_gather_into_tensor(v_all, v, group=dist.group.WORLD)

        def naive(q=q, k_all=k_all, v_all=v_all, mask=mask, n=n):
            gather()
            kf = k_all.permute(1, 2, 0, 3, 4).reshape(b, hkv, world * n, d)
            vf = v_all.permute(1, 2, 0, 3, 4).reshape(b, hkv, world * n, d)
            return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, enable_gqa=h != hkv, scale=scale)

        impl = naive_impl(torch.__version__, cfg["causal"])
        try:
            rows.append({"s": size, "impl": impl, **timed(f"naive S={size}", naive)})
        except Exception as e:  # noqa: BLE001
            rows.append({"s": size, "impl": impl, "skipped": f"{type(e).__name__}: {str(e)[:200]}"})
        if zigzag:
            rows.append(_zigzag_row(torch, dist, cfg, rank, world, size, q, k_all, v_all, gather, naive, scale,
                                    timed, chosen))
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return rows


def _zigzag_row(torch, dist, cfg, rank, world, size, q, k_all, v_all, gather, naive, scale, timed,
                chosen: dict) -> dict:
    """The zig-zag baseline at one S: the first LSE-returning SDPA op (cuDNN's, then flash's; K / V
    as they are, then expanded to every head) whose output matches the naive one on every rank is
    timed, and kept in `chosen` for the next sizes (still checked at each)."""
    h, hkv = cfg["heads"], cfg["kv_heads"]
    ref = naive().float()

    def make(attend):
        def call():
            gather()
            kp, vp = to_position_order(torch, k_all, world), to_position_order(torch, v_all, world)
            return zigzag_attention(torch, q, kp, vp, world, rank, attend)
        return call

    options = [chosen["option"]] if chosen else [
        (name, expand) for name in ("cuDNN", "flash") for expand in ((False, True) if h != hkv else (False,))]
    tried = []
    for name, expand in options:
        attend = lse_attend(torch, name, scale, h // hkv, expand)
        what = name + (" (K / V expanded to every head)" if expand else "")
        try:
            got = make(attend)().float()
            err = tensor_rel_err(got, ref)
            msg = f"{what}: relative error {err:.2e} against the naive output"
        except Exception as e:  # noqa: BLE001 - the op refuses the shape here
            err, msg = float("inf"), f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        t = torch.tensor([err], dtype=torch.float64, device=q.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank takes the same op: the worst rank decides
        if float(t.item()) <= CP_MAX_REL_ERR:
            chosen["option"] = (name, expand)
            return {"s": size, "impl": zigzag_impl(torch.__version__, what), "rel_err_vs_naive": float(t.item()),
                    **timed(f"zig-zag S={size}", make(attend))}
        tried.append(msg)
    return {"s": size, "impl": zigzag_impl(torch.__version__, "cuDNN / flash"),
            "skipped": "no LSE-returning SDPA op matched the naive output: " + "; ".join(tried)[:400]}
