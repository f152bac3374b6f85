"""attention: a flash-attention forward on one Hopper GPU (sm_90a), FlashAttention-3 style.

    O = softmax(scale * Q K^T  [+ causal mask]) V,   LSE = log(sum_j exp(scale * q . k_j))

Layout [batch, seq, heads, head_dim] for Q, K, V and O (params.layout "bhsd":
[batch, heads, seq, head_dim]); LSE is fp32 [batch, heads, q_len], natural log, -inf for a
query that sees no key (its O row is 0), so partial results over KV chunks merge exactly.
Grouped-query attention: query head h reads KV head h // (heads // kv_heads).

Positions (the causal mask, sequence parallelism): query row r sits at global position
q_offset + r for r < q_split and q_offset2 + (r - q_split) after it (a rank's two
"zig-zag" chunks i and 2P-1-i); key row j at kv_offset + j; causal: a query sees the keys
at positions <= its own. With params.kv_waits the producer waits, before loading KV chunk c
(kv_chunk rows), until kv_signal[c] >= kv_expected (acquire, tsgen's timeout diagnostic).

Two host entry points (TMA descriptors are encoded on the host, so the runtime calls the
launcher, `host_launch`):
  <kernel>_launch(peers, rank, calls, count, q, k, v, o, lse, stream): tsgen's calling
      convention: count = sequence length (q_len = kv_len = count), params.batch sequences,
      positions from 0, no waits. The runtime, `tsgen test` and the harness use it.
  <kernel>_forward(q, k, v, o, lse, batch, q_len, kv_len, q_offset, q_split, q_offset2,
      kv_offset, kv_signal, kv_chunk, kv_expected, blocks, stream): everything at run time.

The kernel (templates/include/tsgen/attention.cuh): a producer warpgroup loads Q once per
128-row tile and K / V blocks into mbarrier rings with TMA (128B-swizzled); two consumer
warpgroups (64 query rows each) compute S = Q K^T with wgmma, the online softmax in fp32
registers (exp2, scale * log2 e folded in), and O += P V with P in registers; S of the next
block is issued with P V of the current one (intra-warpgroup overlap) and the two
warpgroups take turns at the tensor cores (ping-pong). Causal: only blocks that cross the
diagonal are masked, blocks past it are never loaded. O leaves through TMA stores.

The backward (dQ, dK, dV) has its reference here (attention_backward_reference, the algorithm
the kernel runs, with per-element tolerances through o_tolerance); its op is `attention_backward`
(tsgen/ops/attention_backward.py), designed in docs/design/attention.md.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import numpy as np
from pydantic import AfterValidator, BeforeValidator, Field

from ..spec_types import SpecBase, StrictModel, _as_list
from .base import Buffer, OpFamily, one_kernel_abi
from .collectives import from_f64, to_f64
from .conventions import Baseline, BenchCase, BenchConventions

# sm_90: at most 227 KiB of shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin)
SMEM_LIMIT = 232448
SMEM_ALIGN_SLACK = 1024  # the dynamic shared memory base is only 16-byte aligned
# fp32 scores + fp32 outputs + 16-bit P registers one consumer thread can hold (of 232; of 160 with
# three consumer warpgroups, tile.m 192)
MAX_ACCUMULATORS = 200
MAX_ACCUMULATORS_M192 = 128



# The kernel takes the scale, and the scale times log2(e), as float32 literals: both must stay
# normal float32 numbers, from FLT_MIN (2^-126) up (a huge scale would render as `inff`, a tiny
# one round to 0).
def _fits_float32(value: float) -> float:
    if not 2.0**-126 <= value <= 1e38:
        raise ValueError(f"{value!r} does not fit the float32 the kernel takes it as (from 2^-126 to 1e38)")
    return value


SoftmaxScale = Annotated[float, Field(gt=0), AfterValidator(_fits_float32)]

# params.row_max_chains of attention and cp_attention (the same kernel code, tsgen/attention.cuh)
RowMaxChains = Annotated[Literal[2, 4, 8] | None, Field(
    description="the softmax's row maximum of each block in this many independent chains per row and thread, then "
    "a pairwise tree (unset: one serial chain of tile.n / 4 dependent max instructions per row). The same maxima bit "
    "for bit; shortens the latency between a block's S and its first exp2. Divides tile.n / 4 (a thread's scores "
    "per row)")]


# params.rescale_at of attention and cp_attention (the same consumer loop, tsgen/attention.cuh)
RescaleAt = Annotated[int | None, Field(
    ge=0, le=12, description="how many of a block's tile.n / 16 column groups of exp2 each consumer computes before "
    "it waits for the previous block's P V and rescales O by the rows' new maxima; the rest of the exp2 follow, so "
    "that the rescale's multiplies (and P's conversion) interleave with them, as FlashAttention-4's Hopper forward "
    "does (ptxas places the wait itself: 2 and 6 give the same loop at hd 128). Unset: after every exp2 (the rescale "
    "and the conversion after the softmax). At most tile.n / 16. Measured +2-3 % at hd 128 not causal and hd 64 "
    "causal (H200, 2026-11-28, suites/attention-rescale.yaml)")]


# params.rescale_skip of attention and cp_attention (the same consumer loop, tsgen/attention.cuh)
RescaleSkip = Annotated[bool, Field(
    description="skip O's rescale after a block where no row maximum of the warp's 16 rows grew: every scale is then "
    "exactly 1 and the multiplies change no bit (x * 1 = x in IEEE arithmetic; one warp vote a block decides). "
    "Measured on an H200 (2026-11-29): +1-3 % at hd 128 causal GQA, whose rescale follows every exp2 (shipped "
    "there); 0.92-0.95x with rescale_at, whose interleave the vote's branch cuts (docs/design/attention.md)")]


# params.exp2_fma_every of attention and attention_backward (tsgen/attention.cuh exp2_of_group)
Exp2FmaEvery = Annotated[int | None, Field(
    ge=2, le=16, description="every this-many-th group of 4 exponentials of a consumer thread (8 keys of a block's "
    "scores in the forward, 8 queries of a step's P^T in the backward) takes its exp2 on the FMA pipe "
    "(tsgen::attention::exp2_fma: a cubic for 2^f and the exponent built from bits, relative error under 1.1e-4, "
    "38x under P's bf16 rounding, 4.8x under fp16's; a NaN score gives P = 0 there, not NaN) instead of MUFU, a "
    "quarter-rate pipe, so that the FMA pipe works beside it (FlashAttention-4 does so on Blackwell). Unset: all on "
    "MUFU. Measured on an H200 (2026-11-29): slower in the forward (hd 64 causal: 8 at 0.94x unset, 4 at "
    "0.88-0.89x) and the backward (2 at 0.89-0.97x, 4 level), where the issue slots an exponential adds cost more "
    "than MUFU's wait; no shipped spec sets it (docs/design/attention.md)")]


class AttentionTile(StrictModel):
    """CTA tile: tile.m query rows (64 per consumer warpgroup) against blocks of tile.n keys."""

    m: Literal[128] = Field(128, description="query rows per CTA tile: 2 consumer warpgroups x 64 rows")
    n: int = Field(128, ge=64, le=192, multiple_of=16,
                   description="keys per KV block (the N of S = Q K^T, the K of O += P V)")


class ForwardTile(AttentionTile):
    """The forward's CTA tile: also 192 query rows (three consumer warpgroups, launch.threads 512;
    head_dim 64 only), as FlashAttention-3 and -4 tile head dim 64 on Hopper (hopper/tile_size.h,
    flash_attn/cute/interface.py _tile_size_fwd_sm90: 192 x 128)."""

    m: Literal[128, 192] = Field(128, description="query rows per CTA tile, 64 per consumer warpgroup: 128 (two) "
                                 "or 192 (three; head_dim 64 only, launch.threads 512, 160 registers a consumer "
                                 "thread)")


class AttentionShape(StrictModel):
    """The problem's shape, shared by the forward (`attention`) and the backward
    (`attention_backward`, tsgen/ops/attention_backward.py)."""

    head_dim: Literal[64, 128] = Field(128, description="Q, K, V and O columns per head")
    heads: int = Field(32, ge=1, le=1024, description="query heads")
    kv_heads: int = Field(32, ge=1, le=1024, description="K and V heads; divides heads (grouped-query attention)")
    batch: int = Field(1, ge=1, le=1 << 20,
                       description="sequences per call of the runtime's entry (<kernel>_launch, whose count is "
                       "the sequence length); the run-time entry takes the batch at run time")
    causal: bool = Field(False, description="a query sees only keys at positions <= its own")
    softmax_scale: SoftmaxScale | None = Field(None, description="scale of Q K^T; default 1 / sqrt(head_dim)")
    layout: Literal["bshd", "bhsd"] = Field(
        "bshd", description="bshd: [batch, seq, heads, head_dim]; bhsd: [batch, heads, seq, head_dim]")


def heads_problems(p: AttentionShape) -> list[tuple[tuple, str]]:
    """The KV heads must divide the query heads (each KV head serves a group of query heads)."""
    if p.kv_heads > p.heads or p.heads % p.kv_heads:
        return [(("params", "kv_heads"), f"{p.kv_heads} KV heads do not divide {p.heads} query heads")]
    return []


class AttentionParams(AttentionShape):
    tile: ForwardTile = ForwardTile()
    stages: int = Field(2, ge=1, le=8, description="K and V blocks in flight (each its own ring)")
    pingpong: bool = Field(True, description="the two consumer warpgroups take turns issuing their GEMMs "
                           "(one's softmax overlaps the other's matrix products)")
    kv_waits: bool = Field(False, description="compile in the per-KV-chunk waits of sequence parallelism")
    kv_wait_scope: Literal["gpu", "sys"] = Field(
        "sys", description="scope of the waits' acquire loads: sys when peers raise the signals")
    kv_wait_diagnostic: bool = Field(
        False, description="a wait that times out prints who waited for what (tsgen/sync.cuh) before it traps; "
        "the printf is a function call, which makes ptxas serialize every wgmma: for debugging hangs only")
    schedule: Literal["grid", "persistent"] = Field(
        "grid", description="grid: one CTA per query tile, dispatched by the hardware (launch.blocks N: N CTAs "
        "walking tiles c, c + N, ...); persistent: one CTA per SM (by occupancy; launch.blocks N: at most N) taking "
        "tiles from a tile counter, longest first in L2-sized head groups when causal, head-major when not. The "
        "module holds one counter per stream for the first 64 streams a device sees, each resetting itself at the "
        "end of a call (back-to-back calls and CUDA graph replays need nothing); calls on streams past those 64, "
        "or on cudaStreamPerThread from two host threads, share one and must not overlap")
    epilogue_overlap: bool = Field(
        False, description="stage O in shared memory of its own (one more Q tile's bytes) and release Q after a "
        "tile's last S = Q K^T, so that with schedule: persistent the next tile's Q and first K blocks load during "
        "this tile's last P V and epilogue, and its O store drains during the next tile's first S")
    row_max_chains: RowMaxChains = None
    rescale_at: RescaleAt = None
    exp2_fma_every: Exp2FmaEvery = None
    rescale_skip: RescaleSkip = False


class AttentionLaunch(StrictModel):
    blocks: int = Field(0, ge=0, le=1 << 20,
                        description="0: one CTA per tile (a plain grid; params.schedule persistent: one per SM); "
                        "N: at most N CTAs, each walking tiles blockIdx.x, + N, ... (persistent; params.schedule "
                        "persistent: tiles from the counter)")
    threads: Literal[384, 512] = Field(384, description="one producer + two consumer warpgroups (384), or + three "
                                       "(512: tile.m 192)")


class OneGpuAttentionSpec(SpecBase):
    """What the forward's and the backward's specs share: one GPU, a 16-bit element type."""

    world_sizes: Annotated[
        list[Literal[1]], BeforeValidator(_as_list), Field(min_length=1, max_length=1)
    ] = Field(description="attention runs on one GPU: [1]")
    dtype: Literal["bfloat16", "float16"] = Field("bfloat16", description="Q, K, V and O element type")


class AttentionSpec(OneGpuAttentionSpec):
    """Spec of op `attention`: flash-attention forward, O and LSE."""

    op: Literal["attention"]
    params: AttentionParams = AttentionParams()
    launch: AttentionLaunch = AttentionLaunch()


def scale_of(spec: AttentionSpec) -> float:
    p = spec.params
    return p.softmax_scale if p.softmax_scale is not None else 1.0 / math.sqrt(p.head_dim)


def scale_vars(spec: AttentionSpec) -> dict[str, str]:
    """The softmax scale and its multiple by log2(e) as the template writes them (float literals)."""
    scale = scale_of(spec)
    return {"softmax_scale": repr(float(scale)), "scale_log2": repr(float(scale * math.log2(math.e)))}


def shape_constants(p: AttentionShape) -> dict[str, int]:
    """The shape constants every attention kernel's source defines (forward, backward, cp_attention)."""
    return {"HEAD_DIM": p.head_dim, "HEADS": p.heads, "KV_HEADS": p.kv_heads, "BATCH": p.batch}


