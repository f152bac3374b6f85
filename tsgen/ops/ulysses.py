"""Ulysses sequence parallelism: the all-to-alls around attention (DeepSpeed-Ulysses).

P ranks each hold S/P tokens of a sequence of S (rank r: tokens [r S/P, (r+1) S/P)) with every
head. Attention needs every token of a head, so

  ulysses_pre_a2a   turns rank r's shard [batch, S/P, heads, head_dim] into rank j's
                    [batch, S, heads/P, head_dim] (params.layout bshd) or
                    [batch, heads/P, S, head_dim] (bhsd): every token, heads
                    [j H/P, (j+1) H/P). These are the layouts tsgen's attention kernel reads
                    (tsgen/ops/attention.py, params.layout).
                    With params.packed_qkv the input is one packed tensor
                    [batch, S/P, heads + 2 kv_heads, head_dim] (query heads, then key heads,
                    then value heads: with kv_heads == heads this is [batch, S/P, 3, heads,
                    head_dim]) and the outputs are q [batch, S, heads/P, head_dim] and k, v
                    [batch, S, max(1, kv_heads/P), head_dim] (or bhsd). Grouped-query attention:
                    query head h reads KV head h // (heads / kv_heads), so rank j's query heads
                    need KV heads [j kv_heads/P, (j+1) kv_heads/P) when P divides kv_heads; with
                    fewer KV heads than ranks (P a multiple of kv_heads) rank j gets KV head
                    j kv_heads // P, the one its query heads read: each KV head is REPLICATED on
                    P / kv_heads ranks, as Ulysses requires.
  ulysses_post_a2a  the inverse, for the attention output: rank j's [batch, S, heads/P,
                    head_dim] (or bhsd, params.layout) back into rank r's
                    [batch, S/P, heads, head_dim].

The run-time `count` is the tokens per rank, S/P (like gemm_reduce_scatter's M / world), so
any S divisible by P runs; batch, heads and head_dim are compile-time. A C++ caller with the
sequence length instead calls `<kernel>_launch_seq(..., seq_len, ..., stream)`, which refuses
an S that P does not divide (a message on stderr and cudaErrorInvalidValue, before anything
is launched); in Python `tokens_per_rank` says the same, and `tsgen bench` sizes are S.

The transpose is fused into the exchange: for each destination rank j and each (batch,
token) the rows of j's head group are contiguous in the input, and they land at sequence
offset r S/P of j's output, contiguous too (bshd: one run of S/P x heads/P x head_dim
elements per batch; bhsd: one run of S/P x head_dim per head). Rank r's blocks push these
runs with 16-byte vector loads (read-only path) and stores straight into j's output
(templates/include/tsgen/ulysses.cuh): every input byte is read once and every output byte
written once, no staging buffer and no permute kernel (in packed_qkv with replicated KV
heads a KV head is read once per rank that receives it).

Push, not pull. A store to a peer is posted (the SM does not wait for NVLink's round trip),
so a few loads in flight per thread keep the links busy, while a pull needs enough remote
loads in flight to cover the round trip. Push also lets the caller reuse its input as soon as
its own kernel returns (nobody reads it later), where a pull would need a second signal
telling the owner that every peer has finished reading it. What push costs: the receiver
must say its output may be overwritten (the entry signal below), and must wait for the data.

Synchronization per call e (signals are epoch counters in the symmetric heap, never reset):
  1. entry: block 0 raises entry[r] = e in every peer (release, system scope): "my call e
     started, so whatever read my output of call e-1 on my stream is done".
  2. The BLOCKS / P blocks that push to peer j wait (one thread, acquire) until entry[j] >= e
     in their own memory, copy, and each adds 1 to arrive[r] in j's memory (release, after
     __syncthreads: the block's stores are ordered before it).
  3. One block waits until arrive[j] >= e x BLOCKS/P for every peer j (acquire): when the
     kernel returns, its output is complete, and the next kernel on the stream may read it.
params.arrival_wait false leaves step 3 out: a negative control for the GPU tests (the
output is then not complete when the kernel returns; a consumer on the stream sees holes).

Not a plan (the layout transform is not one of the plan IR's slices): `tsgen verify` has
nothing to check; the tests compare with the NumPy reference below, bit for bit.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ..errors import RuntimeSetupError
from ..runtime.placement import fit_blocks
from ..spec_types import Launch, SpecBase, StrictModel, TestConfig
from .base import Buffer, OpFamily
from .conventions import Baseline, BenchCase, BenchConventions

VEC_BYTES = 16  # one vector load / store
MAX_BLOCKS = 132  # blocks wait on peers: every block of every rank resident at once (one per SM)
ITEMSIZE = 2  # bfloat16 / float16


def tokens_per_rank(seq_len: int, world: int, what: str = "ulysses") -> int:
    """S / P, the run-time `count`; RuntimeSetupError when P does not divide S."""
    if seq_len < 1 or seq_len % world:
        raise RuntimeSetupError(f"{what}: sequence length {seq_len} does not split over {world} ranks "
                                f"(Ulysses needs S divisible by the world size: S / P tokens per rank)")
    return seq_len // world


def kv_heads_per_rank(kv_heads: int, world: int) -> int:
    """KV heads on each rank after the exchange: kv_heads / P, or 1 (replicated) when P > kv_heads."""
    return max(1, kv_heads // world)


def kv_head_base(kv_heads: int, world: int, rank: int) -> int:
    """The first KV head rank `rank` receives: rank kv_heads / P, or rank // (P / kv_heads)."""
    return rank * kv_heads // world


