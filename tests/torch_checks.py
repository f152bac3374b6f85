"""tsgen.torch on GPUs, one process per GPU: run under torchrun (tools/gpu_torch.sh does, and so does
tests/test_torch_gpu.py where there are 2 GPUs and torch):

    torchrun --nproc-per-node 2 tests/torch_checks.py            # the checks, NCCL group
    torchrun --nproc-per-node 2 tests/torch_checks.py --probe    # a peer that never arrives, gloo group
    TSGEN_SHARE_GPUS=1 torchrun --nproc-per-node 4 tests/torch_checks.py --shared   # 4 ranks, one GPU, MPS

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
import os
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


def report(name: str, ok: bool, detail: str = "", group=None, word: str = "PASS") -> bool:
    """Gather every rank's (ok, detail); rank 0 prints one CHECK line (`word` where every rank is ok:
    SKIP for a check that could not run, with the reason in the detail)."""
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
    ap.add_argument("--heaps", default=os.environ.get("TSGEN_TORCH_HEAP") or "ipc,symm_mem",
                    help="--shared: the heap modes to check, in order (default: $TSGEN_TORCH_HEAP, else both)")
    args = ap.parse_args()
    heaps = [m.strip() for m in args.heaps.split(",") if m.strip()]
    if args.shared and (not heaps or set(heaps) - {"ipc", "symm_mem"}):
        ap.error(f"--heaps {args.heaps!r}: name ipc and/or symm_mem (each checked as itself, no fallback)")
    if args.probe:
        probe()
        return 0
    if args.shared:
        shared(heaps)
    else:
        main_checks()
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
