"""The list-scheduling model behind docs/torch.md's overlap_backward prediction (issue 35 item 2): the
attention backward's main kernel as CTAs of 128 keys (one KV head, its 4 query heads) walking every
64-row query block that sees them (zig-zag causal, W 2, S 8192), block j of every head first, greedily
on 132 SMs, a CTA's time proportional to its steps; calibrated on rank 0's full call (1.43 ms main
kernel, 2026-11-27 on an H200); each call's preprocess + dQ conversion 0.061 ms, the backward's two
reduce-scatters 0.12 ms of the step. Prints the full call, each rank's runs alone (backward_runs), and
the overlapped backward (peers' runs dispatched first, own runs after, no barrier between) against
the full call + scatter. A model, not a measurement: tools/torch_cp_pieces.py times the same calls.
Last, the fused backward that docs/design/cp_attention.md plans (one call, its CTAs over the peers' key
blocks first, each peer's dK / dV partial pushed over NVLink as its blocks finish, the owner adding the
W - 1 incoming partials after its own): PUSH_GBS and ADD_GBS are assumptions, named where printed.

    python3 tools/cp_overlap_model.py"""
import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tsgen.torch.cp_attention_op import backward_runs, cp_positions  # noqa: E402

S, W, SMS, KV_HEADS, GROUP = 8192, 2, 132, 8, 4
PRE_CONV, SCATTER, DQ_SUM = 0.061, 0.12, 0.03  # ms: per call; the two reduce-scatters; one dQ add (more: fp32)
HEAD_DIM, PUSH_GBS, ADD_GBS = 128, 350.0, 3000.0  # the fused model's assumptions: NVLink push, HBM add (GB/s)
n = S // W


def ctas(rank: int, lo: int, hi: int) -> list[float]:
    """Steps of each CTA of a call on key positions [lo, hi) (+1 for loading K, V and writing dK, dV)."""
    q_offset, q_split, q_offset2, _ = cp_positions("zigzag", W, n, rank)
    pos = [q_offset + r if r < q_split else q_offset2 + r - q_split for r in range(n)]
    latest = [max(pos[i:i + 64]) for i in range(0, n, 64)]
    return [GROUP * sum(1 for m in latest if m >= k0) + 1.0 for k0 in range(lo, hi, 128) for _ in range(KV_HEADS)]


def schedule(kernels: list[list[float]]) -> list[float]:
    """Each kernel's end (steps), its CTAs dispatched after the earlier kernels' onto the first free SM."""
    sms = [0.0] * SMS
    ends = []
    for works in kernels:
        end = 0.0
        for w in works:
            t = heapq.heappop(sms)
            heapq.heappush(sms, t + w)
            end = max(end, t + w)
        ends.append(end)
    return ends


unit = 1.43 / schedule([ctas(0, 0, S)])[0]  # ms per step
for rank in range(W):
    peers, own = backward_runs("zigzag", True, W, n, rank)
    full = schedule([ctas(rank, 0, S)])[0] * unit + PRE_CONV + SCATTER
    print(f"rank {rank}: full call + scatter {full:.3f} ms")
    for what, runs in (("peers'", peers), ("own", own)):
        for lo, hi in runs:
            print(f"  {what} run {lo}-{hi} alone: {schedule([ctas(rank, lo, hi)])[0] * unit + PRE_CONV:.3f} ms")
    ends = schedule([ctas(rank, lo, hi) for lo, hi in peers + own])
    parts = len(peers) + len(own)
    sent = max(ends[:len(peers)]) * unit + PRE_CONV
    for label, pre_conv in (("each call's preprocess + conversion in turn", PRE_CONV * parts),
                            ("beside the other calls' main kernels", PRE_CONV)):
        done = max(max(ends) * unit + pre_conv, sent + SCATTER) + DQ_SUM * (parts - 1)
        print(f"  overlapped ({label}): {done:.3f} ms (the peers' sums leave at {sent:.3f})")
    # the fused backward: one call; the peers' partials (bf16 dK and dV of their n rows) leave as the peers' blocks
    # finish and cross NVLink under the own blocks; the owner reads its own and the W - 1 incoming partials, writes
    # the sums (after its own blocks)
    partial = 2 * n * KV_HEADS * HEAD_DIM * 2  # bytes: dK and dV of n key rows, bf16
    push = (W - 1) * partial / (PUSH_GBS * 1e6)  # ms
    add = (W + 1) * partial / (ADD_GBS * 1e6)
    fused = max(max(ends) * unit, sent - PRE_CONV + push) + PRE_CONV + add
    print(f"  fused (one call, pushes at {PUSH_GBS:.0f} GB/s, add at {ADD_GBS:.0f} GB/s, both assumed): {fused:.3f} ms "
          f"against {full:.3f} (push {push:.3f}, add {add:.3f})")
