"""MoE dispatch and combine on GPUs (shared-GPU worlds on one GPU: TSGEN_SHARE_GPUS=1).

Each call: fresh routing of one case (tokens per rank differ: the spec's count, 0, 1, odd),
every output and receive buffer poisoned, and combine's inbox (`comb`, bf16 NaN) and the rows
dispatch records for it (`sent_row`, -2), dispatch, then every received row, its metadata, its
handle and recv_counts compared exactly with the NumPy reference and the rows past what arrived
checked still poisoned; then combine of rows the test makes from the received ones (row r scaled
by 2^(r mod 3), exact in bf16) compared with the reference. Signals are never reset between
calls; the last test launches 20 dispatch + combine pairs back to back with no host sync, each
pair's out and recv_counts checked.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from conftest import need_gpus
from results_rows import CONTROL_CALLS, calls_named, record_control
from tsgen.harness import _mutated, poison_byte, render_to_cache, shared_gpu_variant
from tsgen.ops.collectives import from_f64, to_f64
from tsgen.ops.moe import (combine_reference, counts_array, out_tolerance, dispatch_reference, fp8_dequantize, fp8_error_bound,
                           fp8_quantize, ll_combine_reference, ll_counts_array, ll_dispatch_reference, low_latency,
                           recv_rows, routing, slot_rows)
from tsgen.spec import load_spec, spec_variant

pytestmark = pytest.mark.gpu

SPEC = "specs/moe.yaml"
LL_SPEC = "specs/moe_ll.yaml"
FP8_SPEC = "specs/moe_fp8.yaml"
CASES = ("random", "skewed", "one_rank_idle", "no_expert", "same_rank", "pattern")


def tokens_of(call: int, rank: int, cap: int, rng) -> int:
    """Per-rank token counts: the capacity-ish odd count, 0, 1 and random ones."""
    choice = (call + rank) % 5
    return [cap - 1 if cap % 2 == 0 else cap, 0, 1, int(rng.integers(0, cap + 1)), 7 if cap >= 7 else cap][choice]


def expert_stand_in(recv_x: np.ndarray, hidden: int) -> np.ndarray:
    """Row r of y = row r of recv_x times 2^(r mod 3) (exact in bf16 for these values)."""
    rows = recv_x.reshape(-1, hidden)
    f = to_f64(rows, "bfloat16") * (2.0 ** (np.arange(rows.shape[0]) % 3))[:, None]
    return from_f64(f.reshape(-1), "bfloat16")


class Moe:
    """The module loaded on a world, with its dispatch and combine launchers."""

    def __init__(self, world, loaded, skew=None, mutate=None, echo=print):
        fitted = shared_gpu_variant(loaded, world, echo)
        self.spec = fitted.model
        cached = render_to_cache(fitted, skew)
        source = cached.source if mutate is None else _mutated(cached.source, mutate)  # the .cu, not the manifest
        self.world = world
        self.module = world.load(cached.manifest, source=source)
        lib = ctypes.CDLL(str(self.module.binary))
        name = self.module.kernel.name
        self.dispatch_fn = getattr(lib, f"{name}_dispatch_launch")
        self.combine_fn = getattr(lib, f"{name}_combine_launch")
        self.pair_fn = getattr(lib, f"{name}_launch")
        for fn in (self.dispatch_fn, self.combine_fn, self.pair_fn):
            fn.restype = ctypes.c_int
        p = self.spec.params
        self.cap, self.hidden, self.topk, self.experts = p.capacity, p.hidden, p.topk, p.experts
        self.recv = recv_rows(self.spec)
        self.ll, self.slot = low_latency(self.spec), slot_rows(self.spec)
        self.fp8 = p.payload == "fp8"
        self.fp8_worst = 0.0  # largest |dequantized - x| / bound seen
        self.dispatches = 0  # dispatch calls so far: the low-latency half is (this + 1) & 1
        self.bufs = self.module.alloc(self.cap)
        self.y = {}
        cp = world.cp
        y_rows = self.experts * self.slot if self.ll else self.recv
        for r in world.ranks:
            with cp.cuda.Device(world.devices[r]):
                self.y[r] = cp.zeros(y_rows * self.hidden, dtype=np.uint16)

    def _args(self, rank, tokens, extra=()):
        args = self.module.kernel.args
        values = self.bufs.arg_values(args, rank)
        out = []
        for a, v in zip(args, values):
            if a.role == "rank":
                out.append(ctypes.c_int(v))
            elif a.role == "count":
                out.append(ctypes.c_uint64(tokens[rank]))
            else:
                out.append(ctypes.c_void_p(v))
        return out + [ctypes.c_void_p(e) for e in extra] + [ctypes.c_void_p(self.world.streams[rank].ptr)]

    def launch(self, which, tokens):
        cp = self.world.cp
        for r in self.world.ranks:
            with cp.cuda.Device(self.world.devices[r]):
                if which == "dispatch":
                    err = self.dispatch_fn(*self._args(r, tokens))
                elif which == "combine":
                    err = self.combine_fn(*self._args(r, tokens, (self.y[r].data.ptr,)))
                else:
                    err = self.pair_fn(*self._args(r, tokens))
                assert err == 0, f"rank {r}: {which} launch failed with cudaError {err}"
        if which != "combine":
            self.dispatches += 1

    def load(self, inputs, call):
        world, cp = self.world, self.world.cp
        for r in world.ranks:
            with cp.cuda.Device(world.devices[r]):
                for name in ("x", "topk_idx", "topk_weights"):
                    a = self.bufs.array(name, r)
                    full = np.zeros(a.size, dtype=a.dtype)
                    full[: inputs[name][r].size] = inputs[name][r].view(a.dtype)
                    a.set(full)
                payload = ("recv_q", "recv_scale") if self.fp8 else ("recv_x",)
                scratch = ("recv_x", "recv_src") if self.ll else payload + ("recv_idx", "recv_w", "handle")
                for name in ("out", "recv_counts") + scratch:
                    self.bufs.array(name, r).view(np.uint8)[...] = poison_byte(call)
                # combine's inbox as bf16 NaN: a sum that reads a slot before its chunk arrived (the
                # "comb" control) is NaN, not a stale row that might be right; sent_row as -2 (not a
                # row, nor dispatch's -1): a dispatch that fails to record a token's rows leaves the
                # token's sum without them
                self.bufs.array("comb", r).view(np.uint16)[...] = COMB_POISON
                if not self.ll:
                    self.bufs.array("sent_row", r)[...] = SENT_ROW_POISON

    def get(self, name, rank):
        return self.bufs.array(name, rank).get()

    def free(self):
        self.bufs.free()


COMB_POISON = 0x7FC1  # a bf16 NaN
SENT_ROW_POISON = -2


def make_inputs(moe, world, case, call, seed=0):
    rng = np.random.default_rng([seed, call])
    tokens = {r: tokens_of(call, r, moe.cap, rng) for r in range(world)}
    inputs = {
        "x": [from_f64(rng.standard_normal(tokens[r] * moe.hidden), "bfloat16") for r in range(world)],
        "topk_idx": [routing(case, world, moe.experts, moe.topk, tokens[r], rng, r) for r in range(world)],
        "topk_weights": [rng.random(tokens[r] * moe.topk, dtype=np.float32) for r in range(world)],
    }
    return tokens, inputs


def check_ll_dispatch(moe, world, inputs, call, problems, poisoned=True):
    """Low-latency: every slot's rows and handles in this call's half; everything else poisoned (the
    other half only when the call before this one was poisoned too: `poisoned`)."""
    ref = ll_dispatch_reference(inputs, world.size, moe.experts, moe.topk, moe.hidden, moe.slot)
    poison8, half = poison_byte(call), (moe.dispatches & 1)  # dispatch number `dispatches`: its half
    for d in world.ranks:
        want_counts = ll_counts_array(ref[d], max(moe.spec.world_sizes), moe.experts)
        got_counts = moe.get("recv_counts", d)
        if not np.array_equal(got_counts, want_counts):
            bad = np.flatnonzero(got_counts != want_counts)[:4].tolist()
            problems.append(f"call {call}: rank {d} recv_counts differ at {bad}: {got_counts[bad].tolist()} "
                            f"expected {want_counts[bad].tolist()}")
            continue
        for name, width, want in (("recv_x", moe.hidden, ref[d]["recv_x"]), ("recv_src", 1, ref[d]["recv_src"])):
            got = moe.get(name, d).reshape(2, moe.experts, moe.slot, width)
            written = np.zeros((2, moe.experts, moe.slot), dtype=bool)
            written[1 - half] = not poisoned  # back-to-back calls: the previous one filled the other half
            for i in range(moe.experts):
                n = min(int(ref[d]["counts"][i]), moe.slot)
                written[half, i, :n] = True
                if not np.array_equal(got[half, i, :n].reshape(-1), want[i, :n].reshape(-1)):
                    problems.append(f"call {call}: rank {d} {name} slot {i} (local expert {i // world.size}, "
                                    f"source {i % world.size}) differs in its {n} rows")
            rest = got[~written].view(np.uint8)
            if rest.size and not (rest == poison8).all():
                problems.append(f"call {call}: rank {d} {name} written outside the rows received")
    return ref


def check_dispatch(moe, world, inputs, call, problems, poisoned=True):
    """Compare every rank's received rows, metadata, handles, counts; rows past them poisoned."""
    if moe.ll:
        return check_ll_dispatch(moe, world, inputs, call, problems, poisoned)
    ref = dispatch_reference(inputs, world.size, moe.experts, moe.topk, moe.hidden, moe.recv)
    poison8 = poison_byte(call)
    for d in world.ranks:
        want_counts = counts_array(ref[d], max(moe.spec.world_sizes), moe.experts)
        got_counts = moe.get("recv_counts", d)
        if not np.array_equal(got_counts, want_counts):
            problems.append(f"call {call}: rank {d} recv_counts {got_counts[:2 + world.size].tolist()} ... expected "
                            f"{want_counts[:2 + world.size].tolist()} ...")
            continue
        rows = min(int(want_counts[0]), moe.recv)
        if moe.fp8:
            q, scale = fp8_quantize(ref[d]["recv_x"], moe.hidden)
            payload = (("recv_q", moe.hidden, q), ("recv_scale", moe.hidden // 128, scale))
            ref[d]["rows"] = fp8_dequantize(q, scale)  # what the experts see
            err = np.abs(to_f64(ref[d]["rows"], "bfloat16") - to_f64(ref[d]["recv_x"].reshape(-1), "bfloat16"))
            bound = fp8_error_bound(ref[d]["recv_x"], moe.hidden)
            if err.size:
                moe.fp8_worst = max(moe.fp8_worst, float((err / bound).max()))
        else:
            payload = (("recv_x", moe.hidden, ref[d]["recv_x"]),)
            ref[d]["rows"] = ref[d]["recv_x"]
        for name, width, want in payload + (("recv_idx", moe.topk, ref[d]["recv_idx"]),
                                  ("recv_w", moe.topk, ref[d]["recv_w"]), ("handle", 2, ref[d]["handle"])):
            got = moe.get(name, d)
            head = got[: rows * width].view(np.uint8)
            want_bytes = np.ascontiguousarray(want.reshape(-1)[: rows * width]).view(np.uint8)
            if not np.array_equal(head, want_bytes):
                bad = np.flatnonzero(head != want_bytes)[0] // (got.itemsize * width)
                problems.append(f"call {call}: rank {d} {name} row {bad} of {rows} differs")
            tail = got[rows * width:].view(np.uint8)
            if tail.size and not (tail == poison8).all():
                problems.append(f"call {call}: rank {d} {name} written past the {rows} rows received")
    return ref


def expected_out(moe, world_size, inputs, ys):
    if moe.ll:
        return ll_combine_reference(inputs, ys, world_size, moe.experts, moe.topk, moe.hidden, moe.slot)
    return combine_reference(inputs, ys, world_size, moe.experts, moe.topk, moe.hidden, moe.spec.params.weighted)


def check_combine(moe, world, inputs, ys, call, problems):
    want = expected_out(moe, world.size, inputs, ys)
    for s in world.ranks:
        got = moe.get("out", s)[: want[s].size]
        if moe.spec.params.weighted:
            diff = np.abs(to_f64(got, "bfloat16") - to_f64(want[s], "bfloat16"))
            bad = np.flatnonzero(~(diff <= out_tolerance(want[s])))
        else:
            bad = np.flatnonzero(got != want[s])
        if bad.size:
            i = int(bad[0])
            problems.append(f"call {call}: rank {s} out[{i // moe.hidden}][{i % moe.hidden}] = {got[i]:#x}, expected "
                            f"{want[s][i]:#x} ({bad.size} wrong)")


def identity_rows(moe, inputs, size):
    """What the pair launcher's combine hands back per rank: the received rows (fp8: dequantized)."""
    if moe.ll:
        return [r["recv_x"] for r in ll_dispatch_reference(inputs, size, moe.experts, moe.topk, moe.hidden, moe.slot)]
    ref = dispatch_reference(inputs, size, moe.experts, moe.topk, moe.hidden, moe.recv)
    return [fp8_dequantize(*fp8_quantize(r["recv_x"], moe.hidden)) if moe.fp8 else r["recv_x"] for r in ref]


def expected_counts(moe, inputs, size):
    """Every rank's recv_counts after a dispatch of `inputs`, as the kernel writes them."""
    wmax = max(moe.spec.world_sizes)
    if moe.ll:
        ref = ll_dispatch_reference(inputs, size, moe.experts, moe.topk, moe.hidden, moe.slot)
        return [ll_counts_array(r, wmax, moe.experts) for r in ref]
    ref = dispatch_reference(inputs, size, moe.experts, moe.topk, moe.hidden, moe.recv)
    return [counts_array(r, wmax, moe.experts) for r in ref]


def burst_pairs(moe, world, first_call, burst, problems):
    """`burst` dispatch + combine pairs (the identity expert) back to back with no host sync: each
    pair's inputs are copied in on the rank's stream just before it and its output and recv_counts
    copied out just after, so every pair has its own routing and token counts and every pair's
    output and counts are checked (a wait that is missing shows even where the previous call left
    the same rows; counts read after a peer already wrote its next ones show in recv_counts: a
    rank with no rows on another, e.g. one with 0 tokens, never waits for it in combine)."""
    cp, size = world.cp, world.size
    sets = [make_inputs(moe, size, "random", first_call + j) for j in range(burst)]
    staged, history, counts = {}, {}, {}
    for r in world.ranks:
        with cp.cuda.Device(world.devices[r]):
            staged[r] = []
            for _, inputs in sets:
                one = {}
                for name in ("x", "topk_idx", "topk_weights"):
                    a = moe.bufs.array(name, r)
                    full = np.zeros(a.size, dtype=a.dtype)
                    full[: inputs[name][r].size] = inputs[name][r].view(a.dtype)
                    one[name] = cp.asarray(full)
                staged[r].append(one)
            history[r] = [cp.asarray(np.zeros(moe.bufs.array("out", r).size, np.uint16)) for _ in range(burst)]
            counts[r] = [cp.asarray(np.zeros(moe.bufs.array("recv_counts", r).size, np.int32)) for _ in range(burst)]
    world.synchronize()
    for j, (tokens, _) in enumerate(sets):
        for r in world.ranks:
            with cp.cuda.Device(world.devices[r]), world.streams[r]:
                for name, src in staged[r][j].items():
                    moe.bufs.array(name, r)[...] = src
        moe.launch("pair", tokens)
        for r in world.ranks:
            with cp.cuda.Device(world.devices[r]), world.streams[r]:
                history[r][j][...] = moe.bufs.array("out", r)
                counts[r][j][...] = moe.bufs.array("recv_counts", r)
    world.synchronize()
    for j, (tokens, inputs) in enumerate(sets):
        want = expected_out(moe, size, inputs, identity_rows(moe, inputs, size))
        want_counts = expected_counts(moe, inputs, size)
        for d in world.ranks:
            got_counts = counts[d][j].get()
            if not np.array_equal(got_counts, want_counts[d]):
                bad = np.flatnonzero(got_counts != want_counts[d])[:4].tolist()
                problems.append(f"back-to-back pair {j + 1} of {burst}: rank {d} recv_counts differ at {bad}: "
                                f"{got_counts[bad].tolist()} expected {want_counts[d][bad].tolist()}")
        for s in world.ranks:
            got = history[s][j].get()[: want[s].size]
            diff = np.abs(to_f64(got, "bfloat16") - to_f64(want[s], "bfloat16"))
            bad = np.flatnonzero(~(diff <= out_tolerance(want[s])))
            if bad.size:
                problems.append(f"back-to-back pair {j + 1} of {burst}: rank {s} out differs in {bad.size} elements")


def graph_pairs(moe, world, call, replays, problems):
    """One dispatch + combine pair captured into a CUDA graph on every rank's stream, replayed
    `replays` times with no host sync: the epochs come from the device call counters, so every
    replay is a new call; the last one's output and counts are checked."""
    cp, size = world.cp, world.size
    tokens, inputs = make_inputs(moe, size, "random", call)
    moe.load(inputs, call)
    world.synchronize()
    graphs = {}
    for r in world.ranks:
        with cp.cuda.Device(world.devices[r]):
            stream = world.streams[r]
            stream.begin_capture()
            try:
                err = moe.pair_fn(*moe._args(r, tokens))
            finally:
                graphs[r] = stream.end_capture()
            assert err == 0, f"rank {r}: the pair launcher failed under capture with cudaError {err}"
    for _ in range(replays):
        for r in world.ranks:
            with cp.cuda.Device(world.devices[r]):
                graphs[r].launch(world.streams[r])
        moe.dispatches += 1
    world.synchronize()
    check_dispatch(moe, world, inputs, call, problems, poisoned=replays == 1)
    want = expected_out(moe, size, inputs, identity_rows(moe, inputs, size))
    for s in world.ranks:
        got = moe.get("out", s)[: want[s].size]
        diff = np.abs(to_f64(got, "bfloat16") - to_f64(want[s], "bfloat16"))
        if (~(diff <= out_tolerance(want[s]))).any():
            problems.append(f"after {replays} graph replays: rank {s} out differs")
        calls = int(moe.bufs.array("calls", s)[0:1].get()[0])
        if calls != moe.dispatches:
            problems.append(f"rank {s}: dispatch call counter {calls}, expected {moe.dispatches}")


def run_moe(world_size, cases=CASES, iters=12, variant=None, skew=None, mutate=None, combine=True, burst=0,
            spec=SPEC, graph_replays=0):
    """Problems found (empty: every check passed)."""
    from tsgen.runtime import World

    loaded = spec_variant(load_spec(spec), variant or {})
    lines, problems = [], []
    with World(world_size, share_gpus=None) as world:
        moe = Moe(world, loaded, skew=skew, mutate=mutate, echo=lines.append)
        try:
            for call in range(iters):
                case = cases[call % len(cases)]
                tokens, inputs = make_inputs(moe, world_size, case, call)
                moe.load(inputs, call)
                world.synchronize()
                moe.launch("dispatch", tokens)
                world.synchronize()
                ref = check_dispatch(moe, world, inputs, call, problems)
                if not combine or any(r["flags"] for r in ref):
                    continue
                ys = [expert_stand_in(ref[d]["rows" if "rows" in ref[d] else "recv_x"], moe.hidden)
                      for d in range(world_size)]
                for d in world.ranks:
                    with world.cp.cuda.Device(world.devices[d]):
                        moe.y[d][: ys[d].size].set(ys[d])
                world.synchronize()
                moe.launch("combine", tokens)
                world.synchronize()
                check_combine(moe, world, inputs, ys, call, problems)
            if burst:
                burst_pairs(moe, world, iters, burst, problems)
            if graph_replays:
                graph_pairs(moe, world, iters + burst, graph_replays, problems)
            if moe.fp8:
                lines.append(f"fp8: largest |dequantized - x| / bound = {moe.fp8_worst:.3f} (bound: half an e4m3 "
                             "step at x, 2^-4 relative or 2^-10 x scale, plus a bf16 rounding)")
                if moe.fp8_worst > 1:
                    problems.append(f"fp8 quantization error {moe.fp8_worst:.3f} x the bound")
        finally:
            moe.free()
    return problems, lines


def _record(row):
    out = os.environ.get("TSGEN_RESULTS_DIR")
    if out:
        import json

        with open(os.path.join(out, "moe.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_moe_dispatch_combine(world, weighted):
    need_gpus(world)
    problems, lines = run_moe(world, variant={"params": {"weighted": weighted}}, burst=20 if weighted else 0)
    _record({"test": "dispatch_combine", "world": world, "weighted": weighted, "pass": not problems,
             "problems": problems[:5], "lines": lines})
    assert not problems, "\n".join(lines + problems[:10])


@pytest.mark.parametrize("world", [2, 4])
def test_moe_combine_on_its_own_grid(world):
    """params.combine_blocks: combine on more blocks than dispatch (the moe-w2 suite's 64 against
    32), its chunks dealt over another number of sender warps; every output right, also back to
    back (on a shared GPU both grids are fitted: 4 ranks get 33 combine blocks against 16)."""
    need_gpus(world)
    problems, lines = run_moe(world, variant={"launch": {"blocks": 16}, "params": {"combine_blocks": 40}}, burst=20)
    _record({"test": "combine_grid", "world": world, "pass": not problems, "problems": problems[:5], "lines": lines})
    assert not problems, "\n".join(lines + problems[:10])


@pytest.mark.parametrize("world,chunk_rows", [(2, 2), (4, 2), (8, 2), (4, 3)])
def test_moe_combine_peer_order(world, chunk_rows):
    """params.combine_order "peers": the peers' chunks interleaved over the sender warps; chunks of 2 and
    3 rows (a chunk where one source's rows end and the next one's begin is pushed in two parts, each
    signalled to its source); every output right, also back to back."""
    need_gpus(world)
    problems, lines = run_moe(world, variant={"launch": {"blocks": 16}, "params": {
        "combine_blocks": 40, "combine_order": "peers", "combine_chunk_rows": chunk_rows}}, burst=20)
    _record({"test": "combine_peer_order", "world": world, "chunk_rows": chunk_rows, "pass": not problems,
             "problems": problems[:5], "lines": lines})
    assert not problems, "\n".join(lines + problems[:10])


@pytest.mark.parametrize("world,params", [(2, {"combine_order": "peers", "combine_senders": 2, "combine_send_unroll": 8}),
                                          (4, {"combine_order": "peers", "combine_senders": 2, "combine_send_unroll": 8}),
                                          (4, {"combine_senders": 1}),
                                          (2, {"combine_senders": 16, "combine_send_unroll": 2})])
def test_moe_combine_senders(world, params):
    """params.combine_senders / combine_send_unroll: fewer (or all) warps of a block push the rows home
    before they sum (16 of 16: no warp sums until its chunks are out), each with its own unroll; every
    output right, also back to back."""
    need_gpus(world)
    problems, lines = run_moe(world, variant={"launch": {"blocks": 16}, "params": {"combine_blocks": 40, **params}},
                              burst=20)
    _record({"test": "combine_senders", "world": world, "params": params, "pass": not problems,
             "problems": problems[:5], "lines": lines})
    assert not problems, "\n".join(lines + problems[:10])


@pytest.mark.parametrize("world", [2, 4, 8])
def test_moe_fp8_dispatch(world):
    """FP8 payload: e4m3 bytes and scales bit-exact with the reference quantizer, the error of the
    dequantized rows against bf16 within the bound (measured and recorded), bf16 combine."""
    need_gpus(world)
    problems, lines = run_moe(world, spec=FP8_SPEC, burst=20)
    _record({"test": "fp8", "world": world, "pass": not problems, "problems": problems[:5], "lines": lines})
    assert not problems, "\n".join(lines + problems[:10])


@pytest.mark.parametrize("world,params", [(2, {"fp8_send_unroll": 7}), (4, {"fp8_send_unroll": 3, "hidden": 640}),
                                          (8, {"fp8_send_unroll": 8})])
def test_moe_fp8_send_unroll(world, params):
    """params.fp8_send_unroll: the send with a pass's scales gathered (a lane per 128-channel group);
    bytes and scales bit-exact with the reference quantizer as for the shipped send, also where a pass
    ends inside a slot (hidden 640: 40 chunks, 5 groups, 3 slots of 32 chunks), back to back."""
    need_gpus(world)
    problems, lines = run_moe(world, spec=FP8_SPEC, variant={"params": params}, burst=20)
    _record({"test": "fp8_send_unroll", "world": world, "params": params, "pass": not problems,
             "problems": problems[:5], "lines": lines})
    assert not problems, "\n".join(lines + problems[:10])


@pytest.mark.parametrize("world", [2, 4, 8])
def test_moe_low_latency(world):
    need_gpus(world)
    problems, lines = run_moe(world, spec=LL_SPEC, burst=20)
    _record({"test": "low_latency", "world": world, "pass": not problems, "problems": problems[:5], "lines": lines})
    assert not problems, "\n".join(lines + problems[:10])


@pytest.mark.parametrize("world", [2, 4])
def test_moe_low_latency_slot_overflow_is_reported(world):
    """Slots of 16 rows and every token to expert 0: the slots past 16 rows are flagged, nothing
    is written past a slot."""
    need_gpus(world)
    problems, lines = run_moe(world, spec=LL_SPEC, cases=("skewed",), iters=3, combine=False,
                              variant={"params": {"slot_tokens": 16}})
    _record({"test": "ll_overflow", "world": world, "pass": not problems, "problems": problems[:5]})
    assert not problems, "\n".join(lines + problems[:10])


@pytest.mark.parametrize("spec", [SPEC, FP8_SPEC, LL_SPEC], ids=["bf16", "fp8", "low_latency"])
def test_moe_cuda_graph_replays(spec):
    """The pair captured into a CUDA graph per rank and replayed 10 times: outputs right, the
    device call counter advanced once per replay."""
    need_gpus(4)
    problems, lines = run_moe(4, spec=spec, iters=1, graph_replays=10)
    _record({"test": "graph_replays", "spec": spec, "world": 4, "pass": not problems, "problems": problems[:5]})
    assert not problems, "\n".join(lines + problems[:10])


@pytest.mark.parametrize("world", [2, 4])
def test_moe_receive_overflow_is_reported(world):
    """A receive capacity of one rank's tokens and every token to expert 0: rank 0 flags the
    overflow, its first rows are right, nothing is written past the capacity; senders flag drops."""
    need_gpus(world)
    problems, lines = run_moe(world, cases=("skewed",), iters=3, variant={"params": {"recv_capacity": 200}},
                              combine=False)
    _record({"test": "overflow", "world": world, "pass": not problems, "problems": problems[:5]})
    assert not problems, "\n".join(lines + problems[:10])


SKEW = "lag"  # the negative controls' schedule: rank 0 ahead of every peer (templates/ops/skew.j2)
# for the waits after the counts handshake, which lines the ranks up again: measured on one H200
# (2026-11-26) under "lag", the data wait was caught at 0 of 51 calls, comb 45, ll_comb 47
PAIR_SKEW = "lag_blocks"
# the wait for every rank's counts row: satisfied at once (stale rows give wrong offsets)
COUNTS_WAIT = ("wait_ge_acquire_sys(b.sig + SIG_COUNTS * WMAX + tid, epoch,",
               "wait_ge_acquire_sys(b.sig + SIG_COUNTS * WMAX + tid, 0ull,")


@pytest.mark.parametrize("skew", [SKEW, PAIR_SKEW])
@pytest.mark.parametrize("spec", [SPEC, LL_SPEC], ids=["normal", "low_latency"])
def test_moe_passes_under_the_lag_schedule(spec, skew):
    """The positive twin of the controls below: the same schedules, every wait compiled in."""
    need_gpus(4)
    problems, lines = run_moe(4, spec=spec, cases=("random", "skewed"), iters=4, skew=skew, burst=4)
    _record({"test": "lag_schedule", "spec": spec, "world": 4, "pass": not problems, "problems": problems[:5]})
    assert not problems, "\n".join(lines + problems[:10])


def test_moe_negative_control_counts_wait_removed():
    """Dispatch without its wait for the peers' counts rows must fail (with rank skew)."""
    need_gpus(4)
    old, new = COUNTS_WAIT
    problems, lines = run_moe(4, cases=("random", "skewed"), iters=CONTROL_CALLS, skew=SKEW, combine=False,
                              mutate=lambda text: text.replace(old, new))
    _record({"test": "negative_control_counts_wait", "world": 4, "caught": bool(problems), "problems": problems[:3]})
    record_control("moe counts wait", CONTROL_CALLS, calls_named(problems), world=4, skew=SKEW)
    assert problems, "dispatch without the counts wait passed:\n" + "\n".join(lines)


# low-latency: block 0's wait for every slot's signal (its count rides on it)
LL_SLOT_WAIT = ("wait_ge_acquire_sys(b.lsig + i, epoch << 32,", "wait_ge_acquire_sys(b.lsig + i, 0ull,")


def test_moe_low_latency_negative_control_slot_wait_removed():
    need_gpus(4)
    old, new = LL_SLOT_WAIT
    problems, lines = run_moe(4, spec=LL_SPEC, cases=("random", "skewed"), iters=CONTROL_CALLS, skew=SKEW,
                              combine=False, mutate=lambda text: text.replace(old, new))
    _record({"test": "negative_control_ll_slot_wait", "world": 4, "caught": bool(problems), "problems": problems[:3]})
    record_control("moe_ll slot wait", CONTROL_CALLS, calls_named(problems), world=4, skew=SKEW)
    assert problems, "low-latency dispatch without the slot wait passed:\n" + "\n".join(lines)


# The other waits, each removed (satisfied at once) with rank skew: the same checks must fail.
#   data: dispatch's block 0 waits for every source block's rows before the kernel ends (combine,
#         the next kernel, reads the handles and rows)
#   comb: a token's sum waits for the chunks that hold its rows on the other ranks (chunk_sig)
#   ll_comb: low-latency combine waits for every rank's rows before it sums them
MORE_CONTROLS = {
    "data": (SPEC, "wait_ge_acquire_sys(b.sig + SIG_DATA * WMAX + tid, epoch * (uint64_t)gridDim.x,",
             "wait_ge_acquire_sys(b.sig + SIG_DATA * WMAX + tid, 0ull,"),
    "comb": (SPEC, "wait_ge_acquire_sys(b.chunk_sig + lane * NCHUNK + row / CHUNK, epoch,",
             "wait_ge_acquire_sys(b.chunk_sig + lane * NCHUNK + row / CHUNK, 0ull,"),
    "ll_comb": (LL_SPEC, "wait_ge_acquire_sys(b.csig + tid, epoch * (uint64_t)gridDim.x,",
                "wait_ge_acquire_sys(b.csig + tid, 0ull,"),
}


# Without the data wait a rank's combine can read handles and counts its peers have not written yet,
# and a peer then waits for a chunk signal nobody raises: the control hangs instead of summing wrong,
# and the kernel's timeout trap (sync.timeout_ms) names the wait. A trap ends the CUDA context of its
# process, so this control runs in a process of its own (like test_gpu.py's timeout probes) and a
# trap whose message names a wait counts as caught, like a wrong element.
TRAPPING_CONTROLS = {"data"}


def control_outcome(wait: str) -> dict:
    """Run one control of MORE_CONTROLS in this process: its problems and lines, or the error that
    ended it (a KernelFailed after a timeout trap)."""
    spec, old, new = MORE_CONTROLS[wait]
    try:
        problems, lines = run_moe(4, spec=spec, cases=("random",), iters=1, skew=PAIR_SKEW, burst=CONTROL_CALLS,
                                  mutate=lambda text: text.replace(old, new))
        return {"problems": problems, "lines": lines}
    except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
        # after a trap the context is dead and run_moe's clean-up (moe.free) raises too, with the
        # KernelFailed as its context: report the KernelFailed where the chain holds one
        chain, cur = [], e
        while cur is not None and len(chain) < 8:
            chain.append(cur)
            cur = cur.__cause__ or cur.__context__
        first = next((c for c in chain if type(c).__name__ == "KernelFailed"), e)
        return {"error": f"{type(first).__name__}: {first}"}


CHILD = """
import ctypes, json, os, sys
sys.path.insert(0, "tests")
import test_moe_gpu
out = test_moe_gpu.control_outcome(sys.argv[1])
print("\\nCONTROL " + json.dumps(out), flush=True)  # on a line of its own after any device printf
ctypes.CDLL(None).fflush(None)  # the device's printf lines, before leaving without the dead context's teardown
os._exit(0)
"""


def run_control_in_child(wait: str, child: str = CHILD) -> tuple[list[str], list[str], str | None]:
    """(problems, lines, trap): `trap` is the first timeout line the kernel printed when the control
    ended in a trap (the problems are then empty), None otherwise. `child`: the script the process
    runs (tests/test_moe_cpu.py gives it stand-ins)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", child, wait], cwd=root, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    found = [line[line.index("CONTROL ") + len("CONTROL "):] for line in proc.stdout.splitlines() if "CONTROL {" in line]
    assert found, f"the control's process printed no outcome (exit {proc.returncode}):\n{out[-4000:]}"
    res = json.loads(found[-1])
    if "error" not in res:
        return res["problems"], res["lines"], None
    timeouts = [line for line in out.splitlines() if line.startswith("tsgen: timeout:")]
    assert "KernelFailed" in res["error"] and timeouts, (
        f"the control ended in an error that is not a timeout trap: {res['error']}\n{out[-4000:]}")
    return [], [], timeouts[0]


@pytest.mark.parametrize("wait", sorted(MORE_CONTROLS))
def test_moe_negative_control_other_waits(wait):
    """Pairs launched back to back (no host sync between dispatch and combine): without the wait
    the output must come out wrong, or (TRAPPING_CONTROLS) the kernel must trap on a timeout."""
    need_gpus(4)
    if wait in TRAPPING_CONTROLS:
        problems, lines, trap = run_control_in_child(wait)
    else:
        spec, old, new = MORE_CONTROLS[wait]
        problems, lines = run_moe(4, spec=spec, cases=("random",), iters=1, skew=PAIR_SKEW, burst=CONTROL_CALLS,
                                  mutate=lambda text: text.replace(old, new))
        trap = None
    _record({"test": f"negative_control_{wait}_wait", "world": 4, "caught": bool(problems or trap),
             "problems": problems[:3], "trap": trap})
    if trap:  # the run ends at the trap: one run, caught
        record_control(f"moe {wait} wait", 1, 1, world=4, skew=PAIR_SKEW, outcome="timeout trap", trap=trap)
        return
    if wait == "data":  # call 0 syncs the host between its two kernels: only the back-to-back pairs can show it
        record_control("moe data wait", CONTROL_CALLS, calls_named([p for p in problems if p.startswith("back-to-back")]),
                       world=4, skew=PAIR_SKEW)
    else:
        record_control(f"moe {wait} wait", CONTROL_CALLS + 1, calls_named(problems), world=4, skew=PAIR_SKEW)
    assert problems, f"without the {wait} wait the calls passed:\n" + "\n".join(lines)
