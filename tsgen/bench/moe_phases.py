"""tsgen's MoE dispatch and combine timed each alone (issue 34 item 1), beside the pair `tsgen bench`
times as tsgen's own row: the in-process rows of the moe family's "tsgen_phases" (baselines.moe_phases).

The module's two host entries (`<kernel>_dispatch_launch`, `<kernel>_combine_launch`, tsgen/moe.cuh)
are called through Module.launch_entry on tsgen's World, buffer sets and streams, by the same timing
core as the pair (CUDA graphs, a lineup call before each sample, the device call counters):
  dispatch  back-to-back dispatches of the bench's inputs. The kernels' protocol puts a combine
            between two dispatches (a source rewrites its counts and rows only once every reader is
            done); here a rank may rewrite a peer's counts row and rows of the previous dispatch while
            the peer still reads them, with the same values (every call of a buffer set has the same
            inputs), so what is read is right; the signals only count up.
  combine   back-to-back combines of the rows of one untimed pair per buffer set (dispatch, and for
            fp8 the dequantize into recv_bf16, as combine's y; the received rows themselves for bf16,
            null for low-latency: the identity expert, as the pair). A rank may push its rows into a
            peer's inbox while the peer still sums the previous call's, again with the same values.
Each phase's outputs are poisoned after its warm-up and checked after its timing against the NumPy
reference of the bench's inputs (dispatch: recv_counts and what the ranks received, `check_received`:
the rows, bf16 exactly or fp8 bytes and scales bit-exactly, with their local expert ids, weights and
handles; low-latency the slot rows and handles of the last call's half; combine: out).

Bytes (DeepEP's convention): what the bottleneck rank stores into other ranks in that phase
(tsgen.ops.moe.traffic: dispatch counts rows, fp8 scales, metadata and handles; combine the bf16
rows), so the row's busbw is GB/s a rank sends over NVLink, to be read beside the deepep baseline's
peer-copy ceiling row; the row names the SMs (blocks, one per SM) each kernel runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import TsgenError
from ..harness import wrong_elements
from ..ops.conventions import BenchCase
from ..ops.moe import (dispatch_reference, fp8_quantize, ll_dispatch_reference, low_latency, phase_sms, recv_rows,
                       slot_rows, traffic)
from .sizes import calls_per_sample
from .timing import CupyClock, time_calls

# phase -> (the output it writes, its device call counter)
PHASES = {"dispatch": ("recv_counts", "calls"), "combine": ("out", "combine_calls")}


def phase_case(family, spec, world: int, size: int, phase: str) -> BenchCase:
    """The bytes of one phase: the bottleneck rank's (most sent) as the bandwidth bytes, the least any
    rank sends as the guard's link bytes."""
    conv = family.bench
    sent = traffic(spec, world, conv.bench_inputs(family, spec, world, size, np.random.default_rng(12345)))[phase]
    return BenchCase(size, size, link_bytes=float(min(sent)), bw_bytes=float(max(sent)),
                     note=f"bytes: the bottleneck rank's {phase} bytes to other ranks")


def combine_input(step, rank: int) -> list[int]:
    """combine's y on `rank` in the pair's identity expert: the received rows (bf16), the dequantized
    ones (fp8), null (low-latency: the kernel reads its slots)."""
    spec, bufs = step.spec, step.sets
    if low_latency(spec):
        return [[0] for _ in bufs]
    name = "recv_bf16" if spec.params.payload == "fp8" else "recv_x"
    return [[b.bases[rank] + b.by_name[name].offset] for b in bufs]


def received_buffers(spec) -> tuple[str, ...]:
    """The scratch buffers dispatch fills on the receiving rank (docs/design/moe.md): the rows and what
    travels with them (normal mode: local expert ids, weights, handles; low-latency: the handles)."""
    if low_latency(spec):
        return ("recv_x", "recv_src")
    payload = ("recv_q", "recv_scale") if spec.params.payload == "fp8" else ("recv_x",)
    return (*payload, "recv_idx", "recv_w", "handle")


@dataclass(frozen=True)
class Received:
    """Rows start, start + 1, ... of buffer `name` (rows of `rows.shape[1]` elements) as a dispatch
    leaves them on one rank: `rows` [n, width] holds the expected bits; `where` names the rows' place."""

    name: str
    start: int
    rows: np.ndarray
    where: str = ""


def expected_received(spec, world: int, inputs: dict, call: int) -> list[list[Received]]:
    """Per rank, what dispatch call number `call` (1, 2, ...: the dispatch call counter after it) of
    `inputs` leaves in its received buffers (received_buffers). Normal mode: the first `received`
    rows (at most the receive capacity; the rows past it are never written) from dispatch_reference:
    bf16 rows, or fp8 e4m3 bytes and scales (fp8_quantize, as dispatch computes them), local expert
    ids, weights, handles. Low-latency: in the half `call & 1` of the slots, every (local expert,
    source) slot's rows and handles (token * 32 + k), as many as it received (at most slot_tokens)."""
    p = spec.params
    if low_latency(spec):
        slot, half = slot_rows(spec), call & 1
        out = []
        for got in ll_dispatch_reference(inputs, world, p.experts, p.topk, p.hidden, slot):
            segs = []
            for i, n in enumerate(np.minimum(got["counts"], slot)):
                if not n:
                    continue
                where = f"slot {i} (local expert {i // world}, source {i % world}) of half {half}, "
                start = (half * p.experts + i) * slot
                segs += [Received("recv_x", start, got["recv_x"][i, :n], where),
                         Received("recv_src", start, got["recv_src"][i, :n, None], where)]
            out.append(segs)
        return out
    out = []
    for got in dispatch_reference(inputs, world, p.experts, p.topk, p.hidden, recv_rows(spec)):
        n = min(int(got["per_source"].sum()), recv_rows(spec))
        rows = got["recv_x"][:n]
        payload = (dict(zip(("recv_q", "recv_scale"), fp8_quantize(rows, p.hidden))) if p.payload == "fp8"
                   else {"recv_x": rows})
        meta = {"recv_idx": got["recv_idx"][:n], "recv_w": got["recv_w"][:n], "handle": got["handle"][:n]}
        out.append([Received(name, 0, a) for name, a in {**payload, **meta}.items()])  # each [n, width]
    return out