# ---------------------------------------------------------------------------
# Spec
# ---------------------------------------------------------------------------


class UlyssesParams(StrictModel):
    batch: int = Field(1, ge=1, le=4096, description="sequences per call (compile-time)")
    heads: int = Field(32, ge=1, le=1024, description="attention heads (query heads with packed_qkv); every world "
                       "size must divide them")
    head_dim: int = Field(128, ge=8, le=1024, multiple_of=8,
                          description="elements per head (a multiple of 8: rows move as 16-byte vectors)")
    layout: Literal["bshd", "bhsd"] = Field(
        "bshd", description="layout of the full-sequence side (what attention reads or writes): bshd "
        "[batch, seq, heads/P, head_dim], bhsd [batch, heads/P, seq, head_dim]; the sequence-sharded side is "
        "always [batch, seq/P, heads, head_dim]")
    arrival_wait: bool = Field(
        True, description="wait, before the kernel returns, until every peer's data has landed (so the output "
        "is complete on return); false is a NEGATIVE CONTROL for the GPU tests only: the output may then be "
        "incomplete when the kernel returns")


class UlyssesPreParams(UlyssesParams):
    packed_qkv: bool = Field(
        False, description="input is packed [batch, seq/P, heads + 2 kv_heads, head_dim] (query, key, value "
        "heads), outputs q, k and v; KV heads fewer than the world size are replicated (rank j gets KV head "
        "j kv_heads // P, the one its query heads read)")
    kv_heads: int | None = Field(
        None, ge=1, le=1024, description="key/value heads with packed_qkv (default: heads); divides heads; every "
        "world size divides it or is a multiple of it (then KV heads are replicated), and the world sizes are all "
        "<= kv_heads or all >= kv_heads (the k and v buffers have one size formula)")


class UlyssesTest(TestConfig):
    count: int = Field(1001, ge=1, le=1 << 31, description="tokens per rank (S / P)")
    iters: int = Field(20, ge=1, le=100_000, description="back-to-back calls, no reset")


class UlyssesLaunch(Launch):
    blocks: int = Field(64, ge=1, le=1024, description="thread blocks per rank: blocks // P push to each peer "
                        "(the local copy too); at most 132 (they wait on peers), at least the largest world size")
    threads: int = Field(512, ge=32, le=1024, multiple_of=32, description="threads per block")
    unroll: int = Field(4, ge=1, le=16, description="16-byte loads in flight per thread")


class _UlyssesSpec(SpecBase):
    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    launch: UlyssesLaunch = UlyssesLaunch()
    test: UlyssesTest = UlyssesTest()


class UlyssesPreSpec(_UlyssesSpec):
    """Spec of op `ulysses_pre_a2a`: sequence shard of every head -> every token of a head group."""

    op: Literal["ulysses_pre_a2a"]
    params: UlyssesPreParams = UlyssesPreParams()


class UlyssesPostSpec(_UlyssesSpec):
    """Spec of op `ulysses_post_a2a`: every token of a head group -> sequence shard of every head."""

    op: Literal["ulysses_post_a2a"]
    params: UlyssesParams = UlyssesParams()


# ---------------------------------------------------------------------------
# What moves: the tensors of one side, per rank
# ---------------------------------------------------------------------------


