"""The `attention_backward` op on one GPU: correctness against a float32 reference, then a short
bench against torch autograd of SDPA's backward (flash and cuDNN backends).

Usage: python tools/gpu_attention_bwd.py OUT_DIR [--quick] [--no-bench] [--impl shipped,mma_sync,wgmma_red,wgmma,wgmma_det,wgmma_g1,wgmma_l3,wgmma_m128,wgmma_dkq,wgmma_m128dkq]
       python tools/gpu_attention_bwd.py OUT_DIR --impl wgmma --ncu hd128_full_kv32[:8192]
       python tools/gpu_attention_bwd.py OUT_DIR --ncu hd128_full_kv32[:8192] --ncu-source [--ncu-baseline fa4]
       (ncu's warp-stall samples per SASS instruction of one main kernel launch, tsgen's or FA4's: the summary in
       OUT_DIR/src_<who>_<variant>_s<seq>.txt, by reason, hottest instructions, and stretch of the step)
       python tools/gpu_attention_bwd.py OUT_DIR --kernel-times hd128_full_kv32[:8192] [--kt-baselines sdpa_cudnn,cudnn_fe] [--kt-rounds 3]
       (every kernel of tsgen's call and of the baselines' under torch.profiler, back-to-back calls in interleaved
       blocks: each kernel's median time, a call's span, the GPU's busy share; OUT_DIR/kernels_<variant>_s<seq>.md)
       (on the lent machines: bash tools/gpu_attention_bwd.sh, which sets up the environment; source
       tools/device_env.sh before the --ncu form: ncu over every kernel of one variant's warm calls at the
       bench's shape, the report in OUT_DIR/ncu_<variant>_s<seq>.txt; with --ncu-baseline sdpa_cudnn (or
       sdpa_flash, cudnn_fe, fa4) the same metrics over that baseline's backward kernels on the same
       tensors, in OUT_DIR/ncu_<baseline>_<variant>_s<seq>.txt: the two side by side)

--impl: the main kernels to run (default shipped): shipped (the shipped specs' main kernel for the variant's
head dim: at 128 params.dk_after_dq, at 64 params.step_rows 128), mma_sync (params.impl mma_sync), wgmma
(params.impl wgmma: dQ by bulk reductions, in 64-row steps and the default product order), wgmma_dkq
(params.dk_after_dq: FlashAttention-3's product order) and wgmma_red (params.impl wgmma with
dq_reduce atomic: the first wgmma version's per-element fp32 reductions) and wgmma_det (params.impl
wgmma with params.deterministic: the bulk reductions in a fixed order; its checks add cases run 3 or 5
times on the same inputs that pass only with dQ, dK, dV and the fp32 dq_accum workspace (whose bits
keep most of the order differences that the 16-bit rounding hides) bit-identical across the runs, and
a causal two-segment case whose split (480) falls inside a query block), wgmma_g1 / g2 / g4 / g8
(params.impl wgmma with params.head_group 1, 2, 4, 8: the main kernel's CTAs in groups of that many
(sequence, KV head) pairs, for L2 locality), wgmma_l3 (params.impl wgmma with params.lookahead: the
next step's S^T and dP^T issued under this step's dQ tail), wgmma_m128 (params.impl wgmma with params.step_rows
128: steps of 128 query rows, FlashAttention-3's hd 64 tile; head dim 64 only: the hd 128 variants run without
it, their rows keep the other impls' columns). wgmma's checks run one such
repeated case as information (whether its fp32 dq_accum differed: expected, not a failure; it shows
that the check can see the order). Each listed one is built,
checked and benched with the same variants and cases; a variant of an impl other than shipped is
named NAME_IMPL (its checks' rows), and its bench timings are column tsgen_IMPL of the same rows,
interleaved with the others (ratio_ref: the first listed impl's time / its time, x in the table; the
SDPA columns' ratio: SDPA's time / the last listed impl's, so list the candidate last).

1. Build: the variants below, rendered from specs/attention_backward_hd128.yaml, compiled into
   host-launcher shared libraries (in parallel) before anything runs.
2. Correctness, one child process per variant (a trapping kernel ends its CUDA context): each
   case draws random 16-bit Q, K, V, dO (torch, on the GPU), computes O (rounded to 16 bits)
   and LSE with a float32 forward, and checks dQ, dK, dV of <kernel>_backward against the
   float32 backward of the same formulas (tsgen.ops.attention.attention_backward_reference's,
   on the GPU, TF32 off) element by element within the family's grad_tolerance: ulp |ref| + 2 ulp
   (the |.| sums of each product) + 1e-6 (o_tolerance's, ulp 2^-7 bf16 / 2^-10 fp16), plus for dQ
   and dK head_dim 2^-23 of the sums of the terms dS = P (dP - D) cancels; no NaN. Before every
   checked call the outputs and the fp32 workspace are poisoned with NaN and sentinels sit after
   the outputs' ends. Cases: S = 1000 (tails of queries and keys, batch 2), 4096; one case of
   20 back-to-back calls (the dQ accumulator must be zeroed per call); one where q_len and
   kv_len differ (causal: bottom-right aligned positions); wgmma_det, wgmma: the repeated cases above.
3. Bench (one child): hd 128, 32 heads (32 and 8 KV heads), S 4K, 8K, 16K (16K tokens: batch =
   16384 / S), causal and not; hd 64 MHA causal and not: tsgen's three kernels against torch autograd of
   scaled_dot_product_attention (flash and cuDNN backends: the backward only, the forward run
   once) and, where flash-attn-4 is installed (tools/fa4_wheels.sh), FlashAttention-4's backward
   through its autograd function (column fa4; else a printed note), timed in interleaved rounds (tsgen/bench/timing.py Sampler, eager), FLOPs 10 b h s^2 d
   (halved causal).

Writes OUT_DIR/attention_bwd.json and OUT_DIR/attention_bwd.md and prints the tables. Exit code
0: every check passed; 1: a check failed or a child crashed.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import ctypes
import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "tools"))

from tsgen.bench.timing import ROUND_ORDERS  # noqa: E402
from tsgen.env import force_no_multicast  # noqa: E402
from tsgen.ops.attention import grad_tolerance  # noqa: E402
import gpu_attention as ga  # noqa: E402  (the forward's script)
from ncu_source import page_summary, source_args  # noqa: E402
from gpu_attention import Op as ForwardOp, build as build_forward, build_loaded, torch_dtype  # noqa: E402

force_no_multicast()

SPEC = ROOT / "specs" / "attention_backward_hd128.yaml"
PEAK_TFLOPS = 990.0  # dense bf16 of an H100 / H200 SXM: anything above is a measurement error
TOKENS = 16384
CHECK_TIMEOUT_S, BENCH_TIMEOUT_S = 120, 150


def variant(head_dim=128, causal=False, kv_heads=32, **extra) -> dict:
    changes = {"params": {"head_dim": head_dim, "causal": causal, "kv_heads": kv_heads}}
    for key, value in extra.items():
        (changes if key == "dtype" else changes["params"])[key] = value
    return changes


VARIANTS = {f"hd{d}_{'causal' if c else 'full'}_kv{kv}": variant(d, c, kv)
            for d in (64, 128) for c in (False, True) for kv in (32, 8)}
VARIANTS.update({
    "fp16_hd128_causal_kv8": variant(128, True, 8, dtype="float16"),
    "hd128_full_kv4_bhsd": variant(128, False, 4, layout="bhsd"),
})
# variants whose checks also chain tsgen's forward (tools/gpu_attention.py's variant of the same shape)
CHAINED = {"hd128_causal_kv8": "hd128_causal_kv8", "hd64_full_kv8": "hd64_full_kv8"}
CHECK_VARIANTS = ["hd128_full_kv32", "hd128_causal_kv8", "hd64_full_kv8", "hd64_causal_kv32",
                  "fp16_hd128_causal_kv8", "hd128_full_kv4_bhsd"]
BENCH_VARIANTS = ["hd128_full_kv32", "hd128_causal_kv32", "hd128_full_kv8", "hd128_causal_kv8", "hd64_causal_kv32",
                  "hd64_full_kv32"]
BENCH_SEQS = [4096, 8192, 16384]


# main kernels; the first is the default and the bench's "tsgen" column
# shipped: the shipped specs' main kernel for the variant's head dim (SHIPPED_SPECS: at 128 params.dk_after_dq, at 64
# params.step_rows 128); mma_sync: params.impl mma_sync; wgmma: params.impl wgmma in the 64-row default order (neither
# lever; the shipped kernel until 2026-11-27); wgmma_gN: the CTAs in groups of N (sequence, KV head) pairs
# (params.head_group; g0: no groups, the order before groups of 4 became the default); wgmma_l3: params.lookahead (the
# next step's S^T and dP^T under the dQ tail, docs/design/attention.md's lever 3), with the default head_group;
# wgmma_m128: params.step_rows 128 (steps of 128 query rows at head dim 64, docs/design/attention.md's "Tall steps");
# wgmma_dkq: params.dk_after_dq (FlashAttention-3's product order: the dQ staged while dK runs); wgmma_m128dkq: both,
# the 128-row steps in that order (head dim 64; against shipped, its one lever alone); every wgmma impl
# but shipped walks whole items (params.tail_split false): at head dim 128 not causal, shipped against wgmma_dkq
# times the tail split alone
IMPLS = ("shipped", "mma_sync", "wgmma", "wgmma_red", "wgmma_det", "wgmma_g0", "wgmma_g1", "wgmma_g2", "wgmma_g4",
         "wgmma_g8", "wgmma_l3", "wgmma_m128", "wgmma_dkq", "wgmma_m128dkq", "shipped_g2", "shipped_g8",
         "shipped_r80", "shipped_e2", "shipped_e3", "shipped_e4")
# shipped_gN: the shipped spec's main kernel with its CTAs in groups of N (sequence, KV head) pairs (params.head_group;
# the shipped default is 4, DEFAULT_HEAD_GROUP); shipped_r80: with steps of 80 query rows (params.step_rows 80, dQ
# transposed; head dim 128, not causal); shipped_eN: every N-th column group's exp2 on the FMA pipe
# (params.exp2_fma_every N)
SHIPPED_CHANGES = {"shipped_g2": {"head_group": 2}, "shipped_g8": {"head_group": 8}, "shipped_r80": {"step_rows": 80},
                   **{f"shipped_e{n}": {"exp2_fma_every": n} for n in (2, 3, 4)}}
# the spec params of each (beside its threads per CTA, those of params.impl); every wgmma one names the levers, as
# SPEC sets one of them and params.tail_split is on by default where it applies (shipped: as the specs resolve it)
WGMMA = {"impl": "wgmma", "dk_after_dq": False, "step_rows": None, "tail_split": False}
IMPL_PARAMS = {"mma_sync": {"impl": "mma_sync", "dk_after_dq": False, "step_rows": None, "tail_split": None},
               "wgmma": WGMMA,
               "wgmma_red": {**WGMMA, "dq_reduce": "atomic"}, "wgmma_det": {**WGMMA, "deterministic": True},
               **{f"wgmma_g{n}": {**WGMMA, "head_group": n} for n in (0, 1, 2, 4, 8)},
               "wgmma_l3": {**WGMMA, "lookahead": True},
               "wgmma_m128": {**WGMMA, "step_rows": 128},
               "wgmma_dkq": {**WGMMA, "dk_after_dq": True},
               "wgmma_m128dkq": {**WGMMA, "step_rows": 128, "dk_after_dq": True}}
# the shipped spec of each head dim, whose main kernel impl "shipped" builds (its impl and the two levers)
SHIPPED_SPECS = {128: ROOT / "specs" / "attention_backward_hd128.yaml",
                 64: ROOT / "specs" / "attention_backward_hd64_causal_gqa.yaml"}
# impls built for some variants only (the spec check refuses the others): the params of the variants they run on
IMPL_ONLY = {"wgmma_m128": {"head_dim": 64}, "wgmma_m128dkq": {"head_dim": 64},
             "shipped_r80": {"head_dim": 128, "causal": False}}


def runs(name: str, impl: str) -> bool:
    """Whether main kernel `impl` is built, checked and benched for variant `name` (IMPL_ONLY)."""
    return all(VARIANTS[name]["params"][k] == v for k, v in only_for(impl).items())


def only_for(impl: str) -> dict:
    """The variant params `impl` is built for (IMPL_ONLY; a base_X impl: shipped_X's), {} for every variant."""
    return IMPL_ONLY.get(base_of(impl) or impl, {})


def impl_name(name: str, impl: str) -> str:
    """Variant `name` built with main kernel `impl`: the shipped one's keeps the name."""
    return name if impl == IMPLS[0] else f"{name}_{impl}"


# --base-tree: another commit's tsgen (tools/ab_tree.py), whose build of the shipped params is impl "base", and of
# shipped_X's (SHIPPED_CHANGES) impl base_X
BASE_TREE: Path | None = None
BASE_IMPLS = {"base": "shipped", **{"base" + k.removeprefix("shipped"): k for k in SHIPPED_CHANGES}}


def base_of(impl: str) -> str | None:
    """The impl of this checkout whose params BASE_TREE builds as `impl` (base: shipped, base_r80: shipped_r80), or
    None for this checkout's own impls."""
    return BASE_IMPLS.get(impl)


def build(out: Path, name: str, impl: str = IMPLS[0]) -> dict:
    """Render and compile variant `name` of SPEC with main kernel `impl`: {"manifest", "library",
    "softmax_scale"}. Impl "base": the shipped impl's changes, rendered and compiled by BASE_TREE's tsgen and
    templates (tools/ab_tree.py)."""
    from tsgen.spec import load_spec, merge, spec_variant

    changes = merge(VARIANTS[name], {"name": f"attbwd_{impl_name(name, impl)}"})
    head_dim = VARIANTS[name]["params"]["head_dim"]
    if base_of(impl):
        import ab_tree

        return ab_tree.build(BASE_TREE, str(SPEC.relative_to(ROOT)),
                             merge(changes, impl_changes(base_of(impl), head_dim)), out / "build" / impl)
    return build_loaded(out, spec_variant(load_spec(SPEC), merge(changes, impl_changes(impl, head_dim))))


def impl_changes(impl: str, head_dim: int = 128) -> dict:
    """The spec changes that select main kernel `impl` for a variant of head dim `head_dim` (its threads per CTA go
    with it)."""
    from tsgen.ops.attention_backward import IMPLS as THREADS
    from tsgen.spec import load_spec

    if impl == "shipped" or impl in SHIPPED_CHANGES:
        shipped = load_spec(SHIPPED_SPECS[head_dim]).model.params
        params = {"impl": shipped.impl, "dk_after_dq": shipped.dk_after_dq, "step_rows": shipped.step_rows,
                  "tail_split": shipped.tail_split}  # unset: on where it applies to the variant
        params.update(SHIPPED_CHANGES.get(impl, {}))
    else:
        params = IMPL_PARAMS[impl]
    return {"params": dict(params), "launch": {"threads": THREADS[params["impl"]]["threads"]}}


class Op(ga.Entry):
    """One compiled variant, called through <kernel>_backward with torch tensors."""

    ENTRY = "backward"
    ARGTYPES = [ctypes.c_void_p] * 12 + [ctypes.c_uint64] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_void_p]

    def __init__(self, built: dict):
        super().__init__(built)
        self.deterministic = bool(self.manifest["constants"].get("DETERMINISTIC", 0))
        self.tail_items = int(self.manifest["constants"].get("TAIL_SPLIT", 0))  # params.tail_split's slots
        self.dq_tiled = bool(self.manifest["constants"].get("DQ_TILED", 0))  # dQ by bulk reductions

    def workspace_floats(self, batch, q_len) -> tuple[int, int, int]:
        """This variant's workspace at `batch` sequences of `q_len` query rows (dq_accum, dsum, lse2), in floats."""
        from tsgen.ops.attention_backward import workspace_floats

        return workspace_floats(batch, q_len, self.heads, self.head_dim, self.deterministic, self.tail_items)

    def workspace(self, torch, batch, q_len, device="cuda"):
        return tuple(torch.empty(n, device=device, dtype=torch.float32) for n in self.workspace_floats(batch, q_len))

    def __call__(self, t: dict, ws, batch, q_len, kv_len, stream, q_offset=0, kv_offset=0, q_split=None, q_offset2=0):
        # the entry takes bare pointers: a workspace made for another variant (a deterministic one's
        # holds the dQ semaphores after dq_accum) would be written past its end, so refuse it here
        # (once per workspace, by addresses and sizes, and shape: the bench's timed calls repeat them)
        key = (tuple((w.data_ptr(), w.numel()) for w in ws), batch, q_len)
        if key != getattr(self, "_checked", None):
            want = self.workspace_floats(batch, q_len)
            got = tuple(w.numel() for w in ws)
            if len(got) != len(want) or any(g < n for g, n in zip(got, want)):
                raise ValueError(f"{self.manifest['name']}_backward: workspace of {got} floats, this variant needs "
                                 f"{want} at batch {batch}, {q_len} query rows (make it with this Op's workspace())")
            self._checked = key
        ptrs = [t[n].data_ptr() for n in ("q", "k", "v", "o", "do", "lse", "dq", "dk", "dv")] + [w.data_ptr() for w in ws]
        self.check(self.fn(*ptrs, batch, q_len, kv_len, q_offset, q_len if q_split is None else q_split, q_offset2,
                           kv_offset, stream.cuda_stream))


