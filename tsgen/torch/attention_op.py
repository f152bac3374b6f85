"""tsgen's flash attention on one GPU as one differentiable torch op (issue 35): the forward module
(op `attention`) and its backward module (op `attention_backward`), paired.

    attn = tsgen.torch.attention("specs/attention_hd128.yaml", "specs/attention_backward_hd128.yaml")
    o = attn(q, k, v)                     # q [B, S, H, D], k, v [B, S_kv, H_kv, D] (the specs' layout)
    o, lse = attn(q, k, v, return_lse=True)
    o.backward(do)                        # dQ, dK, dV by tsgen's attention_backward kernels

Two custom ops, one per module, each calling its module's run-time host entry (batch and lengths
at run time; the spec's `batch` is only the runtime's `<kernel>_launch` convention):

    tsgen::<forward>(Tensor q, Tensor k, Tensor v) -> (Tensor o, Tensor lse)        <kernel>_forward
    tsgen::<backward>(Tensor q, Tensor k, Tensor v, Tensor o, Tensor dout, Tensor lse)
        -> (Tensor dq, Tensor dk, Tensor dv)                                        <kernel>_backward

each with a fake kernel (shapes, dtypes, the errors), so torch.compile(fullgraph=True) traces
them. The forward's autograd formula (torch.library.register_autograd, as tsgen.torch's other ops)
keeps q, k, v, O and LSE and calls the backward op: dQ, dK, dV, with GQA's dK and dV summed over
the query heads of a group by the kernel. LSE is returned without a gradient.

No process group and no symmetric heap: every tensor is handed to the kernel by its address, the
outputs and the backward's fp32 workspace are torch.empty on the inputs' GPU (NaN-filled first where
TSGEN_TORCH_POISON=1: the GPU checks' way to make an unwritten element show), and the kernels run
on torch.cuda.current_stream(), so a call is captured by CUDA graphs. The sources compile as the
shared library with the host launchers (toolchain.compile_source mode "shared", cached by content
hash), the entries come through ctypes (runtime.world.own_symbol), as for tsgen.torch.load.

The pair must agree on what both compute (head_dim, heads, kv_heads, causal, dtype, layout and the
softmax scale, read from the manifest's constants and the rendered source); `attention` refuses a
pair that does not, naming each difference. Positions start at 0 for queries and keys (causal:
query i sees keys 0..i, top-left aligned as torch's scaled_dot_product_attention(is_causal=True)).
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch

from ..errors import TsgenError
from ..manifest import Manifest
from ..ops.attention_backward import workspace_floats
from ..runtime.world import own_symbol
from . import ops as ops_mod
from .signature import TsgenArgumentError, TsgenTorchError

_MODULES: dict[str, "_Module"] = {}  # module name -> the loaded module (forward or backward)
_PAIRS: dict[str, str] = {}  # forward module name -> the backward module its autograd formula calls
PUSH_SKIP_WAIT, PUSH_SIGNAL_FIRST = 1, 2  # <kernel>_backward_push's negative controls (its `control` argument)
# <kernel>_backward_push: a rank's rows a multiple of this (each consumer warpgroup's 64 keys have one owner, and
# the zig-zag chunks, half a rank's rows, are whole warpgroup blocks)
PUSH_ROWS = 128
ALIGN = 16  # TMA (the forward's tensor maps) wants 16-byte aligned addresses; the backward's vector loads too
_SCALE = re.compile(r"^// softmax scale ([0-9.eE+-]+);", re.MULTILINE)  # the templates' header comment
_ENTRY = {"attention": "forward", "attention_backward": "backward"}  # op kind -> its host entry's suffix
AGREE = ("head_dim", "heads", "kv_heads", "causal", "layout", "dtype", "scale")  # what a pair must share


def _output(*args, like: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """torch.empty (or empty_like `like`), NaN-filled where TSGEN_TORCH_POISON=1 (read at every call):
    tests/torch_checks.py --attention sets it so that an element the kernels leave unwritten reads NaN,
    whatever block the caching allocator hands out. Off (the default) it is torch.empty alone."""
    t = torch.empty_like(like) if like is not None else torch.empty(*args, **kwargs)
    if os.environ.get("TSGEN_TORCH_POISON") == "1":
        t.fill_(float("nan"))
    return t


def agree_fields(manifest: Manifest, source: Path) -> dict[str, Any]:
    """AGREE's fields of a module that computes attention (an attention or attention_backward module, or
    cp_attention's fused forward), read off its manifest's constants and its source's softmax scale line;
    TsgenTorchError naming what is missing."""
    where = f"tsgen::{manifest.name}"
    c = manifest.constants
    missing = [n for n in ("HEAD_DIM", "HEADS", "KV_HEADS", "CAUSAL", "BHSD") if n not in c]
    q = next((b for b in manifest.buffers if b.name == "q"), None)
    if missing or q is None:
        raise TsgenTorchError(f"{where}: {manifest.spec}'s manifest has no {', '.join(missing) or 'buffer q'}")
    try:
        found = _SCALE.search(Path(source).read_text(errors="replace"))
    except OSError as e:
        raise TsgenTorchError(f"{where}: cannot read {source}: {e.strerror or e}") from None
    if found is None:
        raise TsgenTorchError(f"{where}: {source} names no softmax scale (its '// softmax scale' line)")
    return {"head_dim": int(c["HEAD_DIM"]), "heads": int(c["HEADS"]), "kv_heads": int(c["KV_HEADS"]),
            "causal": bool(c["CAUSAL"]), "layout": "bhsd" if c["BHSD"] else "bshd", "dtype": q.dtype,
            "scale": float(found[1])}


def agree_diffs(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """AGREE's fields where two attention modules differ, as "name mine / theirs" (the refusals' words;
    the tensor layout, bshd or bhsd, as "tensors")."""
    return [f"{'tensors' if f == 'layout' else f} {mine[f]} / {theirs[f]}" for f in AGREE if mine[f] != theirs[f]]


@dataclass(frozen=True)
class AttentionSignature:
    """One attention module as a torch op: its shape constants, layout, element type and softmax
    scale. Pure Python: the fake kernels, the real ones and the CPU tests share the checks."""

    module: str
    op: str  # "attention" or "attention_backward"
    spec: str
    head_dim: int
    heads: int
    kv_heads: int
    causal: bool
    layout: str  # "bshd" or "bhsd"
    dtype: str
    scale: float
    blocks: int = 0  # the forward's launch.blocks (0: one CTA per tile)
    deterministic: bool = False  # the backward's params.deterministic: its workspace holds the dQ semaphores too
    tail_items: int = 0  # the backward's params.tail_split (manifest TAIL_SPLIT): its workspace holds its slots too
    kv_push: bool = False  # the backward's params.kv_push: it has <kernel>_backward_push (tsgen.torch.cp_attention)

    @classmethod
    def of(cls, manifest: Manifest, source: Path) -> "AttentionSignature":
        if manifest.op not in _ENTRY:
            raise TsgenTorchError(f"tsgen::{manifest.name}: {manifest.spec} is op {manifest.op}, not attention or "
                                  "attention_backward")
        c = manifest.constants
        return cls(manifest.name, manifest.op, manifest.spec, **agree_fields(manifest, source),
                   blocks=int(c.get("BLOCKS", 0)), deterministic=bool(c.get("DETERMINISTIC", 0)),
                   tail_items=int(c.get("TAIL_SPLIT", 0)), kv_push=bool(c.get("KV_PUSH", 0)))

    @property
    def agreed(self) -> dict[str, Any]:
        """AGREE's fields of this module (what agree_fields read off its manifest)."""
        return {f: getattr(self, f) for f in AGREE}

    @property
    def qualname(self) -> str:
        return f"tsgen::{self.module}"

    def where(self, arg: str) -> str:
        return f"{self.qualname}: argument {arg}"

    def described(self, kv: bool) -> str:
        """The shape a tensor must have, in words: [batch, S, heads 32, head_dim 128] (q, o, dout) or
        [batch, S_kv, kv_heads 8, head_dim 128] (k, v); bhsd puts the heads before the sequence."""
        seq, heads = ("S_kv", f"kv_heads {self.kv_heads}") if kv else ("S", f"heads {self.heads}")
        dims = ["batch", seq, heads] if self.layout == "bshd" else ["batch", heads, seq]
        return "[" + ", ".join(dims + [f"head_dim {self.head_dim}"]) + "]"

    def _dims(self, arg: str, meta: tuple, kv: bool) -> tuple[Any, Any]:
        """(batch, sequence length) of a q-like (kv False) or k-like tensor given as (shape, torch dtype
        name, contiguous); a TsgenArgumentError naming the argument when the op cannot take it."""
        shape, dtype, contiguous = meta
        if dtype != self.dtype:
            raise TsgenArgumentError(f"{self.where(arg)}: dtype {dtype}, but {self.spec} was compiled for {self.dtype}")
        if len(shape) != 4:
            raise TsgenArgumentError(f"{self.where(arg)}: {len(shape)} dimensions (shape {tuple(shape)}), but "
                                     f"{self.qualname} takes {self.described(kv)}")
        h, s = (2, 1) if self.layout == "bshd" else (1, 2)
        for i, name, n in ((h, "kv_heads" if kv else "heads", self.kv_heads if kv else self.heads),
                           (3, "head_dim", self.head_dim)):
            if shape[i] != n:
                raise TsgenArgumentError(f"{self.where(arg)}: dimension {i} ({name}) is {shape[i]} (shape "
                                         f"{tuple(shape)}), but {self.spec} was compiled for {name} {n}: "
                                         f"{self.qualname} takes {self.described(kv)}")
        if not contiguous:
            raise TsgenArgumentError(f"{self.where(arg)}: not contiguous (shape {tuple(shape)}); call .contiguous() "
                                     f"first (the kernel reads one dense {self.layout} buffer)")
        return shape[0], shape[s]

    def _same(self, arg: str, got: tuple, want: tuple, like: str, shape: Sequence[Any]) -> None:
        if got[0] != want[0] or got[1] != want[1]:
            raise TsgenArgumentError(f"{self.where(arg)}: batch {got[0]} and length {got[1]} (shape {tuple(shape)}), "
                                     f"but {like} has batch {want[0]} and length {want[1]}")

    def check_forward(self, metas: Sequence[tuple]) -> tuple[Any, Any, Any]:
        """(batch, q_len, kv_len) of a forward call on (q, k, v) given as _dims takes them."""
        if len(metas) != 3:
            raise TsgenArgumentError(f"{self.qualname}: {len(metas)} tensors, but it takes 3 (q, k, v)")
        batch, q_len = self._dims("q", metas[0], False)
        kb, kv_len = self._dims("k", metas[1], True)
        if kb != batch:
            raise TsgenArgumentError(f"{self.where('k')}: batch {kb} (shape {tuple(metas[1][0])}), but q's is {batch}")
        self._same("v", self._dims("v", metas[2], True), (kb, kv_len), "k", metas[2][0])
        if kv_len == 0:
            raise TsgenArgumentError(f"{self.where('k')}: no keys (shape {tuple(metas[1][0])}); every query "
                                     "needs a key to attend to")
        return batch, q_len, kv_len

    def lse_shape(self, batch: Any, q_len: Any) -> tuple:
        """LSE: float32 [batch, heads, S] whatever the layout (the forward's convention, natural log)."""
        return (batch, self.heads, q_len)

    def check_backward(self, metas: Sequence[tuple]) -> tuple[Any, Any, Any]:
        """(batch, q_len, kv_len) of a backward call on (q, k, v, o, dout, lse)."""
        if len(metas) != 6:
            raise TsgenArgumentError(f"{self.qualname}: {len(metas)} tensors, but it takes 6 (q, k, v, o, dout, lse)")
        batch, q_len, kv_len = self.check_forward(metas[:3])
        for arg, meta in (("o", metas[3]), ("dout", metas[4])):
            self._same(arg, self._dims(arg, meta, False), (batch, q_len), "q", meta[0])
        shape, dtype, contiguous = metas[5]
        want = self.lse_shape(batch, q_len)
        if dtype != "float32" or len(shape) != 3 or any(g != w for g, w in zip(shape, want)) or not contiguous:
            got = f"dtype {dtype}, shape {tuple(shape)}{'' if contiguous else ', not contiguous'}"
            raise TsgenArgumentError(f"{self.where('lse')}: {got}, but the forward's LSE for this q is float32 "
                                     f"{tuple(want)} [batch, heads, S], contiguous")
        return batch, q_len, kv_len

    def check_positions(self, positions: Sequence[Any] | None, q_len: Any) -> tuple:
        """(q_offset, q_split, q_offset2, kv_offset) for the run-time entries: query row r sits at
        position q_offset + r (r < q_split) or q_offset2 + r - q_split, key row j at kv_offset + j
        (the templates' convention). None: (0, q_len, 0, 0), positions from 0. Offsets >= 0 and
        0 <= q_split <= q_len, else a TsgenArgumentError naming the value."""
        if positions is None:
            return (0, q_len, 0, 0)
        pos = tuple(positions)
        if len(pos) != 4:
            raise TsgenArgumentError(f"{self.qualname}: positions {pos}: give 4 integers (q_offset, q_split, "
                                     "q_offset2, kv_offset)")
        q_offset, q_split, q_offset2, kv_offset = pos
        for name, value in (("q_offset", q_offset), ("q_offset2", q_offset2), ("kv_offset", kv_offset)):
            if value < 0:
                raise TsgenArgumentError(f"{self.qualname}: {name} {value}: positions are >= 0")
        if not 0 <= q_split <= q_len:
            raise TsgenArgumentError(f"{self.qualname}: q_split {q_split}: the first query segment's rows, "
                                     f"0..q_len ({q_len})")
        return pos

    def pair_problem(self, backward: "AttentionSignature") -> str | None:
        """Why `backward` cannot be this forward's backward, or None: the op kinds, and every field of
        AGREE that differs."""
        if self.op != "attention" or backward.op != "attention_backward":
            return (f"tsgen.torch.attention(forward, backward) takes an attention spec and an attention_backward "
                    f"spec, not {self.op} ({self.spec}) and {backward.op} ({backward.spec})")
        diffs = agree_diffs(self.agreed, backward.agreed)
        if not diffs:
            return None
        return (f"tsgen.torch.attention: {self.spec} ({self.qualname}) and {backward.spec} ({backward.qualname}) "
                f"do not compute the same attention ({'; '.join(diffs)}, forward / backward): compile the backward "
                "spec for the forward's head_dim, heads, kv_heads, causal, dtype, tensors (bshd or bhsd) and softmax_scale")