def _groups(spec) -> list[tuple[str, int, int]]:
    """(output name, input head offset, heads) of the tensors of the full-sequence side, per
    world size resolved later: [("dst", 0, H)] or q, k, v of the packed input."""
    p = spec.params
    if getattr(p, "packed_qkv", False):
        kv = p.kv_heads or p.heads
        return [("q", 0, p.heads), ("k", p.heads, kv), ("v", p.heads + kv, kv)]
    return [("dst", 0, p.heads)]


def _input_heads(spec) -> int:
    return sum(h for _, _, h in _groups(spec))


def _per_rank_heads(name: str, heads: int, world: int) -> int:
    return kv_heads_per_rank(heads, world) if name in ("k", "v") else heads // world


def _base_head(name: str, heads: int, world: int, rank: int) -> int:
    return kv_head_base(heads, world, rank) if name in ("k", "v") else rank * (heads // world)


# ---------------------------------------------------------------------------
# Bench conventions
# ---------------------------------------------------------------------------


class UlyssesBench(BenchConventions):
    """A size is the sequence length S (rows of the full sequence; count = S / P tokens per rank,
    an error when P does not divide S). algbw bytes = what each rank's outputs receive per call
    (its own share included); busbw = algbw x (P-1)/P, what crosses NVLink, as for all_to_all.
    The device-memory floor counts each input byte read once and each output byte written once.
    Rows carry the bytes one call reads, writes and sends per rank against that minimum
    (`traffic`). Baseline, one process per GPU: PyTorch all_to_all_single (NCCL) with the
    permutes Ulysses implementations do around it (tsgen/bench/ulysses.py)."""

    kind = "collective"
    size_unit = "rows"
    default_sizes = "4K,16K,64K"
    metric = "busbw_GBps"
    baselines = (Baseline("torch_a2a", "torch_a2a"),)

    def group_shape(self, spec):
        """Rows exchanged and their layout: a variant of another shape gets its own baseline."""
        p = spec.params
        kv = f"/qkv{p.kv_heads}" if getattr(p, "packed_qkv", False) else ""  # pre only
        return f"/b{p.batch}/h{p.heads}{kv}/d{p.head_dim}/{p.layout}"

    def case(self, family, spec, world, size):
        count = tokens_per_rank(size, world, spec.name)
        t = family.traffic(spec, world, count)
        return BenchCase(size, count, link_bytes=t["sent_B"], hbm_bytes=t["min_read_B"] + t["min_written_B"],
                         bw_bytes=t["min_written_B"], busbw_factor=(world - 1) / world,
                         fields=tuple(t.items()))

    def bench_inputs(self, family, spec, world, count, rng):
        return family.make_inputs(spec, world, count, rng, pattern=False)


# ---------------------------------------------------------------------------
# Families
# ---------------------------------------------------------------------------


class _UlyssesFamily(OpFamily):
    template = "ulysses.cu.j2"
    category = "sequence"
    count_unit = "rows"  # tokens per rank, S / P
    blocks_wait = True
    bench = UlyssesBench()
    pre: bool

    # -- checks ---------------------------------------------------------------
    def check(self, spec):
        p, problems = spec.params, []
        worlds = list(spec.world_sizes)
        if spec.launch.blocks > MAX_BLOCKS:
            problems.append((("launch", "blocks"), f"its blocks wait on peers: at most {MAX_BLOCKS} (one per SM)"))
        if spec.launch.blocks < max(worlds):
            problems.append((("launch", "blocks"), f"needs at least one block per peer: {max(worlds)} "
                             f"(world size {max(worlds)}), not {spec.launch.blocks}"))
        bad = [w for w in worlds if p.heads % w]
        if bad:
            problems.append((("params", "heads"), f"{p.heads} heads do not split over world size(s) "
                             f"{', '.join(map(str, bad))}: Ulysses gives each rank heads / P heads"))
        if self.pre and (p.kv_heads is not None and not p.packed_qkv):
            problems.append((("params", "kv_heads"), "only with packed_qkv (the single-tensor input has one head "
                             "count, params.heads)"))
        if self.pre and p.packed_qkv:
            kv = p.kv_heads or p.heads
            if kv > p.heads or p.heads % kv:
                problems.append((("params", "kv_heads"), f"{kv} KV heads do not divide {p.heads} query heads"))
            odd = [w for w in worlds if kv % w and w % kv]
            if odd:
                problems.append((("params", "kv_heads"), f"{kv} KV heads neither split over nor replicate evenly "
                                 f"onto world size(s) {', '.join(map(str, odd))} (P must divide kv_heads or be a "
                                 "multiple of it)"))
            elif min(worlds) < kv < max(worlds):
                problems.append((("world_sizes",), f"with {kv} KV heads the world sizes must all be <= {kv} or all "
                                 f">= {kv} (split or replicated KV heads: the k and v buffers have one size "
                                 "formula); use two specs"))
        return problems

    def summary_of(self, spec):
        p = spec.params
        extra = ""
        if self.pre and p.packed_qkv:
            extra = f", packed QKV ({p.heads} query / {p.kv_heads or p.heads} KV heads)"
        wait = "" if p.arrival_wait else " [NEGATIVE CONTROL: no arrival wait]"
        return f"{self.summary} ({p.layout}{extra}){wait}"

    def shared_fit(self, spec, colocated, sms):
        """At least one block per peer at the largest world size."""
        if colocated == 1:
            return {}
        blocks = fit_blocks(spec.launch.blocks, colocated, sms, floor=max(spec.world_sizes))
        return {"launch": {"blocks": blocks}} if blocks != spec.launch.blocks else {}

    # -- ABI --------------------------------------------------------------------
    def constants(self, spec):
        p = spec.params
        c = {"BATCH": p.batch, "HEADS": p.heads, "HEAD_VEC": p.head_dim * ITEMSIZE // VEC_BYTES,
             "BHSD": int(p.layout == "bhsd"), "ARRIVAL_WAIT": int(p.arrival_wait)}
        if self.pre and p.packed_qkv:
            c["KV_HEADS"] = p.kv_heads or p.heads
        c["IN_HEADS"] = _input_heads(spec) if self.pre else p.heads
        return c

    def template_vars(self, spec):
        return {"pre": self.pre, "groups": _groups(spec)}

    def _signals(self, spec):
        wmax = max(spec.world_sizes)
        return (Buffer("entry", "uint64", "signal", per_count=0, fixed=wmax),
                Buffer("arrive", "uint64", "signal", per_count=0, fixed=wmax))

    def bytes_moved(self, spec, world, count):
        return self.traffic(spec, world, count)["sent_B"]

    def traffic(self, spec, world, count) -> dict:
        raise NotImplementedError

    # -- as torch tensors (tsgen.torch) ------------------------------------------
    def torch_tensors(self, constants, world):
        """The data buffers as the tensors tsgen.torch's op takes and returns (tsgen/torch/signature.py),
        read off the manifest's constants: buffer name -> (dims, count dim), dims as (name, size)
        where the count dimension's size is its multiple of count (S/P tokens per rank: 1 on the
        sequence-sharded side, P on the full-sequence side)."""
        c = constants
        batch, head_dim = ("batch", c["BATCH"]), ("head_dim", c["HEAD_VEC"] * VEC_BYTES // ITEMSIZE)

        def shard(heads):  # [batch, S/P, heads, head_dim]
            return (batch, ("S/P", 1), ("heads", heads), head_dim), 1

        def full(name, heads):  # [batch, S, heads/P, head_dim] (bshd) or [batch, heads/P, S, head_dim] (bhsd)
            local = ("kv_heads/P" if name in ("k", "v") else "heads/P", _per_rank_heads(name, heads, world))
            if c["BHSD"]:
                return (batch, local, ("S", world), head_dim), 2
            return (batch, ("S", world), local, head_dim), 1

        if not self.pre:
            return {"src": full("src", c["HEADS"]), "dst": shard(c["HEADS"])}
        if "KV_HEADS" in c:
            kv = c["KV_HEADS"]
            qkv = (batch, ("S/P", 1), ("heads + 2 kv_heads", c["IN_HEADS"]), head_dim), 1
            return {"qkv": qkv, "q": full("q", c["HEADS"]), "k": full("k", kv), "v": full("v", kv)}
        return {"src": shard(c["HEADS"]), "dst": full("dst", c["HEADS"])}

    # -- reference --------------------------------------------------------------
    def make_inputs(self, spec, world, count, rng, pattern):
        """Call 0: the (rank, index) pattern; then random 16-bit patterns (bits, not values: nothing is
        computed, and distinct bits make a misplaced element visible)."""
        out = {}
        for b in self.buffers(spec):
            if b.role != "input":
                continue
            n = b.elems(count, world)
            out[b.name] = [self._bits(spec, n, rng, pattern, r) for r in range(world)]
        return out

    @staticmethod
    def _bits(spec, n, rng, pattern, rank):
        from .base import fill

        if pattern:
            return fill(spec.dtype, n, rng, True, rank)
        bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
        return bits if spec.dtype == "bfloat16" else bits.view(np.float16)


class UlyssesPreFamily(_UlyssesFamily):
    kind = "ulysses_pre_a2a"
    summary = ("Ulysses pre-attention all-to-all: rank r's [batch, S/P, heads, head_dim] -> every token of "
               "heads/P heads on each rank, transpose fused into the push")
    Spec = UlyssesPreSpec
    pre = True

    def buffers(self, spec):
        p = spec.params
        d, worlds = p.head_dim, spec.world_sizes
        out = [Buffer("qkv" if p.packed_qkv else "src", spec.dtype, "input", per_count=p.batch * _input_heads(spec) * d)]
        for name, _, heads in _groups(spec):
            if name in ("k", "v") and max(worlds) > heads:  # replicated: one head of S = P x count rows
                out.append(Buffer(name, spec.dtype, "output", per_count=0, per_world_count=p.batch * d))
            else:  # heads / P heads of P x count rows
                out.append(Buffer(name, spec.dtype, "output", per_count=p.batch * heads * d))
        return tuple(out) + self._signals(spec)

    def reference(self, spec, world, count, inputs):
        p = spec.params
        name = "qkv" if p.packed_qkv else "src"
        # the full sequence, every head: [batch, S, in_heads, d]
        full = np.concatenate([x.reshape(p.batch, count, _input_heads(spec), p.head_dim) for x in inputs[name]], axis=1)
        out = {}
        for tensor, offset, heads in _groups(spec):
            hl = _per_rank_heads(tensor, heads, world)
            per = []
            for j in range(world):
                h0 = offset + _base_head(tensor, heads, world, j)
                part = full[:, :, h0:h0 + hl, :]
                per.append(np.ascontiguousarray(part if p.layout == "bshd" else part.transpose(0, 2, 1, 3)).reshape(-1))
            out[tensor] = per
        return out

    def traffic(self, spec, world, count):
        """Bytes one call reads, writes and sends to peers, per rank, and the least a rank must:
        read its input once, write its outputs once, send every output row not its own once."""
        p = spec.params
        row = p.head_dim * ITEMSIZE * p.batch * count  # one head of every local token
        in_heads = _input_heads(spec)
        out_heads = sum(_per_rank_heads(n, h, world) for n, _, h in _groups(spec))  # per destination
        read = world * out_heads * row  # every destination's head group, each read from the input
        written = world * out_heads * row  # every output element once (ours: from every source)
        return {"read_B": read, "written_B": written, "sent_B": (world - 1) * out_heads * row,
                "min_read_B": in_heads * row, "min_written_B": written,
                "moved_vs_min": (read + written) / (in_heads * row + written)}


class UlyssesPostFamily(_UlyssesFamily):
    kind = "ulysses_post_a2a"
    summary = ("Ulysses post-attention all-to-all: every token of heads/P heads on each rank -> rank r's "
               "[batch, S/P, heads, head_dim], transpose fused into the push")
    Spec = UlyssesPostSpec
    pre = False

    def buffers(self, spec):
        p = spec.params
        n = p.batch * p.heads * p.head_dim
        return (Buffer("src", spec.dtype, "input", per_count=n), Buffer("dst", spec.dtype, "output", per_count=n)
                ) + self._signals(spec)

    def reference(self, spec, world, count, inputs):
        p = spec.params
        hl, seq = p.heads // world, world * count
        parts = []
        for x in inputs["src"]:  # rank j's heads, every token -> [batch, S, hl, d]
            x = x.reshape((p.batch, seq, hl, p.head_dim) if p.layout == "bshd" else (p.batch, hl, seq, p.head_dim))
            parts.append(x if p.layout == "bshd" else x.transpose(0, 2, 1, 3))
        full = np.concatenate(parts, axis=2)  # [batch, S, heads, d]
        return {"dst": [np.ascontiguousarray(full[:, r * count:(r + 1) * count]).reshape(-1) for r in range(world)]}

    def traffic(self, spec, world, count):
        p = spec.params
        total = p.batch * p.heads * p.head_dim * ITEMSIZE * count  # input bytes = output bytes per rank
        return {"read_B": total, "written_B": total, "sent_B": total * (world - 1) // world,
                "min_read_B": total, "min_written_B": total, "moved_vs_min": 1.0}


FAMILIES: list[OpFamily] = [UlyssesPreFamily(), UlyssesPostFamily()]