def to_bshd(x, bhsd: bool):
    return x.transpose(1, 2) if bhsd else x


# ---------------------------------------------------------------------------
# The float32 reference on the GPU (the formulas of attention_backward_reference)
# ---------------------------------------------------------------------------


def reference(torch, q, k, v, do, scale, causal, q_offset=0, kv_offset=0, q_split=None, q_offset2=0):
    """q, do [B, Sq, H, D], k, v [B, Skv, Hkv, D] (float32, bshd) -> O (rounded by the caller), LSE
    [B, H, Sq], and a function of O giving dQ, dK, dV, their |.| sums and the cancellation sums
    of dQ and dK (attention_backward_reference's with_abs), all float32 bshd. Query row r at
    position q_offset + r before q_split, q_offset2 + r - q_split from it (the kernels')."""
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    rows = torch.arange(Sq, device=q.device)
    split = Sq if q_split is None else q_split
    qp = torch.where(rows < split, q_offset + rows, q_offset2 + rows - split)
    kp = kv_offset + torch.arange(Skv, device=q.device)
    hidden = (kp[None, :] > qp[:, None]) if causal else None

    def scores(b, h):
        s = scale * (q[b, :, h] @ k[b, :, h // g].T)
        return s.masked_fill(hidden, -math.inf) if causal else s

    o = torch.zeros_like(q)
    lse = torch.empty(B, H, Sq, device=q.device)
    for b in range(B):
        for h in range(H):
            s = scores(b, h)
            lse[b, h] = torch.logsumexp(s, dim=1)
            o[b, :, h] = torch.softmax(s, dim=1).nan_to_num(0.0) @ v[b, :, h // g]

    def grads(o16):
        dsum = (do * o16).sum(-1)  # [B, Sq, H]
        dsum_abs = (do.abs() * o16.abs()).sum(-1)  # D's terms
        out = [torch.zeros_like(x) for x in (q, k, v, q, k, v, q, k)]
        dq, dk, dv, aq, ak, av, cq, ck = out
        for b in range(B):
            for h in range(H):
                kh, vh = k[b, :, h // g], v[b, :, h // g]
                seen = torch.isfinite(lse[b, h])
                p = torch.exp(scores(b, h) - torch.where(seen, lse[b, h], 0.0)[:, None])
                p = torch.where(seen[:, None], p, 0.0)
                ds = p * (do[b, :, h] @ vh.T - dsum[b, :, h][:, None])
                dq[b, :, h] = scale * (ds @ kh)
                dk[b, :, h // g] += scale * (ds.T @ q[b, :, h])
                dv[b, :, h // g] += p.T @ do[b, :, h]
                aq[b, :, h] = scale * (ds.abs() @ kh.abs())
                ak[b, :, h // g] += scale * (ds.abs().T @ q[b, :, h].abs())
                av[b, :, h // g] += p.T @ do[b, :, h].abs()
                cancel = p * (do[b, :, h].abs() @ vh.abs().T + dsum_abs[b, :, h][:, None])  # dP's and D's terms
                cq[b, :, h] = scale * (cancel @ kh.abs())
                ck[b, :, h // g] += scale * (cancel.T @ q[b, :, h].abs())
        return out

    return o, lse, grads


def run_case(torch, op: Op, case: dict, gen, device: str = "cuda", forward=None) -> dict:
    """One case: random inputs, the reference, `calls` calls of `op` on poisoned outputs and
    workspace, the per-element check (device "cpu": the tests' fake ops). forward (an Op of
    tools/gpu_attention.py, the same shape) and case["forward"]: O and LSE come from tsgen's
    forward instead of the reference's (the chain a trainer runs: its LSE convention, natural
    log, is the one the backward reads), and the reference gradients are those of its O."""
    batch, q_len, kv_len, calls = case["batch"], case["q_len"], case["kv_len"], case.get("calls", 1)
    repeats = case.get("repeats", 1)  # runs of the same inputs, each on a poisoned workspace: bit-identical?
    info = case.get("info", False)  # repeats as information only (no fixed order: bits may differ, not a failure)
    dt = torch_dtype(torch, op.dtype)
    # causal with q_len != kv_len: bottom-right aligned (the last query sees every key); a case with
    # q_split: two query segments (a zig-zag rank's), positions 0 .. and q_offset2 ..
    q_offset = case.get("q_offset", kv_len - q_len if op.causal and "q_split" not in case else 0)
    segments = {"q_split": case["q_split"], "q_offset2": case["q_offset2"]} if "q_split" in case else {}

    def randn(rows, heads):
        return torch.randn(batch, rows, heads, op.head_dim, device=device, generator=gen).to(dt)

    q, k, v, do = randn(q_len, op.heads), randn(kv_len, op.kv_heads), randn(kv_len, op.kv_heads), randn(q_len, op.heads)
    f32 = [x.float() for x in (q, k, v, do)]
    o32, lse, grads = reference(torch, *f32, op.scale, op.causal, q_offset=q_offset, **segments)
    o = o32.to(dt)

    def layout(x):  # bshd -> the op's layout, contiguous
        return to_bshd(x, op.bhsd).contiguous()

    guard = 64  # sentinel elements after each output
    t = {"q": layout(q), "k": layout(k), "v": layout(v), "o": layout(o), "do": layout(do), "lse": lse.contiguous()}
    stream = torch.cuda.Stream() if device == "cuda" else None
    chained = {}
    if case.get("forward"):
        t["o"], t["lse"] = torch.full_like(t["o"], math.nan), torch.full_like(lse, math.nan)
        torch.cuda.synchronize()  # the NaN fills ran on the current stream, the forward runs on `stream`
        forward(t["q"], t["k"], t["v"], t["o"], t["lse"], batch, q_len, kv_len, stream, q_offset=q_offset)
        stream.synchronize()
        o = to_bshd(t["o"], op.bhsd)
        chained = {"forward_o_rel_err": float((o.float() - o32).norm() / o32.norm()),
                   "forward_lse_max_err": float((t["lse"] - lse).abs().max())}
    dq, dk, dv, aq, ak, av, cq, ck = grads(o.float())
    flat = {}
    for name, like in (("dq", q), ("dk", k), ("dv", v)):
        flat[name] = torch.empty(like.numel() + guard, device=device, dtype=dt)
        t[name] = flat[name][:like.numel()].view(layout(like).shape)
    ws = op.workspace(torch, batch, q_len, device)
    if case.get("ws_offset"):  # dsum and lse2 (ws[1:]) start that many floats into buffers one float longer
        ws = (ws[0], *(torch.empty(w.numel() + case["ws_offset"], device=device, dtype=w.dtype)[case["ws_offset"]:]
                       for w in ws[1:]))
    first = first_accum = None  # the first run's gradients and fp32 dq_accum (ws[0]), bit for bit (repeats > 1)
    identical = accum_identical = True
    for _ in range(repeats):
        for x in list(flat.values()) + list(ws):
            x.fill_(math.nan)
        for x in flat.values():
            x[-guard:].fill_(7.0)
        if stream is not None:
            torch.cuda.synchronize()
        for _ in range(calls):
            op(t, ws, batch, q_len, kv_len, stream, q_offset=q_offset, **segments)
        if stream is not None:
            stream.synchronize()
        bits = {n: flat[n].view(torch.int16).clone() for n in flat}  # NaN == NaN as bits, too
        # the fp32 sums before the 16-bit rounding, where most order differences still show (deterministic:
        # the semaphores after them too, each its query block's count of adds)
        accum = ws[0].view(torch.int32).clone()
        if first is None:
            first, first_accum = bits, accum
        else:
            identical = identical and all(torch.equal(bits[n], first[n]) for n in flat)
            accum_identical = accum_identical and torch.equal(accum, first_accum)
    result = {"case": case, "calls": calls, **chained}
    if getattr(op, "tail_items", 0) and device != "cpu":  # params.tail_split: this call's split on this GPU
        from tsgen.ops.attention_backward import BLOCK_M, IMPLS, tail_plan

        items = -(-kv_len // IMPLS["wgmma"]["block_n"]) * op.kv_heads * batch
        first, parts = tail_plan(items, torch.cuda.get_device_properties(device).multi_processor_count,
                                 op.heads // op.kv_heads * -(-q_len // BLOCK_M))
        result["tail"] = {"items": items - first, "parts": parts}
    if repeats > 1:
        result["bit_identical"] = identical
        result["dq_accum_identical"] = accum_identical
    ok = not chained or (chained["forward_o_rel_err"] < 1e-2 and chained["forward_lse_max_err"] < 1e-3 * (
        1 + float(lse.abs().max())))
    for name, ref, absum, cancel in (("dq", dq, aq, cq), ("dk", dk, ak, ck), ("dv", dv, av, None)):
        got = to_bshd(t[name], op.bhsd).float()
        bad = ~((got - ref).abs() <= grad_tolerance(ref, absum, cancel, op.dtype, op.head_dim))
        rel = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
        sentinel = bool((flat[name][-guard:] == 7.0).all())
        result[name] = {"wrong": int(bad.sum()), "of": bad.numel(), "rel_err": rel, "nan": int(got.isnan().sum()),
                        "sentinel_ok": sentinel}
        if bad.any():
            i = int(bad.flatten().nonzero()[0])
            result[name]["first_wrong"] = {"index": i, "got": float(got.flatten()[i]), "ref": float(ref.flatten()[i])}
        ok = ok and not bad.any() and sentinel
    result["pass"] = ok and (info or (identical and accum_identical))
    return result


def cases_for(op: Op, quick: bool) -> list[dict]:
    cases = [{"batch": 2, "q_len": 1000, "kv_len": 1000},
             {"batch": 1, "q_len": 1000, "kv_len": 1000, "calls": 20},
             {"batch": 1, "q_len": 300, "kv_len": 777},
             # q_len no multiple of 4: a step's LSE2 / D rows are no 16-byte aligned run there, so a producer that
             # bulk-copies them (results/attention_backward/2026-11-29-a59ef26-bulk-lse.patch) copies through its
             # lanes instead; every other case takes the bulk path
             {"batch": 2, "q_len": 999, "kv_len": 1001},
             # D and LSE2 4 bytes past a 16-byte boundary (ws_offset: run_case): the same lane-copy path at a q_len
             # that is a multiple of 4
             {"batch": 1, "q_len": 1000, "kv_len": 1000, "ws_offset": 1}]
    if not quick:
        cases.append({"batch": 1, "q_len": 4096, "kv_len": 4096})
    if getattr(op, "causal", False):  # top-left aligned: the key blocks past row 300 see no query (their dK, dV must be zero)
        cases.append({"batch": 1, "q_len": 300, "kv_len": 777, "q_offset": 0})
    if getattr(op, "deterministic", False):
        # the same inputs run again on a poisoned workspace: dQ (and dK, dV) bit-identical every time;
        # 4096 (many CTAs adding into each query block at once) where the bulk path's bits vary; the
        # zig-zag-like case (rows 0-479 at positions 0-479, 480-1023 at 1504-2047; the split not a multiple of
        # 64: query block 7 straddles it, rows_see_keys's two-segment branch) checks the visitor order of
        # the causal walk's two query segments
        cases += [{"batch": 2, "q_len": 1000, "kv_len": 1000, "repeats": 3},
                  {"batch": 1, "q_len": 1024, "kv_len": 2048, "q_split": 480, "q_offset2": 1504, "repeats": 3}]
        if not quick:
            cases.append({"batch": 1, "q_len": 4096, "kv_len": 4096, "repeats": 5})
    elif getattr(op, "dq_tiled", False):
        # the default bulk path (no fixed order), the same repeated case as information: whether its fp32
        # dq_accum differed between runs (expected: the check above has something to catch), not a failure
        cases.append({"batch": 2, "q_len": 1000, "kv_len": 1000, "repeats": 3, "info": True} if quick
                     else {"batch": 1, "q_len": 4096, "kv_len": 4096, "repeats": 5, "info": True})
    if getattr(op, "tail_items", 0):
        # params.tail_split: calls whose last wave is split on a 132-SM H100 / H200 (tail_plan; the result's case
        # names the split on this GPU): 35 KV blocks (the last one 48 rows) x the KV heads, 64 items in 2 pieces
        # at 32 KV heads, 8 in 16 at 4; and the bench's split, 4 items in 32 pieces (4096 items at 32 heads)
        cases.append({"batch": 1, "q_len": 1000, "kv_len": 4400})
        if not quick:
            cases.append({"batch": 1, "q_len": 2048, "kv_len": 16384})
    return cases


def check_variant(built: dict, quick: bool, echo=print) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    op = Op(built)
    forward = ForwardOp(built["forward"]) if built.get("forward") else None
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    results = []
    cases = cases_for(op, quick)
    if forward is not None:
        cases += [{"batch": 1, "q_len": n, "kv_len": n, "forward": True} for n in ((1000,) if quick else (1000, 4096))]
    for case in cases:
        r = run_case(torch, op, case, gen, forward=forward)
        results.append(r)
        echo(json.dumps(r))
    return {"pass": all(r["pass"] for r in results), "cases": results}


# ---------------------------------------------------------------------------
# Bench
# ---------------------------------------------------------------------------


def bench_inputs(torch, op: "Op", seq: int) -> tuple[int, dict, tuple]:
    """The bench's tensors for `op` at `seq`: (batch, {q, k, v, do, o, lse, dq, dk, dv}, workspace); the
    batch fills TOKENS rows. O from SDPA's forward, LSE zeros: timing only, the values do not change the
    work."""
    import torch.nn.functional as F

    batch = max(1, TOKENS // seq)
    dt = torch_dtype(torch, op.dtype)
    t = {n: torch.randn(batch, seq, h, op.head_dim, device="cuda", dtype=dt)
         for n, h in (("q", op.heads), ("k", op.kv_heads), ("v", op.kv_heads), ("do", op.heads))}
    with torch.no_grad():
        t["o"] = F.scaled_dot_product_attention(*(t[n].transpose(1, 2) for n in ("q", "k", "v")), is_causal=op.causal,
                                                enable_gqa=op.heads != op.kv_heads).transpose(1, 2).contiguous()
    t["lse"] = torch.zeros(batch, op.heads, seq, device="cuda")
    for n in ("dq", "dk", "dv"):
        t[n] = torch.empty_like(t[{"dq": "q", "dk": "k", "dv": "v"}[n]])
    return batch, t, op.workspace(torch, batch, seq)


def warm_calls(built: dict, seq: int, baselines: list[str]):
    """({"tsgen": call, label: call, ...}, batch) for tsgen's backward (variant `built`) and each of `baselines` on
    the bench's tensors at `seq`, one stream, each call(i, rs) run once already (a baseline's first call also
    checks its grads); or (None, why) where a baseline cannot run. What --ncu and --kernel-times run."""
    import torch

    op = Op(built)
    batch, t, ws = bench_inputs(torch, op, seq)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    calls = {"tsgen": lambda i, rs: op(t, ws, batch, seq, seq, stream)}
    calls["tsgen"](0, [0])
    for label in baselines:
        fn, why = baseline_call(torch, label, t, op, stream)  # its first call runs here
        if fn is None:
            return None, f"{label}: {why}"
        calls[label] = fn
    torch.cuda.synchronize()
    return calls, batch


def one_shape(built: dict, seq: int, calls: int = 3, baseline: str | None = None) -> dict:
    """`calls` calls of the bench's shape at `seq` on one stream, tsgen's or `baseline`'s (one of BASELINES,
    on the same tensors): what ncu profiles (--ncu; --profile-from-start off: the warm calls only, not the first
    call nor the SDPA reference that checks cudnn_fe's and fa4's grads, so that the report holds every kernel of
    a call: tsgen's preprocess, main kernel and dQ conversion, or the baseline's)."""
    import torch

    fns, batch = warm_calls(built, seq, [baseline] if baseline else [])
    if fns is None:
        return {"pass": False, "why": batch}
    fn = fns[baseline or "tsgen"]
    torch.cuda.profiler.start()
    for i in range(calls - 1):
        fn(i, [0])
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return {"pass": True, "seq": seq, "batch": batch}


# What `--ncu` asks for: the throughputs, where warps stall, and the tensor pipe's and the MUFU's busy share
NCU_SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "WarpStateStats",
                "SchedulerStats", "Occupancy", "LaunchStats")
NCU_METRICS = ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
               "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
               "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio")


def profile(out: Path, name: str, impl: str, seq: int, baseline: str | None = None) -> int:
    """ncu over every kernel of two warm backward calls of variant `name` (impl `impl`: its preprocess, main kernel
    and dQ conversion) at the bench's shape for `seq`, or of `baseline`'s on the same tensors (whatever its
    kernels are named): the report in OUT/ncu_<variant>_s<seq>.txt, or
    OUT/ncu_<baseline>_<variant>_s<seq>.txt (ncu on PATH; the GPU's clocks as they are: ncu's own warning
    says so). Where the backward's time goes, and where the baseline's, before a lever is chosen
    (docs/design/attention.md)."""
    built = build(out, name, impl)
    # every kernel of the warm calls (one_shape starts the profiler after its first call), tsgen's or the baseline's
    report = out / (f"ncu_{impl_name(name, impl)}_s{seq}.txt" if baseline is None else f"ncu_{baseline}_{name}_s{seq}.txt")
    return run_ncu(["--launch-count", "16", *[a for sec in NCU_SECTIONS for a in ("--section", sec)],
                    "--metrics", ",".join(NCU_METRICS)], built, seq, baseline, report)


def run_ncu(ncu_args: list[str], built: dict, seq: int, baseline: str | None, report: Path | None) -> int:
    """ncu (`ncu_args` beside the common ones) over a `--child one` run of `built` at `seq` (tsgen's calls, or
    `baseline`'s): its output into `report` (and the end of it printed) where given; the exit status, or 1 where
    ncu could not run or the profiled child did not (its RESULT line says why)."""
    # --clock-control none: ncu would otherwise lock the GPU's clocks to base while it profiles, and the lent
    # machines' clocks are never to be changed (the device tool's METHOD.md); the counters read the clocks as they
    # are. --profile-from-start off: one_shape starts the profiler after its first call (warm calls only).
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", *ncu_args,
           sys.executable, __file__, "--child", "one", json.dumps(built), str(seq), *([baseline] if baseline else [])]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"ncu: {e}", file=sys.stderr)
        return 1
    if report is not None:
        report.write_text(p.stdout + p.stderr)
        print(p.stdout[-6000:], flush=True)
    elif p.returncode != 0:
        print((p.stdout + p.stderr)[-4000:], file=sys.stderr)
    result = next((json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")), None)
    if p.returncode == 0 and not (result or {}).get("pass"):
        print(f"ncu: the profiled child did not run ({(result or {}).get('why', 'no RESULT line')})", file=sys.stderr)
        return 1
    return p.returncode


# --ncu-source: the main kernel of each implementation, by a regex over its name (one launch after the warm call)
SOURCE_KERNELS = {"tsgen": r"_main$", "fa4": r"FlashAttentionBackwardSm90"}


def profile_source(out: Path, name: str, impl: str, seq: int, baseline: str | None = None) -> int:
    """ncu's warp-stall sampling per SASS instruction of one main kernel launch (tsgen's, or with `baseline` fa4's
    FlashAttentionBackwardSm90) at the bench's shape for `seq`: the report (OUT/src_<who>_<variant>_s<seq>.ncu-rep),
    its source page as CSV (.csv) and a summary (.txt: the samples by stall reason, the hottest instructions, and
    the samples of each stretch between landmark instructions: which waits the step's time goes to). Counting
    instructions did not rank the levers (docs/design/attention.md, "FA4's sm_90 backward beside tsgen's"): this
    does, tsgen's step beside FA4's from the same tensors."""
    who = baseline or "tsgen"
    if who not in SOURCE_KERNELS:
        print(f"--ncu-source: the main kernel of {who} is not named here (of {', '.join(SOURCE_KERNELS)})", file=sys.stderr)
        return 2
    built = build(out, name, impl)
    stem = out / f"src_{who}_{name}_s{seq}"
    code = run_ncu(source_args(SOURCE_KERNELS[who], stem), built, seq, baseline, None)
    if code != 0:
        return code
    return page_summary(stem, f"{who} {name} S {seq}")


KERNEL_CALLS, KERNEL_ROUNDS = 10, 3  # --kernel-times: back-to-back calls a block, blocks an implementation


def kernel_times(built: dict, seq: int, baselines: list[str], calls: int = KERNEL_CALLS,
                 rounds: int = KERNEL_ROUNDS) -> dict:
    """--kernel-times: `calls` back-to-back calls of tsgen's backward (variant `built`) and of each of `baselines` on
    the same tensors, in `rounds` interleaved blocks (round r in tsgen.bench.timing.round_order: each implementation
    takes every place in turn, as the bench's rounds), each block under torch.profiler (CUPTI's kernel records: the
    GPU's own start and end of every kernel and memset / memcpy, as the bench's sustained sequence runs, unlike ncu's
    single replays). {"pass", "seq", "batch", "calls", "order": [names per round], "blocks": {impl: [[(name,
    start_us, end_us), ...] per round]}}: what summarize_kernels reads."""
    import torch

    fns, batch = warm_calls(built, seq, baselines)  # every first call outside the records
    if fns is None:
        return {"pass": False, "why": batch}
    enqueue = {impl: (lambda f=f: [f(i, [0]) for i in range(calls)]) for impl, f in fns.items()}
    blocks, order = profile_rounds(torch, enqueue, rounds)
    return {"pass": True, "seq": seq, "batch": batch, "calls": calls, "order": order, "blocks": blocks}


def profile_rounds(torch, enqueue: dict, rounds: int) -> tuple[dict, list]:
    """`rounds` rounds in tsgen.bench.timing.round_order of each implementation's block (enqueue[impl](): its
    back-to-back calls), each block under torch.profiler and synchronized: ({impl: [[(name, start_us, end_us) of
    every GPU kernel, memset and memcpy] per round]}, [names per round]). Also tools/fwd_kernel_times.py's."""
    from torch.profiler import ProfilerActivity, profile

    from tsgen.bench.timing import round_order

    blocks, order = {impl: [] for impl in enqueue}, []
    for r in range(rounds):
        order.append(round_order(list(enqueue), r))
        for impl in order[-1]:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                enqueue[impl]()
                torch.cuda.synchronize()
            blocks[impl].append([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                                 if e.device_type == torch.autograd.DeviceType.CUDA])
    return blocks, order


def summarize_kernels(result: dict) -> dict:
    """kernel_times' blocks -> {impl: {"span_us": per call (first kernel start to last kernel end of a block over its
    calls; median over blocks), "spans_us": that of every block (the raw samples, in round order), "busy": the
    kernels' summed time over that span, "kernels": [{"name", "per_call", "median_us"}] in order of first
    appearance, and, for every implementation after the first (tsgen's), "vs_first": its span over the first's in
    the same round (the rounds interleave the implementations), median and range over the rounds}}: where each
    implementation's call time goes, kernel by kernel, and how much of it the GPU ran nothing of it (1 - busy)."""
    from statistics import median

    calls, out = result["calls"], {}
    for impl, blocks in result["blocks"].items():
        spans, busy, durations = [], [], {}  # durations: by kernel name, in order of first appearance
        for events in blocks:
            if not events:
                spans.append(None)
                continue
            start, end = min(e[1] for e in events), max(e[2] for e in events)
            spans.append((end - start) / calls)
            busy.append(sum(e[2] - e[1] for e in events) / (end - start) if end > start else 0.0)
            for name, a, b in events:
                durations.setdefault(name, []).append(b - a)
        n = max(1, len([e for e in blocks if e]))
        timed = [x for x in spans if x is not None]
        out[impl] = {"span_us": median(timed) if timed else None, "spans_us": spans,
                     "busy": median(busy) if busy else None,
                     "kernels": [{"name": k, "per_call": len(durations[k]) / (n * calls),
                                  "median_us": median(durations[k])} for k in durations]}
    first = next(iter(out), None)
    for impl, s in out.items():
        if impl == first:
            continue
        ratios = [b / a for a, b in zip(out[first]["spans_us"], s["spans_us"]) if a and b]
        s["vs_first"] = {"median": median(ratios), "min": min(ratios), "max": max(ratios)} if ratios else None
    return out


def kernels_markdown(name: str, seq: int, summary: dict, meta: dict | None = None) -> str:
    """summarize_kernels' result as a short report: the run's device, date, commit and command where `meta` has
    them, then a line an implementation (its span a call, the raw spans of its blocks, and after the first its span
    over the first's in the same rounds: > 1, the first is faster), then its kernels."""
    lines = [f"# Kernel times, {name} at S {seq} (torch.profiler over back-to-back calls)", ""]
    if meta:
        lines += [f"{meta.get('date', '?')}, commit {meta.get('commit', '?')}; {meta.get('device', '?')}.", "",
                  f"Command: `{meta.get('command', '')}`", ""]
    first = next(iter(summary), None)
    for impl, s in summary.items():
        busy = f"{100 * s['busy']:.1f} % busy" if s["busy"] is not None else "no kernels"
        span = f"{s['span_us']:.1f} us a call" if s["span_us"] is not None else "-"
        lines += [f"## {impl}: {span}, {busy}", ""]
        raw = ", ".join("-" if x is None else f"{x:.1f}" for x in s.get("spans_us", []))
        if raw:
            lines += [f"Spans a call, block by block (us): {raw}.", ""]
        v = s.get("vs_first")
        if v:
            lines += [f"Its span over {first}'s in the same rounds: {v['median']:.3f} (range {v['min']:.3f} - "
                      f"{v['max']:.3f}).", ""]
        lines += ["| kernel | per call | median us |", "|---|---|---|"]
        lines += [f"| {k['name'][:100]} | {k['per_call']:.2f} | {k['median_us']:.1f} |" for k in s["kernels"]]
        lines.append("")
    return "\n".join(lines)


def fa4_backward(torch, t: dict, causal: bool, stream):
    """(call, None): FlashAttention-4's backward through its autograd function (flash_attn.cute's
    flash_attn_func forward once, on the bench's [batch, seq, heads, d] tensors; each call
    torch.autograd.grad of dO, as SDPA's columns), run once here (the DSL compiles it) and its dQ,
    dK, dV checked against SDPA's of the same tensors before it is timed; or (None, why) where
    flash-attn-4 is not installed, refuses, or computes something else
    (tsgen/bench/attention_baselines.py)."""
    from tsgen.bench.attention_baselines import fa4_stream, import_fa4

    fa4, why = import_fa4()
    if fa4 is None:
        return None, why
    try:
        q, k, v = (t[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
        with fa4_stream(torch, stream):
            out = fa4.flash_attn_func(q, k, v, causal=causal)[0]
        got = {}

        def call(i, rs):
            with fa4_stream(torch, stream):
                got["grads"] = torch.autograd.grad(out, (q, k, v), t["do"], retain_graph=True)

        call(0, [0])
        torch.cuda.synchronize()
        wrong = differs_from_sdpa(torch, t, causal, got["grads"])
        if wrong:
            return None, wrong
    except Exception as e:  # noqa: BLE001 - an arch or shape FA4 refuses, or the DSL's compile fails
        return None, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    return call, None


def differs_from_sdpa(torch, t: dict, causal: bool, grads) -> str | None:
    """Why a baseline's (dQ, dK, dV) of the bench's [batch, seq, heads, d] tensors is not SDPA's (its
    default backends, the same inputs): the first gradient off by more than BASELINE_MAX_REL_ERR, or
    None: checked before a baseline is timed."""
    import torch.nn.functional as F

    from tsgen.bench.attention_baselines import BASELINE_MAX_REL_ERR, tensor_rel_err

    qt, kt, vt = (t[n].detach().transpose(1, 2).requires_grad_(True) for n in ("q", "k", "v"))
    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=kt.shape[1] != qt.shape[1])
    want = torch.autograd.grad(ref, (qt, kt, vt), t["do"].transpose(1, 2))
    for name, g, w in zip(("dQ", "dK", "dV"), grads, want):
        err = tensor_rel_err(g, w.transpose(1, 2))
        if not err <= BASELINE_MAX_REL_ERR:
            return f"its {name} differs from SDPA's by {err:.2e} (relative): not timed"
    return None


def cudnn_fe_backward(torch, t: dict, causal: bool, stream):
    """(call, None): cuDNN's SDPA backward through cudnn-frontend (its own graph, as a framework
    calling cuDNN directly would: tsgen/bench/attention_baselines.py cudnn_backward) on the bench's
    tensors and stream, run once and its dQ, dK, dV checked against SDPA's before it is timed; or
    (None, why) where cudnn-frontend does not import, cannot build the shape, or computes something else."""
    try:
        import cudnn
    except Exception as e:  # noqa: BLE001 - not installed, or no cuDNN library to load
        return None, f"cudnn-frontend does not import: {type(e).__name__}: {str(e)[:160]}"
    from tsgen.bench.attention_baselines import cudnn_backward

    try:
        run, grads = cudnn_backward(cudnn, torch, t["q"], t["k"], t["v"], t["do"], causal,
                                    t["q"].shape[-1] ** -0.5, stream.cuda_stream)

        def call(i, rs):
            run()

        call(0, [0])
        torch.cuda.synchronize()
        wrong = differs_from_sdpa(torch, t, causal, grads)
    except Exception as e:  # noqa: BLE001 - a shape or version cudnn-frontend refuses
        return None, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    return (None, wrong) if wrong else (call, None)


BASELINES = ("sdpa_flash", "sdpa_cudnn", "cudnn_fe", "fa4")  # the bench's columns, in order


def sdpa_backward(torch, t: dict, causal: bool, stream, backend: str):
    """(call, None): torch autograd of scaled_dot_product_attention's backward with one SDPA backend
    ("flash" or "cudnn"), its forward run once here on `stream`; (None, why) where the backend refuses
    the shape (its first call raises)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t[n].transpose(1, 2).requires_grad_(True) for n in ("q", "k", "v"))
    dot = t["do"].transpose(1, 2)
    gqa = qt.shape[1] != kt.shape[1]
    try:
        with sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]), \
                torch.cuda.stream(stream):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)

        def call(i, rs):
            with torch.cuda.stream(stream):
                torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True)
        call(0, [0])
    except RuntimeError as e:  # a backend that refuses the shape
        return None, str(e).splitlines()[0]
    return call, None


def baseline_call(torch, label: str, t: dict, op: "Op", stream):
    """(call, None) or (None, why) for one of BASELINES on the bench's tensors `t`: what the bench times
    beside tsgen and what `--ncu-baseline` profiles."""
    if label.startswith("sdpa_"):
        return sdpa_backward(torch, t, op.causal, stream, label.removeprefix("sdpa_"))
    return {"cudnn_fe": cudnn_fe_backward, "fa4": fa4_backward}[label](torch, t, op.causal, stream)


# the bench's rounds (whole cycles of the balanced order for 2, 4 or 8 columns) and untimed calls before each sample
BENCH_ROUNDS, BENCH_SETTLE = 8, 1


def bench(built: dict[str, dict], quick: bool, echo=print, order: str = "balanced", settle: int = BENCH_SETTLE,
          rounds: int = BENCH_ROUNDS, shapes: list[str] | None = None, sm_clocks: bool = False) -> dict:
    """built: variant name -> {impl: its build} (the impls timed side by side, interleaved; the first
    is the reference of ratio_ref). order, settle, rounds: tsgen.bench.timing's round order, untimed calls
    before each sample, rounds; shapes: "VARIANT:SEQ" rows to time (default all); sm_clocks: NVML's SM clock
    read while timing (tsgen/bench/clocks.py), each impl's sm_mhz per sample and each baseline's cycle_ratio."""
    if not sm_clocks:
        return _bench(built, quick, echo, order, settle, rounds, shapes)
    from tsgen.bench import clocks

    with clocks.sm_clocks(clocks.visible_bus_ids()) as sm:
        result = _bench(built, quick, echo, order, settle, rounds, shapes)
    return {**result, "sm_clock_failures": sm.failures}


def cycle_ratio(base, mine) -> float | None:
    """The median over rounds of (base's time x its SM clock) / (mine's time x its clock): the ratio of GPU
    cycles, where paired_ratio is that of times (> 1: mine takes fewer cycles). None unless every round of
    both has a clock reading."""
    from tsgen.bench.timing import paired_ratio

    if not base.sm_mhz or None in base.sm_mhz or None in mine.sm_mhz or len(base.sm_mhz) != len(mine.sm_mhz):
        return None
    cycles = [[t * f for t, f in zip(x.samples_us, x.sm_mhz)] for x in (base, mine)]  # per sample, us x MHz
    return paired_ratio(*cycles)["ratio"]


def _bench(built, quick, echo, order, settle, rounds, shapes) -> dict:
    import torch
    from tsgen.bench.timing import Sampler, TorchClock, paired_ratio, time_interleaved
    from tsgen.ops.attention_backward import flops

    clock = TorchClock(torch)
    rows = []
    for name in (n for n in BENCH_VARIANTS if n in built):  # --bench-shapes builds only its variants
        ops = {impl: Op(b) for impl, b in built[name].items()}
        op = next(iter(ops.values()))
        for seq in BENCH_SEQS[:1] if quick else BENCH_SEQS:
            if shapes and f"{name}:{seq}" not in shapes:
                continue
            batch, t, _ = bench_inputs(torch, op, seq)
            wss = {impl: o.workspace(torch, batch, seq) for impl, o in ops.items()}  # each variant its own
            stream = torch.cuda.Stream()

            def tsgen_call(impl):
                def call(i, rs):
                    ops[impl](t, wss[impl], batch, seq, seq, stream)
                return call

            impls = {("tsgen" if impl == IMPLS[0] else f"tsgen_{impl}"): tsgen_call(impl) for impl in ops}
            ref = next(iter(impls))  # the first listed impl: x of the others
            last = list(impls)[-1]  # the last listed: SDPA's ratios (the candidate, listed last)
            for label in BASELINES:
                fn, why = baseline_call(torch, label, t, op, stream)
                if fn is None:
                    echo(f"{name} S={seq}: {label} unavailable: {why}")
                else:
                    impls[label] = fn
            samplers = {k: Sampler(clock, [0], {0: stream}, fn, calls=3, warmup=2, graphs=False, label=k,
                                   settle=settle) for k, fn in impls.items()}
            timings = time_interleaved(samplers, rounds=rounds, order=order)
            f = flops(batch, seq, seq, op.heads, op.head_dim, op.causal)
            row = {"variant": name, "seq": seq, "batch": batch, "order": order, "settle": settle}
            for k, tm in timings.items():
                row[k] = {"us": tm.median_us, "tflops": f / tm.median_us / 1e6, "problems": tm.problems,
                          "samples_us": tm.samples_us, **tm.clock_fields()}
                if row[k]["tflops"] > PEAK_TFLOPS:
                    row[k]["problems"].append(f"{row[k]['tflops']:.0f} TFLOP/s is above the dense peak")
                if not k.startswith("tsgen"):
                    row[k]["ratio"] = paired_ratio(tm.samples_us, timings[last].samples_us)["ratio"]
                    if (cycles := cycle_ratio(tm, timings[last])) is not None:
                        row[k]["cycle_ratio"] = cycles
                elif k != ref:
                    row[k]["ratio_ref"] = paired_ratio(timings[ref].samples_us, tm.samples_us)["ratio"]
            row["ref"], row["last"] = ref, last
            if "sdpa_cudnn" in timings and "cudnn_fe" in timings:  # one cuDNN kernel under two callers: 1.00 unless
                row["same_kernel"] = paired_ratio(timings["cudnn_fe"].samples_us,  # the method favours one
                                                  timings["sdpa_cudnn"].samples_us)
            rows.append(row)
            echo(json.dumps(row))
            del t, wss, impls, samplers, fn, _  # the last baseline's closure holds t too
            torch.cuda.empty_cache()
    return {"rows": rows}


# ---------------------------------------------------------------------------
# Children and the report
# ---------------------------------------------------------------------------


def child(args: list[str], timeout: float) -> tuple[dict, str]:
    cmd = [sys.executable, __file__, "--child", *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        log = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"pass": False, "error": f"timed out after {timeout} s"}, log
    lines = p.stdout.splitlines()
    for line in reversed(lines):
        if line.startswith("RESULT "):
            return json.loads(line[7:]), p.stdout + p.stderr
    return {"pass": False, "error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:] or ''}"}, p.stdout + p.stderr


def clock_table(rows: list[dict], impls: list[str], last: str) -> list[str]:
    """Where the bench read the SM clocks (--sm-clocks): each impl's median SM MHz per row, and each baseline's
    ratio of GPU cycles to `last`'s (cycle_ratio): a time ratio that the cycle ratio matches is the kernels' work,
    one that it does not is the clock (the H200 runs attention at its power limit)."""
    if not any(isinstance(row.get(k), dict) and row[k].get("sm_mhz_median") for row in rows for k in impls):
        return []
    base = [k for k in impls if not k.startswith("tsgen")]
    out = ["", f"SM clock (MHz: the median over samples of NVML's reading during each; --sm-clocks) and cycle ratio "
           f"(the median over rounds of the baseline's time x clock over {last}'s: > 1, {last} takes fewer cycles)", "",
           "| variant | S | " + " | ".join(f"{k} MHz" for k in impls) + "".join(f" | {k} cycles" for k in base) + " |",
           "|---|---|" + "---|" * (len(impls) + len(base))]
    for row in rows:
        mhz = [f"{row[k]['sm_mhz_median']:.0f}" if k in row and row[k].get("sm_mhz_median") else "-" for k in impls]
        cyc = [f"{row[k]['cycle_ratio']:.3f}" if k in row and "cycle_ratio" in row[k] else "-" for k in base]
        out.append(f"| {row['variant']} | {row['seq']} | " + " | ".join(mhz + cyc) + " |")
    return out


def markdown(s: dict) -> str:
    out = [f"# attention_backward on one GPU ({s['device']}, {s['date']})", "", f"Command: `{s['command']}`", "",
           *([f"Impl base (tsgen_base): this checkout's shipped params for each variant, applied to the backward spec of "
              f"{s['base']} and rendered and compiled by its tsgen and templates (tools/ab_tree.py); base_X: shipped_X's "
              "params so; the other impls by this checkout's.", ""] if "base" in s else []),
           "## Correctness", "", "| variant | case | calls | dQ wrong | dK wrong | dV wrong | rel err dQ / dK / dV | pass |",
           "|---|---|---|---|---|---|---|---|"]
    if not s["checks"]:
        out[-3:] = ["Not checked in this run (--no-check: a timing experiment)."]
    for name, r in s["checks"].items():
        for c in r.get("cases", []):
            case = c["case"]
            chain = ", tsgen forward" if case.get("forward") else ""
            if "q_split" in case:
                chain += f", rows from {case['q_split']} at {case['q_offset2']}"
            if "q_offset" in case:
                chain += f", queries at {case['q_offset']} (keys past them unseen)"
            if c.get("tail", {}).get("items"):
                chain += f", the last {c['tail']['items']} items in {c['tail']['parts']} pieces each (tail_split)"
            if "bit_identical" in c:
                same = {"outputs": c["bit_identical"], "fp32 dq_accum": c.get("dq_accum_identical", True)}
                if case.get("info"):  # no fixed order: information only
                    chain += (f", {case['repeats']} runs (information): fp32 dq_accum "
                              + ("identical" if same["fp32 dq_accum"] else "differs") + ", outputs "
                              + ("identical" if same["outputs"] else "differ"))
                elif all(same.values()):
                    chain += f", {case['repeats']} runs: bit-identical (outputs, fp32 dq_accum)"
                else:
                    chain += f", {case['repeats']} runs: BITS DIFFER ({', '.join(k for k, v in same.items() if not v)})"
            out.append(f"| {name} | b{case['batch']} q{case['q_len']} kv{case['kv_len']}{chain} | {c['calls']} | "
                       + " | ".join(f"{c[g]['wrong']} / {c[g]['of']}" for g in ("dq", "dk", "dv"))
                       + " | " + " / ".join(f"{c[g]['rel_err']:.1e}" for g in ("dq", "dk", "dv"))
                       + f" | {'yes' if c['pass'] else 'NO'} |")
        if "error" in r:
            out.append(f"| {name} | {r['error']} | | | | | | NO |")
    if s.get("bench"):
        rows = s["bench"].get("rows", [])
        extra = sorted({k for row in rows for k in row if k.startswith("tsgen_")})  # other impls
        mine = (["tsgen"] if any("tsgen" in row for row in rows) else []) + extra  # the tsgen columns
        # the first listed impl's column: that of a row where several ran (an impl of some head dims only,
        # IMPL_ONLY, leaves the other rows with fewer)
        many = [row for row in rows if sum(k == "tsgen" or k.startswith("tsgen_") for k in row) > 1] or rows
        ref = many[0].get("ref", "tsgen") if rows else "tsgen"
        others = ["sdpa_flash", "sdpa_cudnn"] + [k for k in ("cudnn_fe", "fa4") if any(k in row for row in rows)]
        last = many[0].get("last", ref) if rows else ref
        how = (f"{len(many[0]['tsgen']['samples_us'])} rounds, order {many[0].get('order')}, "
               f"{many[0].get('settle')} untimed call(s) before each sample" if rows and "samples_us" in many[0].get("tsgen", {})
               else "paired rounds")
        out += ["", "## Speed (TFLOP/s: 10 b h s^2 d, halved causal; ratio = SDPA time / "
                f"{last} time, {how}"
                + (f"; {', '.join(extra)}: other main kernels, x = {ref}'s time / theirs" if extra else "") + ")", "",
                "| variant | S | " + "".join(f"{k} | " + ("x | " if extra else "") for k in mine)
                + "SDPA flash | ratio | SDPA cuDNN | ratio |" + (" cuDNN frontend | ratio |" if "cudnn_fe" in others else "")
                + (" FA4 | ratio |" if "fa4" in others else ""),
                "|---|---|" + ("---|---|" if extra else "---|") * len(mine) + "---|---|" * len(others)]
        for row in rows:
            cells = []
            for k in mine:  # with several impls, each one's x: the reference impl's time over its own
                ratio = row[k].get("ratio_ref", row[k].get("ratio_mma_sync")) if k in row else None
                x = "ref" if row.get("ref", ref) == k else f"{ratio:.2f}" if ratio is not None else "-"
                cells += [f"{row[k]['tflops']:.0f}" if k in row else "-"] + ([x] if extra else [])
            for k in others:
                cells += [f"{row[k]['tflops']:.0f}", f"{row[k]['ratio']:.2f}"] if k in row else ["-", "-"]
            out.append(f"| {row['variant']} | {row['seq']} | " + " | ".join(cells) + " |")
        out += clock_table(rows, mine + others, last)
        same = [(f"{row['variant']} S {row['seq']}", row["same_kernel"]) for row in rows if "same_kernel" in row]
        if same:
            from tsgen.bench.report import method_control_line

            out += ["", method_control_line("SDPA cuDNN", "cudnn-frontend", same)]
        if "error" in s["bench"]:
            out.append(f"\nBench error: {s['bench']['error']}")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="/tmp/tsgen-out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--impl", default=IMPLS[0],
                    help=f"comma-separated main kernels to build, check and bench side by side: {', '.join(IMPLS)}")
    ap.add_argument("--ncu", metavar="VARIANT[:SEQ]",
                    help=f"profile every kernel of one variant's warm calls under ncu instead (the first --impl; SEQ default "
                    f"{BENCH_SEQS[1]}; variants: {', '.join(BENCH_VARIANTS)})")
    ap.add_argument("--ncu-baseline", choices=BASELINES,
                    help="with --ncu: profile this baseline's backward at the variant's shape instead of tsgen's")
    ap.add_argument("--ncu-source", action="store_true",
                    help="with --ncu: the warp-stall samples per SASS instruction of the main kernel (one launch; "
                    "--ncu-baseline fa4 for FA4's), OUT/src_<who>_<variant>_s<seq>.{ncu-rep,csv,txt}")
    ap.add_argument("--kernel-times", metavar="VARIANT[:SEQ]",
                    help="time every kernel of tsgen's call (the first --impl) and of --kt-baselines' in interleaved "
                    "blocks of back-to-back calls under torch.profiler; the report in OUT/kernels_<variant>_s<seq>.md")
    ap.add_argument("--kt-rounds", type=int, default=KERNEL_ROUNDS,
                    help=f"with --kernel-times: rounds of blocks (default {KERNEL_ROUNDS}; each implementation takes every "
                    "place in a round in turn)")
    ap.add_argument("--kt-baselines", default="sdpa_cudnn,cudnn_fe",
                    help="with --kernel-times: comma-separated baselines beside tsgen (of " + ", ".join(BASELINES) + ")")
    ap.add_argument("--order", choices=ROUND_ORDERS, default="balanced",
                    help="the bench's round order (tsgen.bench.timing.round_order; rotate: the old one, for its control)")
    ap.add_argument("--settle", type=int, default=BENCH_SETTLE,
                    help=f"the bench's untimed calls before each sample (default {BENCH_SETTLE})")
    ap.add_argument("--rounds", type=int, default=BENCH_ROUNDS, help=f"the bench's rounds (default {BENCH_ROUNDS})")
    ap.add_argument("--sm-clocks", action="store_true",
                    help="read NVML's SM clock while timing (tsgen/bench/clocks.py; nvidia-ml-py): each impl's MHz and "
                    "each baseline's cycle ratio in the report")
    ap.add_argument("--bench-shapes", metavar="VARIANT:SEQ,...",
                    help="time these rows of the bench only (default: every variant at every S)")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the correctness checks (a timing experiment; the report says so)")
    ap.add_argument("--base-tree", metavar="DIR",
                    help="another commit's tsgen, templates and specs (python tools/ab_tree.py make REV: .ab/REV7); "
                    "--impl may then name 'base', the shipped params built by that tree, timed beside this checkout's")
    ap.add_argument("--child", nargs="+")
    a = ap.parse_args()
    if a.child:
        kind, built_json = a.child[0], json.loads(a.child[1])
        if kind == "check":
            result = check_variant(built_json, a.quick)
        elif kind == "one":
            result = one_shape(built_json, int(a.child[2]), baseline=a.child[3] if len(a.child) > 3 else None)
        elif kind == "kernels":
            result = kernel_times(built_json, int(a.child[2]), [b for b in a.child[3].split(",") if b],
                                  rounds=int(a.child[4]) if len(a.child) > 4 else KERNEL_ROUNDS)
        else:
            opts = json.loads(a.child[2]) if len(a.child) > 2 else {}
            result = bench(built_json, a.quick, **opts)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    impls = [i for i in a.impl.split(",") if i]
    if not impls or set(impls) - set(IMPLS) - (set(BASE_IMPLS) if a.base_tree else set()):
        ap.error(f"--impl: a comma-separated list of {', '.join(IMPLS)} (and {', '.join(BASE_IMPLS)}, with "
                 f"--base-tree), not {a.impl!r}")
    if a.base_tree:
        import ab_tree

        global BASE_TREE
        BASE_TREE = Path(a.base_tree).resolve()
        if problem := ab_tree.tree_problem(BASE_TREE):
            ap.error(f"--base-tree: {problem}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atexit.register(ga.pack_build, out)  # OUT/build into one archive at exit: a device call returns few files
    if a.kernel_times:
        name, _, seq = a.kernel_times.partition(":")
        baselines = [b for b in a.kt_baselines.split(",") if b]
        if name not in VARIANTS or not runs(name, impls[0]) or set(baselines) - set(BASELINES):
            ap.error(f"--kernel-times: a variant built by impl {impls[0]} ({', '.join(sorted(VARIANTS))}) and "
                     f"--kt-baselines of {', '.join(BASELINES)}")
        seq = int(seq) if seq else BENCH_SEQS[1]
        if a.kt_rounds < 1:
            ap.error("--kt-rounds: at least 1")
        result, log = child(["kernels", json.dumps(build(out, name, impls[0])), str(seq), ",".join(baselines),
                             str(a.kt_rounds)], BENCH_TIMEOUT_S)
        if not result.get("pass"):
            print(log[-4000:], f"--kernel-times: {result.get('why') or result.get('error')}", sep="\n", file=sys.stderr)
            return 1
        from tsgen.bench.results import commit

        meta = {"device": device_name(), "commit": commit(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join(["python", "tools/gpu_attention_bwd.py", "OUT", *sys.argv[2:]])}
        summary = summarize_kernels(result)
        report = kernels_markdown(impl_name(name, impls[0]), seq, summary, meta)
        stem = out / f"kernels_{impl_name(name, impls[0])}_s{seq}"
        stem.with_suffix(".md").write_text(report)
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "raw": result}) + "\n")
        print(report, flush=True)
        return 0
    if a.ncu_baseline and not a.ncu:
        ap.error("--ncu-baseline: with --ncu VARIANT[:SEQ] (the shape it profiles)")
    if a.ncu_source and not a.ncu:
        ap.error("--ncu-source: with --ncu VARIANT[:SEQ] (the shape it profiles)")
    if a.ncu:
        name, _, seq = a.ncu.partition(":")
        if name not in VARIANTS:
            ap.error(f"--ncu: variant {name!r}; one of {', '.join(sorted(VARIANTS))}")
        if not runs(name, impls[0]):
            ap.error(f"--ncu: impl {impls[0]} is built for variants with {only_for(impls[0])} only, not {name}")
        return (profile_source if a.ncu_source else profile)(out, name, impls[0], int(seq) if seq else BENCH_SEQS[1],
                                                             a.ncu_baseline)
    if a.rounds < 1 or a.settle < 0:
        ap.error("--rounds: at least 1; --settle: 0 or more")
    shapes = [x for x in (a.bench_shapes or "").split(",") if x]
    bad = [x for x in shapes if x.partition(":")[0] not in BENCH_VARIANTS or x.partition(":")[2] not in map(str, BENCH_SEQS)]
    if bad:
        ap.error(f"--bench-shapes: VARIANT:SEQ of {', '.join(BENCH_VARIANTS)} at {', '.join(map(str, BENCH_SEQS))}, "
                 f"not {', '.join(bad)}")
    bench_names = sorted({x.partition(":")[0] for x in shapes}) if shapes else BENCH_VARIANTS
    names = sorted((set() if a.no_check else set(CHECK_VARIANTS)) | (set() if a.no_bench else set(bench_names)))
    jobs = [(n, i) for i in impls for n in names if runs(n, i)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as ex:
        try:
            built = dict(zip(jobs, ex.map(lambda j: build(out, *j), jobs)))
        except (RuntimeError, FileNotFoundError) as e:  # impl base: the tree's tsgen failed (tools/ab_tree.py)
            print(f"gpu_attention_bwd: a build failed: {e}", file=sys.stderr)
            return 1
        forwards = dict(zip(CHAINED, ex.map(lambda n: build_forward(out, CHAINED[n]), CHAINED)))
    for (name, impl), b in built.items():
        if name in forwards:
            built[name, impl] = {**b, "forward": forwards[name]}
    print(f"built {len(built)} variants", flush=True)
    checks = {}
    for impl in impls:
        for name in (n for n in CHECK_VARIANTS if runs(n, impl) and not a.no_check):
            extra = ["--quick"] if a.quick else []
            # wgmma_det's children run the repeated cases too (three more references), wgmma's one (information)
            r, log = child(["check", json.dumps(built[name, impl]), *extra],
                           CHECK_TIMEOUT_S * (2 if IMPL_PARAMS.get(impl, {}).get("deterministic") else
                                              1.5 if impl in ("wgmma", "wgmma_m128", "wgmma_m128dkq") else 1))
            checks[impl_name(name, impl)] = r
            print(f"{impl_name(name, impl)}: {'pass' if r.get('pass') else 'FAIL'}", flush=True)
            if not r.get("pass"):
                print(log[-4000:], flush=True)
    summary = {"device": device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join(sys.argv), "checks": checks}
    if any(map(base_of, impls)):  # the commit whose tsgen built impls base, base_X
        summary["base"] = next((f"commit {b['commit']}" if b.get("commit") else f"the tree {BASE_TREE}"
                                for (n, i), b in built.items() if base_of(i)), None)
    if not a.no_bench:
        opts = {"order": a.order, "settle": a.settle, "rounds": a.rounds, "shapes": shapes or None,
                "sm_clocks": a.sm_clocks}
        extra = ["--quick"] if a.quick else []
        n_rows = len(shapes) if shapes else len(BENCH_VARIANTS) * len(BENCH_SEQS)
        summary["bench"], log = child(["bench", json.dumps({n: {i: built[n, i] for i in impls if runs(n, i)}
                                                           for n in bench_names}), json.dumps(opts),
                                       *extra], max(90.0, BENCH_TIMEOUT_S * len(impls) * n_rows / (len(BENCH_VARIANTS) * len(BENCH_SEQS))
                                                    * (a.rounds / 5) * (3 + a.settle) / 3))
        if "rows" not in summary["bench"]:
            print(log[-4000:], flush=True)
    (out / "attention_bwd.json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary)
    (out / "attention_bwd.md").write_text(text)
    print(text)
    ok = all(r.get("pass") for r in checks.values()) and all(
        not v.get("problems") for row in summary.get("bench", {}).get("rows", []) for v in row.values()
        if isinstance(v, dict))
    return 0 if ok else 1


def device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