# The host entries' argument types (the generated sources' `<kernel>_forward` and `<kernel>_backward`).
_VP, _U64, _I64 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64
_BACKWARD_ARGS = [_VP] * 12 + [_U64] * 3 + [_I64] * 4  # tensors, sizes, positions (before the stream)
_ARGTYPES = {"forward": [_VP] * 5 + [_U64] * 3 + [_I64] * 4 + [_VP, _U64, _U64, ctypes.c_int, _VP],
             "backward": _BACKWARD_ARGS + [_VP],
             # params.kv_push's <kernel>_backward_push: the backward's, then the KvPush table and the control
             "backward_push": _BACKWARD_ARGS + [_VP, ctypes.c_int, _VP]}


class _BackwardCall(NamedTuple):
    """A backward call's checked arguments (_Module._backward_call): the six inputs (dout aligned), the sizes, the
    query positions, the device, dQ, and the fp32 workspace (None: no query, nothing to launch)."""
    tensors: tuple
    batch: int
    q_len: int
    kv_len: int
    pos: tuple
    device: int
    dq: torch.Tensor
    work: tuple | None

    def where(self) -> str:
        """The call's sizes and positions, for a launch's error message."""
        return f"batch {self.batch}, S {self.q_len}, S_kv {self.kv_len}, positions {self.pos}"


