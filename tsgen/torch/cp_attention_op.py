"""Context-parallel attention for torch users, forward and backward, composed from tsgen ops (issue 35,
item 2, a first version: no kernel of its own; by default no overlap of communication with compute).

    cp = tsgen.torch.cp_attention("specs/attention_hd128_causal_gqa.yaml",
                                  "examples/torch/specs/attention_backward_hd128_causal_gqa.yaml",
                                  "specs/allgather.yaml", "specs/reduce_scatter.yaml", layout="zigzag")
    o = cp(q, k, v)        # this rank's rows: q [B, n, H, D], k, v [B, n, H_kv, D] (the specs' layout)
    o.backward(do)         # dQ (this rank's rows), dK and dV (this rank's rows, summed over every rank)

Each rank of the group holds n rows of the sequence (S = W n): `contiguous`, rank r rows r n ..
(r + 1) n - 1; `zigzag`, the sequence cut in 2W chunks of n / 2 rows, rank r holds chunks r and
2W - 1 - r (tsgen.ops.cp_attention.positions). The adjoint of the forward's K / V all-gather is a
reduce-scatter of dK / dV:

    forward:  K_full, V_full = allgather(K), allgather(V)          (tsgen allgather op, the group)
              O, LSE = attention(Q, K_full, V_full) at this rank's query positions  (tsgen::<fwd>_at)
    backward: dQ, dK_full, dV_full = attention_backward(Q, K_full, V_full, O, dO, LSE), same positions
              dK, dV = reduce_scatter(dK_full), reduce_scatter(dV_full)   (tsgen reduce_scatter op)

The attention kernels take the positions at run time (their `<kernel>_forward` / `<kernel>_backward`
entries: query row r at q_offset + r for r < q_split, q_offset2 + r - q_split after, key row j at
kv_offset + j), so the zig-zag query layout needs no copy of Q; the keys must be in position order
(one kv_offset), so causal zig-zag reorders the gathered rows (one index_select of K and V, and
its inverse for dK and dV). Not causal, positions do not matter and the gathered order stays.
The collectives split dimension 0, so K and V travel sequence-first ([n, B, H_kv, D]: a view for
bshd at batch 1, a copy otherwise).

`overlap_backward=True` (an experiment, default off; measured slower: 2.77 against 2.16 ms a step at
S 8192, W 2 zig-zag causal, docs/torch.md) runs the backward kernel by runs of key rows
(backward_runs): first the runs of the peers' rows, on a high-priority side stream, then this rank's
own rows' runs on the current stream; the reduce-scatter of the peers' partial sums (this rank's own
rows zero) follows them on the side stream, so it overlaps the own rows' kernels, and the own rows'
partial sums are added to what it returns. The attention backward is linear in the keys (dK, dV of a
key row are its own; dQ is a sum over the keys; D = rowsum(dO O) and the forward's LSE hold for any
key subset), so the parts compose exactly; each call returns its dQ in the input dtype, and the
partials are added with one rounding (two: torch's 16-bit add is fp32 then one rounding; more: in
fp32): at most 2^-8 of sum_j |dS_ij| |k_j| more error, within the checks' bound (grad_tolerance holds
dQ to 2^-7 |dQ| + 2^-6 of that sum). Each call runs the kernel's preprocess and dQ conversion over
all of this rank's queries again (two or three calls at W 2) and holds its own fp32 workspace.

Memory against time: by default the gathered K_full, V_full are kept for the backward (2 W n H_kv
D elements of the dtype per layer, W times the local K and V); `regather=True` keeps the local K
and V and gathers them again in the backward (one more all-gather per step, no W-fold copy).

dK_full / dV_full are the backward kernel's outputs in the input dtype (bf16 or fp16: the kernel
accumulates each key block's dK, dV in fp32 over every query of this rank, then rounds once), so
the reduce-scatter sums W rounded partial sums (the reduce_scatter spec's dtype must be the
attention's; an fp32 reduce-scatter of rounded partials would not add accuracy: the kernel would
have to write fp32 partials, a kernel change not made here).

`push=SPEC` (an attention_backward spec of the same attention with params.kv_push, e.g.
examples/torch/specs/attention_backward_hd128_causal_gqa_push.yaml) makes the backward one call of that
kernel: each block's dK, dV partial sums stored at the rank that holds its keys as the block ends (a
peer's over NVLink into its symmetric heap), then summed there (backward_push; tsgen/attention_bwd.cuh
KvPush): the reduce-scatter overlapped with the backward, no reorder of dK, dV. Where it does not fit
(pushes()) the composed backward runs. Measured 1.01-1.06x the composed step (docs/torch.md).

`fused=SPEC` (a cp_attention spec of the same attention and layout, e.g.
examples/torch/specs/cp_attention_hd128_causal_gqa.yaml) makes the forward one call of the cp_attention
kernel instead: its K / V gather on the copy engine overlapped with the attention, the gathered K, V it
leaves in the symmetric heap copied out and kept for the backward (fused_forward says how they are put in
the backward's order). Measured level with the composed forward (causal) or slower (not causal):
docs/torch.md. Its batch is the spec's params.batch, fixed at compile time.

The op is a torch.autograd.Function over custom ops. Its default form's whole step (forward + backward)
was captured in a CUDA graph and a replay's results checked on 2 GPUs (tests/torch_checks.py
cp_graph_step, timing label tsgen_graph); torch.compile is not checked for it yet. tests/torch_checks.py
--cp is the GPU check; tests/test_torch_cp_attention_cpu.py the CPU tests (fake kernels, errors, and the composition's math with stand-in kernels in a
simulated world).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import ops as ops_mod
from ..ops.cp_attention import segments
from .attention_op import PUSH_ROWS, AttentionOp, _load_module, agree_diffs, agree_fields, attention
from .signature import TsgenArgumentError, TsgenTorchError

LAYOUTS = ("contiguous", "zigzag")


def cp_positions(layout: str, world: int, count: int, rank: int) -> tuple[int, int, int, int]:
    """(q_offset, q_split, q_offset2, kv_offset) of `rank`'s `count` query rows over the whole
    gathered sequence in position order (tsgen.ops.cp_attention.positions as run-time arguments)."""
    if layout == "contiguous":
        return (rank * count, count, 0, 0)
    half = count // 2
    return (rank * half, half, (2 * world - 1 - rank) * half, 0)


def reorders(layout: str, causal: bool) -> bool:
    """Whether the gathered rows are put in position order (zig-zag causal; contiguous, the all-gather's
    order is position order; not causal, positions do not matter): gather_order's rows, and push='s table
    (its owner map then reads keys in position order)."""
    return layout == "zigzag" and causal


def gather_order(layout: str, causal: bool, world: int, count: int) -> list[int] | None:
    """Which row of the all-gather's output (rank-major: rank r's count rows at r count) goes to each
    position of the sequence, or None where the all-gather's order will do (reorders)."""
    if not reorders(layout, causal):
        return None
    half = count // 2
    order = []
    for chunk in range(2 * world):
        rank, second = (chunk, 0) if chunk < world else (2 * world - 1 - chunk, half)
        order.extend(range(rank * count + second, rank * count + second + half))
    return order