def check_received(step, what: str) -> tuple[dict, list[str]]:
    """After dispatch alone's timing (its received buffers poisoned after the warm-up): set 0's
    received rows on this process's ranks against expected_received of the bench's host inputs, the
    last call's (its number from the rank's dispatch call counter), bit for bit. Fields for the row:
    what was compared and `received_wrong` (elements; every rank's); problems: per rank and buffer
    that differs, how many rows and the first one."""
    w, spec, set0 = step.world, step.spec, step.sets[0]
    if step.host is None:
        return {"received_check": "not checked: no host inputs (above the reference check's size)"}, []
    expected, wrong, problems, compared = {}, 0, [], 0
    for r in w.ranks:
        with w.cp.cuda.Device(w.devices[r]):
            call = int(set0.array("calls", r)[0:1].get()[0])
            key = call & 1 if low_latency(spec) else 0
            if key not in expected:
                expected[key] = expected_received(spec, w.size, step.host, call)
            bad_rows: dict[str, list] = {}  # name -> [rows differing, rows compared, first differing]
            for seg in expected[key][r]:
                n, width = seg.rows.shape
                got = set0.array(seg.name, r)[seg.start * width:(seg.start + n) * width].get()
                bad = wrong_elements(got, seg.rows.reshape(-1).view(got.dtype), None, None, None)
                tally = bad_rows.setdefault(seg.name, [0, 0, None])
                tally[1] += n
                if bad.size:
                    wrong += int(bad.size)
                    rows = np.unique(bad // width)
                    tally[0] += rows.size
                    if tally[2] is None:
                        tally[2] = f"{seg.where}row {int(rows[0])}"
            compared += bad_rows.get(received_buffers(spec)[0], [0, 0])[1]
            problems += [f"{what}: rank {r} {name}: {differ} of {rows} received rows differ from the reference "
                         f"(first: {first})" for name, (differ, rows, first) in bad_rows.items() if differ]
    wrong = sum(w.exchange(f"{what}: received rows wrong", wrong))
    desc = (f"{', '.join(received_buffers(spec))} of set 0, bit-exact: {compared} rows on rank(s) "
            f"{', '.join(map(str, w.ranks))}")
    return {"received_check": desc, "received_wrong": wrong}, problems


def time_phases(step) -> list[tuple[str, object, BenchCase, dict]]:
    """(impl, Timing, case, row fields) of dispatch alone and combine alone, after tsgen's pair timing
    on its World and sets (a runner.Step); Timing None where a launch was refused (fields["skipped"]
    says how)."""
    w, spec, family, module, sets = step.world, step.spec, step.family, step.module, step.sets
    n = len(sets)
    ys = {r: combine_input(step, r) for r in w.ranks}
    mode = "low_latency" if low_latency(spec) else "normal"
    out = []
    for phase, (written, counter_buf) in PHASES.items():
        extra = None if phase == "dispatch" else (lambda i: (lambda r: ys[r][i % n]))
        poisoned = [written, *(received_buffers(spec) if phase == "dispatch" else ())]

        def enqueue(i, ranks, phase=phase, extra=extra):
            module.launch_entry(phase, sets[i % n], ranks, w.streams, None if extra is None else extra(i))

        def counter(rank, counter_buf=counter_buf):
            with w.cp.cuda.Device(w.devices[rank]):
                return sum(int(b.array(counter_buf, rank)[0:1].get()[0]) for b in sets)

        label = f"tsgen {phase} {step.label}"
        payload = spec.params.payload if phase == "dispatch" else "bf16"
        sms = phase_sms(spec, phase)  # one block per SM (launch bounds (threads, 1)); combine's grid may differ
        impl = f"tsgen {phase} ({payload}, {sms} SMs)"
        fields = {"phase": phase, "payload": payload, "ep_mode": mode, "sms": sms}
        case = phase_case(family, spec, w.size, step.case.size, phase)
        try:
            if phase == "combine":  # one pair per set: dispatch's rows (and fp8's dequantized ones) for combine
                for b in sets:
                    module.launch(b, ranks=step.ranks, streams=w.streams)
                w.synchronize()
            timing = time_calls(CupyClock(w), step.ranks, w.streams, enqueue, calls=calls_per_sample(step.iters, n),
                                reps=step.reps, warmup=step.warmup, graphs=step.conv.graphs, lineup=w.size > 1,
                                after_warmup=lambda poisoned=poisoned: step.poison(poisoned), counter=counter,
                                label=label)
        except TsgenError as e:  # a launch refused: this phase's row becomes a note saying so; the bench goes on
            out.append((impl, None, case, {**fields, "skipped": f"{type(e).__name__}: {e}"}))
            continue
        checked, problems = step.check(label)
        if not checked.get("wrong"):  # wrong elements: _baseline_row says so from the row's `wrong`
            timing.problems += problems
        if phase == "dispatch":  # the received rows: each differing buffer named, its elements in `wrong`
            rows, problems = check_received(step, label)
            timing.problems += problems
            if "received_wrong" in rows:
                checked["wrong"] = checked.get("wrong", 0) + rows["received_wrong"]
            checked.update(rows)
        out.append((impl, timing, case, {**fields, **checked}))
    return out