class _Module:
    """One compiled attention module: its signature and its host entry, per GPU architecture (compiled
    on first use of an architecture; at load for the current GPU's). Without CUDA it only traces."""

    def __init__(self, manifest: Manifest, source: Path, signature: AttentionSignature, arch: str | None):
        self.manifest, self.source, self.signature, self.arch = manifest, source, signature, arch
        self.name = manifest.name
        self.entry = self.entry_name(_ENTRY[manifest.op])
        self._fns: dict[tuple[str, str], Any] = {}  # (architecture, entry suffix) -> the entry
        self._archs: dict[int, str] = {}  # device index -> its architecture
        self.trace_only = not torch.cuda.is_available()
        if not self.trace_only:
            self._fn(torch.cuda.current_device())  # compile now: a build error belongs to load

    def __repr__(self) -> str:
        return f"<{self.signature.qualname} ({self.signature.spec}){' trace only' if self.trace_only else ''}>"

    def entry_name(self, suffix: str) -> str:
        """The host entry <kernel>_<suffix> of this module (forward, backward, backward_push)."""
        return f"{self.manifest.kernel(1).name}_{suffix}"

    def _fn(self, device: int, suffix: str | None = None) -> Any:
        """The host entry <kernel>_<suffix> (default: the op's, forward or backward) for `device`'s architecture."""
        suffix = suffix or _ENTRY[self.manifest.op]
        arch = self._archs.get(device)
        if arch is None:
            arch = self._archs[device] = self.arch or ops_mod._arch(device)
        fn = self._fns.get((arch, suffix))
        if fn is None:
            from ..toolchain import compile_source

            try:
                binary = compile_source(self.source, arch=arch, mode="shared").output
                fn = own_symbol(ctypes.CDLL(str(binary)), binary, self.entry_name(suffix))
            except (TsgenError, OSError) as e:
                raise TsgenTorchError(f"{self.signature.qualname}: loading {self.source.name} for {arch}: {e}") from e
            fn.restype = ctypes.c_int
            fn.argtypes = _ARGTYPES[suffix]
            self._fns[(arch, suffix)] = fn
        return fn

    def _device(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """The GPU every tensor is on, each at an ALIGN-aligned address; TsgenArgumentError naming
        the first that is not."""
        sig = self.signature
        if self.trace_only:
            raise TsgenTorchError(f"{sig.qualname}: loaded where CUDA is not available: it traces (fake kernels) "
                                  "but does not run")
        first = named[0][1].device
        for arg, t in named:
            if t.device.type != "cuda" or t.device != first:
                raise TsgenArgumentError(f"{sig.where(arg)}: on {t.device}, but the op runs on the GPU of "
                                         f"{named[0][0]} ({first}); every tensor on that one CUDA device")
            if t.data_ptr() % ALIGN:
                raise TsgenArgumentError(f"{sig.where(arg)}: its address is not {ALIGN}-byte aligned (a view that "
                                         "starts inside an element row?); pass .clone() (the kernel's tensor maps "
                                         "and vector loads need it)")
        return first.index if first.index is not None else torch.cuda.current_device()

    def _launch(self, device: int, args: list, what: str, suffix: str | None = None) -> None:
        err = ops_mod.call_on_stream(device, self._fn(device, suffix), args)
        if err != 0:
            entry = self.entry_name(suffix or _ENTRY[self.manifest.op])
            raise TsgenTorchError(f"{self.signature.qualname}: {entry} failed with cudaError {err} ({what}); a "
                                  "kernel that trapped before leaves this error: tsgen.torch.synchronize() names it")

    def run_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    positions: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """O and LSE; `positions` (q_offset, q_split, q_offset2, kv_offset) as check_positions takes
        them (None: from 0, one query segment)."""
        sig = self.signature
        batch, q_len, kv_len = sig.check_forward(ops_mod._metas((q, k, v)))
        pos = sig.check_positions(positions, q_len)
        device = self._device((("q", q), ("k", k), ("v", v)))
        o = _output(like=q)
        lse = _output(sig.lse_shape(batch, q_len), dtype=torch.float32, device=q.device)
        if batch * q_len == 0:
            return o, lse
        # the query rows' positions (two segments: zig-zag), the keys' from kv_offset, no KV waits
        self._launch(device, [q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), batch, q_len,
                              kv_len, *pos, None, 0, 0, sig.blocks],
                     f"batch {batch}, S {q_len}, S_kv {kv_len}, positions {pos}")
        return o, lse

    def _backward_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, dout: torch.Tensor,
                       lse: torch.Tensor, positions: Sequence[int] | None) -> _BackwardCall:
        """A backward call's checked arguments (_BackwardCall); its workspace None for batch x q_len = 0 (nothing to
        launch)."""
        sig = self.signature
        if dout.is_contiguous() and dout.data_ptr() % ALIGN:
            dout = dout.clone()  # an output gradient is autograd's, at any address: the kernel's copy is aligned
        tensors = (q, k, v, o, dout, lse)
        batch, q_len, kv_len = sig.check_backward(ops_mod._metas(tensors))
        pos = sig.check_positions(positions, q_len)
        device = self._device(tuple(zip(("q", "k", "v", "o", "dout", "lse"), tensors)))
        dq = _output(like=q)
        if batch * q_len == 0:
            return _BackwardCall(tensors, batch, q_len, kv_len, pos, device, dq, None)
        # the workspace: dQ's fp32 accumulator (deterministic: and the dQ semaphores; tail_split: and the tail
        # slots), D and LSE in base 2
        work = tuple(_output(n, dtype=torch.float32, device=q.device)
                     for n in workspace_floats(batch, q_len, sig.heads, sig.head_dim, sig.deterministic,
                                               sig.tail_items))
        return _BackwardCall(tensors, batch, q_len, kv_len, pos, device, dq, work)

    def run_backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, dout: torch.Tensor,
                     lse: torch.Tensor, positions: Sequence[int] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dQ, dK, dV; `positions` as run_forward's (the forward's)."""
        c = self._backward_call(q, k, v, o, dout, lse, positions)
        if c.work is None:  # no query: nothing flows to the keys
            return c.dq, torch.zeros_like(k), torch.zeros_like(v)
        dk, dv = _output(like=k), _output(like=v)
        self._launch(c.device, [t.data_ptr() for t in (*c.tensors, c.dq, dk, dv, *c.work)]
                     + [c.batch, c.q_len, c.kv_len, *c.pos], c.where())
        return c.dq, dk, dv

    def run_backward_push(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                          dout: torch.Tensor, lse: torch.Tensor, positions: Sequence[int], table: torch.Tensor,
                          world: int, rows: int, control: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """params.kv_push: dQ, and this rank's `rows` rows of dK, dV summed over the `world` ranks of the table
        (tsgen::attention_bwd::KvPush, made by tsgen.torch.cp_attention: k, v are the keys gathered from
        every rank, kv_len = world x rows). A collective: every rank of the table calls it, in the same order.
        `control`: the GPU checks' negative controls (wrong sums): PUSH_SKIP_WAIT, the sums without waiting for the
        peers; PUSH_SIGNAL_FIRST, the signal to the owners before this rank's stores."""
        sig = self.signature
        if not sig.kv_push:
            raise TsgenTorchError(f"{sig.qualname}: {sig.spec} has no params.kv_push, so no <kernel>_backward_push")
        c = self._backward_call(q, k, v, o, dout, lse, positions)
        if c.work is None or c.kv_len != world * rows or rows % PUSH_ROWS:
            raise TsgenArgumentError(f"{sig.where('k')}: {c.kv_len} gathered rows for {world} ranks of {rows} rows "
                                     f"and {c.q_len} queries: the push backward takes world x rows keys, rows a "
                                     f"multiple of {PUSH_ROWS}, and at least one query")
        shape = list(k.shape)
        shape[1 if sig.layout == "bshd" else 2] = rows  # the sequence's dimension: this rank's rows
        dk, dv = (_output(shape, dtype=k.dtype, device=k.device) for _ in range(2))
        self._launch(c.device, [t.data_ptr() for t in (*c.tensors, c.dq, dk, dv, *c.work)]
                     + [c.batch, c.q_len, c.kv_len, *c.pos, table.data_ptr(), int(control)],
                     f"{c.where()}, rows {rows}", suffix="backward_push")
        return c.dq, dk, dv