def shape_key(p) -> str:
    """What makes two attention benchmarks (attention, cp_attention) time the same work at one
    size: batch, heads, KV heads, head dim, layout, causality."""
    return f"/b{p.batch}/h{p.heads}/kv{p.kv_heads}/d{p.head_dim}/{p.layout}{'/causal' if p.causal else ''}"


def smem_bytes(spec: AttentionSpec) -> int:
    """Q tile + K and V stages (+ the O staging of epilogue_overlap, a Q tile's size) + barriers +
    the dynamic schedule's tile slot + alignment slack (tsgen::attention::Layout asserts it).
    Also cp_attention's (the same params where it has them)."""
    p = spec.params
    q = p.tile.m * p.head_dim * 2
    kv = p.tile.n * p.head_dim * 2
    o = q if getattr(p, "epilogue_overlap", False) else 0
    barriers = 8 * (2 + 4 * p.stages)
    return q + 2 * p.stages * kv + o + barriers + 8 + SMEM_ALIGN_SLACK


def accumulators(spec: AttentionSpec) -> int:
    """Registers a consumer thread holds across the main loop: S (fp32), O (fp32), P (16-bit pairs)."""
    p = spec.params
    return p.tile.n // 2 + p.head_dim // 2 + p.tile.n // 4


class AttentionBench(BenchConventions):
    """Size = S, the sequence length of Q and of K / V (q_len = kv_len = S; the spec's batch, heads
    and layout). FLOPs per call from `flops` (halved for causal); the device-memory floor reads
    Q, K and V once and writes O and LSE once. Baselines in this process, on the same GPU and
    stream, timed in the same interleaved rounds as tsgen (`interleave`: one sample of each per
    round, ratios paired round by round): PyTorch SDPA with its flash and with its cuDNN backend,
    cuDNN's SDPA graph through cudnn-frontend, and FlashAttention-4's CuTe DSL forward (flash-attn-4;
    a note where it is not installed: tools/fa4_wheels.sh) (tsgen/bench/attention_baselines.py). Timed eagerly (a call is milliseconds: a launch's microseconds do not count), checked
    on sampled query rows of sequence 0 against float32 attention over the whole sequence. The
    single-GPU rate of a shape is also cp_attention's "ideal" (suites cp-w*: an attention entry
    of the same heads beside the cp entries)."""

    kind = "gemm"
    size_unit = "rows"
    default_sizes = "4096,8192,16384"
    metric = "TFLOPs"
    baselines = (Baseline("sdpa", "sdpa", in_process=True),
                 Baseline("cudnn_frontend", "cudnn_frontend", in_process=True),
                 Baseline("flash_attn_4", "flash_attn_4", in_process=True))
    graphs = False
    interleave = True
    counts_calls = False  # one kernel, no call counter (peers, rank and calls are unused: see the template)
    check = "rows"

    def case(self, family, spec, world, size):
        p = spec.params
        elem = 2  # bf16 / fp16
        qo = p.batch * size * p.heads * p.head_dim * elem
        kv = p.batch * size * p.kv_heads * p.head_dim * elem
        return BenchCase(size, size, flops=flops(p.batch, size, size, p.heads, p.head_dim, p.causal),
                         hbm_bytes=float(2 * qo + 2 * kv + 4 * p.batch * p.heads * size))

    def group_shape(self, spec):
        return shape_key(spec.params)

    def check_rows(self, family, spec, world, count, fetch):
        """O at query rows of sequence 0 spread over the whole sequence (`check_query_rows`)
        against float32 attention over all its keys: the worst row's relative error
        (`worst_row_error`)."""
        p = spec.params

        def tensor(name, heads):
            x = to_f64(fetch(name, 0, 0, p.batch * count * heads * p.head_dim), spec.dtype).astype(np.float32)
            return to_bshd(x, p.batch, count, heads, p.head_dim, p.layout)[:1]

        rows = check_query_rows(count)
        k, v = tensor("k", p.kv_heads), tensor("v", p.kv_heads)
        ref, _ = attention_reference(tensor("q", p.heads)[:, rows], k, v, scale_of(spec), p.causal, q_pos=rows)
        return worst_row_error(tensor("o", p.heads)[:, rows], ref)