def backward_runs(layout: str, causal: bool, world: int, count: int,
                  rank: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(peers' runs, own runs) for overlap_backward: the key rows of the gathered sequence whose dK, dV
    `rank`'s queries make, as [start, stop) in the backward kernel's key order (position order where
    causal, the all-gather's otherwise: gather_order), cut into maximal runs of the peers' rows and of
    this rank's own. Causal: only up to this rank's last query position (later keys see none of its
    queries). Each run is one kernel call (one kv_offset: its keys must be consecutive positions)."""
    order = gather_order(layout, causal, world, count)
    unit = count // 2 if layout == "zigzag" else count  # the runs' bounds are whole chunks
    end = world * count
    if causal:
        q_offset, q_split, q_offset2, _ = cp_positions(layout, world, count, rank)
        end = (q_offset2 + count - q_split) if q_split < count else q_offset + q_split
    runs: dict[bool, list[tuple[int, int]]] = {False: [], True: []}
    for start in range(0, end, unit):
        row = order[start] if order is not None else start  # the chunk's row in the all-gather's output
        own = rank * count <= row < (rank + 1) * count
        mine = runs[own]
        if mine and mine[-1][1] == start:
            mine[-1] = (mine[-1][0], start + unit)
        else:
            mine.append((start, start + unit))
    return runs[False], runs[True]


# params.kv_push (the backward spec's): tsgen::attention_bwd::KvPush's constants (tsgen/attention_bwd.cuh)
PUSH_MAX_WORLD = 8
PUSH_AREA = 256  # the heap's bytes before the receive area: calls[2] at 0, arrived[PUSH_MAX_WORLD] at PUSH_ARRIVED
PUSH_ARRIVED = 16  # the heap's arrived[] (after calls[2])


def push_owner(zigzag: bool, world: int, rows: int, key: int) -> tuple[int, int]:
    """(owner, its row) of gathered key `key` (tsgen::attention_bwd::push_owner, which the CPU tests compare):
    zigzag, the keys in position order, chunk c of rows / 2 held by rank c < world ? c : 2 world - 1 - c;
    otherwise rank-major (contiguous, or the all-gather's order where positions do not matter)."""
    if not zigzag:
        return key // rows, key % rows
    half = rows // 2
    c = key // half
    return (c, key % half) if c < world else (2 * world - 1 - c, half + key % half)


def push_heap_bytes(world: int, elems: int, element_size: int) -> int:
    """A KvPush heap's bytes: PUSH_AREA, then [2 parities][world - 1 senders][dK, dV][elems elements]."""
    return PUSH_AREA + 2 * (world - 1) * 2 * elems * element_size


def push_table_bytes(world: int, rank: int, rows: int, zigzag: bool, peers: list[int]) -> bytes:
    """tsgen::attention_bwd::KvPush for `rank` (little-endian, its C layout): world, rank, rows, zigzag; this
    rank's calls and arrived; each rank's receive area and its arrived[rank], from every rank's heap base as
    this rank addresses it (`peers`)."""
    import struct

    pad = [0] * (PUSH_MAX_WORLD - world)
    me = peers[rank]
    return (struct.pack("<4I", world, rank, rows, int(zigzag)) + struct.pack("<2Q", me, me + PUSH_ARRIVED)
            + struct.pack(f"<{PUSH_MAX_WORLD}Q", *[p + PUSH_AREA for p in peers], *pad)
            + struct.pack(f"<{PUSH_MAX_WORLD}Q", *[p + PUSH_ARRIVED + 8 * rank for p in peers], *pad))


def _seq_first(x: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, n, H, D] (bshd) or [B, H, n, D] (bhsd) -> [n, B, H, D], contiguous (a view when it is)."""
    return (x.transpose(0, 1) if layout == "bshd" else x.permute(2, 0, 1, 3)).contiguous()


def _from_seq_first(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of _seq_first: [S, B, H, D] -> the layout's, contiguous."""
    return (x.transpose(0, 1) if layout == "bshd" else x.permute(1, 2, 0, 3)).contiguous()


def _on(stream: Any) -> Any:
    """torch.cuda.stream(stream), or no change where there is none (off CUDA)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The partial dQs added with one rounding to their dtype: two by torch's add (a 16-bit add is
    computed in fp32 and rounded once), more accumulated in fp32 (or their dtype where wider)."""
    if len(parts) <= 2:
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]
    total = parts[0].to(torch.promote_types(parts[0].dtype, torch.float32))
    for x in parts[1:]:
        total += x
    return total.to(parts[0].dtype)


# the ops holding push= heaps, closed by tsgen.torch.close_all() (ops.AT_CLOSE_ALL)
_PUSHING: "weakref.WeakSet[CPAttentionOp]" = weakref.WeakSet()


def _close_push_heaps() -> None:
    for op in list(_PUSHING):
        op.close_push()


ops_mod.AT_CLOSE_ALL.append(_close_push_heaps)


@dataclass
class _PushHeap:
    """push=: one size's symmetric heap, its KvPush table on the GPU, and the event recorded after its last call:
    the next call waits for it on its own stream, so calls on different streams (layers whose forwards ran on
    different streams: autograd runs each backward on its forward's) still take epochs and slots in order."""

    heap: Any
    table: torch.Tensor
    done: Any = None
    # why the heap may no longer be used: a call that failed past its argument checks (a launch, or the module's
    # load) may have signalled its peers or advanced its counters part way, or not, while its peers went on; the
    # epochs of the ranks may disagree and a later sum could read a slot at the wrong epoch without any wait
    # failing (set by CPAttentionOp.backward_push)
    broken: str | None = None


class _CPAttention(torch.autograd.Function):
    """forward(q, k, v, op) -> (O, LSE); backward: dQ, and dK, dV through the reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, op: "CPAttentionOp") -> tuple:
        pos = op.positions(q, k, v)
        if op.fused is not None:  # one call: the gather overlapped with the attention, the gathered K, V kept
            o, lse, k_full, v_full = op.fused_forward(q, k, v)
        else:
            k_full, v_full = op.gather_kv(k, v)
            o, lse = getattr(torch.ops.tsgen, f"{op.attention.forward.name}_at")(q, k_full, v_full, *pos)
        ctx.op, ctx.pos = op, pos
        ctx.save_for_backward(q, *((k, v) if op.regather else (k_full, v_full)), o, lse)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, dlse: Any) -> tuple:
        op = ctx.op
        q, k, v, o, lse = ctx.saved_tensors
        if op.regather:
            k, v = op.gather_kv(k, v)
        if op.overlap_backward:
            dq, dk, dv = op.backward_overlapped(q, k, v, o, do.contiguous(), lse, ctx.pos)
        elif op.pushes(q):
            dq, dk, dv = op.backward_push(q, k, v, o, do.contiguous(), lse, ctx.pos)
        else:
            dq, dk_full, dv_full = getattr(torch.ops.tsgen, f"{op.attention.backward.name}_at")(
                q, k, v, o, do.contiguous(), lse, *ctx.pos)
            # every rank calls the reduce-scatters (a collective), whatever its own inputs need
            dk, dv = op.scatter_kv(dk_full, dv_full)
        need = ctx.needs_input_grad[:3]
        return (*(g if n else None for g, n in zip((dq, dk, dv), need)), None)


class CPAttentionOp:
    """Context-parallel attention on this rank of a process group: `op(q, k, v)` is this rank's O,
    differentiable; `op(q, k, v, return_lse=True)` is (O, LSE). `layout`: contiguous or zigzag;
    `regather`: gather K, V again in the backward instead of keeping them; `overlap_backward`: the
    backward by runs of key rows, the peers' reduce-scatter beside the own rows' kernels (module doc);
    `fused`: the forward through a cp_attention op (module doc, fused_forward). `attention` is the
    single-GPU AttentionOp whose kernels it runs, `allgather` and `reduce_scatter` the collectives."""

    def __init__(self, attention_op: AttentionOp, allgather: Any, reduce_scatter: Any, layout: str, regather: bool,
                 kv_together: bool = False, overlap_backward: bool = False, fused: Any = None, push: Any = None):
        self.attention, self.allgather, self.reduce_scatter = attention_op, allgather, reduce_scatter
        self.layout, self.regather, self.kv_together = layout, regather, kv_together
        self.overlap_backward = overlap_backward
        # the fused forward (a cp_attention TorchOp) or None; as a function of (q, k, v) -> (O, LSE, the
        # gathered K, V in the kernel's order): the CPU tests put a simulated one here
        self.fused = fused
        self._fused: Callable[..., tuple] | None = fused
        self.local_kv = bool(fused is not None and fused.manifest.constants.get("LOCAL_KV", 0))
        self.rank, self.world = allgather.rank, allgather.world
        sig = attention_op.signature
        self.causal, self.tensor_layout = sig.causal, sig.layout
        # the collectives as functions of one tensor (the CPU tests put a simulated world here)
        self._allgather: Callable[[torch.Tensor], torch.Tensor] = allgather
        self._reduce_scatter: Callable[[torch.Tensor], torch.Tensor] = reduce_scatter
        # gather_order as index tensors (the order and its inverse) per (rows, device), made once: a
        # tensor made from a Python list and copied from pageable memory cost 1.6 ms at 8192 rows on
        # an H200 (with the GPU idle), four times a step when it was made per call. One entry per
        # sequence length seen (a training run has few).
        self._orders: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor] | None] = {}
        # overlap_backward: backward_runs per (rows a rank, rank), each own run with its first local row;
        # the side stream per device (high priority: its kernels take the SMs that free up before the
        # own rows' kernels' waiting CTAs do)
        self._runs: dict[tuple[int, int], tuple[list[tuple[int, int]], list[tuple[int, int, int]]]] = {}
        self._streams: dict[torch.device, Any] = {}
        # push=: a symmetric heap and its KvPush table per (rows, batch, dtype) (the receive area's size depends on
        # all three), made at the first backward of each (a collective), with the event
        # after its last call (_PushHeap); push_control and push_before: the GPU checks' negative controls only
        # (the sums without waiting, which also lets a sender run a call ahead into a slot being read; a callable
        # run on the stream before the kernels, e.g. a delay)
        self._push: dict[tuple[int, int, torch.dtype], _PushHeap] = {}
        self.push = push  # the kv_push backward module (cp_attention's push=), or None
        self.push_control = 0  # attention_op.PUSH_SKIP_WAIT or PUSH_SIGNAL_FIRST: wrong sums
        self.push_before: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return (f"<tsgen.torch cp_attention rank {self.rank}/{self.world} {self.layout}"
                f"{' causal' if self.causal else ''}{' regather' if self.regather else ''}"
                f"{' kv_together' if self.kv_together else ''}{' overlap_backward' if self.overlap_backward else ''}"
                f"{' fused' if self.fused is not None else ''}: "
                f"{self.attention!r}, "
                f"{self.allgather.signature.qualname}, {self.reduce_scatter.signature.qualname}>")

    @property
    def where(self) -> str:
        return f"tsgen.torch.cp_attention on rank {self.rank}"

    @property
    def _seq_dim(self) -> int:
        """The sequence's dimension of q, k, v and their gathered forms (bshd 1, bhsd 2)."""
        return 1 if self.tensor_layout == "bshd" else 2

    def _rows(self, x: torch.Tensor) -> Any:
        return x.shape[self._seq_dim]

    def positions(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
        """This rank's positions for local q, k, v of n rows each; TsgenArgumentError naming what
        does not fit (the tensors' own shapes, dtypes: the kernels' checks)."""
        for arg, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise TsgenArgumentError(f"{self.where}: argument {arg}: {t.dim()} dimensions (shape "
                                         f"{tuple(t.shape)}); it takes {self.attention.signature.described(arg != 'q')} "
                                         "with this rank's n rows")
        n = self._rows(q)
        for arg, t in (("k", k), ("v", v)):
            if self._rows(t) != n:
                raise TsgenArgumentError(f"{self.where}: argument {arg}: {self._rows(t)} rows (shape {tuple(t.shape)}), "
                                         f"but q has {n}: every rank holds the same n rows of Q, K and V")
        if self.layout == "zigzag" and n % 2:
            raise TsgenArgumentError(f"{self.where}: {n} rows per rank: zigzag holds two chunks of n / 2 rows, "
                                     "so n must be even")
        return cp_positions(self.layout, self.world, n, self.rank)

    def _order(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(order, inverse) of gather_order for `n` rows a rank as int64 tensors on `device`, or None
        where the all-gather's order will do; made at the first call of each size, then kept."""
        if device.type == "cuda" and device.index is None:  # the key names the device, whatever is current later
            device = torch.device("cuda", torch.cuda.current_device())
        key = (n, device)
        if key not in self._orders:
            order = gather_order(self.layout, self.causal, self.world, n)
            if order is None:
                self._orders[key] = None
            else:
                index = torch.tensor(order, dtype=torch.int64)
                inverse = torch.empty_like(index)
                inverse[index] = torch.arange(index.numel())
                self._orders[key] = (index.to(device), inverse.to(device))
        return self._orders[key]

    def _reorder(self, x: torch.Tensor, rows: int, inverse: bool) -> torch.Tensor:
        """Sequence-first rows of the whole sequence (`rows` a rank) from the all-gather's order to
        position order, or (`inverse`) back; unchanged where the all-gather's order will do."""
        order = self._order(rows, x.device)
        return x if order is None else x.index_select(0, order[1 if inverse else 0])

    def _side_by_side(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """kv_together: two tensors of the KV heads' shape, sequence-first, side by side in the heads dimension."""
        return torch.cat([_seq_first(a, self.tensor_layout), _seq_first(b, self.tensor_layout)], dim=2)

    def _halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """_side_by_side's inverse, each half in the layout's order (contiguous)."""
        kv_heads = self.attention.signature.kv_heads
        return (_from_seq_first(x[:, :, :kv_heads], self.tensor_layout),
                _from_seq_first(x[:, :, kv_heads:], self.tensor_layout))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's K or V -> the whole sequence's, in position order where causal (the layout's)."""
        full = self._allgather(_seq_first(x, self.tensor_layout))
        return _from_seq_first(self._reorder(full, self._rows(x), inverse=False), self.tensor_layout)

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gather of K and of V; `kv_together`: one all-gather of both, side by side in the heads
        dimension (a copy of the two into one tensor, and one out again: the same bytes as two
        calls' copies, one collective call instead of two)."""
        if not self.kv_together:
            return self.gather(k), self.gather(v)
        if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:  # side by side: they must match
            raise TsgenArgumentError(f"{self.where}: argument v: shape {tuple(v.shape)}, {v.dtype} on {v.device}, but k "
                                     f"is {tuple(k.shape)}, {k.dtype} on {k.device}: K and V are the same shape, "
                                     "dtype and device (kv_together gathers them as one tensor)")
        full = self._allgather(self._side_by_side(k, v))
        return self._halves(self._reorder(full, self._rows(k), inverse=False))

    def scatter(self, g_full: torch.Tensor) -> torch.Tensor:
        """dK_full or dV_full (every position's partial sum from this rank's queries) -> this rank's
        rows summed over every rank: gather's adjoint (position order back to the all-gather's)."""
        g = _seq_first(g_full, self.tensor_layout)
        g = self._reorder(g, g.shape[0] // self.world, inverse=True)
        return _from_seq_first(self._reduce_scatter(g), self.tensor_layout)

    def scatter_kv(self, dk_full: torch.Tensor, dv_full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scatter of dK and of dV; `kv_together`: one reduce-scatter of both, side by side in the
        heads dimension."""
        if not self.kv_together:
            return self.scatter(dk_full), self.scatter(dv_full)
        both = self._side_by_side(dk_full, dv_full)
        return self._halves(self._reduce_scatter(self._reorder(both, both.shape[0] // self.world, inverse=True)))

    def fused_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """`fused`: (O, LSE, K_full, V_full) from one call of the cp_attention kernel (its gather on the copy
        engine, overlapped with the attention), K_full and V_full in the order the composed forward's gather
        gives them (position order where causal, the all-gather's otherwise), for the backward; None for
        both with `regather` (the backward gathers again). The kernel's own gathered buffers are that order
        where causal; not causal they hold the shards rotated (slot j rank + 1 + j's,
        tsgen.ops.cp_attention.segments), turned back here. With local_kv the kernel read this rank's own
        rows in place and they may be missing from the gathered buffers: copied in here.

        Causal, the rows of the chunks after this rank's last query position are undefined in K_full and
        V_full: the kernel never waits for them (no query of this rank sees them), so a peer may still be
        writing them when the call's copy out of the heap reads them. The backward never reads them either
        (it skips every key block no query of the rank sees), so dK and dV are what the composed path gives."""
        batch = self.fused.signature.ins[0].dims[0][1]
        if q.shape[0] != batch:
            raise TsgenArgumentError(f"{self.where}: a batch of {q.shape[0]} sequences (q {tuple(q.shape)}), but the "
                                     f"fused forward {self.fused.manifest.spec} was compiled for {batch}: compile it "
                                     f"with params.batch {q.shape[0]}, or leave fused= out (the composed forward "
                                     "takes any batch)")
        o, lse, k_full, v_full = self._fused(q.contiguous(), k.contiguous(), v.contiguous())
        if self.regather:
            return o, lse, None, None
        n, dim = self._rows(q), self._seq_dim
        if self.local_kv:
            for src, rows, dst, _ in segments(self.layout, self.causal, self.world, n, self.rank, self.rank):
                k_full.narrow(dim, dst, rows).copy_(k.narrow(dim, src, rows))
                v_full.narrow(dim, dst, rows).copy_(v.narrow(dim, src, rows))
        if not self.causal:  # slot j holds rank (rank + 1 + j) % W's shard: block b of the all-gather's order is
            shift = (self.rank + 1) * n  # slot (b - rank - 1) % W
            k_full, v_full = k_full.roll(shift, dim), v_full.roll(shift, dim)
        return o, lse, k_full, v_full

    def _side_stream(self, device: torch.device) -> Any:
        """overlap_backward's side stream on `device` (made once, high priority), or None off CUDA (the
        CPU tests: everything in order on the host)."""
        if device.type != "cuda":
            return None
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device, priority=-1)
        return self._streams[device]

    def backward_overlapped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                            do: torch.Tensor, lse: torch.Tensor, pos: tuple) -> tuple:
        """overlap_backward: (dQ, dK, dV) of this rank from the gathered K, V (position order where
        causal): the backward kernel on the peers' runs of key rows (side stream), on this rank's own
        runs (current stream), the reduce-scatter of the peers' partial sums (side stream, after their
        kernels: it runs beside the own runs'), then the own partial sums added to its rows here."""
        n = self._rows(q)
        key = (n, self.rank)  # the rank too: the CPU tests' ranks are copies of one op
        if key not in self._runs:  # made once per size, as _order (gather_order is a Python list of S rows)
            peers, own = backward_runs(self.layout, self.causal, self.world, n, self.rank)
            order = gather_order(self.layout, self.causal, self.world, n)
            # each own run's first row among this rank's rows (the reduce-scatter's output)
            here = [(order[start] if order is not None else start) - self.rank * n for start, _ in own]
            self._runs[key] = (peers, [(start, stop, local) for (start, stop), local in zip(own, here)])
        peers, own = self._runs[key]
        at = getattr(torch.ops.tsgen, f"{self.attention.backward.name}_at")
        dim = self._seq_dim
        q_offset, q_split, q_offset2, _ = pos

        def part(start: int, stop: int) -> tuple:
            """The kernel on key rows [start, stop) (kernel order: their positions from start)."""
            rows = [x.narrow(dim, start, stop - start).contiguous() for x in (k, v)]  # views at batch 1, bshd
            return at(q, *rows, o, do, lse, q_offset, q_split, q_offset2, start)

        main, side = (torch.cuda.current_stream(q.device), self._side_stream(q.device)) if q.is_cuda else (None, None)
        if side is not None:
            side.wait_stream(main)
            for t in (q, k, v, o, do, lse):
                t.record_stream(side)
        with _on(side):
            sent = [part(*run) for run in peers]
        kept = [part(start, stop) for start, stop, _ in own]  # the side stream's priority: the peers' CTAs first
        with _on(side):
            dk_full, dv_full = torch.zeros_like(k), torch.zeros_like(v)  # the own rows' and later keys' zero
            for (start, stop), (_, dk_part, dv_part) in zip(peers, sent):
                dk_full.narrow(dim, start, stop - start).copy_(dk_part)
                dv_full.narrow(dim, start, stop - start).copy_(dv_part)
            # every rank calls the reduce-scatters (a collective), whatever its own inputs need
            dk, dv = self.scatter_kv(dk_full, dv_full)
        if side is not None:
            main.wait_stream(side)
            for t in (dk, dv, *(x for parts in sent for x in parts)):
                t.record_stream(main)
        for (start, stop, local), (_, dk_part, dv_part) in zip(own, kept):
            dk.narrow(dim, local, stop - start).add_(dk_part)
            dv.narrow(dim, local, stop - start).add_(dv_part)
        return _sum([x[0] for x in sent + kept]), dk, dv

    def pushes(self, q: torch.Tensor) -> bool:
        """Whether the backward takes the push= module's path: one given, on CUDA, 2 to PUSH_MAX_WORLD ranks and
        whole PUSH_ROWS-row blocks a rank (otherwise the composed backward: the pair's kernel and the
        reduce-scatters)."""
        rows = self._rows(q)
        return (self.push is not None and q.is_cuda and 2 <= self.world <= PUSH_MAX_WORLD and rows > 0
                and rows % PUSH_ROWS == 0)

    def _push_heap(self, rows: int, k: torch.Tensor) -> "_PushHeap":
        """The KvPush heap and table for `rows` rows a rank of k's batch and dtype (k: the gathered keys); made
        at the first call of each (a collective over the all-gather's group, as the collectives' heaps)."""
        from . import heap as heap_mod

        batch = k.shape[0]
        key = (rows, batch, k.dtype)
        if key not in self._push:
            if torch.cuda.is_current_stream_capturing():
                raise TsgenTorchError(f"{self.where}: the first backward with {rows} rows a rank makes its kv_push heap "
                                      "(a collective with host waits), which cannot happen inside CUDA graph "
                                      "capture; run one step with this shape before capturing (warm-up)")
            elems = k.numel() // self.world  # this rank's rows of the gathered keys
            nbytes = push_heap_bytes(self.world, elems, k.element_size())
            device = k.device.index if k.device.index is not None else torch.cuda.current_device()
            ag = self.allgather
            with torch.cuda.device(device):
                heap, _ = heap_mod.make_heap(nbytes, ag.group, device, getattr(ag, "heap_mode", "auto"),
                                             lambda t: None)
            table = push_table_bytes(self.world, self.rank, rows, reorders(self.layout, self.causal),
                                     list(heap.host_table))
            self._push[key] = _PushHeap(heap, torch.tensor(list(table), dtype=torch.uint8, device=k.device))
            _PUSHING.add(self)
        return self._push[key]

    def backward_push(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                      lse: torch.Tensor, pos: tuple) -> tuple:
        """params.kv_push: (dQ, dK, dV) of this rank from the gathered K, V in one backward call: each block's dK,
        dV partial sums stored at the rank that holds its keys as the block ends (over NVLink for a peer's), then
        this rank's own summed with what every peer stored here (tsgen/attention_bwd.cuh KvPush). No
        reduce-scatter, no reorder of dK, dV."""
        rows = self._rows(q)
        state = self._push_heap(rows, k)
        if state.broken is not None:
            raise TsgenTorchError(f"{self.where}: {state.broken}")
        stream = torch.cuda.current_stream(k.device)
        if state.done is not None:  # the previous call's reduce: before this call's stores and epoch (another stream)
            stream.wait_event(state.done)
        if self.push_before is not None:
            self.push_before()
        try:
            out = self.push.run_backward_push(q, k, v, o, do, lse, pos, state.table, self.world, rows,
                                              self.push_control)
        except TsgenArgumentError:
            raise  # refused before anything was launched: the counters are as they were
        except TsgenTorchError as e:
            state.broken = (f"a kv_push backward with {rows} rows a rank failed ({e}); its heap's call counters may "
                            "be out of step with the peers' (a sum could read a slot of another call without any "
                            "wait failing), so it is not used again (the peers, whose waits for this rank's signal "
                            "time out, trap): close_push() on every rank (a collective) makes a new one at the next "
                            "backward")
            raise
        state.done = torch.cuda.Event()
        state.done.record(stream)
        return out

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: bool = False) -> Any:
        if self.attention.backward is None:
            raise TsgenTorchError(f"{self.where}: no attention_backward module")
        o, lse = _CPAttention.apply(q, k, v, self)
        return (o, lse) if return_lse else o

    def close_push(self) -> None:
        """Free push='s heaps (a collective for CUDA IPC heaps: every rank closes); tsgen.torch.close_all() does
        this too. The next backward makes them again."""
        if not self._push:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # no push kernel still reading or writing a heap (as TorchOp.close)
        problems = []
        for state in self._push.values():
            try:
                state.heap.close()
            except TsgenTorchError as e:
                problems.append(str(e))
        self._push.clear()
        _PUSHING.discard(self)
        if problems:
            raise TsgenTorchError(f"{self.where}: closing its kv_push heaps: {'; '.join(problems)}")

    def close(self) -> None:
        """Unload the attention pair and free push='s heaps (the collectives and the fused forward stay loaded:
        close them, or tsgen.torch.close_all())."""
        try:
            self.close_push()
        finally:
            self.attention.close()


def _collective(given: Any, kind: str, group: Any, arch: str | None, argument: str | None = None) -> Any:
    """A TorchOp of op `kind` on `group`: `given` loaded (a spec, manifest) or one already loaded.
    `argument`: the parameter's name in the refusal (default: `kind`)."""
    op = given if isinstance(given, ops_mod.TorchOp) else ops_mod.load(given, group, arch=arch)
    if op.manifest.op != kind:
        raise TsgenTorchError(f"tsgen.torch.cp_attention: its {argument or kind} argument is {op.manifest.spec}, op "
                              f"{op.manifest.op}, not {kind}")
    return op


def cp_attention(forward: Any, backward: Any, allgather: Any, reduce_scatter: Any, group: Any = None, *,
                 layout: str = "zigzag", regather: bool = False, kv_together: bool = False,
                 overlap_backward: bool = False, fused: Any = None, push: Any = None,
                 arch: str | None = None) -> CPAttentionOp:
    """Context-parallel attention on `group` (default: the default group), differentiable (module doc).
    `forward` / `backward`: an attention and an attention_backward spec computing the same attention
    (as tsgen.torch.attention takes them; world_sizes [1]: single-GPU kernels); `allgather` /
    `reduce_scatter`: specs (or loaded ops) of those collectives compiled for the group's size, in
    the attention's dtype. `layout`: how the sequence is split over the ranks, contiguous or zigzag.
    `regather`: keep the local K, V and gather them again in the backward (less memory, one more
    all-gather) instead of keeping the gathered ones. `kv_together`: K and V in one all-gather, dK
    and dV in one reduce-scatter (half the collective calls, the same bytes; an experiment until
    measured: tools/torch_cp_pieces.py times both). `overlap_backward`: the backward by runs of key
    rows, the peers' rows first, their reduce-scatter on a side stream beside the kernels of this
    rank's own rows (an experiment until measured: module doc; tests/torch_checks.py --cp times it).
    `fused`: a cp_attention spec (or loaded op) computing the same attention with this `layout`, gather
    copy_engine or sm: the forward is then its one call (the gather overlapped with the attention; the
    gathered K, V it leaves are what the backward reads) instead of the all-gathers and the attention
    kernel (examples/torch/specs/cp_attention_hd128_causal_gqa.yaml; module doc). `push`: an attention_backward
    spec of the same attention with params.kv_push (examples/torch/specs/attention_backward_hd128_causal_gqa_push.yaml):
    the backward is then its one call, each block's dK, dV stored at the rank that holds its keys as the block ends
    and summed there (no reduce-scatter, no reorder of dK, dV; CPAttentionOp.backward_push), where it fits
    (pushes(); elsewhere the composed backward). It is loaded unpaired (the forward's autograd pair stays
    `backward`)."""
    if layout not in LAYOUTS:
        raise TsgenTorchError(f"tsgen.torch.cp_attention: layout {layout!r}; one of {', '.join(LAYOUTS)}")
    if backward is None:
        raise TsgenTorchError("tsgen.torch.cp_attention needs the attention_backward spec (its backward runs it)")
    if group is None:
        if not dist.is_initialized():
            raise TsgenTorchError("tsgen.torch.cp_attention: torch.distributed is not initialised; call "
                                  "dist.init_process_group(...) first or pass group=")
        group = dist.group.WORLD
    attn = attention(forward, backward, arch=arch)
    ag = _collective(allgather, "allgather", group, arch)
    rs = _collective(reduce_scatter, "reduce_scatter", group, arch)
    problems = []
    for what, op in (("allgather", ag), ("reduce_scatter", rs)):
        if op.signature.dtype != attn.signature.dtype:
            problems.append(f"{what} {op.manifest.spec} moves {op.signature.dtype}, the attention is "
                            f"{attn.signature.dtype}")
        if op.group_name != ag.group_name or op.world != ag.world:
            problems.append(f"{what} is on group {op.group_name!r} (world {op.world}), not the allgather's")
    if problems:
        raise TsgenTorchError(f"tsgen.torch.cp_attention: {'; '.join(problems)}: compile the collectives for the "
                              "attention's dtype, on one group")
    if fused is not None:
        fused = _collective(fused, "cp_attention", group, arch, "fused")
        problem = fused_problem(fused, attn, layout, ag)
        if problem:
            raise TsgenTorchError(problem)
    if push is not None:
        if overlap_backward:
            raise TsgenTorchError("tsgen.torch.cp_attention: push= and overlap_backward=True are two backwards; "
                                  "give one of them")
        try:
            push = _load_module(push, "attention_backward", arch)
        except TsgenTorchError as e:
            raise TsgenTorchError(f"tsgen.torch.cp_attention: push={push}: {e}") from e
        problem = attn.signature.pair_problem(push.signature)
        if problem or not push.signature.kv_push:
            raise TsgenTorchError(f"tsgen.torch.cp_attention: push={push.signature.spec}: "
                                  + (problem or "has no params.kv_push (set it: the spec's backward_push entry)"))
    return CPAttentionOp(attn, ag, rs, layout, regather, kv_together, overlap_backward, fused, push)


def fused_problem(fused: Any, attn: AttentionOp, layout: str, allgather: Any) -> str | None:
    """Why the loaded cp_attention op `fused` cannot be the forward of cp_attention(attn, layout, ...), or
    None: it must compute the same attention (AGREE), split the sequence the same way, on the
    collectives' group."""
    sig = attn.signature
    if fused.manifest.constants.get("SKIP_WAIT", 0):
        return (f"tsgen.torch.cp_attention: the fused forward {fused.manifest.spec} is a negative control "
                "(params.skip_wait: its kernel does not wait for a peer's chunk and gives wrong results); use the "
                "spec without it")
    diffs = agree_diffs(agree_fields(fused.manifest, fused.source), sig.agreed)
    zigzag = bool(fused.manifest.constants.get("ZIGZAG", 0))
    if zigzag != (layout == "zigzag"):
        diffs.append(f"placement {'zigzag' if zigzag else 'contiguous'} / {layout}")
    if fused.group_name != allgather.group_name:
        diffs.append(f"group {fused.group_name!r} / {allgather.group_name!r}")
    if not diffs:
        return None
    return (f"tsgen.torch.cp_attention: the fused forward {fused.manifest.spec} does not compute "
            f"{sig.spec}'s attention on this layout and group ({'; '.join(diffs)}, fused / the op's): compile it for "
            "the attention's head_dim, heads, kv_heads, causal, dtype, tensors (bshd or bhsd) and softmax_scale, and the "
            "op's layout (contiguous or zigzag)")