def _module(name: str) -> _Module:
    module = _MODULES.get(name)
    if module is None:
        raise TsgenTorchError(f"tsgen::{name} is not loaded in this process; call tsgen.torch.attention(...) first")
    return module


def _define_forward(name: str) -> None:
    """tsgen::<name>(q, k, v) -> (o, lse): the real kernel, the fake kernel, and the autograd formula
    (the paired backward module's op; LSE carries no gradient)."""
    lib = ops_mod._library()
    qual = f"tsgen::{name}"
    lib.define(f"{name}(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)")

    def real(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        return _module(name).run_forward(q, k, v)

    def fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        sig = _module(name).signature
        batch, q_len, _ = sig.check_forward(ops_mod._metas((q, k, v)))
        return q.new_empty(q.shape), q.new_empty(sig.lse_shape(batch, q_len), dtype=torch.float32)

    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.save_for_backward(*inputs, *output)
        ctx.mark_non_differentiable(output[1])
        # LSE's gradient stays None rather than a tensor of zeros the engine would fill each call (a fill kernel
        # and tens of us of host time: tools/torch_op_overhead.py); so does O's where nothing used it
        ctx.set_materialize_grads(False)

    def backward(ctx: Any, do: torch.Tensor | None, dlse: Any) -> tuple:
        adjoint = _PAIRS.get(name)
        if adjoint is None:
            raise TsgenTorchError(f"{qual} has no backward: load it with its attention_backward spec, "
                                  "tsgen.torch.attention(forward_spec, backward_spec)")
        if do is None:  # O did not reach the loss (only LSE, which carries no gradient): nothing flows back
            return None, None, None
        q, k, v, o, lse = ctx.saved_tensors
        grads = getattr(torch.ops.tsgen, adjoint)(q, k, v, o, do.contiguous(), lse)
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))

    torch.library.impl(qual, "default", real, lib=lib)
    torch.library.register_fake(qual, fake, lib=lib)
    torch.library.register_autograd(qual, backward, setup_context=setup_context, lib=lib)

    # tsgen::<name>_at: the same kernel at given positions (no autograd formula of its own:
    # tsgen.torch.cp_attention's autograd.Function calls it and the backward's _at op)
    lib.define(f"{name}_at(Tensor q, Tensor k, Tensor v, SymInt q_offset, SymInt q_split, SymInt q_offset2, "
               "SymInt kv_offset) -> (Tensor, Tensor)")

    def real_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *positions: int) -> tuple:
        return _module(name).run_forward(q, k, v, positions)

    def fake_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *positions: Any) -> tuple:
        sig = _module(name).signature
        batch, q_len, _ = sig.check_forward(ops_mod._metas((q, k, v)))
        if all(isinstance(p, int) for p in positions):
            sig.check_positions(positions, q_len)
        return q.new_empty(q.shape), q.new_empty(sig.lse_shape(batch, q_len), dtype=torch.float32)

    torch.library.impl(f"{qual}_at", "default", real_at, lib=lib)
    torch.library.register_fake(f"{qual}_at", fake_at, lib=lib)


