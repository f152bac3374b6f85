"""attention_backward: the gradients dQ, dK, dV of the `attention` op's forward on one GPU.

    D = rowsum(dO * O),  P = exp(scale Q K^T - LSE)  (the forward's LSE: no second softmax),
    dV = P^T dO,  dS = P * (dO V^T - D),  dQ = scale dS K,  dK = scale dS^T Q

Inputs Q, K, V, O, dO (`dout`) and LSE as the forward wrote them (its layouts: params.layout;
LSE fp32 [batch, heads, q_len], natural log, -inf where a query saw no key); outputs dQ, dK,
dV, 16-bit, in the layout of Q, K and V. GQA: dK and dV of a KV head are summed over the
query heads of its group. Positions and the causal mask are the forward's.

A family of its own, not a mode of `attention`: every buffer differs (six inputs, three
outputs, an fp32 workspace), and so do the launch, the kernels and the tile parameters; what
the two share (the shape parameters, the GQA check, the scale, the reference and the
tolerance) they import from tsgen/ops/attention.py, one home each.

Three kernels per call (templates/include/tsgen/attention_bwd.cuh): a preprocess (D, LSE in
base 2, dQ's fp32 accumulator zeroed), the main kernel (a CTA per block of 64 keys walks the
query blocks of its group's heads; dK, dV in registers, dQ added into the fp32 accumulator
with atomics), and a conversion of dQ to 16 bits. This first version uses mma.sync, not the
FA3-style wgmma pipeline docs/design/attention.md plans: correctness before speed. The second main
kernel (params.impl: wgmma, tsgen/attention_bwd_wgmma.cuh) is that pipeline; by default it adds dQ
with one bulk reduction per consumer warpgroup and step into a tiled dq_accum (params.dq_reduce,
the same workspace size).

Host entry points (host_launch):
  <kernel>_launch(peers, rank, calls, count, q, k, v, o, dout, lse, dq, dk, dv, dq_accum,
      dsum, lse2, stream): tsgen's calling convention, count = the sequence length (q_len =
      kv_len), params.batch sequences, positions from 0.
  <kernel>_backward(q, k, v, o, dout, lse, dq, dk, dv, dq_accum, dsum, lse2, batch, q_len,
      kv_len, q_offset, q_split, q_offset2, kv_offset, stream): everything at run time; the
      workspace: dq_accum batch * q_len * heads * head_dim floats (params.deterministic: then
      batch * heads * ceil(q_len / 64) uint32 semaphores), dsum and lse2 batch * heads * q_len
      floats each (workspace_floats).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ..spec_types import StrictModel
from .attention import (AttentionShape, Exp2FmaEvery, OneGpuAttentionSpec, attention_backward_reference,
                        attention_reference, from_bshd, grad_tolerance, heads_problems, scale_of, scale_vars,
                        shape_constants, to_bshd)
from .base import Buffer, OpFamily, one_kernel_abi
from .collectives import from_f64, to_f64

BLOCK_M = 64  # query rows per step (tsgen::attention_bwd::BLOCK_M; the wgmma kernel's too)
BLOCK_N = 64  # keys per CTA (BLOCK_N)
GRADS = ("dq", "dk", "dv")

# The main kernel's implementations (params.impl): threads per CTA and keys per CTA.
IMPLS = {"mma_sync": {"threads": 128, "block_n": 64},  # tsgen/attention_bwd.cuh
         "wgmma": {"threads": 384, "block_n": 128}}    # tsgen/attention_bwd_wgmma.cuh
WGMMA_STAGES = 2  # Q / dO stages of the wgmma kernel's ring (tsgen::attention_bwd::wgmma)
DQ_STAGING = 2 * BLOCK_M * 64 * 4  # the wgmma kernel's fp32 dQ staging (dq_reduce bulk): 64 x 64 per warpgroup
DEFAULT_HEAD_GROUP = 4  # params.head_group unset, impl wgmma: 0.99-1.29x no groups at hd 128 (H200, 2026-11-27)
TAIL_ITEMS = 64  # params.tail_split: the workspace's tail slots (tsgen::attention_bwd::wgmma::TAIL_ITEMS)
TAIL_SLOT_FLOATS_PER_COLUMN = 2 * IMPLS["wgmma"]["block_n"]  # a slot's key rows x (dK, dV); times head_dim: TAIL_SLOT_FLOATS<C> in C++


def dq_semaphores(batch: int, q_len: int, heads: int) -> int:
    """params.deterministic: the dQ semaphores (uint32, one per sequence, head and block of BLOCK_M query
    rows) that follow dq_accum's floats in its workspace (tsgen::attention_bwd::dq_semaphores)."""
    return batch * heads * -(-q_len // BLOCK_M)


def workspace_floats(batch: int, q_len: int, heads: int, head_dim: int,
                     deterministic: bool = False, tail_items: int = 0) -> tuple[int, int, int]:
    """The fp32 workspace of one `<kernel>_backward` call, in 4-byte words: (dq_accum, dsum, lse2);
    deterministic: dq_accum grows by the dQ semaphores (dq_semaphores); tail_items (the manifest's
    TAIL_SPLIT, params.tail_split): by that many tail slots (tail_floats)."""
    rows = batch * q_len * heads
    extra = (dq_semaphores(batch, q_len, heads) if deterministic else 0) + tail_floats(tail_items, head_dim)
    return rows * head_dim + extra, rows, rows


def tail_plan(items: int, sms: int, steps: int) -> tuple[int, int]:
    """params.tail_split's split of a call (tsgen::attention_bwd::wgmma::tail_plan, which the tests compare with
    this): (the first split item, pieces per split item); (items, 1) where none is split. items: the main
    kernel's (KV blocks x KV heads x batch), sms: the GPU's, steps: one item's walk (query heads of a group x
    ceil(q_len / 64))."""
    tail = items % sms if sms > 0 else 0
    parts = min(sms // tail, steps) if tail else 0
    if items <= sms or tail == 0 or tail > TAIL_ITEMS or parts < 2:
        return items, 1
    return items - tail, parts


def tail_floats(tail_items: int, head_dim: int) -> int:
    """params.tail_split: the tail slots after dq_accum's floats (tsgen::attention_bwd::wgmma::tail_accum)."""
    return tail_items * TAIL_SLOT_FLOATS_PER_COLUMN * head_dim

class AttentionBackwardParams(AttentionShape):
    impl: Literal["mma_sync", "wgmma"] = Field(
        "mma_sync", description="the main kernel: mma_sync (4 warps per block of 64 keys, plain loads; proven on "
        "GPUs) or wgmma (sm_90a, FlashAttention-3 style: a TMA producer warp, two consumer warpgroups per block "
        "of 128 keys, every product a wgmma; the shipped specs' choice since 2026-11-27, after every check of "
        "tools/gpu_attention_bwd.sh passed on an H200)")
    dq_reduce: Literal["bulk", "atomic"] | None = Field(
        None, description="how the wgmma main kernel adds each step's dQ into the fp32 accumulator: bulk (the "
        "default with impl wgmma: the warpgroup's 64 x 64 partial through shared memory, one "
        "cp.reduce.async.bulk add.f32 per warpgroup and step into a tiled accumulator) or atomic (one "
        "red.global.add.f32 per element from registers, the first wgmma version; kept to bench against). "
        "mma_sync: atomic only")

    deterministic: bool = Field(
        False, description="dQ bit-identical from run to run (impl wgmma, dq_reduce bulk only): the bulk reductions "
        "into each query block's dQ accumulator wait their turn in a fixed order (the KV blocks' order) on a "
        "semaphore per (sequence, head, query block) after dq_accum in its workspace (which grows by one word "
        "per 64 query rows per head and sequence). Measured on an H200 (2026-11-27, at 3ee75d0): 0.78-0.87 of the "
        "default's speed at hd 128")

    head_group: int | None = Field(
        None, ge=0, description="impl wgmma: the main kernel's CTAs in groups of this many (sequence, KV head) pairs, "
        "one group after the other, KV block major inside a group (tsgen::attention_bwd::kv_cta); 0: no groups (KV "
        "block major over every pair: block 0 of every head first); unset: 4 for impl wgmma without deterministic, "
        "else no groups. Fewer pairs at once share their Q, dO and dQ accumulator through L2 among more CTAs. "
        "Measured on an H200 (2026-11-27, 917bff7, hd 128): groups of 4 at 0.99-1.29x the speed of no groups. "
        "Not with deterministic (its turns beside the grouped order spill)")

    lookahead: bool = Field(
        False, description="impl wgmma, dq_reduce bulk, not deterministic: each step's S^T product issued as soon "
        "as the previous step's dV / dK are done, behind its dQ and before the dQ is waited for, and its dP^T right "
        "after the dQ's staging stores, so that the tensor pipe runs them under the dQ tail instead of idling "
        "until the next step starts (tsgen::attention_bwd::wgmma::consume_lookahead; the default's register peak; "
        "one S^T / dP^T pair past each walk's end, unread). Not yet measured on a GPU")

    dk_after_dq: bool = Field(
        False, description="impl wgmma, dq_reduce bulk, not deterministic, 64-row steps, not lookahead: each step's "
        "products in FlashAttention-3's order, dV alone before the warpgroups' dS^T barrier, then dQ, then dK once dV "
        "is done, so that the dQ's staging and bulk issue run while dK is still on the tensor pipe (the default "
        "issues dV and dK together before the barrier and dQ last, and the pipe drains before the staging); "
        "tsgen::attention_bwd::wgmma::consume, and consume_tall with step_rows 128 (head dim 64). Measured 1.06-1.15x "
        "the default order at head dim 128, 1.00-1.03x at 64 in 64-row steps (H200, S 4K-16K, 2026-11-27), 1.02-1.06x "
        "with step_rows 128 (2026-11-28); the shipped specs set it")

    tail_split: bool | None = Field(
        None, description="impl wgmma, not causal: where the main kernel's items (blocks of 128 keys x KV heads x "
        "batch) leave a last wave of at most half the SMs busy, cut each of those items into pieces along its walk "
        "over the idle SMs, their dK, dV partial sums added in fp32 into the workspace (which grows by "
        f"{TAIL_ITEMS} slots of 128 x 2 head_dim floats) and converted by a fourth kernel. Unset: on where it "
        "applies (impl wgmma, dq_reduce bulk, not causal, not deterministic, not lookahead, 64-row steps, not "
        "kv_push); true "
        "elsewhere is refused. dK, dV of the split items then vary in their last bits from run to run")

    kv_push: bool = Field(
        False, description="impl wgmma, not tail_split: the backward of context-parallel attention with its dK / dV "
        "reduce-scatter overlapped (issue 35). The main kernel runs over the keys gathered from every rank (kv_len = "
        "world x rows); each consumer warpgroup stores its 64 keys' dK, dV partial sums at the rank that holds them "
        "(its own rows into dk, dv; a peer's over NVLink into that peer's receive area) as soon as its walk ends; "
        "after the main kernel <kernel>_push_signal tells every owner once, <kernel>_push_wait waits for every "
        "sender, and <kernel>_push_reduce adds their partials to the rank's own. Adds the entry <kernel>_backward_push (tsgen::attention_bwd::KvPush: the table of "
        "peers' areas the caller fills, e.g. tsgen.torch.cp_attention). Rows a rank: a multiple of 128")

    step_rows: Literal[64, 80, 128] | None = Field(
        None, description="impl wgmma: query rows per step of the main kernel's walk; unset or 64: 64 (the default), "
        "80: FlashAttention-3's and -4's head-dim-128 tile when not causal (80 queries x 128 keys a step: S^T, dP^T as "
        "m64n80, dV, dK over 80 rows, dQ computed transposed, dQ^T = K^T dS^T as m64 head-dim columns x n80 queries, "
        "since 80 is no multiple of a wgmma's M; tsgen::attention_bwd::wgmma::consume with WIDE): head_dim 128, not "
        "causal, dq_reduce bulk, not deterministic, not lookahead, not kv_push. Measured 0.91-0.97x 64-row steps (H200, "
        "S 4K-16K, 2026-11-29: its transposed dQ staging costs more than the steps save); no shipped spec sets it. "
        "128: FlashAttention-3's head-dim-64 tile (128 queries x 128 keys a step: S^T, dP^T as m64n128, dV, dK and dQ "
        "over 128 rows or keys, dQ split by query rows between the consumer warpgroups), so that each step's fixed "
        "waits, barriers and dQ issue are paid once per 128 query rows (tsgen::attention_bwd::wgmma::consume_tall). "
        "head_dim 64 only, dq_reduce bulk, not deterministic, not lookahead. Measured 1.23-1.28x 64-row steps (H200, "
        "S 4K-16K, 2026-11-27); the shipped head-dim-64 specs set it")

    exp2_fma_every: Exp2FmaEvery = None  # impl wgmma

    @property
    def cta_head_group(self) -> int | None:
        """The main kernel's group of (sequence, KV head) pairs (its HEAD_GROUP), None for none: head_group
        where set (0: none), else DEFAULT_HEAD_GROUP for impl wgmma without deterministic, else none."""
        if self.head_group is not None:
            return self.head_group or None
        return DEFAULT_HEAD_GROUP if self.impl == "wgmma" and not self.deterministic else None

    @property
    def tail_applies(self) -> bool:
        """Whether params.tail_split can be built for these parameters (tsgen::attention_bwd::wgmma's Layout)."""
        return (self.impl == "wgmma" and self.dq_reduce != "atomic" and not self.causal and not self.deterministic
                and not self.lookahead and self.step_rows != 128 and not self.kv_push)

    @property
    def split_tail(self) -> bool:
        """params.tail_split resolved: as set, or unset: where it applies."""
        return self.tail_applies if self.tail_split is None else self.tail_split

    @property
    def wide(self) -> bool:
        """params.step_rows 80: the wgmma kernel's steps of 80 query rows, dQ transposed (consume, WIDE)."""
        return self.step_rows == 80

    @property
    def tall(self) -> bool:
        """params.step_rows 128: the wgmma kernel's steps of 128 query rows (consume_tall)."""
        return self.step_rows == 128

    @property
    def dq_tiled(self) -> bool:
        """dq_accum in the tiled layout of the bulk reductions (tsgen::attention_bwd::dq_tiled_offset)."""
        return self.impl == "wgmma" and self.dq_reduce != "atomic"


def dq_accum_elems(p: AttentionBackwardParams) -> dict[str, int]:
    """Buffer dq_accum's size per count (sequence positions) and fixed: dQ's floats, and with
    params.deterministic the dQ semaphores after them. A buffer's size is linear in count, the
    semaphores are batch * heads * ceil(count / 64): bounded by ceil(batch * heads / 64) per count
    plus batch * heads fixed."""
    bh = p.batch * p.heads
    tail = tail_floats(TAIL_ITEMS if p.split_tail else 0, p.head_dim)
    if not p.deterministic:
        return {"per_count": bh * p.head_dim, **({"fixed": tail} if tail else {})}
    return {"per_count": bh * p.head_dim + -(-bh // BLOCK_M), "fixed": bh + tail}


class AttentionBackwardLaunch(StrictModel):
    threads: Literal[128, 384] = Field(
        128, description="the main kernel's threads, fixed by params.impl: 128 (mma_sync: 4 warps, 16 keys each) "
        "or 384 (wgmma: a producer and two consumer warpgroups)")
    blocks: Literal[0] = Field(0, description="one CTA per (block of keys, KV head, sequence): a plain grid")


class AttentionBackwardSpec(OneGpuAttentionSpec):
    """Spec of op `attention_backward`: dQ, dK and dV of the flash-attention forward (dtype: also
    dO's and the gradients')."""

    op: Literal["attention_backward"]
    params: AttentionBackwardParams = AttentionBackwardParams()
    launch: AttentionBackwardLaunch = AttentionBackwardLaunch()


SMEM_LIMIT = 227 * 1024  # the dynamic shared memory a CTA may opt into on sm_90


def smem_bytes(spec: AttentionBackwardSpec) -> int:
    """mma_sync: K, V, Q and dO tiles of 64 rows padded by 8 elements, dS^T (64 x 72), LSE2 and
    D of 64 rows (tsgen::attention_bwd::Layout asserts the same). wgmma: K and V of 128 rows,
    STAGES Q and dO tiles of 64 rows (128B-swizzled, no padding), two dS^T buffers (128 x 64),
    the fp32 dQ staging of the two consumer warpgroups (64 x 64 each, dq_reduce bulk), LSE2 and D per
    stage (params.step_rows 128: 128 query rows in each of those), the barriers, 1024 bytes of slack for
    the alignment (tsgen::attention_bwd::wgmma::Layout asserts the same)."""
    d = spec.params.head_dim
    if spec.params.impl == "wgmma":
        n, st = IMPLS["wgmma"]["block_n"], WGMMA_STAGES
        m = spec.params.step_rows or BLOCK_M  # query rows per step (params.step_rows)
        staging_rows = m if spec.params.wide else BLOCK_M  # a warpgroup's fp32 partial: its rows x 64 columns
        staging = 2 * staging_rows * 64 * 4 if spec.params.dq_tiled else 0
        return (2 * (2 * n * d + 2 * st * m * d + 2 * n * m) + staging + 2 * 4 * st * m + 8 * (1 + 2 * st)
                + 1024)
    pitch = d + 8
    return 2 * ((2 * BLOCK_N + 2 * BLOCK_M) * pitch + BLOCK_N * (BLOCK_M + 8)) + 2 * 4 * BLOCK_M


def backward_inputs(spec, count: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random Q, K, V and dO, and O and LSE from the float64 forward reference (O rounded to the
    16-bit type as the forward writes it), as flat arrays in the spec's layout and types."""
    p = spec.params
    rows_q, rows_kv = p.batch * count * p.heads * p.head_dim, p.batch * count * p.kv_heads * p.head_dim
    out = {name: from_f64(rng.standard_normal(n), spec.dtype)
           for name, n in (("q", rows_q), ("k", rows_kv), ("v", rows_kv), ("dout", rows_q))}
    q, k, v = (to_bshd(to_f64(out[n], spec.dtype), p.batch, count, h, p.head_dim, p.layout)
               for n, h in (("q", p.heads), ("k", p.kv_heads), ("v", p.kv_heads)))
    o, lse = attention_reference(q, k, v, scale_of(spec), p.causal)
    out["o"] = from_f64(from_bshd(o, p.layout).reshape(-1), spec.dtype)
    out["lse"] = lse.reshape(-1).astype(np.float32)
    return out


def refuse_first(problems: list, field: str, rules: list[tuple[bool, str]]) -> None:
    """An opt-in knob's refusals in order: the first rule whose condition holds adds (params.field, its
    message) to `problems`; one message a knob, the most basic reason first."""
    why = next((message for bad, message in rules if bad), None)
    if why is not None:
        problems.append((("params", field), why))


class AttentionBackwardFamily(OpFamily):
    kind = "attention_backward"
    Spec = AttentionBackwardSpec
    template = "attention_backward.cu.j2"
    category = "compute"
    gpu_sweep = "one_gpu"  # and tools/gpu_attention_bwd.py: lengths, GQA, layouts, the bench
    variant_worlds = ()
    min_world = 1
    count_unit = "rows"  # sequence positions (q_len = kv_len) through <kernel>_launch
    host_launch = True  # three kernels per call
    # tsgen.torch: a one-GPU op, the forward and the backward paired as one differentiable op
    # (tsgen/torch/attention_op.py); tsgen.torch.load points here
    torch_loader = "tsgen.torch.attention(forward_spec, backward_spec)"
    summary = (
        "flash-attention backward on one GPU: dQ, dK, dV from Q, K, V, O, dO and the forward's LSE; "
        "a preprocess (D = rowsum(dO O)), a main kernel per block of 64 keys (mma.sync; dK, dV in "
        "registers, GQA summed there; dQ by fp32 atomics), a conversion of dQ"
    )

    def check(self, spec):
        problems = heads_problems(spec.params)
        if spec.params.impl == "mma_sync" and spec.params.dq_reduce == "bulk":
            problems.append((("params", "dq_reduce"), "dq_reduce bulk needs params.impl wgmma (the mma_sync kernel "
                             "adds dQ with atomics only)"))
        if spec.params.head_group and spec.params.impl != "wgmma":
            problems.append((("params", "head_group"), "head_group needs params.impl wgmma (the mma_sync kernel's CTAs "
                             "keep their KV-block-major order)"))
        elif spec.params.head_group and spec.params.deterministic:
            problems.append((("params", "head_group"), "head_group with deterministic is not built: the grouped order's "
                             "KV block and head stay live in the consumers and spill beside the turns (ptxas: 8 "
                             "bytes of stack); use one of the two"))
        p = spec.params
        if p.lookahead:
            refuse_first(problems, "lookahead", [
                (p.impl != "wgmma", "lookahead needs params.impl wgmma (the mma_sync kernel issues no product "
                 "asynchronously)"),
                (not p.dq_tiled, "lookahead is built for dq_reduce bulk only (the atomic path is kept to bench against)"),
                (p.deterministic, "lookahead with deterministic is not built (the turns' wait and hand-over sit in the "
                 "dQ tail that the lookahead reorders); use one of the two")])
        if p.dk_after_dq:
            refuse_first(problems, "dk_after_dq", [
                (p.impl != "wgmma", "dk_after_dq needs params.impl wgmma (the mma_sync kernel issues no product "
                 "asynchronously)"),
                (not p.dq_tiled, "dk_after_dq is built for dq_reduce bulk only (the atomic path is kept to bench "
                 "against)"),
                (p.deterministic, "dk_after_dq with deterministic is not built (its turn's wait sits in the dQ tail it "
                 "reorders)"),
                (p.lookahead, "dk_after_dq with lookahead is not built (two reorders of one tail)")])
        if p.tall:
            refuse_first(problems, "step_rows", [
                (p.impl != "wgmma", "step_rows 128 needs params.impl wgmma (the mma_sync kernel walks 64-row blocks "
                 "only)"),
                (p.head_dim != 64, "step_rows 128 is built for head_dim 64 only (at 128, S^T, dP^T of 64 x 128 and dK, "
                 "dV of 64 x 128 are 256 accumulator registers a thread, over the consumers' 232)"),
                (not p.dq_tiled, "step_rows 128 is built for dq_reduce bulk only (the atomic path is kept to bench "
                 "against)"),
                (p.deterministic, "step_rows 128 with deterministic is not built (its turns are per 64-row query block "
                 "and warpgroup pair); use one of the two"),
                (p.lookahead, "step_rows 128 with lookahead is not built (two consumer loops, each with its own order "
                 "of waits); use one of the two")])
        if p.wide:
            refuse_first(problems, "step_rows", [
                (p.impl != "wgmma", "step_rows 80 needs params.impl wgmma (the mma_sync kernel walks 64-row blocks "
                 "only)"),
                (p.head_dim != 128, "step_rows 80 is built for head_dim 128 only (dQ^T's M is the head dim, 64 columns "
                 "a consumer warpgroup)"),
                (p.causal, "step_rows 80 is built for causal false only (FlashAttention-4's choice too: a causal "
                 "walk's diagonal steps would mask more of 80 rows than of 64); use 64 there"),
                (not p.dq_tiled, "step_rows 80 is built for dq_reduce bulk only (the atomic path is kept to bench "
                 "against)"),
                (p.deterministic, "step_rows 80 with deterministic is not built (its turns are per 64-row query "
                 "block); use one of the two"),
                (p.lookahead, "step_rows 80 with lookahead is not built (consume_lookahead's steps are 64 rows); use "
                 "one of the two"),
                (p.kv_push, "step_rows 80 with kv_push is not built (not tested together); use one of the two")])
        if p.kv_push:
            refuse_first(problems, "kv_push", [
                (p.impl != "wgmma", "kv_push needs params.impl wgmma (the mma_sync kernel's dK, dV stores are not "
                 "built to push)"),
                (p.split_tail, "kv_push with tail_split is not built (a split item's dK, dV are summed in the tail "
                 "slots and converted by the tail kernel, which does not push): set tail_split: false")])
        if p.exp2_fma_every and p.impl != "wgmma":
            problems.append((("params", "exp2_fma_every"), "exp2_fma_every needs params.impl wgmma (the mma_sync "
                             "kernel's exponentials are not built to move)"))
        elif p.exp2_fma_every:
            groups = (p.step_rows or 64) // 8  # a thread's column groups of P^T a step (8 query columns each)
            if p.exp2_fma_every > groups:
                problems.append((("params", "exp2_fma_every"),
                                 f"exp2_fma_every {p.exp2_fma_every}: a consumer thread holds {groups} column groups "
                                 f"of P^T a step of {p.step_rows or 64} query rows, so none would move; use 2 to "
                                 f"{groups}"))
        if p.tail_split and not p.tail_applies:
            refuse_first(problems, "tail_split", [
                (p.impl != "wgmma", "tail_split needs params.impl wgmma (the mma_sync kernel's CTAs walk whole items)"),
                (not p.dq_tiled, "tail_split is built for dq_reduce bulk only (the atomic path is kept to bench "
                 "against)"),
                (p.causal, "tail_split is built for causal false only (a causal walk skips the query blocks that see "
                 "none of its keys, so its steps do not divide evenly; its last items are the shortest anyway)"),
                (p.deterministic, "tail_split with deterministic is not built (the pieces' dK, dV sums are added in no "
                 "fixed order)"),
                (p.lookahead, "tail_split with lookahead is not built (consume_lookahead walks whole items)"),
                (p.tall, "tail_split with step_rows 128 is not built (consume_tall walks whole items)")])
        if spec.params.deterministic and not spec.params.dq_tiled:
            problems.append((("params", "deterministic"), "deterministic needs params.impl wgmma with dq_reduce bulk "
                             "(the ordered adds are the bulk reductions; mma_sync and dq_reduce atomic add dQ with "
                             "per-element atomics in no fixed order)"))
        if not problems and smem_bytes(spec) > SMEM_LIMIT:
            problems.append((("params",), f"{smem_bytes(spec)} bytes of shared memory a CTA, over the {SMEM_LIMIT} a "
                             "Hopper CTA may use (227 KiB)"))
        want = IMPLS[spec.params.impl]["threads"]
        if spec.launch.threads != want:
            problems.append((("launch", "threads"), f"params.impl {spec.params.impl} runs {want} threads per CTA, "
                             f"not {spec.launch.threads}: set launch.threads: {want}"))
        return problems

    def buffers(self, spec):
        p = spec.params
        q_row, kv_row = p.batch * p.heads * p.head_dim, p.batch * p.kv_heads * p.head_dim
        return (
            Buffer("q", spec.dtype, "input", per_count=q_row),
            Buffer("k", spec.dtype, "input", per_count=kv_row),
            Buffer("v", spec.dtype, "input", per_count=kv_row),
            Buffer("o", spec.dtype, "input", per_count=q_row),
            Buffer("dout", spec.dtype, "input", per_count=q_row),
            Buffer("lse", "float32", "input", per_count=p.batch * p.heads),
            Buffer("dq", spec.dtype, "output", per_count=q_row),
            Buffer("dk", spec.dtype, "output", per_count=kv_row),
            Buffer("dv", spec.dtype, "output", per_count=kv_row),
            Buffer("dq_accum", "float32", "scratch", **dq_accum_elems(p)),
            Buffer("dsum", "float32", "scratch", per_count=p.batch * p.heads),
            Buffer("lse2", "float32", "scratch", per_count=p.batch * p.heads),
        )

    def constants(self, spec):
        p = spec.params
        return {
            **shape_constants(p),
            "CAUSAL": int(p.causal),
            "BHSD": int(p.layout == "bhsd"),
            "THREADS": spec.launch.threads,
            "BLOCKS": spec.launch.blocks,
            "SMEM_BYTES": smem_bytes(spec),
            **({"TILE_M": 80 if p.wide else BLOCK_M, "TILE_N": IMPLS["wgmma"]["block_n"], "STAGES": WGMMA_STAGES,
                "DQ_TILED": int(p.dq_tiled)} if p.impl == "wgmma" else {}),
            **({"DETERMINISTIC": 1} if p.deterministic else {}),  # absent by default: those sources stay as they were
            **({"HEAD_GROUP": p.cta_head_group} if p.cta_head_group else {}),  # likewise
            **({"LOOKAHEAD": 1} if p.lookahead else {}),  # likewise
            **({"DK_AFTER_DQ": 1} if p.dk_after_dq else {}),  # likewise
            **({"STEP_ROWS": p.step_rows} if p.tall or p.wide else {}),  # likewise
            **({"KV_PUSH": 1} if p.kv_push else {}),  # likewise
            **({"EXP2_FMA_EVERY": p.exp2_fma_every} if p.exp2_fma_every else {}),  # likewise
            **({"TAIL_SPLIT": TAIL_ITEMS} if p.split_tail else {}),  # the tail slots (workspace_floats' tail_items)
        }

    def template_vars(self, spec):
        return {**scale_vars(spec), "tail_items": TAIL_ITEMS}

    def abi(self, spec):
        return one_kernel_abi(self, spec, smem=smem_bytes(spec), constants=self.constants(spec))

    # -- reference ----------------------------------------------------------
    def make_inputs(self, spec, world, count, rng, pattern):
        """Random Q, K, V, dO; O and LSE from the forward's reference (backward_inputs)."""
        return {name: [x] for name, x in backward_inputs(spec, count, rng).items()}

    def _grads(self, spec, count, inputs, with_abs):
        p = spec.params

        def shaped(name, heads):  # flat -> the layout's 4-d shape (the reference takes that layout)
            x = to_f64(inputs[name][0], spec.dtype)
            return x.reshape((p.batch, count, heads, p.head_dim) if p.layout == "bshd"
                             else (p.batch, heads, count, p.head_dim))

        q, o, do = (shaped(n, p.heads) for n in ("q", "o", "dout"))
        k, v = (shaped(n, p.kv_heads) for n in ("k", "v"))
        lse = inputs["lse"][0].astype(np.float64).reshape(p.batch, p.heads, count)
        return attention_backward_reference(q, k, v, o, do, lse, scale_of(spec), p.causal, layout=p.layout,
                                            with_abs=with_abs)

    def _grads_once(self, spec, count, inputs):
        """The gradients with their |.| and cancellation sums, once per call's inputs (reference and tolerance)."""
        return self.once_per_inputs(inputs, (spec, count), lambda: self._grads(spec, count, inputs, with_abs=True))

    def reference(self, spec, world, count, inputs):
        grads = self._grads_once(spec, count, inputs)[:3]
        return {name: [from_f64(g.reshape(-1), spec.dtype)] for name, g in zip(GRADS, grads)}

    def tolerance(self, spec, world, count, inputs):
        """Per element, grad_tolerance over each product's |.| sums and dS's cancellation sums
        (tsgen/ops/attention.py)."""
        out = self._grads_once(spec, count, inputs)
        cancels = (*out[6:], None)  # dQ's, dK's; dV cancels nothing

        def flat(x):
            return None if x is None else x.reshape(-1)

        return {name: [grad_tolerance(flat(g), flat(a), flat(c), spec.dtype, spec.params.head_dim)]
                for name, g, a, c in zip(GRADS, out[:3], out[3:6], cancels)}


def flops(batch: int, q_len: int, kv_len: int, heads: int, head_dim: int, causal: bool) -> float:
    """10 b h sq skv d (five matrix products: S, dP, dV, dK, dQ), halved for causal: the
    FlashAttention papers' convention, 2.5 x the forward's."""
    f = 10.0 * batch * heads * q_len * kv_len * head_dim
    return f / 2 if causal else f


FAMILIES: list[OpFamily] = [AttentionBackwardFamily()]