class AttentionFamily(OpFamily):
    kind = "attention"
    Spec = AttentionSpec
    template = "attention.cu.j2"
    category = "compute"
    gpu_sweep = "one_gpu"  # and tools/gpu_attention.py: the full case list
    variant_worlds = ()
    min_world = 1
    count_unit = "rows"  # sequence positions (q_len = kv_len) through <kernel>_launch
    bench = AttentionBench()
    host_launch = True  # TMA descriptors are encoded on the host
    # tsgen.torch: a one-GPU op, the forward and the backward paired as one differentiable op
    # (tsgen/torch/attention_op.py); tsgen.torch.load points here
    torch_loader = "tsgen.torch.attention(forward_spec, backward_spec)"
    summary = (
        "flash-attention forward on one Hopper GPU: TMA + mbarrier pipeline, producer and two consumer "
        "warpgroups, wgmma for Q K^T and P V, online softmax, causal tile skipping, GQA, O and LSE"
    )

    def check(self, spec):
        p = spec.params
        problems = heads_problems(p)
        acc = accumulators(spec)
        m = p.tile.m
        threads = getattr(spec.launch, "threads", 384)
        if threads != 128 * (1 + m // 64):
            problems.append((("launch", "threads"), f"tile.m {m} ({m // 64} consumer warpgroups) needs launch.threads "
                             f"{128 * (1 + m // 64)}, not {threads}"))
        if m == 192 and p.head_dim != 64:
            problems.append((("params", "tile", "m"), f"tile.m 192 (three consumer warpgroups of 160 registers) is "
                             f"for head_dim 64: head_dim {p.head_dim} holds {acc} accumulator registers per thread"))
        elif m == 192 and p.kv_waits:
            problems.append((("params", "kv_waits"), "tile.m 192 has no KV waits (compiled in, they spill the "
                             "32-register producer or, at 40 / 152, the consumers): use tile.m 128"))
        elif m == 192 and acc > MAX_ACCUMULATORS_M192:
            problems.append((("params", "tile", "n"),
                             f"tile.m 192 with blocks of {p.tile.n} keys needs {acc} accumulator registers per "
                             f"consumer thread; at most {MAX_ACCUMULATORS_M192} fit in 160: use tile.n 128"))
        if acc > MAX_ACCUMULATORS:
            problems.append((("params", "tile", "n"),
                             f"head_dim {p.head_dim} with blocks of {p.tile.n} keys needs {acc} accumulator "
                             f"registers per consumer thread (S {p.tile.n // 2}, O {p.head_dim // 2}, "
                             f"P {p.tile.n // 4}); at most {MAX_ACCUMULATORS} fit: use a smaller tile.n"))
        need = smem_bytes(spec)
        if need > SMEM_LIMIT:
            overlap = getattr(p, "epilogue_overlap", False)  # cp_attention's check calls this one too
            staging = " and its O staging (epilogue_overlap)" if overlap else ""
            problems.append((("params", "stages"),
                             f"{p.stages} stages of K and V blocks of {p.tile.n} x {p.head_dim} (+ the "
                             f"{p.tile.m}-row Q tile{staging}) need {need} bytes of shared memory; sm_90 has "
                             f"{SMEM_LIMIT} per block: use fewer stages or a smaller tile.n"))
        chains = getattr(p, "row_max_chains", None)
        if chains and (p.tile.n // 4) % chains:
            problems.append((("params", "row_max_chains"),
                             f"row_max_chains {chains} does not divide the {p.tile.n // 4} scores per row a consumer "
                             f"thread holds with blocks of {p.tile.n} keys (tile.n / 4): use a divisor of it"))
        at = getattr(p, "rescale_at", None)
        if at is not None and at > p.tile.n // 16:
            problems.append((("params", "rescale_at"),
                             f"rescale_at {at}: a block of {p.tile.n} keys has {p.tile.n // 16} column groups of "
                             f"exp2 (tile.n / 16); use 0 to {p.tile.n // 16}"))
        every = getattr(p, "exp2_fma_every", None)
        if every and every > p.tile.n // 8:
            problems.append((("params", "exp2_fma_every"),
                             f"exp2_fma_every {every}: a consumer thread holds {p.tile.n // 8} groups of 4 "
                             f"exponentials of a block of {p.tile.n} keys (tile.n / 8), so none would move; use 2 to "
                             f"{p.tile.n // 8}"))
        # cp_attention's CTAs always walk tiles (no params.schedule): the overlap needs nothing more there
        if getattr(p, "epilogue_overlap", False) and getattr(p, "schedule", "persistent") != "persistent":
            problems.append((("params", "epilogue_overlap"),
                             "epilogue_overlap overlaps a tile's epilogue with the next tile of the same CTA: it "
                             "needs schedule: persistent (a grid of one CTA per tile has no next tile)"))
        return problems

    def buffers(self, spec):
        p = spec.params
        return (
            Buffer("q", spec.dtype, "input", per_count=p.batch * p.heads * p.head_dim),
            Buffer("k", spec.dtype, "input", per_count=p.batch * p.kv_heads * p.head_dim),
            Buffer("v", spec.dtype, "input", per_count=p.batch * p.kv_heads * p.head_dim),
            Buffer("o", spec.dtype, "output", per_count=p.batch * p.heads * p.head_dim),
            Buffer("lse", "float32", "output", per_count=p.batch * p.heads),
        )

    def constants(self, spec):
        p = spec.params
        return {
            **shape_constants(p),
            "TILE_M": p.tile.m,
            "TILE_N": p.tile.n,
            "STAGES": p.stages,
            "CAUSAL": int(p.causal),
            "PINGPONG": int(p.pingpong),
            "KV_WAITS": int(p.kv_waits),
            "BHSD": int(p.layout == "bhsd"),
            "THREADS": spec.launch.threads,
            "BLOCKS": spec.launch.blocks,
            "SMEM_BYTES": smem_bytes(spec),
            # only where set: the shipped specs' sources and manifests stay as they were
            **({"PERSISTENT": 1} if p.schedule == "persistent" else {}),
            **({"EPILOGUE_OVERLAP": 1} if p.epilogue_overlap else {}),
            **({"ROW_MAX_CHAINS": p.row_max_chains} if p.row_max_chains else {}),
            **({"RESCALE_AT": p.rescale_at} if p.rescale_at is not None else {}),
            **({"EXP2_FMA_EVERY": p.exp2_fma_every} if p.exp2_fma_every else {}),
            **({"RESCALE_SKIP": 1} if p.rescale_skip else {}),
        }

    def template_vars(self, spec):
        return scale_vars(spec)

    def abi(self, spec):
        return one_kernel_abi(self, spec, smem=smem_bytes(spec), constants=self.constants(spec))

    # -- reference ----------------------------------------------------------
    def make_inputs(self, spec, world, count, rng, pattern):
        """Normal random Q, K and V (a pattern would make every score alike; random data it is)."""
        out = {}
        for b in self.buffers(spec):
            if b.role == "input":
                out[b.name] = [from_f64(rng.standard_normal(b.elems(count)), spec.dtype)]
        return out

    def _shaped(self, spec, count, inputs):
        p = spec.params
        q = to_f64(inputs["q"][0], spec.dtype)
        k = to_f64(inputs["k"][0], spec.dtype)
        v = to_f64(inputs["v"][0], spec.dtype)
        return (to_bshd(q, p.batch, count, p.heads, p.head_dim, p.layout),
                to_bshd(k, p.batch, count, p.kv_heads, p.head_dim, p.layout),
                to_bshd(v, p.batch, count, p.kv_heads, p.head_dim, p.layout))

    def _outputs(self, spec, count, inputs):
        """O, LSE and sum_j p_ij |v_j| (float64), once per call's inputs (reference and tolerance)."""
        return self.once_per_inputs(inputs, (spec, count), lambda: attention_reference(
            *self._shaped(spec, count, inputs), scale_of(spec), spec.params.causal, with_abs=True))

    def reference(self, spec, world, count, inputs):
        p = spec.params
        o, lse, _ = self._outputs(spec, count, inputs)
        return {"o": [from_f64(from_bshd(o, p.layout).reshape(-1), spec.dtype)],
                "lse": [lse.reshape(-1).astype(np.float32)]}

    def tolerance(self, spec, world, count, inputs):
        """O: o_tolerance (per element); LSE: 1e-3 relative (absolute below 1)."""
        p = spec.params
        o, lse, o_abs = self._outputs(spec, count, inputs)
        tol = o_tolerance(from_bshd(o, p.layout).reshape(-1), from_bshd(o_abs, p.layout).reshape(-1), spec.dtype)
        return {"o": [tol], "lse": [1e-3 * np.maximum(1.0, np.abs(lse.reshape(-1)))]}


# ---------------------------------------------------------------------------
# NumPy reference (float64), shared with the tests and the GPU script
# ---------------------------------------------------------------------------


def to_bshd(x: np.ndarray, batch: int, seq: int, heads: int, dim: int, layout: str) -> np.ndarray:
    """Flat values in `layout` -> [batch, seq, heads, dim]."""
    if layout == "bshd":
        return x.reshape(batch, seq, heads, dim)
    return x.reshape(batch, heads, seq, dim).transpose(0, 2, 1, 3)


def from_bshd(x: np.ndarray, layout: str) -> np.ndarray:
    return x if layout == "bshd" else x.transpose(0, 2, 1, 3)


def query_positions(q_len: int, q_offset: int = 0, q_split: int | None = None, q_offset2: int = 0) -> np.ndarray:
    """Global position of each query row: q_offset + r before q_split, q_offset2 + (r - q_split) after."""
    r = np.arange(q_len, dtype=np.int64)
    split = q_len if q_split is None else min(max(q_split, 0), q_len)
    return np.where(r < split, q_offset + r, q_offset2 + (r - split))


def zigzag(world: int, rank: int, chunk: int) -> dict:
    """The query positions of `rank` in the zig-zag layout: chunks rank and 2 world - 1 - rank."""
    return {"q_offset": rank * chunk, "q_split": chunk, "q_offset2": (2 * world - 1 - rank) * chunk}


def attention_reference(q, k, v, scale: float, causal: bool, q_pos=None, k_pos=None, with_abs: bool = False):
    """q [b, sq, h, d], k and v [b, skv, hkv, d] (float64) -> O [b, sq, h, d], LSE [b, h, sq].
    q_pos / k_pos: global positions of the rows (default 0, 1, ...). A query with no visible
    key gets O = 0 and LSE = -inf. with_abs: also sum_j p_ij |v_j| [b, sq, h, d] (o_tolerance)."""
    b, sq, h, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    qp = np.arange(sq) if q_pos is None else np.asarray(q_pos)
    kp = np.arange(skv) if k_pos is None else np.asarray(k_pos)
    visible = _visible(qp, kp, causal)
    o = np.zeros((b, sq, h, d))
    o_abs = np.zeros((b, sq, h, d)) if with_abs else None
    lse = np.full((b, h, sq), -np.inf)
    for bi in range(b):
        for hi in range(h):
            s = scale * (q[bi, :, hi, :] @ k[bi, :, hi // group, :].T)
            s = np.where(visible, s, -np.inf)
            m = s.max(axis=1, initial=-np.inf)
            some = np.isfinite(m)
            e = np.exp(s - np.where(some, m, 0)[:, None])
            total = e.sum(axis=1)
            o[bi, :, hi, :] = np.where(some[:, None], (e @ v[bi, :, hi // group, :]) / np.where(some, total, 1)[:, None],
                                       0.0)
            lse[bi, hi, :] = np.where(some, m + np.log(np.where(some, total, 1)), -np.inf)
            if with_abs:
                o_abs[bi, :, hi, :] = np.where(some[:, None], (e @ np.abs(v[bi, :, hi // group, :]))
                                               / np.where(some, total, 1)[:, None], 0.0)
    return (o, lse, o_abs) if with_abs else (o, lse)


def _visible(qp: np.ndarray, kp: np.ndarray, causal: bool) -> np.ndarray:
    """[len(qp), len(kp)]: which keys each query sees (causal: positions <= its own)."""
    return (kp[None, :] <= qp[:, None]) if causal else np.ones((len(qp), len(kp)), dtype=bool)


def _probs_and_ds(q, k, v, do, lse, dsum, visible, scale):
    """One block of the backward, as the kernel computes it: P = exp(scale q k^T - LSE) from the
    forward's LSE (not normalised again), 0 where masked or where the query saw no key
    (LSE = -inf); dS = P * (dO v^T - D)."""
    seen = np.isfinite(lse)
    s = np.where(visible & seen[:, None], scale * (q @ k.T), -np.inf)
    p = np.exp(s - np.where(seen, lse, 0)[:, None])
    return p, p * (do @ v.T - dsum[:, None])


def _cancelled_terms(p, do, v, dsum_abs):
    """C = P * (|dO| |v|^T + sum |dO| |o|): the |.| sums of the terms of dP = dO v^T and of D, which
    dS = P (dP - D) subtracts (grad_tolerance's rounding floor)."""
    return p * (np.abs(do) @ np.abs(v).T + dsum_abs[:, None])


def attention_backward_reference(q, k, v, o, do, lse, scale: float, causal: bool, q_pos=None, k_pos=None, *,
                                 layout: str = "bshd", q_rows=None, kv_rows=None, dtype=np.float64,
                                 chunk: int = 1024, with_abs: bool = False):
    """The gradients of attention_reference's O: dQ, dK, dV from Q, K, V, O, dO and the forward's
    LSE [b, h, sq], by the algorithm of FlashAttention-2/3's backward (the kernel's): D =
    rowsum(dO * O) from the O given, P from the LSE, dV = P^T dO, dS = P * (dO V^T - D), dQ =
    scale dS K, dK = scale dS^T Q. GQA: dK and dV of a KV head summed over its query heads.
    A query that saw no key (LSE = -inf) contributes nothing and gets dQ = 0.

    q, o, do [b, sq, h, d] and k, v [b, skv, hkv, d] in `layout` ("bshd"; "bhsd": heads before
    sequence); the gradients come back in it. q_pos / k_pos: positions as attention_reference's.
    dtype: float64, or float32 for long sequences. Rows: q_rows (indices into sq) gives dQ of
    those rows only, kv_rows dK and dV of those keys only, each from every key (query) in blocks
    of `chunk`: a check of sampled rows costs O(rows x length) and never holds an sq x skv matrix.
    Returns dQ [b, rows, h, d], dK, dV [b, rows, hkv, d]; with_abs: also |.| sums of the terms of
    each (sum_j |dS_ij| |k_j| scale, sum_i |dS_ij| |q_i| scale, sum_i P_ij |dO_i|), then the sums
    of the terms dS cancels (C_ij = P_ij (sum |dO_i| |v_j| + sum |dO_i| |o_i|): dP_ij's and D_i's
    terms) for dQ and dK (scale sum_j C_ij |k_j|, scale sum_i C_ij |q_i|), for grad_tolerance, in
    the same order and layout: eight arrays."""
    # to bshd (the transposition is its own inverse)
    q, k, v, o, do = (from_bshd(x, layout).astype(dtype, copy=False) for x in (q, k, v, o, do))
    lse = np.asarray(lse, dtype=dtype)
    b, sq, h, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    qp = np.arange(sq) if q_pos is None else np.asarray(q_pos)
    kp = np.arange(skv) if k_pos is None else np.asarray(k_pos)
    qi = np.arange(sq) if q_rows is None else np.asarray(q_rows)
    kj = np.arange(skv) if kv_rows is None else np.asarray(kv_rows)
    dsum = np.einsum("bshd,bshd->bhs", do, o)  # D: the kernel's preprocessing pass
    dq = np.zeros((b, len(qi), h, d), dtype)
    dk = np.zeros((b, len(kj), hkv, d), dtype)
    dv = np.zeros((b, len(kj), hkv, d), dtype)
    absum = [np.zeros_like(x) for x in (dq, dk, dv, dq, dk)] if with_abs else None
    # D's terms, sum_e |dO_ie| |o_ie| (with_abs: the cancellation sums)
    dsum_abs = np.einsum("bshd,bshd->bhs", np.abs(do), np.abs(o)) if with_abs else None
    for bi in range(b):
        for hi in range(h):
            g = hi // group
            qh, kh, vh, doh = q[bi, :, hi], k[bi, :, g], v[bi, :, g], do[bi, :, hi]
            for c in range(0, skv, chunk):  # dQ of rows qi: every key, a block at a time
                keys = slice(c, c + chunk)
                p, ds = _probs_and_ds(qh[qi], kh[keys], vh[keys], doh[qi], lse[bi, hi, qi], dsum[bi, hi, qi],
                                      _visible(qp[qi], kp[keys], causal), scale)
                dq[bi, :, hi] += scale * (ds @ kh[keys])
                if with_abs:
                    absum[0][bi, :, hi] += scale * (np.abs(ds) @ np.abs(kh[keys]))
                    cancel = _cancelled_terms(p, doh[qi], vh[keys], dsum_abs[bi, hi, qi])
                    absum[3][bi, :, hi] += scale * (cancel @ np.abs(kh[keys]))
            for c in range(0, sq, chunk):  # dK, dV of keys kj: every query, a block at a time
                rows = slice(c, c + chunk)
                p, ds = _probs_and_ds(qh[rows], kh[kj], vh[kj], doh[rows], lse[bi, hi, rows], dsum[bi, hi, rows],
                                      _visible(qp[rows], kp[kj], causal), scale)
                dk[bi, :, g] += scale * (ds.T @ qh[rows])
                dv[bi, :, g] += p.T @ doh[rows]
                if with_abs:
                    absum[1][bi, :, g] += scale * (np.abs(ds).T @ np.abs(qh[rows]))
                    absum[2][bi, :, g] += p.T @ np.abs(doh[rows])
                    cancel = _cancelled_terms(p, doh[rows], vh[kj], dsum_abs[bi, hi, rows])
                    absum[4][bi, :, g] += scale * (cancel.T @ np.abs(qh[rows]))
    grads = tuple(from_bshd(x, layout) for x in (dq, dk, dv))
    return (grads + tuple(from_bshd(x, layout) for x in absum)) if with_abs else grads


def o_tolerance(o: np.ndarray, o_abs: np.ndarray, dtype: str) -> np.ndarray:
    """How far the kernel's 16-bit O may be from the float64 reference, element by element: one
    unit of the output's rounding (2^-7 / 2^-10 relative at most, bf16 / fp16) plus the rounding
    of P to 16 bits before P V, each term at most half a unit: 2^-8 (2^-11) of sum_j p_ij |v_j|,
    given four times that here. Bounded per element, not by max|v| over the tensor: a zero or a
    stale V chunk then shows (at world 8 the old bound, 2 units of max|v|, let an all-zero O pass
    in most elements). grad_tolerance holds the backward's gradients to the same bound over the
    |.| sums of their own products (attention_backward_reference's with_abs: P dO with P rounded
    to 16 bits, dS Q and dS K with dS rounded), each gradient rounded once to 16 bits, plus a
    floor for dS's cancellation."""
    ulp = 2.0**-7 if dtype == "bfloat16" else 2.0**-10
    return ulp * abs(o) + 2 * ulp * o_abs + 1e-6  # abs(): NumPy arrays or torch tensors


def grad_tolerance(g, g_abs, g_cancel, dtype: str, head_dim: int):
    """The backward's per-element bound on a gradient (NumPy arrays or torch tensors):
    o_tolerance over the |.| sums of its product (g_abs), plus a floor for the cancellation in
    dS = P (dP - D): dP and D are float32 dot products of head_dim terms, each within head_dim
    2^-24 of the |.| sum of its terms whatever the summation order, and where dP ~ D (a causal
    row that sees one key: dS = 0 exactly) that rounding is all of dS. Once for the kernel and
    once for a float32 reference: head_dim 2^-23 of g_cancel (attention_backward_reference's
    cancellation sums, with_abs; None for dV, which subtracts nothing). docs/design/attention.md,
    "Tolerances" (issue 35)."""
    tol = o_tolerance(g, g_abs, dtype)
    return tol if g_cancel is None else tol + head_dim * 2.0**-23 * g_cancel


CHECK_ROWS = 64  # query rows the timed-output check compares, spread over the sequence


def check_query_rows(count: int) -> np.ndarray:
    """The query rows the timed-output check compares (issue 33): CHECK_ROWS spread evenly over
    [0, count), the first and the last included, and the last two rows (the sequence's tail,
    where a kernel that drops the last keys or tiles is wrong first)."""
    picks = np.rint(np.linspace(0, count - 1, CHECK_ROWS)).astype(np.int64)
    return np.unique(np.concatenate([picks, [max(count - 2, 0), count - 1]]))


def worst_row_error(got: np.ndarray, ref: np.ndarray) -> float:
    """got, ref [batch, rows, heads, d]: the largest ||got - ref|| / ||ref|| over (batch, row),
    each row against its own norm (a pooled norm lets rows of large O, a query seeing few keys,
    hide errors in rows of small O, which see many); inf where got holds a NaN or inf."""
    if not np.isfinite(got).all():
        return float("inf")
    axes = tuple(range(2, got.ndim))
    err = np.sqrt(((got.astype(np.float64) - ref) ** 2).sum(axis=axes))
    norm = np.sqrt((np.asarray(ref, np.float64) ** 2).sum(axis=axes))
    return float((err / np.maximum(norm, 1e-30)).max())


def flops(batch: int, q_len: int, kv_len: int, heads: int, head_dim: int, causal: bool) -> float:
    """4 * b * h * sq * skv * d (two matrix products), halved for causal (the issue's convention)."""
    f = 4.0 * batch * heads * q_len * kv_len * head_dim
    return f / 2 if causal else f


FAMILIES: list[OpFamily] = [AttentionFamily()]