def _define_backward(name: str) -> None:
    """tsgen::<name>(q, k, v, o, dout, lse) -> (dq, dk, dv): the real and the fake kernel (no autograd
    formula of its own: no double backward)."""
    lib = ops_mod._library()
    qual = f"tsgen::{name}"
    lib.define(f"{name}(Tensor q, Tensor k, Tensor v, Tensor o, Tensor dout, Tensor lse) -> (Tensor, Tensor, Tensor)")

    def real(*tensors: torch.Tensor) -> tuple:
        return _module(name).run_backward(*tensors)

    def fake(*tensors: torch.Tensor) -> tuple:
        _module(name).signature.check_backward(ops_mod._metas(tensors))
        return tuple(t.new_empty(t.shape) for t in tensors[:3])

    torch.library.impl(qual, "default", real, lib=lib)
    torch.library.register_fake(qual, fake, lib=lib)

    # tsgen::<name>_at: at given positions (the forward's _at op's)
    lib.define(f"{name}_at(Tensor q, Tensor k, Tensor v, Tensor o, Tensor dout, Tensor lse, SymInt q_offset, "
               "SymInt q_split, SymInt q_offset2, SymInt kv_offset) -> (Tensor, Tensor, Tensor)")

    def real_at(q, k, v, o, dout, lse, *positions: int) -> tuple:
        return _module(name).run_backward(q, k, v, o, dout, lse, positions)

    def fake_at(q, k, v, o, dout, lse, *positions: Any) -> tuple:
        tensors = (q, k, v, o, dout, lse)
        sig = _module(name).signature
        _, q_len, _ = sig.check_backward(ops_mod._metas(tensors))
        if all(isinstance(p, int) for p in positions):
            sig.check_positions(positions, q_len)
        return tuple(t.new_empty(t.shape) for t in tensors[:3])

    torch.library.impl(f"{qual}_at", "default", real_at, lib=lib)
    torch.library.register_fake(f"{qual}_at", fake_at, lib=lib)


