"""tsgen.torch on GPUs, one process per GPU: run under torchrun (tools/gpu_torch.sh does, and so does
tests/test_torch_gpu.py where there are 2 GPUs and torch):

    torchrun --nproc-per-node 2 tests/torch_checks.py            # the checks, NCCL group
    torchrun --nproc-per-node 2 tests/torch_checks.py --probe    # a peer that never arrives, gloo group
    TSGEN_SHARE_GPUS=1 torchrun --nproc-per-node 4 tests/torch_checks.py --shared   # 4 ranks, one GPU, MPS
    torchrun --nproc-per-node 2 tests/torch_checks.py --cp       # cp_attention fwd + bwd, NCCL group
    TSGEN_SHARE_GPUS=1 torchrun --nproc-per-node 4 tests/torch_checks.py --cp --shared   # on one GPU, MPS

Checks (each a line `CHECK name PASS|FAIL detail`, rank 0 printing every rank's detail):
  fused_*: allgather_gemm / gemm_reduce_scatter (the specs examples/torch/tp_mlp.py loads) against
    NCCL + cuBLAS, the gathered A bit for bit, their gradients against the twins' autograd,
    AG-GEMM -> GEMM-RS in a CUDA graph, 20 replays against eager calls; the out= form bit for bit
    against the functional form (C in place, at an unaligned address, the gathered A in the heap
    slot empty_out gives) and in a CUDA graph, 20 replays;
  moe_*: MoE dispatch / combine against all_to_all_single with the routing's splits + index_add,
    bit for bit on integer rows; the input gradient; dispatch -> combine in a CUDA graph, 20 replays;
  ulysses_*: Ulysses pre / post all-to-alls (and the packed GQA pre) against the twins
    (all_to_all_single + permutes), bit for bit; their gradients against the twins' autograd;
    pre -> post in a CUDA graph, 100 replays;
  allgather / reduce_scatter against torch.distributed's all_gather_into_tensor /
    reduce_scatter_tensor (NCCL) on random data: integer-valued (every sum exact: bit-equal) and
    normal (close), shapes with odd sizes, the heap's output buffer poisoned before every call;
  all_reduce_one_shot / all_to_all / broadcast against all_reduce / all_to_all_single / broadcast,
    bit for bit (integer data for the sum);
  zero_copy: an input from op.empty() is read in place (no copy) and gives the same result;
  out_form: the out= form of allgather (into empty_out's heap slot and into a plain tensor) and
    reduce_scatter, exact against NCCL;
  graph: allgather -> reduce_scatter captured in one torch.cuda.CUDAGraph, 100 replays with new
    data each, every replay checked;
  grad: autograd through the ops (allgather's backward a tsgen reduce_scatter and the other way
    round) against the torch-only twins (examples/torch/twins.py);
  ipc_heap: the same op on a second group with heaps from CUDA IPC instead of symmetric memory;
  errors: a tensor on the other GPU, a float32 tensor: exceptions naming argument and rank.
--cp: tsgen.torch.cp_attention (context-parallel attention, forward + backward, composed from the
  allgather, attention _at and reduce_scatter ops) at W = the ranks: zig-zag causal GQA 32:8 and
  contiguous not causal, S 2048 and 8192 (S / W rows per rank), every rank's O, LSE, dQ, dK, dV
  against float32 autograd of SDPA over the whole sequence (the --attention bounds), by default, with
  kv_together (the first case), with overlap_backward (both cases: the backward by runs of key rows,
  the peers' reduce-scatter on a side stream beside the own rows' kernels) and with the fused forward
  (both cases, not with --shared: CP_FUSED's cp_attention specs, their gather on the copy engine);
  negative controls (the dK / dV reduce-scatter left out, by default and with overlap_backward) that
  must be caught; step times (cp_step_times) against an NCCL all_gather + SDPA twin and the
  single-GPU ideal at each S of CP_TIME_SEQS (default "2048 8192 16384 32768"), the implementations
  CP_TIME_VARIANTS names (default "tsgen ideal twin twin_cudnn"; tsgen_graph, the default step in a CUDA
  graph, checked after a replay; tsgen_fused, tsgen_kv_together and tsgen_overlap too where named) in CP_TIME_ROUNDS
  interleaved rounds (default 8), every round's samples in the file CP_TIME_JSON names (where set), each
  timed S's O, dQ, dK, dV against the single-GPU op's. With --shared: ranks on one GPU, gloo, MPS, S 2048,
  no times.
--probe: both ranks call allgather once (CUDA IPC heaps on a gloo group: no NCCL watchdog to
  take the process down), then rank 1 stops calling: rank 0's kernel waits for it, times out after
  the spec's sync.timeout_ms (10 s), traps, and tsgen.torch.synchronize() must raise the kernel's
  diagnosis as an error on rank 0.
--shared: W ranks (W 4 under tools/gpu_torch.sh) sharing the visible GPUs (rank on GPU
  LOCAL_RANK % GPUs: all on one GPU where one is visible), a gloo group (NCCL refuses two ranks on
  one GPU; no NCCL anywhere), TSGEN_SHARE_GPUS=1 and an MPS daemon running (without MPS the ranks'
  processes are time-sliced and their kernels never resident together: tsgen.torch refuses). No
  collective twin to compare with, so every rank makes every rank's input itself (`pattern`: small
  integers from the rank and the call number, every sum exact in bf16) and the reference locally
  (`local_*`); outputs poisoned before every call. Per heap mode (--heaps, default $TSGEN_TORCH_HEAP,
  else ipc then symm_mem; symm_mem with TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1): allgather,
  reduce_scatter, all_to_all and the Ulysses pre / post pair, 20 back-to-back calls each with fresh
  data (checked after the last); allgather -> reduce_scatter in a CUDA graph, 20 replays with fresh
  data, every replay checked. Where torch's symmetric memory cannot make the heaps, `CHECK
  shared_symm_mem_heap SKIP` says why and the ipc checks are the ones that count. Before any tsgen
  kernel every rank runs tsgen's printf primer (prime_printf says why).
Exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "torch"))

import tsgen.torch as tt  # noqa: E402
import twins  # noqa: E402

BF16 = torch.bfloat16
SHAPES = [(262147,), (1024, 513), (6, 5, 7), (2,)]  # odd sizes: element-wise tails
RESULTS: list[bool] = []


def failed_checks(output: str) -> list[str]:
    """The CHECK lines of this script's `output` whose result (the word after the name) is FAIL: a caught negative
    control's detail names the failures it caught, so the detail is not searched."""
    return [line for line in output.splitlines()
            if line.startswith("CHECK ") and line.split(maxsplit=3)[2:3] == ["FAIL"]]


def report(name: str, ok: bool, detail: str = "", group=None, word: str = "PASS") -> bool:
    """Gather every rank's (ok, detail); rank 0 prints one CHECK line (`word` where every rank is ok:
    SKIP for a check that could not run, with the reason in the detail). Without a process group
    (--attention) the one process prints its own."""
    if not dist.is_initialized():  # --attention: one process, no group
        print(f"CHECK {name} {word if ok else 'FAIL'} {detail}".rstrip(), flush=True)
        RESULTS.append(bool(ok))
        return bool(ok)
    results = [None] * dist.get_world_size(group)
    dist.all_gather_object(results, (bool(ok), f"r{dist.get_rank()}: {detail}" if detail else ""), group=group)
    all_ok = all(r[0] for r in results)
    if dist.get_rank() == 0:
        text = "; ".join(r[1] for r in results if r[1])
        print(f"CHECK {name} {word if all_ok else 'FAIL'} {text}".rstrip(), flush=True)
    RESULTS.append(all_ok)
    return all_ok


def checked(name: str):
    """Run a check function; an exception is its FAIL (with the first line of the error)."""
    def wrap(fn):
        def run(*args):
            try:
                ok, detail = fn(*args)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return report(name, ok, detail)
        return run
    return wrap


def data(shape, gen, integer: bool) -> torch.Tensor:
    if integer:  # small integers: every sum of two ranks is exact in bf16
        return torch.randint(-8, 9, shape, generator=gen, device="cuda").to(BF16)
    return torch.randn(shape, generator=gen, device="cuda").to(BF16)


def poison(op, x, byte: int) -> None:
    """Fill the heap's output buffers for inputs like x (a tensor, or a tuple of the op's tensors) with
    `byte` (a missing write then shows; a fresh heap would otherwise hold zeros). Makes the heap first
    if needed: a collective, as the call is."""
    sig = op.signature
    count = sig.check([(t.shape, str(t.dtype).removeprefix("torch."), True)
                       for t in (x if isinstance(x, tuple) else (x,))])
    state = op._heap(count)
    for b in sig.outputs:
        state.view(b.name).view(torch.uint8).fill_(byte)


def compare(got: torch.Tensor, want: torch.Tensor, exact: bool) -> tuple[bool, str]:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, f"shape/dtype {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    if exact:  # bit for bit
        bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
        wrong = int((got.view(bits) != want.view(bits)).sum().item())
        return wrong == 0, f"{wrong} of {got.numel()} wrong"
    diff = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    ok = torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    return bool(ok), f"max diff {diff:.3g}"


