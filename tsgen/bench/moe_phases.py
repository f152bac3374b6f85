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
reference of the bench's inputs (dispatch: recv_counts; combine: out).

Bytes (DeepEP's convention): what the bottleneck rank stores into other ranks in that phase
(tsgen.ops.moe.traffic: dispatch counts rows, fp8 scales, metadata and handles; combine the bf16
rows), so the row's busbw is GB/s a rank sends over NVLink, to be read beside the deepep baseline's
peer-copy ceiling row; the row names the SMs (blocks, one per SM) each kernel runs on.
"""

from __future__ import annotations

import numpy as np

from ..errors import TsgenError
from ..ops.conventions import BenchCase
from ..ops.moe import low_latency, traffic
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


def time_phases(step) -> list[tuple[str, object, BenchCase, dict]]:
    """(impl, Timing, case, row fields) of dispatch alone and combine alone, after tsgen's pair timing
    on its World and sets (a runner.Step); Timing None where a launch was refused (fields["skipped"]
    says how)."""
    w, spec, family, module, sets = step.world, step.spec, step.family, step.module, step.sets
    n = len(sets)
    ys = {r: combine_input(step, r) for r in w.ranks}
    sms = module.kernel.grid[0]  # one block per SM (launch bounds (threads, 1))
    mode = "low_latency" if low_latency(spec) else "normal"
    out = []
    for phase, (written, counter_buf) in PHASES.items():
        extra = None if phase == "dispatch" else (lambda i: (lambda r: ys[r][i % n]))

        def enqueue(i, ranks, phase=phase, extra=extra):
            module.launch_entry(phase, sets[i % n], ranks, w.streams, None if extra is None else extra(i))

        def counter(rank, counter_buf=counter_buf):
            with w.cp.cuda.Device(w.devices[rank]):
                return sum(int(b.array(counter_buf, rank)[0:1].get()[0]) for b in sets)

        label = f"tsgen {phase} {step.label}"
        payload = spec.params.payload if phase == "dispatch" else "bf16"
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
                                after_warmup=lambda written=written: step.poison([written]), counter=counter,
                                label=label)
        except TsgenError as e:  # a launch refused: this phase's row becomes a note saying so; the bench goes on
            out.append((impl, None, case, {**fields, "skipped": f"{type(e).__name__}: {e}"}))
            continue
        checked, problems = step.check(label)
        if not checked.get("wrong"):  # wrong elements: _baseline_row says so from the row's `wrong`
            timing.problems += problems
        out.append((impl, timing, case, {**fields, **checked}))
    return out