def _load_module(given: Any, kind: str, arch: str | None) -> _Module:
    """The module of a spec, manifest or LoadedSpec (ops._resolve), of op `kind`: loaded before, or
    loaded and its op defined now."""
    manifest, source = ops_mod._resolve(given, None)
    if manifest.op != kind:
        which = "first" if kind == "attention" else "second"
        raise TsgenTorchError(f"tsgen.torch.attention: {manifest.spec} is op {manifest.op}; its {which} argument "
                              f"is an {kind} spec")
    name, sha = manifest.name, manifest.spec_sha256
    if name in _MODULES:
        module = _MODULES[name]
        if module.manifest.spec_sha256 != sha:
            raise TsgenTorchError(f"tsgen::{name}: already loaded from another spec ({module.manifest.spec}, sha256 "
                                  f"{module.manifest.spec_sha256[:12]}); give the new spec another name")
        return module
    if ops_mod._DEFINED.get(name, sha) != sha:
        raise TsgenTorchError(f"tsgen::{name}: another spec of this name (sha256 {ops_mod._DEFINED[name][:12]}) "
                              "defined the op in this process; one module name is one op: give the spec another name")
    module = _Module(manifest, source, AttentionSignature.of(manifest, source), arch)
    if name not in ops_mod._DEFINED:
        (_define_forward if kind == "attention" else _define_backward)(name)
        ops_mod._DEFINED[name] = sha
    _MODULES[name] = module
    return module