def bits(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor's bits (compared as integers: equal means bit for bit, NaN included)."""
    return t.view(torch.int16)


def replayed(call, refill, wrong, replays: int) -> list[int]:
    """`call()` (tsgen ops on static inputs, returning their outputs) run twice (the heaps exist before
    capture: a heap's first call is a collective), captured in one torch.cuda.CUDAGraph, then
    `replays` times: refill() the static inputs, replay, count wrong(outputs) (a tuple of wrong
    elements). The totals."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = call()
    totals = None
    for _ in range(replays):
        refill()
        g.replay()
        got = wrong(outs)
        totals = list(got) if totals is None else [a + b for a, b in zip(totals, got)]
    torch.cuda.synchronize()
    return totals


def check_collective(op, ref, name: str, gen) -> None:
    w = dist.get_world_size()

    @checked(name)
    def run():
        notes = []
        ok = True
        for call, shape in enumerate(SHAPES):
            if name.startswith("reduce_scatter"):
                shape = (shape[0] * w, *shape[1:])
            for integer in (True, False):
                x = data(shape, gen, integer)
                poison(op, x, 0xFF if call % 2 else 0x7F)  # NaN patterns in bf16
                got = op(x)
                want = ref(x)
                good, why = compare(got, want, exact=integer)
                ok &= good
                if not good or shape == SHAPES[0] or (integer and shape[0] == SHAPES[0][0] * w):
                    notes.append(f"{tuple(shape)} {'int' if integer else 'randn'}: {why}")
        torch.cuda.synchronize()
        return ok, "; ".join(notes)

    run()


def check_others(gen) -> None:
    """all_reduce (one_shot), all_to_all and broadcast against torch.distributed: the other plan-based
    collectives tsgen.torch loads (no adjoints for them yet)."""
    from tsgen.spec import load_spec

    w = dist.get_world_size()

    def all_reduce(x):
        out = x.clone()
        dist.all_reduce(out)
        return out

    def all_to_all(x):
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    root = load_spec(ROOT / "specs" / "broadcast.yaml").model.params.root

    def broadcast(x):
        out = x.clone()
        dist.broadcast(out, src=root)
        return out

    for spec, ref, integer in (("all_reduce_one_shot", all_reduce, True), ("all_to_all", all_to_all, False),
                               ("broadcast", broadcast, False)):
        @checked(f"{spec}_vs_nccl")
        def run():
            op = tt.load(ROOT / "specs" / f"{spec}.yaml")
            dtype = getattr(torch, op.signature.dtype)
            notes, ok = [], True
            for shape in ((4096 * w, 33), (262147 * w,)):
                x = data(shape, gen, integer).to(dtype)
                poison(op, x, 0xFF)
                good, why = compare(op(x), ref(x), exact=True)
                ok &= good
                notes.append(f"{tuple(shape)} {dtype}: {why}")
            op.close()
            return ok, "; ".join(notes)

        run()


def main_checks() -> None:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timedelta(seconds=120))
    rank, w = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(17 + rank)

    t0 = time.perf_counter()
    ag = tt.load(ROOT / "specs" / "allgather.yaml")
    rs = tt.load(ROOT / "specs" / "reduce_scatter.yaml")
    tt.pair(ag, rs)
    report("load", True, f"{time.perf_counter() - t0:.1f} s (render + nvcc + group checks)")

    check_collective(ag, twins.all_gather, "allgather_vs_nccl", gen)
    check_collective(rs, twins.reduce_scatter, "reduce_scatter_vs_nccl", gen)
    report("heap_kind", ag.heap_kind is not None,
           f"{ag.heap_kind} (TSGEN_TORCH_HEAP={os.environ.get('TSGEN_TORCH_HEAP', 'auto')}), torch {torch.__version__}")

    check_others(gen)

    @checked("zero_copy")
    def zero_copy():
        x = ag.empty(1024, 512)
        x.copy_(data((1024, 512), gen, True))
        src = ag._heaps[1024 * 512].view(ag.signature.input.name)
        same = x.data_ptr() == src.data_ptr()
        good, why = compare(ag(x), twins.all_gather(x), exact=True)
        return same and good, f"input in the heap: {same}; {why}"

    zero_copy()

    @checked("out_form")
    def out_form():
        """allgather's out= form: into empty_out's heap slot (written in place, no copy out) and into a
        NaN-poisoned plain tensor (copied out of the heap: a peer writes the output); reduce_scatter
        into a plain tensor; each exact against NCCL."""
        x = data((1024, 512), gen, True)
        want = twins.all_gather(x)
        into = ag.empty_out(x.shape)
        in_heap = into.data_ptr() == ag._heaps[1024 * 512].view(ag.signature.output.name).data_ptr()
        into.view(torch.int16).fill_(-1)
        good1, why1 = compare(ag(x, out=into), want, exact=True)
        plain = torch.full_like(want, float("nan"))
        good2, why2 = compare(ag(x, out=plain), want, exact=True)
        z = torch.full_like(x, float("nan"))
        good3, why3 = compare(rs(want, out=z), twins.reduce_scatter(want), exact=True)
        return in_heap and good1 and good2 and good3, (f"empty_out in the heap: {in_heap}; allgather into it: {why1}; "
                                                       f"into a plain tensor: {why2}; reduce_scatter: {why3}")

    out_form()

    @checked("graph_100_replays")
    def graph():
        n, h = 4096, 256
        static_x = data((n, h), gen, True)

        def call():
            y = ag(static_x)
            return y, rs(y)

        def wrong(outs):  # allgather then reduce_scatter of the gathered rows: rank r gets W times its own rows
            y, z = outs
            return int((y != twins.all_gather(static_x)).sum().item()), int((z != static_x * w).sum().item())

        wrong_y, wrong_z = replayed(call, lambda: static_x.copy_(data((n, h), gen, True)), wrong, 100)
        return wrong_y == 0 and wrong_z == 0, f"100 replays: {wrong_y} wrong allgather, {wrong_z} wrong reduce_scatter elements"

    graph()

    @checked("grad")
    def grad():
        notes, ok = [], True
        for op, twin, shape in ((ag, twins.AllGather.apply, (1000, 64)), (rs, twins.ReduceScatter.apply, (1000 * w, 64))):
            x = data(shape, gen, True)
            out_shape = op.signature.out_shape(shape)
            dy = data(out_shape, gen, True)
            xa = x.clone().requires_grad_(True)
            op(xa).backward(dy)
            xb = x.clone().requires_grad_(True)
            twin(xb).backward(dy)
            good, why = compare(xa.grad, xb.grad, exact=True)
            ok &= good
            notes.append(f"{op.signature.qualname}: grad {why}")
        return ok, "; ".join(notes)

    grad()

    @checked("ipc_heap")
    def ipc():
        g2 = dist.new_group(list(range(w)))
        ag2 = tt.load(ROOT / "specs" / "allgather.yaml", g2, heap="ipc")
        x = data((3001, 7), gen, False)
        good, why = compare(ag2(x), twins.all_gather(x), exact=True)
        kind = ag2.heap_kind
        ag2.close()
        return good and kind == "ipc", f"heap {kind}: {why}"

    ipc()

    @checked("errors")
    def errors():
        seen = []
        cases = [(torch.zeros(8, 4, dtype=torch.float32, device="cuda"), "dtype float32")]
        if torch.cuda.device_count() > 1:
            other = (local + 1) % torch.cuda.device_count()
            cases.append((torch.zeros(8, 4, dtype=BF16, device=f"cuda:{other}"), f"on cuda:{other}"))
        for x, want in cases:
            try:
                ag(x)
                seen.append(f"no error for {want}")
            except tt.TsgenArgumentError as e:
                seen.append("ok" if f"rank {rank}: argument x: {want}" in str(e) else f"message: {e}")
        return all(s == "ok" for s in seen), "; ".join(seen)

    errors()
    tt.close_all()
    check_ulysses(gen)
    tt.close_all()
    check_fused(gen)
    tt.close_all()
    check_moe(gen)
    tt.close_all()
    dist.barrier()
    dist.destroy_process_group()


def check_ulysses(gen) -> None:
    """Ulysses' pre and post all-to-alls (bshd) and the packed GQA pre (bhsd, three outputs) against
    the torch-only twins (all_to_all_single + permutes): permutations, so bit for bit on random bits;
    their gradients (pre's backward runs post and the other way round) against the twins' autograd;
    pre -> post captured in a CUDA graph and replayed 100 times."""
    pre = tt.load(ROOT / "specs" / "ulysses_pre_a2a.yaml")
    post = tt.load(ROOT / "specs" / "ulysses_post_a2a.yaml")
    tt.pair(pre, post)
    w, rank = dist.get_world_size(), dist.get_rank()
    b, _, h, d = (n for _, n in pre.signature.ins[0].dims)

    def shard(tokens):  # random 16-bit patterns (no NaN: bf16 NaNs compare unequal through .float())
        return data((b, tokens, h, d), gen, False)

    @checked("ulysses_vs_twin")
    def forward():
        notes, ok = [], True
        for tokens in (1001, 1, 4096):
            x = shard(tokens)
            poison(pre, x, 0xFF)
            y = pre(x)
            want_y = twins.ulysses_pre(x)
            poison(post, y, 0x7F)
            z = post(y)
            wrong_y = int((bits(y) != bits(want_y)).sum().item()) if y.shape == want_y.shape else -1
            wrong_z = int((bits(z) != bits(twins.ulysses_post(y))).sum().item())
            back = bool(torch.equal(bits(z), bits(x)))
            ok &= wrong_y == 0 and wrong_z == 0 and back
            notes.append(f"S/P {tokens}: pre {wrong_y} wrong of {y.numel()}, post {wrong_z} wrong, post(pre(x)) == x "
                         f"{back}")
        return ok, "; ".join(notes)

    forward()

    @checked("ulysses_grad")
    def grad():
        notes, ok = [], True
        for op, twin, x in ((pre, twins.ulysses_pre, shard(777)), (post, twins.ulysses_post, None)):
            if x is None:
                x = data((b, 777 * w, h // w, d), gen, False)
            xa = x.clone().requires_grad_(True)
            ya = op(xa)
            dy = data(tuple(ya.shape), gen, False)
            ya.backward(dy)
            xb = x.clone().requires_grad_(True)
            twin(xb).backward(dy)
            wrong = int((bits(xa.grad) != bits(xb.grad)).sum().item())
            ok &= wrong == 0
            notes.append(f"{op.signature.qualname}: {wrong} of {x.numel()} gradient elements differ from the twin's")
        return ok, "; ".join(notes)

    grad()

    @checked("ulysses_graph_100_replays")
    def graph():
        static_x = shard(1024)

        def call():
            y = pre(static_x)
            return y, post(y)

        def wrong(outs):
            y, z = outs
            return (int((bits(y) != bits(twins.ulysses_pre(static_x))).sum().item()),
                    int((bits(z) != bits(static_x)).sum().item()))

        wrong_y, wrong_z = replayed(call, lambda: static_x.copy_(shard(1024)), wrong, 100)
        return wrong_y == 0 and wrong_z == 0, f"100 replays: {wrong_y} wrong pre, {wrong_z} wrong post elements"

    graph()

    @checked("ulysses_gqa_vs_twin")
    def gqa():
        if w not in (2, 4, 8):
            return True, f"skipped: specs/ulysses_pre_a2a_gqa.yaml is compiled for 2, 4, 8 ranks, not {w}"
        op = tt.load(ROOT / "specs" / "ulysses_pre_a2a_gqa.yaml")
        dims = dict(op.signature.ins[0].dims)
        heads, kv = op.signature.outs[0].dims[1][1] * w, op.signature.outs[1].dims[1][1]
        x = data((dims["batch"], 555, dims["heads + 2 kv_heads"], dims["head_dim"]), gen, False)
        poison(op, x, 0xFF)
        q, k, v = op(x)
        # the twin: every rank's shard gathered, then the heads this rank receives (KV heads replicated)
        full = torch.cat([t for t in twins.all_gather(x.transpose(0, 1).contiguous()).view(
            w, 555, dims["batch"], -1, dims["head_dim"]).transpose(1, 2)], dim=1)  # [B, S, heads + 2 kv, D]
        kv_heads = (dims["heads + 2 kv_heads"] - heads) // 2
        k0 = rank * kv_heads // w
        want = [full[:, :, rank * (heads // w):(rank + 1) * (heads // w)],
                full[:, :, heads + k0:heads + k0 + kv], full[:, :, heads + kv_heads + k0:heads + kv_heads + k0 + kv]]
        notes, ok = [], True
        for name, got, ref in zip("qkv", (q, k, v), want):
            ref = ref.transpose(1, 2)  # bhsd
            same = got.shape == ref.shape and bool(torch.equal(bits(got), bits(ref.contiguous())))
            ok &= same
            notes.append(f"{name} {tuple(got.shape)} {'equal' if same else 'DIFFERENT'}")
        op.close()
        return ok, "; ".join(notes)

    gqa()


def check_fused(gen) -> None:
    """allgather_gemm and gemm_reduce_scatter (the pair examples/torch/tp_mlp.py loads for this world
    size: compiled for mirrored shapes) against torch: C against allgather(A) @ B and
    reduce_scatter(A @ B) with NCCL and cuBLAS (close: other summation orders), the gathered A
    bit for bit; their gradients (each other's op plus local GEMMs) against the twins' autograd;
    AG-GEMM -> GEMM-RS captured in a CUDA graph and replayed 20 times with new data."""
    import tp_mlp

    w = dist.get_world_size()
    if w not in tp_mlp.FUSED_SPECS:
        report("fused", True, f"skipped: no fused GEMM specs for {w} ranks in examples/torch/tp_mlp.py")
        return
    ag, rs, h, f = tp_mlp.load_fused(w)
    rows = 1000  # per rank: not whole 128-row tiles

    def close(got, want, what):
        if got.shape != want.shape:
            return False, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
        scale = want.float().abs().max().item() or 1.0
        diff = (got.float() - want.float()).abs().max().item()
        return diff <= 2e-2 * scale and bool(torch.isfinite(got).all().item()), f"{what}: max |diff| / max {diff / scale:.1e}"

    def operands():
        a = data((rows, h), gen, False)
        w1 = (data((h, f // w), gen, False) / h ** 0.5).to(BF16)
        a2 = data((rows * w, f // w), gen, False)
        w2 = (data((f // w, h), gen, False) / (f ** 0.5)).to(BF16)
        return a, w1, a2, w2

    @checked("fused_vs_torch")
    def forward():
        a, w1, a2, w2 = operands()
        poison(ag, (a, w1), 0xFF)
        poison(rs, (a2, w2), 0x7F)
        c, a_full = ag(a, w1)
        gathered = twins.all_gather(a)
        same = bool(torch.equal(bits(a_full), bits(gathered)))
        ok1, n1 = close(c, gathered @ w1, "allgather_gemm C")
        ok2, n2 = close(rs(a2, w2), twins.reduce_scatter(a2 @ w2), "gemm_reduce_scatter C")
        return ok1 and ok2 and same, f"{n1}; gathered A bit-equal: {same}; {n2}"

    forward()

    @checked("fused_grad")
    def grad():
        a, w1, a2, w2 = operands()
        notes, ok = [], True
        cases = ((lambda x, b: ag(x, b)[0], lambda x, b: twins.AllGather.apply(x) @ b, a, w1, "allgather_gemm"),
                 (lambda x, b: rs(x, b), lambda x, b: twins.ReduceScatter.apply(x @ b), a2, w2, "gemm_reduce_scatter"))
        for mine, twin, x, b, name in cases:
            xa, ba = x.clone().requires_grad_(True), b.clone().requires_grad_(True)
            ya = mine(xa, ba)
            dy = data(tuple(ya.shape), gen, False)
            ya.backward(dy)
            xb, bb = x.clone().requires_grad_(True), b.clone().requires_grad_(True)
            twin(xb, bb).backward(dy)
            for what, got, want in (("dA", xa.grad, xb.grad), ("dB", ba.grad, bb.grad)):
                good, note = close(got, want, f"{name} {what}")
                ok &= good
                notes.append(note)
        return ok, "; ".join(notes)

    grad()

    @checked("fused_graph_20_replays")
    def graph():
        a, w1, _, w2 = operands()

        def call():
            return rs(ag(a, w1)[0], w2)

        def wrong(y):  # against an eager call of the same kernels: the replay must give the same bits
            return (int((bits(y) != bits(call())).sum().item()),)

        (total,) = replayed(call, lambda: a.copy_(data((rows, h), gen, False)), wrong, 20)
        return total == 0, f"20 replays: {total} elements differ from the eager calls"

    graph()

    @checked("fused_out")
    def out_form():
        """The out= form gives the functional form's bits: C written in place into a NaN-poisoned
        tensor (a local output: its address goes to the launcher), the gathered A into the heap slot
        empty_out gave (no copy out), a C at a 2-byte offset (not TMA-aligned: through the heap and
        copied out), gemm_reduce_scatter's C in place."""
        a, w1, a2, w2 = operands()
        c_want, a_full_want = (t.clone() for t in ag(a, w1))  # before the out= calls reuse the heap
        y_want = rs(a2, w2).clone()
        c_local, a_full = ag.empty_out(a.shape)
        slot = ag._heaps[rows].view("a_full")
        in_heap = a_full.data_ptr() == slot.data_ptr() and c_local.data_ptr() != ag._heaps[rows].view("c").data_ptr()
        notes, ok = [f"gathered A in the heap slot: {in_heap}"], in_heap
        odd = torch.empty(c_want.numel() + 1, dtype=BF16, device="cuda")[1:].view(c_want.shape)
        for what, c in (("C in place", c_local), ("C at a 2-byte offset", odd)):
            c.fill_(float("nan"))
            a_full.view(torch.uint8).fill_(0xFF)
            got = ag(a, w1, out=(c, a_full))
            same = got[0] is c and torch.equal(bits(c), bits(c_want)) and torch.equal(bits(a_full), bits(a_full_want))
            ok &= same
            notes.append(f"{what}: {'same bits' if same else 'DIFFERENT'}")
        y = torch.full_like(y_want, float("nan"))
        same = rs(a2, w2, out=y) is y and torch.equal(bits(y), bits(y_want))
        notes.append(f"gemm_reduce_scatter C in place: {'same bits' if same else 'DIFFERENT'}")
        return ok and same, "; ".join(notes)

    out_form()

    @checked("fused_out_graph_20_replays")
    def out_graph():
        """AG-GEMM -> GEMM-RS in the out= form (static outputs, the gathered A in the heap) captured in
        a CUDA graph: every replay gives the eager functional calls' bits."""
        a, w1, _, w2 = operands()
        c, a_full = ag.empty_out(a.shape)
        y = torch.empty(rows, h, dtype=BF16, device="cuda")

        def call():
            ag(a, w1, out=(c, a_full))
            return (rs(c, w2, out=y),)

        def wrong(outs):
            return (int((bits(outs[0]) != bits(rs(ag(a, w1)[0], w2))).sum().item()),)

        (total,) = replayed(call, lambda: a.copy_(data((rows, h), gen, False)), wrong, 20)
        return total == 0, f"20 replays: {total} elements differ from the eager functional calls"

    out_graph()


def check_moe(gen) -> None:
    """MoE dispatch and combine (specs/moe.yaml, normal mode, unweighted) against the torch-only twin
    (all_to_all_single with the routing's splits, index_add; examples/torch/twins.py MoeRoute) on
    integer-valued rows (every sum exact): the rows received, their local expert ids and weights and
    the combined result bit for bit; gradients (combine's backward a dispatch, dispatch's a combine)
    bit for bit; dispatch -> 2 x rows -> combine in a CUDA graph, 20 replays with new rows."""
    from tsgen.ops.moe import routing

    w, rank = dist.get_world_size(), dist.get_rank()
    moe = tt.load(ROOT / "specs" / "moe.yaml")
    c = moe.dispatch.manifest.constants
    experts, topk, hidden, tokens = c["EXPERTS"], c["TOPK"], c["HIDDEN"], 201
    idx = torch.from_numpy(routing("random", w, experts, topk, tokens, np.random.default_rng([3, rank]), rank))
    idx = idx.reshape(tokens, topk).cuda()
    weights = torch.rand(tokens, topk, generator=gen, device="cuda")

    @checked("moe_vs_twin")
    def forward():
        x = data((tokens, hidden), gen, True)
        poison(moe.dispatch, (x, idx, weights), 0xFF)
        rx, ridx, rw, counts = moe.dispatch(x, idx, weights)
        route = twins.MoeRoute(idx, weights, experts)
        want = route.dispatch(x)
        n = int(counts[0])
        notes = [f"{n} rows received (twin {want.shape[0]}), flags {int(counts[1])}"]
        ok = n == want.shape[0] and int(counts[1]) == 0
        if ok:
            same = {"recv_x": torch.equal(bits(rx[:n]), bits(want)), "recv_idx": torch.equal(ridx[:n], route.recv_idx),
                    "recv_w": torch.equal(rw[:n], route.recv_w)}
            out = moe.combine(rx * 2, idx)
            same["out"] = torch.equal(bits(out), bits(route.combine(want * 2)))
            ok = all(same.values())
            notes.append(", ".join(f"{k} {'equal' if v else 'DIFFERENT'}" for k, v in same.items()))
        else:
            moe.combine(rx, idx)  # keep the call order (dispatch, combine) for the checks after this one
        return ok, "; ".join(notes)

    forward()

    @checked("moe_grad")
    def grad():
        x = data((tokens, hidden), gen, True)
        dout = data((tokens, hidden), gen, True)
        xa = x.clone().requires_grad_(True)
        rx = moe.dispatch(xa, idx, weights)[0]
        moe.combine(rx * 2, idx).backward(dout)
        xb = x.clone().requires_grad_(True)
        route = twins.MoeRoute(idx, weights, experts)
        route.combine(route.dispatch(xb) * 2).backward(dout)
        wrong = int((bits(xa.grad) != bits(xb.grad)).sum().item())
        return wrong == 0, f"dx: {wrong} of {x.numel()} differ from the twin's (combine's backward a tsgen dispatch, " \
                           "dispatch's a tsgen combine)"

    grad()

    @checked("moe_graph_20_replays")
    def graph():
        static_x = data((tokens, hidden), gen, True)
        route = twins.MoeRoute(idx, weights, experts)

        def wrong(out):
            return (int((bits(out) != bits(route.combine(route.dispatch(static_x) * 2))).sum().item()),)

        (total,) = replayed(lambda: moe.combine(moe.dispatch(static_x, idx, weights)[0] * 2, idx),
                            lambda: static_x.copy_(data((tokens, hidden), gen, True)), wrong, 20)
        return total == 0, f"20 replays: {total} wrong elements"

    graph()
    moe.close()


def probe() -> None:
    """A peer that never arrives: rank 0's kernel must time out and the error name it."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, w = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    ag = tt.load(ROOT / "specs" / "allgather.yaml", heap="ipc")
    n = 4096
    x = torch.full((n,), float(rank + 1), dtype=BF16, device="cuda")
    y = ag(x)
    tt.synchronize()
    want = torch.cat([torch.full((n,), float(r + 1), dtype=BF16, device="cuda") for r in range(w)])
    first_ok = bool(torch.equal(y, want))
    dist.barrier()
    if rank != 0:
        # stay alive (rank 0's kernel writes into this rank's heap) until rank 0 has its answer
        store.wait(["tsgen_probe_done"], timedelta(seconds=90))
        print(f"rank {rank}: probe result from rank 0: {store.get('tsgen_probe_done').decode()}", flush=True)
        os._exit(0)
    start = time.perf_counter()
    ag(x)  # rank 1 never makes this call
    try:
        tt.synchronize()
        ok, detail = False, "the call completed although rank 1 never called"
    except tt.TsgenTorchError as e:
        text = str(e)
        ok = "rank 0: a tsgen kernel timed out waiting for a peer: tsgen: timeout:" in text
        detail = text
    waited = time.perf_counter() - start
    ok = ok and first_ok
    line = (f"CHECK peer_never_arrives {'PASS' if ok else 'FAIL'} first call {'right' if first_ok else 'WRONG'} "
            f"(ipc heap, gloo group); raised after {waited:.1f} s: {detail}")
    print(line, flush=True)
    store.set("tsgen_probe_done", "PASS" if ok else "FAIL")
    os._exit(0 if ok else 1)  # the CUDA context is lost: no clean shutdown

# -- --attention: tsgen's attention forward + backward as one op, one GPU, no process group -------

# name -> (forward spec, backward spec): the shipped forwards, each with a backward of its shape
ATTENTION_PAIRS = {
    "hd128": ("specs/attention_hd128.yaml", "specs/attention_backward_hd128.yaml"),
    "hd128_causal_gqa": ("specs/attention_hd128_causal_gqa.yaml",
                         "examples/torch/specs/attention_backward_hd128_causal_gqa.yaml"),
    "hd64_causal": ("specs/attention_hd64_causal.yaml", "examples/torch/specs/attention_backward_hd64_causal.yaml"),
}
ATTENTION_CASES = ((2, 1000), (1, 4096))  # (batch, S): S 1000 ends in a partial query tile and key block
MAX_REL_ERR = 1e-2  # ||got - ref|| / ||ref|| of O, dQ, dK, dV: 16-bit results measure about 2.4e-3 (bf16)


def to_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """[batch, seq, heads, d] in `layout` as [batch, heads, seq, d] (a view; its own inverse)."""
    return x if layout == "bhsd" else x.transpose(1, 2)


def attention_inputs(sig, batch: int, q_len: int, kv_len: int, gen, device="cuda") -> tuple:
    """Random normal q, k, v and dO in the op's layout and dtype, contiguous."""
    dt = getattr(torch, sig.dtype)

    def randn(rows, heads):
        x = torch.randn(batch, rows, heads, sig.head_dim, generator=gen, device=device).to(dt)
        return to_bhsd(x, sig.layout).contiguous() if sig.layout == "bhsd" else x

    return randn(q_len, sig.heads), randn(kv_len, sig.kv_heads), randn(kv_len, sig.kv_heads), randn(q_len, sig.heads)


def sdpa_reference(sig, q, k, v, do) -> dict:
    """O, dQ, dK, dV in float32 (the op's layout): torch autograd of F.scaled_dot_product_attention
    on the upcast inputs, its math backend (TF32 off: main sets it), the causal mask top-left as
    the op's (positions from 0), GQA by repeating K and V over each group's query heads (autograd
    sums their gradients back)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = sig.heads // sig.kv_heads
    qf, kf, vf = (to_bhsd(x, sig.layout).float().requires_grad_(True) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        o = F.scaled_dot_product_attention(qf, kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1),
                                           is_causal=sig.causal, scale=sig.scale)
    o.backward(to_bhsd(do, sig.layout).float())
    return {name: to_bhsd(x.detach(), sig.layout) for name, x in
            (("o", o), ("dq", qf.grad), ("dk", kf.grad), ("dv", vf.grad))}


def attention_bounds(sig, q, k, v, do, ref: dict, o_got: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(LSE [batch, heads, S] in float32, the per-element bound of each result), the bounds the
    attention families hold their kernels to (tsgen/ops/attention.py): O within o_tolerance of the
    |.| sums sum_j p_ij |v_j|; LSE within 1e-3 relative (absolute below 1); each gradient within
    grad_tolerance of the |.| sums of its products and of the terms dS = P (dP - D) cancels
    (attention_backward_reference's with_abs, here in float32 on the GPU), plus what the kernel's
    D = rowsum(dO O) owes to its 16-bit O: it shifts dS_ij by -P_ij dD_i, dD_i = rowsum(dO_i (O_got -
    O_ref)_i), so dQ_i by at most scale |dD_i| sum_j P_ij |k_j| and dK_j by scale sum_i P_ij |dD_i|
    |q_i| (the reference's D is of the exact O). One KV head (and its group of query heads) at a
    time: a few [group, S, S_kv] float32 matrices at once."""
    from tsgen.ops.attention import grad_tolerance, o_tolerance

    group, scale = sig.heads // sig.kv_heads, sig.scale
    qf, dof, orf, ogf = (to_bhsd(x, sig.layout).float() for x in (q, do, ref["o"], o_got))
    kf, vf = (to_bhsd(x, sig.layout).float() for x in (k, v))
    q_len, kv_len = qf.shape[2], kf.shape[2]
    hidden = torch.ones(q_len, kv_len, dtype=torch.bool, device=qf.device).triu(1) if sig.causal else None
    o_abs, aq, cq, eq = (torch.zeros_like(qf) for _ in range(4))
    ak, ck, ek, av = (torch.zeros_like(kf) for _ in range(4))
    lse = torch.empty(qf.shape[:3], device=qf.device)
    for b in range(qf.shape[0]):
        for g in range(sig.kv_heads):
            hs = slice(g * group, (g + 1) * group)
            qh, doh, orh, ogh = qf[b, hs], dof[b, hs], orf[b, hs], ogf[b, hs]  # [group, S, D]
            kh, vh = kf[b, g], vf[b, g]  # [S_kv, D]
            s = scale * (qh @ kh.T)
            if hidden is not None:
                s = s.masked_fill(hidden, -math.inf)
            lse[b, hs] = torch.logsumexp(s, -1)
            p = torch.exp(s - lse[b, hs, :, None])
            del s
            ds = p * (doh @ vh.T - (doh * orh).sum(-1, keepdim=True)).abs()  # |dS|
            o_abs[b, hs] = p @ vh.abs()
            aq[b, hs] = scale * (ds @ kh.abs())
            ak[b, g] = scale * (ds.transpose(1, 2) @ qh.abs()).sum(0)
            av[b, g] = (p.transpose(1, 2) @ doh.abs()).sum(0)
            del ds
            cancel = p * (doh.abs() @ vh.abs().T + (doh.abs() * orh.abs()).sum(-1, keepdim=True))
            cq[b, hs] = scale * (cancel @ kh.abs())
            ck[b, g] = scale * (cancel.transpose(1, 2) @ qh.abs()).sum(0)
            del cancel
            dd = (doh * (ogh - orh)).sum(-1, keepdim=True).abs()
            eq[b, hs] = scale * dd * (p @ kh.abs())
            ek[b, g] = scale * (p.transpose(1, 2) @ (dd * qh.abs())).sum(0)
    back = {n: to_bhsd(x, sig.layout) for n, x in (("o", o_abs), ("aq", aq), ("cq", cq), ("eq", eq), ("ak", ak),
                                                   ("ck", ck), ("ek", ek), ("av", av))}
    hd, dt = sig.head_dim, sig.dtype
    return lse, {"o": o_tolerance(ref["o"], back["o"], dt), "lse": 1e-3 * lse.abs().clamp_min(1.0),
                 "dq": grad_tolerance(ref["dq"], back["aq"], back["cq"], dt, hd) + back["eq"],
                 "dk": grad_tolerance(ref["dk"], back["ak"], back["ck"], dt, hd) + back["ek"],
                 "dv": grad_tolerance(ref["dv"], back["av"], None, dt, hd)}


def rel_norm(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| (float tensors; a zero reference counts as tiny, not as zero)."""
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def attention_compare(got: dict, ref: dict, tol: dict) -> tuple[bool, str]:
    """Every element of O, LSE, dQ, dK, dV within its bound (a NaN never is), and O and the gradients
    within MAX_REL_ERR of the reference in norm (the per-element bound is a worst case, loose where
    many terms of either sign add up: the norm sees an error spread over every element)."""
    ok, notes = True, []
    for name in ("o", "lse", "dq", "dk", "dv"):
        g, r = got[name].float(), ref[name].float()
        wrong = int((~((g - r).abs() <= tol[name])).sum())
        rel = rel_norm(g, r)
        good = wrong == 0 and (name == "lse" or rel <= MAX_REL_ERR)
        ok &= good
        notes.append(f"{name} {wrong}/{g.numel()} wrong, rel {rel:.1e}{'' if good else ' FAIL'}")
    return ok, ", ".join(notes)


def poison_allocator(nbytes: int) -> list[tuple[int, int]]:
    """Fill `nbytes` of fresh device memory (and 8 MiB of the caching allocator's small blocks) with
    0xFF bytes, NaN in bf16 and float32, then free it: the allocations that follow on this stream
    take these blocks, so an output element a kernel leaves unwritten reads NaN. The filled address
    ranges, to tell which outputs landed in them."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = [torch.empty(nbytes, dtype=torch.uint8, device="cuda")]
    held += [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]  # the small pool's blocks
    for t in held:
        t.fill_(0xFF)
    spans = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in held]
    del held
    return spans


def poisoned(t: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    """Whether tensor `t` lies in memory poison_allocator filled."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(a <= lo and hi <= b for a, b in spans)


def attention_case(attn, batch: int, seq: int, gen) -> tuple[dict, dict, dict, tuple, str]:
    """One forward + backward through autograd on fresh random inputs, every output allocated in
    poisoned memory: (got, ref, bounds, (q, k, v, dO), how many outputs were poisoned)."""
    sig = attn.signature
    q, k, v, do = attention_inputs(sig, batch, seq, seq, gen)
    ref = sdpa_reference(sig, q, k, v, do)
    qa, ka, va = (x.clone().requires_grad_(True) for x in (q, k, v))
    size = sum(x.numel() * x.element_size() for x in (q, k, v)) * 3 + (8 << 20)  # the outputs, the fp32 workspace
    spans = poison_allocator(size)
    o, lse = attn(qa, ka, va, return_lse=True)
    spans_back = poison_allocator(size)
    o.backward(do)
    got = {"o": o.detach(), "lse": lse, "dq": qa.grad, "dk": ka.grad, "dv": va.grad}
    hits = sum(poisoned(got[n], spans) for n in ("o", "lse")) + sum(poisoned(got[n], spans_back) for n in ("dq", "dk",
                                                                                                        "dv"))
    ref["lse"], bounds = attention_bounds(sig, q, k, v, do, ref, got["o"])
    return got, ref, bounds, (q, k, v, do), (f"outputs NaN-filled by the op; {hits}/5 also in NaN-poisoned memory"
                                             if os.environ.get("TSGEN_TORCH_POISON") == "1" else
                                             f"{hits}/5 outputs in NaN-poisoned memory")


def attention_checks() -> None:
    """--attention: tsgen.torch.attention on GPU 0 (module doc)."""
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        report("attention_setup", False, "no CUDA device: --attention runs on one GPU")
        return
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference is float32
    torch.backends.cudnn.allow_tf32 = False
    # the op NaN-fills its outputs and workspace before each launch (tsgen/torch/attention_op.py _output):
    # an element the kernels leave unwritten reads NaN in every case, not only where the caching
    # allocator happens to hand out the blocks poison_allocator filled
    os.environ["TSGEN_TORCH_POISON"] = "1"
    gen = torch.Generator(device="cuda").manual_seed(35)
    ops = {}

    @checked("attention_poison_hook")
    def hook():
        from tsgen.torch.attention_op import _output

        x = torch.zeros(3, 5, device="cuda", dtype=torch.bfloat16)
        filled = bool(torch.isnan(_output(like=x)).all()) and bool(
            torch.isnan(_output(7, dtype=torch.float32, device="cuda")).all())
        return filled, "outputs and workspace NaN-filled before each launch (TSGEN_TORCH_POISON=1)"

    hook()

    @checked("attention_load")
    def load():
        t0 = time.perf_counter()
        for name, (fwd, bwd) in ATTENTION_PAIRS.items():
            ops[name] = tt.attention(ROOT / fwd, ROOT / bwd)
        return True, f"{len(ops)} pairs in {time.perf_counter() - t0:.1f} s (render + nvcc, or the cache)"

    if not load():
        return
    for name, attn in ops.items():
        for batch, seq in ATTENTION_CASES:
            @checked(f"attention_{name}_b{batch}_s{seq}")
            def case():
                got, ref, bounds, _, poison_note = attention_case(attn, batch, seq, gen)
                ok, detail = attention_compare(got, ref, bounds)
                return ok, f"{detail}; {poison_note}"

            case()

    @checked("attention_negative_controls")
    def controls():
        """The comparison above must fail on wrong results: the backward fed an LSE 0.05 too large
        (P, so every gradient, 5% too small), dK and dV swapped, the last query row of O zeroed."""
        attn = ops["hd128"]
        got, ref, bounds, (q, k, v, do), _ = attention_case(attn, 2, 1000, gen)
        dq, dk, dv = attn.grads(q, k, v, got["o"], do, got["lse"] + 0.05)
        tail = got["o"].clone()
        tail[:, -1] = 0
        wrong = {"LSE + 0.05": {**got, "dq": dq, "dk": dk, "dv": dv},
                 "dK, dV swapped": {**got, "dk": got["dv"], "dv": got["dk"]},
                 "last row of O zeroed": {**got, "o": tail}}
        notes, ok = [], True
        for what, bad in wrong.items():
            caught, detail = attention_compare(bad, ref, bounds)
            ok &= not caught
            notes.append(f"{what}: {'caught' if not caught else 'NOT CAUGHT'} ({detail})")
        return ok, "; ".join(notes)

    controls()

    @checked("attention_compile_fullgraph")
    def compiled():
        """A tiny module calling the op under torch.compile(fullgraph=True) (Inductor): the op in
        Dynamo's graph, its forward and backward against the reference."""
        from torch._dynamo.backends.registry import lookup_backend

        attn = ops["hd128_causal_gqa"]
        sig = attn.signature
        seen, inductor = [], lookup_backend("inductor")  # what backend="inductor" runs

        def backend(gm, example_inputs):
            seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return inductor(gm, example_inputs)

        class Tiny(torch.nn.Module):
            def forward(self, q, k, v):
                o, lse = attn(q, k, v, return_lse=True)
                return o.float(), lse

        torch._dynamo.reset()
        module = torch.compile(Tiny(), fullgraph=True, backend=backend)
        q, k, v, do = attention_inputs(sig, 1, 1000, 1000, gen)
        ref = sdpa_reference(sig, q, k, v, do)
        qa, ka, va = (x.clone().requires_grad_(True) for x in (q, k, v))
        out, lse = module(qa, ka, va)
        out.backward(do.float())
        o = out.detach().to(q.dtype)  # exact: O was 16-bit
        ref["lse"], bounds = attention_bounds(sig, q, k, v, do, ref, o)
        ok, detail = attention_compare({"o": o, "lse": lse, "dq": qa.grad, "dk": ka.grad, "dv": va.grad}, ref, bounds)
        in_graph = any(sig.module in t for t in seen)
        return ok and in_graph, f"tsgen::{sig.module} in Dynamo's graph: {in_graph}; {detail}"

    compiled()

    @checked("attention_cuda_graph_20_replays")
    def graph():
        """Forward + backward captured in one CUDA graph (warm-up on a side stream first, grads set
        to None before capture), replayed 20 times with fresh inputs copied into the static ones,
        every replay's O, LSE and gradients against the reference."""
        attn = ops["hd128_causal_gqa"]
        sig = attn.signature
        static = [x.clone().requires_grad_(i < 3) for i, x in enumerate(attention_inputs(sig, 1, 1000, 1000, gen))]
        qs, ks, vs, dos = static
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                for t in (qs, ks, vs):
                    t.grad = None
                attn(qs, ks, vs).backward(dos)
        torch.cuda.current_stream().wait_stream(side)
        for t in (qs, ks, vs):
            t.grad = None
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            o, lse = attn(qs, ks, vs, return_lse=True)
            o.backward(dos)
        bad, last = 0, ""
        for _ in range(20):
            fresh = attention_inputs(sig, 1, 1000, 1000, gen)
            with torch.no_grad():
                for t, x in zip(static, fresh):
                    t.copy_(x)
            g.replay()
            torch.cuda.synchronize()
            ref = sdpa_reference(sig, *fresh)
            ref["lse"], bounds = attention_bounds(sig, *fresh, ref, o.detach())
            good, last = attention_compare({"o": o.detach(), "lse": lse, "dq": qs.grad, "dk": ks.grad, "dv": vs.grad},
                                           ref, bounds)
            bad += not good
        return bad == 0, f"{bad} of 20 replays wrong; the last: {last}"

    graph()

    def thread_inputs():
        """hd 128 inputs (S 1000) and this thread's forward and op.grads of them, the new-thread checks' reference."""
        attn = ops["hd128"]
        q, k, v, do = attention_inputs(attn.signature, 1, 1000, 1000, gen)
        o, lse = attn(q, k, v, return_lse=True)
        return attn, (q, k, v, do), (o, lse), attn.grads(q, k, v, o, do, lse)

    def in_new_thread(body) -> dict:
        """body(out) run in a new host thread and joined, with the outputs' NaN fill off there (a CUDA call that
        would give the thread its context first, or put fill kernels into a capture: the op's launches alone); an
        exception it raises is out["error"], its first line."""
        import threading

        out = {}

        def run():
            try:
                body(out)
            except Exception as e:  # noqa: BLE001 - the caller reports it
                out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

        poison = os.environ.pop("TSGEN_TORCH_POISON", None)
        try:
            thread = threading.Thread(target=run)
            thread.start()
            thread.join()
        finally:
            if poison is not None:
                os.environ["TSGEN_TORCH_POISON"] = poison
        return out

    def rel_errors(got, want) -> list[float]:
        return [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, want)]

    @checked("attention_fresh_thread")
    def fresh_thread():
        """The op called from a host thread that has made no CUDA call (PyTorch's autograd worker threads are such,
        where a backward's first CUDA call is its launcher; the outputs' NaN fill is off there, being a CUDA call
        that would give the thread its context first): the forward and op.grads in a new thread whose context is
        unset (cuCtxSetCurrent(NULL)), O and LSE bit for bit and dQ, dK, dV within 1e-2 in norm of the same calls
        on this thread. It holds only where the thread's first launch found no context current (read by
        cuCtxGetCurrent in a wrapper of the launch path; the allocator is warmed first so that no cudaMalloc binds
        one). Until 2026-11-29 the launchers' first TMA encode failed there (cudaError 1)."""
        import ctypes
        import threading

        import tsgen.torch.ops as ops_mod

        attn, (q, k, v, do), (o, lse), grads = thread_inputs()
        # the same calls once more, their outputs dropped: the caching allocator then holds free blocks of every
        # size the thread's calls allocate, so that no cudaMalloc (which would bind the thread's context) runs there
        attn(q, k, v, return_lse=True), attn.grads(q, k, v, o, do, lse)
        torch.cuda.synchronize()
        cuda = ctypes.CDLL("libcuda.so.1")
        unbound_at_launch = []

        def context_unset() -> bool:
            ctx = ctypes.c_void_p()
            cuda.cuCtxGetCurrent(ctypes.byref(ctx))
            return ctx.value is None

        def watched(device, launcher, args):  # each launch: was the thread still without a context?
            if threading.current_thread() is not threading.main_thread():
                unbound_at_launch.append(context_unset())
            return launch(device, launcher, args)

        def body(out):
            cuda.cuCtxSetCurrent(ctypes.c_void_p(None))
            out["fwd"] = attn(q, k, v, return_lse=True)
            out["bwd"] = attn.grads(q, k, v, o, do, lse)
            torch.cuda.synchronize()

        launch = ops_mod.call_on_stream
        ops_mod.call_on_stream = watched
        try:
            out = in_new_thread(body)
        finally:
            ops_mod.call_on_stream = launch
        first = unbound_at_launch[0] if unbound_at_launch else None
        if "error" in out:
            return False, f"in a new thread (no context at its first launch: {first}): {out['error']}"
        fo, flse = out["fwd"]
        same = bool(torch.equal(fo, o)) and bool(torch.equal(flse, lse))
        errs = rel_errors(out["bwd"], grads)
        # the check checks what it says only where the thread's first launch found no context
        ok = first is True and same and max(errs) <= 1e-2
        return ok, (f"no context at the thread's first launch: {first}; O, LSE bit for bit: {same}; dQ, dK, dV "
                    f"rel {', '.join(f'{e:.1e}' for e in errs)}")

    fresh_thread()

    @checked("attention_fresh_thread_captured")
    def fresh_thread_captured():
        """A host thread's first tsgen launches made inside a CUDA graph capture (torch.cuda.graph in a new thread,
        no tsgen call there before it): the forward and op.grads captured, the graph replayed 3 times on this thread,
        O and LSE bit for bit and dQ, dK, dV within 1e-2 in norm of the same calls made eagerly. The launchers bind
        a thread's context where none is current; a call that is illegal during capture (cudaFree, which the
        binding used until 2026-11-29) would end the capture and fail here."""
        attn, (q, k, v, do), (o, lse), grads = thread_inputs()
        torch.cuda.synchronize()

        def body(out):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out["fwd"] = attn(q, k, v, return_lse=True)
                out["bwd"] = attn.grads(q, k, v, o, do, lse)
            out["graph"] = g

        out = in_new_thread(body)
        if "error" in out:
            return False, f"capturing a new thread's first launches: {out['error']}"
        same, errs = True, []
        for _ in range(3):
            for t in (*out["fwd"], *out["bwd"]):
                t.fill_(float("nan"))  # a replay that writes nothing fails
            out["graph"].replay()
            torch.cuda.synchronize()
            fo, flse = out["fwd"]
            same &= bool(torch.equal(fo, o)) and bool(torch.equal(flse, lse))
            errs += rel_errors(out["bwd"], grads)
        ok = same and all(e <= 1e-2 for e in errs)  # a NaN fails: it compares false
        return ok, f"3 replays: O, LSE bit for bit: {same}; dQ, dK, dV rel {', '.join(f'{e:.1e}' for e in errs)}"

    fresh_thread_captured()

    @checked("attention_step_times")
    def times():
        """Forward + backward, eager, S 4096: tsgen's op against torch SDPA's autograd (its default
        backend, bf16), CUDA events around 10 steps after 3 of warm-up, one after the other."""
        notes = []
        for name, attn in ops.items():
            sig = attn.signature
            q, k, v, do = (x.requires_grad_(i < 3) for i, x in enumerate(attention_inputs(sig, 1, 4096, 4096, gen)))
            group = sig.heads // sig.kv_heads

            def tsgen_step():
                attn(q, k, v).backward(do)

            def sdpa_step():  # GQA as SDPA takes it (torch >= 2.5), no repeated K and V
                qb, kb, vb = (to_bhsd(x, sig.layout) for x in (q, k, v))
                o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=sig.causal, scale=sig.scale,
                                                   **({"enable_gqa": True} if group > 1 else {}))
                o.backward(to_bhsd(do, sig.layout))

            ms = {}
            for label, step in (("sdpa", sdpa_step), ("tsgen", tsgen_step)):
                for i in range(13):
                    if i == 3:
                        torch.cuda.synchronize()
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                    for t in (q, k, v):
                        t.grad = None
                    step()
                end.record()
                end.synchronize()
                ms[label] = start.elapsed_time(end) / 10
            for label in ("sdpa", "tsgen"):
                print(f"TIME attention {name}_s4096_{label}: {ms[label]:.3f} ms/step ({ms['sdpa'] / ms[label]:.2f}x "
                      "the twin)", flush=True)
            notes.append(f"{name}: tsgen {ms['tsgen']:.2f} ms, SDPA {ms['sdpa']:.2f} ms")
        return True, "; ".join(notes) + " (fwd + bwd, S 4096, batch 1; a first reading)"

    times()


# -- --cp: tsgen.torch.cp_attention (context-parallel attention, forward + backward) on the group ----

# (name in ATTENTION_PAIRS, layout): zig-zag causal (GQA 32:8) and contiguous not causal (32 heads)
CP_CASES = (("hd128_causal_gqa", "zigzag"), ("hd128", "contiguous"))
# each case's fused forward (cp_attention(..., fused=)): the cp_attention spec of the same attention and layout
CP_FUSED = {("hd128_causal_gqa", "zigzag"): "examples/torch/specs/cp_attention_hd128_causal_gqa.yaml",
            ("hd128", "contiguous"): "examples/torch/specs/cp_attention_hd128.yaml"}
# each case's backward with params.kv_push (cp_attention's dK / dV pushed to their owners as each block ends, the
# reduce-scatter overlapped with the backward): the same kernel's spec with kv_push
CP_PUSH = {("hd128_causal_gqa", "zigzag"): "examples/torch/specs/attention_backward_hd128_causal_gqa_push.yaml",
           ("hd128", "contiguous"): "examples/torch/specs/attention_backward_hd128_push.yaml"}
CP_PUSH_LAG_CYCLES = 100_000_000  # the push control's delay on every rank but 0 (about 50 ms at 2 GHz)
CP_SEQS = (2048, 8192)  # the whole sequence S; each rank holds S / W rows
CP_SHARED_SEQS = (2048,)  # ranks sharing one GPU: every rank computes the whole reference
# cp_step_times (module doc): what it times, from the environment; unset or empty: these
CP_TIME_DEFAULTS = {"CP_TIME_SEQS": "2048 8192 16384 32768", "CP_TIME_VARIANTS": "tsgen ideal twin twin_cudnn",
                    "CP_TIME_ROUNDS": "8"}
# every implementation it can time, in the order of its TIME lines (kv_together: the first case only)
CP_TIME_LABELS = ("tsgen", "tsgen_graph", "tsgen_fused", "tsgen_kv_together", "tsgen_overlap", "tsgen_push", "twin",
                  "twin_cudnn", "ideal")
CP_SAMPLE_MS = 25.0  # one sample: about this long, and at least 2 steps (steps_per_sample)
CP_TIME_ORDER = "balanced"  # tsgen.bench.timing.round_order's Williams design
CP_TIME_MAX_REL_ERR = 2e-2  # the timed cp step against the single-GPU step, both bf16 tsgen results, in norm


def cp_time_settings(env=os.environ) -> tuple[list[int], list[str], int]:
    """(sequence lengths, implementations in CP_TIME_LABELS order, rounds) of cp_step_times, from
    CP_TIME_SEQS, CP_TIME_VARIANTS (space-separated) and CP_TIME_ROUNDS; ValueError naming a wrong one."""
    def words(name):
        return (env.get(name) or "").split() or CP_TIME_DEFAULTS[name].split()

    try:
        seqs, rounds = [int(x) for x in words("CP_TIME_SEQS")], int(" ".join(words("CP_TIME_ROUNDS")))
    except ValueError as e:
        raise ValueError(f"CP_TIME_SEQS / CP_TIME_ROUNDS: whole numbers ({e})") from None
    variants = words("CP_TIME_VARIANTS")
    unknown = sorted(set(variants) - set(CP_TIME_LABELS))
    if unknown or min(seqs) < 1 or rounds < 1:
        raise ValueError(f"CP_TIME_SEQS {seqs}, CP_TIME_ROUNDS {rounds}, CP_TIME_VARIANTS {variants}: sequence "
                         f"lengths and rounds >= 1, variants of {' '.join(CP_TIME_LABELS)}"
                         + (f" (not {' '.join(unknown)})" if unknown else ""))
    return seqs, [x for x in CP_TIME_LABELS if x in variants], rounds


def steps_per_sample(step_ms: float, sample_ms: float = CP_SAMPLE_MS) -> int:
    """Steps in one timed sample: about `sample_ms` of them at `step_ms` a step (a first estimate),
    at least 2."""
    return max(2, math.ceil(sample_ms / max(step_ms, 1e-6)))


def cp_time_rounds(clock, rank: int, streams, steps: dict, rounds: int, lineup, key: str,
                   refusable: tuple = ("twin", "twin_cudnn")) -> dict:
    """Time `steps` (label -> (step, its leaves), in the order given) in interleaved rounds with
    tsgen.bench.timing's core on `clock` (cp_step_times says how): per label an estimate (2 steps of
    warm-up, 1 timed), N = steps_per_sample(it), then `rounds` rounds of one sample each (lineup, 1
    settling step, N timed) in round_order's order. A label of `refusable` whose step raises a
    RuntimeError (SDPA refuses a mask, shape or backend) is left out with its reason. Returns
    {"estimate_ms", "calls" (N), "order" (each round's), "ms" (each round's sample, ms per step),
    "refused", "problems" (the core's witness and region checks)}."""
    from tsgen.bench.timing import Sampler, round_order, time_calls, time_interleaved

    def timed(step, leaves):  # the core's call i: the step, the leaves' grads cleared first
        def call(i, ranks):
            for t in leaves:
                t.grad = None
            step()
        return call

    estimate, refused, problems = {}, {}, []
    for label, (step, leaves) in steps.items():
        try:  # an SDPA refusal comes in the forward on every rank alike, after the same collectives
            t = time_calls(clock, [rank], streams, timed(step, leaves), calls=1, reps=1, warmup=2, graphs=False,
                           before_sample=lineup, label=f"{key} {label} estimate")
        except RuntimeError as e:
            if label not in refusable:
                raise
            refused[label] = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
            continue
        estimate[label] = t.samples_us[0] / 1e3  # the slowest rank's: the same on every rank, and so is N
        problems += t.problems
    calls = {label: steps_per_sample(est) for label, est in estimate.items()}
    samplers = {label: Sampler(clock, [rank], streams, timed(*steps[label]), calls=calls[label], warmup=0,
                               graphs=False, before_sample=lineup, settle=1, label=f"{key} {label}")
                for label in estimate}
    timings = time_interleaved(samplers, rounds, CP_TIME_ORDER)
    return {"estimate_ms": estimate, "calls": calls,
            "order": [round_order(list(samplers), i, CP_TIME_ORDER) for i in range(rounds)],
            "ms": {label: [x / 1e3 for x in t.samples_us] for label, t in timings.items()},
            "refused": refused, "problems": problems + [x for t in timings.values() for x in t.problems]}


def cp_graph_step(cp, q, k, v, do):
    """tsgen_graph: the default op's forward + backward captured in one CUDA graph (torch's whole-step
    recipe: three warm-up steps on a side stream, so that the heaps, the zig-zag index and the autograd
    state exist before capture, then one step captured on the same leaves, copies of q, k, v, with their
    grads cleared). Returns (replay, what a replay writes: O and the leaves' grads, static tensors of the
    graph's pool). What it measures against the eager step is the host's share of the step: a replay
    launches every kernel of it at once."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for t in leaves:
                t.grad = None
            cp(*leaves).backward(do)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = cp(*leaves)
        o.backward(do)
    def replay():  # holds the leaves and dO: the graph reads their memory, which nothing else need keep (a
        graph.replay()  # freed clone is soon another tensor's: 6289cec's replays read such memory, wrong results)
        return leaves, do

    return replay, {"o": o.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def cp_time_lines(key: str, ms: dict[str, list[float]], calls: dict[str, int], S: int, w: int) -> list[str]:
    """cp_step_times' lines of one case at one S, from `ms`: each implementation's samples in ms per step,
    sample i from round i (the ideal's already divided by W). A TIME line per implementation: the median
    over rounds, the twin's sample over this one's (`Rx the twin`) and the ideal's over this one's
    (`ideal/this`) each paired round by round (tsgen.bench.timing.paired_ratio), the latter's median with
    its min-max over rounds; the ideal's own line; then one RAW line with every round's sample and the
    steps per sample (`calls`)."""
    from tsgen.bench.timing import paired_ratio

    lines = []
    for label in [x for x in CP_TIME_LABELS if x in ms and x != "ideal"]:
        parts = []
        if "twin" in ms:
            parts.append(f"{paired_ratio(ms['twin'], ms[label])['ratio']:.2f}x the twin")
        if "ideal" in ms:
            p = paired_ratio(ms["ideal"], ms[label])
            parts.append(f"ideal/this {p['ratio']:.2f}, rounds {p['min']:.2f}-{p['max']:.2f}")
        lines.append(f"TIME cp_attention {key}_{label}: {statistics.median(ms[label]):.3f} ms/step"
                     + (f" ({'; '.join(parts)})" if parts else ""))
    if "ideal" in ms:
        lines.append(f"TIME cp_attention {key}_ideal: {statistics.median(ms['ideal']):.3f} ms/step (single-GPU "
                     f"tsgen attention fwd+bwd over S {S} / {w})")
    labels = [x for x in CP_TIME_LABELS if x in ms]
    lines.append(f"RAW cp_attention {key} (ms/step per round; steps per sample "
                 + ", ".join(f"{x} {calls[x]}" for x in labels) + "): "
                 + " ".join(f"{x}=[{', '.join(f'{v:.3f}' for v in ms[x])}]" for x in labels))
    return lines


def rel_errors(got: dict, want: dict, bound: float) -> tuple[bool, str]:
    """Each tensor of `got` against the same-named one of `want` in norm, ||got - want|| / ||want||
    within `bound`, every element of both finite: (all good, "o 2.1e-03, dq ...")."""
    ok, notes = True, []
    for name, g in got.items():
        g, r = g.float(), want[name].float()
        finite = bool(torch.isfinite(g).all()) and bool(torch.isfinite(r).all())
        rel = rel_norm(g, r)
        good = finite and rel <= bound
        ok &= good
        notes.append(f"{name} {rel:.1e}{'' if finite else ' NOT FINITE'}{'' if good else ' FAIL'}")
    return ok, ", ".join(notes)


def cp_reference(sig, q, k, v, do) -> dict:
    """sdpa_reference over the whole sequence, one KV head (and its query heads) at a time: a few
    [group, S, S] float32 matrices at once (S 8192: about 1 GiB each), bshd."""
    from types import SimpleNamespace

    group = sig.heads // sig.kv_heads
    one = SimpleNamespace(heads=group, kv_heads=1, layout="bshd", causal=sig.causal, scale=sig.scale)
    parts = [sdpa_reference(one, q[:, :, g * group:(g + 1) * group], k[:, :, g:g + 1], v[:, :, g:g + 1],
                            do[:, :, g * group:(g + 1) * group]) for g in range(sig.kv_heads)]
    return {name: torch.cat([p[name] for p in parts], 2) for name in ("o", "dq", "dk", "dv")}


def cp_all_rows(x: torch.Tensor, rows: list[torch.Tensor], group, on_cpu: bool) -> torch.Tensor:
    """Every rank's rows of x ([B, n, ...] bshd) placed at their positions (rows[r]: rank r's) in one
    [B, S, ...] tensor, through torch.distributed (gloo: CPU tensors)."""
    w = dist.get_world_size(group)
    dev = torch.device("cpu") if on_cpu else x.device
    parts = [torch.empty(x.shape, dtype=x.dtype, device=dev) for _ in range(w)]
    dist.all_gather(parts, x.detach().to(dev).contiguous(), group=group)
    full = x.new_empty((x.shape[0], x.shape[1] * w, *x.shape[2:]))
    for r, part in enumerate(parts):
        full[:, rows[r]] = part.to(x.device)
    return full


def cp_checks(group, shared: bool) -> None:
    """--cp (module doc): tsgen.torch.cp_attention on `group` against float32 autograd of SDPA over the
    whole sequence, every rank's O, LSE, dQ, dK, dV (the attention checks' per-element bounds and norm);
    a negative control (the reduce-scatter replaced by this rank's own partial sums); step times
    beside an NCCL all_gather + SDPA twin and the single-GPU attention over the whole sequence
    (not on a shared GPU)."""
    import copy

    import torch.nn.functional as F
    from tsgen.ops.cp_attention import positions as row_positions

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator(device="cuda").manual_seed(35)  # the same on every rank: every rank makes the whole inputs
    ops, together, overlapped, fused, pushed = {}, {}, {}, {}, {}

    @checked("cp_load")
    def load():
        t0 = time.perf_counter()
        def make(name, layout, **kw):
            fwd, bwd = ATTENTION_PAIRS[name]
            return tt.cp_attention(ROOT / fwd, ROOT / bwd, ROOT / "specs" / "allgather.yaml",
                                   ROOT / "specs" / "reduce_scatter.yaml", group, layout=layout, **kw)

        for case_ in CP_CASES:
            ops[case_] = make(*case_)
        # the first case with K and V in one all-gather, dK and dV in one reduce-scatter (kv_together)
        together[CP_CASES[0]] = make(*CP_CASES[0], kv_together=True)
        # every case with the backward by runs of key rows, the reduce-scatter beside the own rows' kernels
        for case_ in CP_CASES:
            overlapped[case_] = make(*case_, overlap_backward=True)
        # every case with the fused forward (the cp_attention kernel: its gather on the copy engine, which
        # ranks sharing a GPU refuse, so not there)
        if not shared:
            for case_ in CP_CASES:
                fused[case_] = make(*case_, fused=ROOT / CP_FUSED[case_])
        # every case with the backward's dK / dV pushed to their owners (params.kv_push)
        for case_ in CP_CASES:
            pushed[case_] = make(*case_, push=ROOT / CP_PUSH[case_])
        return True, (f"{len(ops) + len(together) + len(overlapped) + len(fused) + len(pushed)} ops at world {w} in "
                      f"{time.perf_counter() - t0:.1f} s")

    if not load():
        return

    def case(cp, S: int, bad: bool = False, reduce_scatter=None, batch: int = 1):
        """Every rank's O, LSE, dQ, dK, dV against the reference; `bad`: without the reduce-scatter;
        `reduce_scatter`: this op (loaded) in place of the cp op's."""
        sig = cp.attention.signature
        n = S // w
        rows = [torch.tensor(row_positions(cp.layout, w, n, x), device="cuda") for x in range(w)]
        q, k, v, do = attention_inputs(sig, batch, S, S, gen)
        mine = [x.index_select(1, rows[r]).contiguous() for x in (q, k, v, do)]
        qa, ka, va = (x.clone().requires_grad_(True) for x in mine[:3])
        op = cp
        if bad:  # the reduce-scatter dropped: dK, dV of this rank's own queries only
            op = copy.copy(cp)
            op._reduce_scatter = lambda x: x.chunk(w)[r].contiguous()
        elif reduce_scatter is not None:
            op = copy.copy(cp)
            op._reduce_scatter = reduce_scatter
        o, lse = op(qa, ka, va, return_lse=True)
        o.backward(mine[3])
        got = {"o": o.detach(), "lse": lse, "dq": qa.grad, "dk": ka.grad, "dv": va.grad}
        if shared:
            # every rank's kernels done before any rank computes its reference: the reference's
            # first cuBLAS / SDPA launches load their kernels lazily, and a load waits on the kernels
            # running on the device, among them a peer's collective spinning for this rank's pushes
            # (W 8 on one GPU under MPS: cublasCreate hung until the collectives' 10 s timeout)
            every_rank_done(group)
        ref = cp_reference(sig, q, k, v, do)
        o_full = cp_all_rows(got["o"], rows, group, shared)
        ref["lse"], bounds = attention_bounds(sig, q, k, v, do, ref, o_full)
        pick = {n_: (lambda t, d=(2 if n_ == "lse" else 1): t.index_select(d, rows[r])) for n_ in got}
        return attention_compare(got, {n_: pick[n_](x) for n_, x in ref.items()},
                                 {n_: pick[n_](x) for n_, x in bounds.items()})

    labelled = ([(key, cp, "") for key, cp in ops.items()] + [(key, cp, "_kv_together") for key, cp in together.items()]
                + [(key, cp, "_overlap") for key, cp in overlapped.items()]
                + [(key, cp, "_fused") for key, cp in fused.items()] + [(key, cp, "_push") for key, cp in pushed.items()])
    for (name, layout), cp, tag in labelled:
        for S in (CP_SHARED_SEQS if shared else CP_SEQS):
            @checked(f"cp_{name}_{layout}{tag}_w{w}_s{S}")
            def one():
                return case(cp, S)

            one()
    for (name, layout), cp in pushed.items():  # another batch at the same rows: a heap of its own (its size, its count)
        @checked(f"cp_{name}_{layout}_push_batch2_w{w}_s{CP_SEQS[0]}")
        def batch2():
            return case(cp, CP_SEQS[0], batch=2)

        batch2()

    @checked(f"cp_negative_control_w{w}")
    def control():
        """The comparison must fail when the dK / dV reduce-scatter is left out (each rank keeping its
        own queries' partial sums): caught on every rank."""
        ok, detail = case(ops[CP_CASES[0]], CP_SEQS[0], bad=True)
        return not ok, f"{'caught' if not ok else 'NOT CAUGHT'} ({detail})"

    control()

    @checked(f"cp_negative_control_overlap_w{w}")
    def control_overlap():
        """The same with overlap_backward: the reduce-scatter of the peers' partial sums left out."""
        ok, detail = case(overlapped[CP_CASES[0]], CP_SEQS[0], bad=True)
        return not ok, f"{'caught' if not ok else 'NOT CAUGHT'} ({detail})"

    control_overlap()

    def push_control(control: int):
        """kv_push with a negative control while every rank but 0 starts its backward CP_PUSH_LAG_CYCLES late:
        PUSH_SKIP_WAIT (the owner sums without waiting) or PUSH_SIGNAL_FIRST (each rank signals its owners before
        its main kernel's stores): rank 0 sums slots its peers have not written yet (the previous call's, of other
        inputs), so the comparison must fail on some rank at each of 3 steps; the same op without the control and
        with the same lag passes. Reported the same on every rank."""
        base = pushed[CP_CASES[0]]
        lagged = copy.copy(base)
        lagged.push_before = (lambda: torch.cuda._sleep(CP_PUSH_LAG_CYCLES)) if r != 0 else None
        broken = copy.copy(lagged)
        broken.push_control = control
        caught = []
        for _ in range(3):
            every_rank_done(group)
            caught.append(not case(broken, CP_SEQS[0])[0])
        every_rank_done(group)
        waited_ok = case(lagged, CP_SEQS[0])[0]
        seen = [None] * w
        dist.all_gather_object(seen, waited_ok, group=group)
        fine = all(seen)
        every_step, steps = caught_at_every_step(group, caught)
        return every_step and fine, (f"{'caught' if every_step else 'NOT CAUGHT'} at every step, without the control "
                                     f"{'correct' if fine else 'WRONG'}; {steps}")

    from tsgen.torch.attention_op import PUSH_SIGNAL_FIRST, PUSH_SKIP_WAIT

    checked(f"cp_negative_control_push_w{w}")(lambda: push_control(PUSH_SKIP_WAIT))()
    checked(f"cp_negative_control_push_signal_first_w{w}")(lambda: push_control(PUSH_SIGNAL_FIRST))()

    @checked(f"cp_reduce_scatter_wait_control_w{w}")
    def wait_control():
        """tsgen's reduce-scatter without its reduce steps' waits (tests/mutations.py
        reduce_without_waits) under the lag_blocks schedule: every rank's block 0 (which signals the
        call's entry) and every block of rank 0 start at once, the peers' other blocks (which push
        their pieces into rank 0's inbox) 20 ms later, so rank 0 sums an inbox their pieces have not
        reached, and the comparison must fail at each of 3 steps on some rank. Reported the same on
        every rank. Each call starts with every rank's earlier work done (synchronize + barrier).
        Under the plain lag schedule (every block of a peer late, the entry signal with them) rank 0's
        own pushes wait for its peers' entry, so it reached its reduce step as their pieces were
        landing: at W 8 on one GPU caught at 1 or 2 of 3 steps (2026-11-27, at 917bff7, 55ce6a5 and
        f1c8f82, the host launching every rank within 0.6 ms of the alignment)."""
        bad = broken_reduce_scatter(group)

        def aligned(x):
            every_rank_done(group)
            return bad(x)

        try:
            caught = [not case(ops[CP_CASES[0]], CP_SEQS[0], reduce_scatter=aligned)[0] for _ in range(3)]
        finally:
            bad.close()
        every_step, steps = caught_at_every_step(group, caught)
        return every_step, f"{'caught' if every_step else 'NOT CAUGHT'} at every step; {steps}"

    wait_control()
    if shared:
        return

    @checked(f"cp_step_times_w{w}")
    def times():
        """Forward + backward per step, batch 1, at each S of CP_TIME_SEQS (default 2048 8192 16384 32768),
        of the implementations CP_TIME_VARIANTS names (default tsgen ideal twin twin_cudnn): tsgen, the
        default tsgen.torch.cp_attention (tsgen_graph: the same captured in a CUDA graph, cp_graph_step;
        tsgen_fused, tsgen_kv_together and tsgen_overlap: its variants, the cases
        loaded with them); twin, NCCL all_gather_into_tensor of K and V (its backward
        reduce_scatter_tensor, examples/torch/twins.py), the gathered rows in position order, SDPA per
        query segment (causal zig-zag: two segments, each against the keys up to its end,
        causal_lower_right), SDPA's default backends (twin_cudnn: cuDNN alone); ideal, the single-GPU
        tsgen.torch.attention over the whole sequence on one GPU (every rank on its own), divided by W
        (the issue's target for the fused version: >= 0.90 of it). Every implementation takes the same
        inputs: the whole sequence's (the ideal), this rank's rows of them (the others).

        Timed with tsgen.bench.timing's core, each rank on its current stream (TorchClock): first an
        estimate per implementation (2 steps of warm-up, 1 timed), then CP_TIME_ROUNDS rounds (default
        8), each taking one sample of every implementation in round_order's balanced order (each takes
        every place and follows every other equally often over a cycle, so a drift in clocks or
        temperature falls on all alike). A sample: the ranks line up (synchronize, barrier), one untimed
        settling step, then N steps between two CUDA events, N = steps_per_sample(estimate): about 25
        ms, at least 2 steps; each step after the leaves' grads are cleared. A sample's time is the
        slowest rank's (all_reduce max), so the estimate, N and every number below are the same on
        every rank, and every rank runs the same steps (the collectives) in the same order. Reported:
        per implementation the median ms/step over rounds; the ideal over it and the twin over it,
        each paired round by round (median, ideal/this with its min-max), every round's sample on a
        RAW line (cp_time_lines), and with CP_TIME_JSON set, rank 0 writes per case and S every
        round's samples, N, the rounds and the order to that file. Refused by SDPA (a mask, shape or
        backend): a note, no time.

        Then each timed S is checked: one more step of each timed tsgen op (the default always) and of
        the single-GPU op, fresh grads, this rank's O, dQ, dK, dV (k.grad: this rank's key rows, summed
        over every rank's queries) against the single-GPU step's at this rank's rows, within
        CP_TIME_MAX_REL_ERR in norm, every element finite. A wrong result or a timing that brackets no
        step (the core's witness and region checks) fails the check."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
        from tsgen.bench.timing import TorchClock, paired_ratio

        seqs, variants, rounds = cp_time_settings()
        clock = TorchClock(torch, dist, torch.device("cuda", torch.cuda.current_device()))
        streams = {r: torch.cuda.current_stream()}
        json_path = os.environ.get("CP_TIME_JSON")
        saved = {"world": w, "rounds": rounds, "round_order": CP_TIME_ORDER, "sample_ms": CP_SAMPLE_MS,
                 "variants": variants, "cases": [],
                 "ideal": "ms, median_ms: the single-GPU step / world; estimate_ms: the single-GPU step"}
        ok, notes, errors, problems = True, [], [], []

        def lineup():
            dist.barrier(group)

        for (name, layout), cp in ops.items():
            sig = cp.attention.signature
            group_heads = sig.heads // sig.kv_heads
            tsgen_ops = {"tsgen": cp, "tsgen_fused": fused.get((name, layout)),
                         "tsgen_kv_together": together.get((name, layout)),
                         "tsgen_overlap": overlapped.get((name, layout)), "tsgen_push": pushed.get((name, layout))}
            for S in seqs:
                n = S // w
                key = f"{name}_{layout}_w{w}_s{S}"
                rows = torch.tensor(row_positions(cp.layout, w, n, r), device="cuda")
                whole = attention_inputs(sig, 1, S, S, gen)  # the same on every rank (the same generator)
                q, k, v, do = (x.index_select(1, rows).contiguous() for x in whole)  # this rank's rows
                q, k, v = (x.requires_grad_(True) for x in (q, k, v))
                qf, kf, vf = (x.requires_grad_(True) for x in whole[:3])
                dof = whole[3]
                pos = cp_positions_of(cp, n)
                order = cp_gather_order(cp, n)

                def tsgen_step(op):
                    return lambda: op(q, k, v).backward(do)

                def twin_step():
                    kf_, vf_ = (twins.AllGather.apply(x.transpose(0, 1), group).transpose(0, 1) for x in (k, v))
                    if order is not None:
                        kf_, vf_ = kf_[:, order], vf_[:, order]
                    kb, vb = kf_.transpose(1, 2), vf_.transpose(1, 2)
                    segs = ([(0, pos[1], pos[0] + pos[1]), (pos[1], n, pos[2] + n - pos[1])] if sig.causal
                            else [(0, n, S)])
                    outs = []
                    for a, b, end in segs:
                        qb = q[:, a:b].transpose(1, 2)
                        mask = causal_lower_right(b - a, end) if sig.causal else None
                        outs.append(F.scaled_dot_product_attention(
                            qb, kb[:, :, :end], vb[:, :, :end], attn_mask=mask, scale=sig.scale,
                            **({"enable_gqa": True} if group_heads > 1 else {})))
                    torch.cat(outs, 2).transpose(1, 2).backward(do)

                def cudnn_step():
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        twin_step()

                def single_step():
                    cp.attention(qf, kf, vf).backward(dof)

                steps = {label: (tsgen_step(op), (q, k, v)) for label, op in tsgen_ops.items() if op is not None}
                graphed = None
                if "tsgen_graph" in variants:  # captured once per S (every rank: the warm-up runs the collectives)
                    replay, graphed = cp_graph_step(cp, q, k, v, do)
                    steps["tsgen_graph"] = (replay, ())
                steps.update(twin=(twin_step, (q, k, v)), twin_cudnn=(cudnn_step, (q, k, v)),
                             ideal=(single_step, (qf, kf, vf)))
                got = cp_time_rounds(clock, r, streams, {x: steps[x] for x in variants if x in steps}, rounds,
                                     lineup, key)
                ms = {x: [one / w for one in y] if x == "ideal" else y for x, y in got["ms"].items()}
                problems += got["problems"]

                # the check: one more step of each timed tsgen op and of the single-GPU op, fresh grads
                for t in (qf, kf, vf):
                    t.grad = None
                o1 = cp.attention(qf, kf, vf)
                o1.backward(dof)
                want = {n_: x.index_select(1, rows) for n_, x in (("o", o1.detach()), ("dq", qf.grad),
                                                                  ("dk", kf.grad), ("dv", vf.grad))}
                checked_ops = [label for label in (*tsgen_ops, "tsgen_graph") if label == "tsgen" or label in ms]
                for label in checked_ops:
                    if label == "tsgen_graph":  # one more replay into its static outputs, poisoned first
                        for x in graphed.values():
                            x.fill_(float("nan"))
                        steps[label][0]()
                        got_now = graphed
                    else:
                        for t in (q, k, v):
                            t.grad = None
                        o = tsgen_ops[label](q, k, v)
                        o.backward(do)
                        got_now = {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
                    good, text = rel_errors(got_now, want, CP_TIME_MAX_REL_ERR)
                    ok &= good
                    errors.append(f"{name} s{S} {label}: {text}")

                if r == 0:
                    for line in cp_time_lines(key, ms, got["calls"], S, w):
                        print(line, flush=True)
                    notes += [f"{name} s{S} {x}: {why}" for x, why in got["refused"].items()]
                    saved["cases"].append({
                        "case": name, "layout": layout, "S": S, **got, "ms": ms,
                        "median_ms": {x: statistics.median(y) for x, y in ms.items()},
                        "ideal_over": {x: paired_ratio(ms["ideal"], y) for x, y in ms.items()
                                       if "ideal" in ms and x != "ideal"},
                        "check_rank0": errors[-len(checked_ops):]})
                    if json_path:  # after every S: a step stopped by its timeout leaves what it finished
                        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
                        Path(json_path).write_text(json.dumps(saved, indent=1) + "\n")
                    if "tsgen" in ms and "ideal" in ms:
                        p = paired_ratio(ms["ideal"], ms["tsgen"])
                        twin = f", twin {statistics.median(ms['twin']):.2f} ms" if "twin" in ms else ""
                        others = "".join(f", {x[6:]} {paired_ratio(ms['ideal'], ms[x])['ratio']:.2f}"
                                         for x in ("tsgen_graph", "tsgen_fused", "tsgen_kv_together", "tsgen_overlap",
                                                   "tsgen_push")
                                         if x in ms)
                        notes.append(f"{name} {layout} s{S}: tsgen {statistics.median(ms['tsgen']):.2f} ms{twin}, "
                                     f"{p['ratio']:.2f} of ideal ({p['min']:.2f}-{p['max']:.2f}){others}")
        ok &= not problems
        detail = "; ".join(notes) + (f" (fwd + bwd, batch 1, median over {rounds} interleaved rounds)"
                                     if notes else "")
        return ok, "; ".join(x for x in (detail, "check vs single-GPU, rel err: " + "; ".join(errors),
                                          "; ".join(problems)) if x)

    times()


def caught_at_every_step(group, caught: list[bool]) -> tuple[bool, str]:
    """A negative control run for several steps on every rank (`caught`: this rank's comparison failed, per step):
    whether some rank caught it at every step, and every rank's steps in words; the same on every rank."""
    seen = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, caught, group=group)
    every_step = all(any(c[i] for c in seen) for i in range(len(caught)))
    return every_step, ("steps caught per rank (x caught, . not): "
                        + ", ".join(f"r{x}: {''.join('x' if c_ else '.' for c_ in c)}" for x, c in enumerate(seen)))


def every_rank_done(group) -> None:
    """Return once this rank's GPU work is done and every rank of `group` has got here too."""
    torch.cuda.synchronize()
    dist.barrier(group)


def step_ms(step, group, leaves=(), warmup: int = 3, reps: int = 10) -> tuple[float, float]:
    """(GPU ms, host ms) per call of `step`: the group's ranks start together, `warmup` calls, then
    `reps` between CUDA events on the current stream, each call after the leaves' grads are cleared
    (tools/torch_cp_pieces.py times its pieces with it; cp_step_times takes tsgen.bench.timing's
    interleaved rounds instead, each sample a slowest-rank reading of this same bracket)."""
    dist.barrier(group)
    for i in range(warmup + reps):
        if i == warmup:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
        for t in leaves:
            t.grad = None
        step()
    host = (time.perf_counter() - t0) / reps * 1e3
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps, host


def broken_reduce_scatter(group):
    """specs/reduce_scatter.yaml as a variant of its own name (one module name is one torch op) with
    the lag_blocks schedule rendered in and every reduce step's waits removed (tests/mutations.py), loaded
    on `group`: a negative control's collective."""
    from mutations import reduce_without_waits
    from tsgen.harness import _mutated, render_to_cache
    from tsgen.spec import load_spec, spec_variant
    from tsgen.torch.ops import _fit_shared

    variant = spec_variant(load_spec(ROOT / "specs" / "reduce_scatter.yaml"), {"name": "reduce_scatter_nowait"})
    # ranks sharing a GPU: the grid fitted as tt.load fits a spec (a manifest is loaded as built)
    module = render_to_cache(_fit_shared(variant, group), skew="lag_blocks")
    return tt.load(module.manifest, group, source=_mutated(module.source, reduce_without_waits))


def cp_positions_of(cp, n: int) -> tuple:
    from tsgen.torch.cp_attention_op import cp_positions

    return cp_positions(cp.layout, cp.world, n, cp.rank)


def cp_gather_order(cp, n: int):
    from tsgen.torch.cp_attention_op import gather_order

    order = gather_order(cp.layout, cp.causal, cp.world, n)
    return None if order is None else torch.tensor(order, device="cuda")


def cp_main(shared: bool) -> None:
    """--cp: one process per GPU on an NCCL group; with --shared, the ranks on the visible GPUs (all on
    GPU 0 where one is visible) on a gloo group under MPS (TSGEN_SHARE_GPUS=1)."""
    if shared:
        from tsgen.env import shared_gpu_env

        shared_gpu_env(rank_per_process=True)
        dev = shared_device(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count())
        torch.cuda.set_device(dev)
        dist.init_process_group("gloo", timeout=timedelta(seconds=180))
        prime_printf(dev)
    else:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timedelta(seconds=180))
    try:
        cp_checks(dist.group.WORLD, shared)
    except Exception as e:  # noqa: BLE001 - a setup failure: its FAIL
        traceback.print_exc()
        report("cp_setup", False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    tt.close_all()
    dist.barrier()
    dist.destroy_process_group()


# -- --shared: ranks sharing one GPU -----------------------------------------------------------

def shared_device(local_rank: int, gpus: int) -> int:
    """The GPU of a --shared rank: LOCAL_RANK % the visible GPUs (every rank on GPU 0 where one is
    visible: CUDA_VISIBLE_DEVICES=0)."""
    if gpus < 1:
        raise RuntimeError("--shared: no CUDA device is visible")
    return local_rank % gpus


def pattern(rank: int, call: int, shape, device=None) -> torch.Tensor:
    """Rank `rank`'s input for call `call` (bf16, `shape`): integers in [-8, 8], a hash of the element
    index, the rank and the call (no int64 overflow: the same on CPU and GPU), so every rank can make
    every rank's input, inputs differ between ranks and calls, and any sum over 8 ranks is exact in bf16."""
    n = 1
    for d in shape:
        n *= d
    x = (torch.arange(n, dtype=torch.int64, device=device) * 40503 + rank * 7919 + call * 104729) & 0xFFFFFF
    x = (x ^ (x >> 11)) * 2654435
    x = x ^ (x >> 17)
    return (x % 17 - 8).to(BF16).reshape(tuple(shape))


def local_allgather(inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """What allgather gives rank `rank` (every rank's input, in rank order, along dim 0)."""
    return torch.cat(inputs)


def local_reduce_scatter(inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """What reduce_scatter gives rank `rank`: its 1/W of dim 0 of the sum over ranks (fp32 sum: exact
    on `pattern` data, in any order)."""
    total = torch.stack(inputs).float().sum(0)
    return total.chunk(len(inputs))[rank].to(inputs[0].dtype).contiguous()


def local_all_to_all(inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """What all_to_all gives rank `rank`: chunk `rank` of every rank's input (dim 0), in rank order."""
    return torch.cat([x.chunk(len(inputs))[rank] for x in inputs])


def local_ulysses_pre(inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """Ulysses pre (bshd) for rank `rank`: [B, S/P, H, D] shards -> [B, S, H/P, D], its head group of
    every token, source r's tokens at [r S/P, (r+1) S/P)."""
    hl = inputs[0].shape[2] // len(inputs)
    return torch.cat([x[:, :, rank * hl:(rank + 1) * hl] for x in inputs], dim=1).contiguous()


def local_ulysses_post(inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """Ulysses post (bshd) for rank `rank`, the inverse of pre: [B, S, H/P, D] -> [B, S/P, H, D], its
    tokens of every head group, source r's heads at [r H/P, (r+1) H/P)."""
    s = inputs[0].shape[1] // len(inputs)
    return torch.cat([y[:, rank * s:(rank + 1) * s] for y in inputs], dim=2).contiguous()


def shared_checks(mode: str, group) -> None:
    """One heap mode's checks on `group` (see the module doc, --shared)."""
    rank, w = dist.get_rank(group), dist.get_world_size(group)
    name = f"shared_{mode}"
    spec = {s: ROOT / "specs" / f"{s}.yaml" for s in ("allgather", "reduce_scatter", "all_to_all",
                                                      "ulysses_pre_a2a", "ulysses_post_a2a")}
    ag = tt.load(spec["allgather"], group, heap=mode)
    first = pattern(rank, 0, (4099, 3), "cuda")
    try:
        poison(ag, first, 0xFF)
        got = ag(first)
    except tt.TsgenTorchError as e:
        if mode == "symm_mem" and str(e).startswith("torch symmetric memory failed"):
            # every rank raised the same agreed text: rank 0's alone
            report(f"{name}_heap", True, "" if rank else f"torch {torch.__version__}'s symmetric memory cannot make "
                   f"this group's heaps (the ipc checks count): {str(e).splitlines()[0]}", word="SKIP")
            return
        raise
    good, why = compare(got, local_allgather([pattern(r, 0, (4099, 3), "cuda") for r in range(w)], rank), exact=True)
    report(f"{name}_heap", good and ag.heap_kind == mode,
           f"heap {ag.heap_kind} on cuda:{torch.cuda.current_device()}, first allgather: {why}")
    rs = tt.load(spec["reduce_scatter"], group, heap=mode)
    a2a = tt.load(spec["all_to_all"], group, heap=mode)
    pre = tt.load(spec["ulysses_pre_a2a"], group, heap=mode)
    post = tt.load(spec["ulysses_post_a2a"], group, heap=mode)
    b, _, h, d = (n for _, n in pre.signature.ins[0].dims)

    def back_to_back(op, local, shapes, calls=20):
        """`calls` calls one after the other (no host wait between them), fresh data each, the heap's
        output poisoned before each; then every output against its local reference."""
        outs = []
        for c in range(calls):
            shape = shapes[c % len(shapes)]
            x = pattern(rank, c, shape, "cuda")
            poison(op, x, 0xFF if c % 2 else 0x7F)  # NaN patterns in bf16
            outs.append((c, shape, op(x)))
        ok, wrong, notes = True, 0, []
        for c, shape, got in outs:
            good, why = compare(got, local([pattern(r, c, shape, "cuda") for r in range(w)], rank), exact=True)
            ok &= good
            if not good and len(notes) < 3:
                notes.append(f"call {c} {tuple(shape)}: {why}")
            wrong += not good
        return ok, f"{calls} calls, shapes {', '.join(str(tuple(s)) for s in shapes)}: {wrong} wrong" + \
            (f" ({'; '.join(notes)})" if notes else "")

    for op, local, shapes in (
            (ag, local_allgather, [(262147,), (1024, 513), (6, 5, 7), (2,)]),
            (rs, local_reduce_scatter, [(262147 * w,), (1024 * w, 513), (6 * w, 5, 7), (w,)]),
            (a2a, local_all_to_all, [(4096 * w, 33), (65537 * w,), (7 * w,)]),
            (pre, local_ulysses_pre, [(b, t, h, d) for t in (1001, 1, 64)]),
            (post, local_ulysses_post, [(b, t * w, h // w, d) for t in (1001, 1, 64)])):
        checked(f"{name}_{op.signature.module}_20_calls")(lambda: back_to_back(op, local, shapes))()

    @checked(f"{name}_graph_20_replays")
    def graph():
        n, cols = 4096, 256
        static_x = pattern(rank, 100, (n, cols), "cuda")
        step = [100]

        def call():
            y = ag(static_x)
            return y, rs(y)

        def refill():
            step[0] += 1
            static_x.copy_(pattern(rank, step[0], (n, cols), "cuda"))
            poison(ag, static_x, 0xFF)
            poison(rs, torch.empty((n * w, cols), dtype=BF16, device="meta"), 0x7F)

        def wrong(outs):  # every replay: the gathered rows, and W times this rank's rows; then poison the outputs
            y, z = outs
            want = local_allgather([pattern(r, step[0], (n, cols), "cuda") for r in range(w)], rank)
            counts = int((bits(y) != bits(want)).sum().item()), int((bits(z) != bits(static_x * w)).sum().item())
            y.fill_(float("nan"))
            z.fill_(float("nan"))
            return counts

        wrong_y, wrong_z = replayed(call, refill, wrong, 20)
        return wrong_y == 0 and wrong_z == 0, \
            f"20 replays: {wrong_y} wrong allgather, {wrong_z} wrong reduce_scatter elements"

    graph()


def prime_printf(dev: int) -> None:
    """Launch tsgen's printf primer (tsgen/runtime/world.py) once in this process and wait for it,
    before any tsgen kernel: the first printf kernel of a context waits for every kernel already
    running on the GPU (docs/lab/shared_gpu.md, measured in one process), and a rank's first tsgen
    kernel (they printf their timeout diagnosis) must not wait for a peer's spinning one. Whether
    that wait crosses MPS clients is not measured: a precaution, as a shared CuPy World takes it.
    Driver API through ctypes, in torch's (primary) context."""
    import ctypes

    from tsgen.runtime.world import _PRIME_SOURCE
    from tsgen.toolchain import compile_source, write_cached
    from tsgen.torch.heap import _Driver
    from tsgen.torch.ops import _arch

    cubin = compile_source(write_cached(("runtime",), "tsgen_prime_printf.cu", _PRIME_SOURCE), arch=_arch(dev)).output
    torch.zeros(1, device=f"cuda:{dev}")  # torch's context current on this thread
    drv, module, fn = _Driver(), ctypes.c_void_p(), ctypes.c_void_p()
    drv.call("cuModuleLoad", ctypes.byref(module), str(cubin).encode())
    drv.call("cuModuleGetFunction", ctypes.byref(fn), module, b"tsgen_prime_printf")
    arg = ctypes.c_int(1)
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(arg), ctypes.c_void_p))
    drv.call("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, None, params, None)
    torch.cuda.synchronize(dev)


def shared(modes: list[str]) -> None:
    """--shared: the ranks share the visible GPUs (module doc); every check on a gloo group."""
    from tsgen.env import shared_gpu_env
    from tsgen.runtime.placement import mps_active, share_from_env

    shared_gpu_env(rank_per_process=True)  # before CUDA: eager module loading, the driver's hardware queues
    os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    dev = shared_device(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    w = dist.get_world_size()
    ok = share_from_env() and mps_active()
    primed = "printf primed"
    if ok:
        try:
            prime_printf(dev)
        except Exception as e:  # noqa: BLE001 - this rank's FAIL, agreed below
            traceback.print_exc()
            ok, primed = False, f"printf primer: {type(e).__name__}: {e}"
    # every rank primed (and waited for it) before any rank loads a tsgen op: report is a collective
    ok = report("shared_setup", ok, f"cuda:{dev} of {torch.cuda.device_count()} visible, world {w}, "
                f"TSGEN_SHARE_GPUS={os.environ.get('TSGEN_SHARE_GPUS', '')!r}, MPS {'on' if mps_active() else 'off'}, "
                f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'driver default')}, "
                f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '')}, {primed}")
    if ok:
        for mode in modes:
            try:
                shared_checks(mode, dist.new_group(list(range(w)), backend="gloo"))
            except Exception as e:  # noqa: BLE001 - a setup failure of one mode: its FAIL, then the next mode
                traceback.print_exc()
                report(f"shared_{mode}", False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            tt.close_all()
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe", action="store_true", help="the peer-never-arrives probe (see the module doc)")
    ap.add_argument("--shared", action="store_true", help="ranks sharing one GPU, gloo group, MPS (module doc)")
    ap.add_argument("--attention", action="store_true",
                    help="tsgen.torch.attention on one GPU, no process group, no torchrun (module doc)")
    ap.add_argument("--cp", action="store_true",
                    help="tsgen.torch.cp_attention under torchrun (NCCL), or with --shared on one GPU (module doc)")
    ap.add_argument("--heaps", default=os.environ.get("TSGEN_TORCH_HEAP") or "ipc,symm_mem",
                    help="--shared: the heap modes to check, in order (default: $TSGEN_TORCH_HEAP, else both)")
    args = ap.parse_args()
    heaps = [m.strip() for m in args.heaps.split(",") if m.strip()]
    if args.shared and (not heaps or set(heaps) - {"ipc", "symm_mem"}):
        ap.error(f"--heaps {args.heaps!r}: name ipc and/or symm_mem (each checked as itself, no fallback)")
    if args.probe:
        probe()
        return 0
    if args.attention:
        attention_checks()
        return 0 if RESULTS and all(RESULTS) else 1
    if args.cp:
        cp_main(args.shared)
        return 0 if RESULTS and all(RESULTS) else 1
    if args.shared:
        shared(heaps)
    else:
        main_checks()
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