class AttentionOp:
    """tsgen's attention on one GPU as a torch op: `op(q, k, v)` is O, differentiable through the
    paired backward module; `op(q, k, v, return_lse=True)` is (O, LSE); `op.grads(q, k, v, o, dout,
    lse)` calls the backward op alone. `signature` says what it takes."""

    def __init__(self, forward: _Module, backward: _Module | None):
        self.forward, self.backward = forward, backward

    @property
    def signature(self) -> AttentionSignature:
        return self.forward.signature

    def __repr__(self) -> str:
        back = self.backward.signature.qualname if self.backward else "no backward"
        return f"<tsgen.torch attention {self.signature.qualname} + {back}>"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: bool = False) -> Any:
        o, lse = getattr(torch.ops.tsgen, self.forward.name)(q, k, v)
        return (o, lse) if return_lse else o

    def grads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, dout: torch.Tensor,
              lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dQ, dK, dV) of O for the output gradient `dout`, from the forward's O and LSE (no autograd)."""
        if self.backward is None:
            raise TsgenTorchError(f"{self.signature.qualname}: loaded without its attention_backward spec")
        return getattr(torch.ops.tsgen, self.backward.name)(q, k, v, o, dout, lse)

    def close(self) -> None:
        """Unpair and unload: the ops then raise when called (their definitions stay in the process)."""
        _PAIRS.pop(self.forward.name, None)
        _MODULES.pop(self.forward.name, None)
        if self.backward is not None and self.backward.name not in _PAIRS.values():
            _MODULES.pop(self.backward.name, None)


def attention(forward: Any, backward: Any = None, *, arch: str | None = None) -> AttentionOp:
    """tsgen's attention on this process's GPUs: `forward` an `attention` spec, `backward` (optional:
    without it the op has no backward) an `attention_backward` spec computing the same attention;
    each a spec file (.yaml, rendered into the compile cache), a manifest (NAME.json, its NAME.cu
    beside it), or a tsgen.spec.LoadedSpec (spec_variant). `arch`: nvcc's target (default: each
    GPU's, sm_90a on Hopper). Compiles both modules (where CUDA is available; else the ops only
    trace) and defines tsgen::<forward> and tsgen::<backward>. A forward module has one backward:
    loading it again with another raises (close() the first)."""
    fwd = _load_module(forward, "attention", arch)
    bwd = _load_module(backward, "attention_backward", arch) if backward is not None else None
    if bwd is not None:
        problem = fwd.signature.pair_problem(bwd.signature)
        if problem:
            raise TsgenTorchError(problem)
        paired = _PAIRS.get(fwd.name)
        if paired not in (None, bwd.name):
            raise TsgenTorchError(f"tsgen::{fwd.name} is paired with tsgen::{paired} already; a forward module has "
                                  "one backward (its autograd formula): close() that op first")
        _PAIRS[fwd.name] = bwd.name
    return AttentionOp(fwd, bwd)
