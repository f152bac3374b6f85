"""Does a cp rank's attention kernel run at the single-GPU kernel's rate? One GPU, no torchrun:

    python3 tools/torch_rank_rate.py [S] [ROUNDS]

For hd 128 not causal (specs/attention_hd128.yaml, specs/attention_backward_hd128.yaml), W 2 contiguous:
a rank's kernels (queries S / 2 at its positions, keys S: the `_at` ops that tsgen.torch.cp_attention calls)
beside the same kernels over the whole sequence (the ideal's; per flop: divided by 2) and over S / 2 queries
and keys (per flop: times 2), in interleaved rounds (each sample: 2 untimed calls, then CUDA events on the
current stream around 5 calls), the median over rounds of each and of the paired ratios. A lab tool: no
check of the outputs (the same ops are checked by tests/torch_checks.py --cp), no results file of its own.
"""
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import tsgen.torch as tt  # noqa: E402
from torch_checks import ATTENTION_PAIRS, attention_inputs  # noqa: E402

S = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 12
CALLS, SETTLE = 5, 2

fwd_spec, bwd_spec = ATTENTION_PAIRS["hd128"]
op = tt.attention(ROOT / fwd_spec, ROOT / bwd_spec)
sig = op.signature
F = getattr(torch.ops.tsgen, f"{op.forward.name}_at")
B = getattr(torch.ops.tsgen, f"{op.backward.name}_at")
gen = torch.Generator(device="cuda").manual_seed(35)
n = S // 2


def inputs(q_len, kv_len, pos):
    q, k, v, do = attention_inputs(sig, 1, q_len, kv_len, gen)
    with torch.no_grad():
        o, lse = F(q, k, v, *pos)
    return q, k, v, o, do, lse, pos


# name: (inputs, flop scale to the ideal's per-rank share)
cases = {
    "rank 0 (q S/2 at 0, kv S)": (inputs(n, S, (0, n, 0, 0)), 1.0),
    "rank 1 (q S/2 at S/2, kv S)": (inputs(n, S, (n, n, 0, 0)), 1.0),
    "whole (q S, kv S) / 2": (inputs(S, S, (0, S, 0, 0)), 0.5),
    "half (q S/2, kv S/2) x 2": (inputs(n, n, (0, n, 0, 0)), 2.0),
}
kinds = {"fwd": lambda a: F(a[0], a[1], a[2], *a[6]), "bwd": lambda a: B(*a[:6], *a[6])}


def sample(fn) -> float:
    for _ in range(SETTLE):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / CALLS


ms = {(kind, c): [] for kind in kinds for c in cases}
with torch.no_grad():
    for kind, fn in kinds.items():  # warm-up
        for c, (a, _) in cases.items():
            for _ in range(3):
                fn(a)
    torch.cuda.synchronize()
    for rnd in range(ROUNDS):
        order = list(cases) if rnd % 2 == 0 else list(reversed(cases))
        for kind, fn in kinds.items():
            for c in order:
                a, scale = cases[c]
                ms[(kind, c)].append(sample(lambda: fn(a)) * scale)

print(f"hd 128 not causal, 32 heads, S {S}, W 2 contiguous: ms per rank's share of the flops "
      f"(median of {ROUNDS} interleaved rounds, {CALLS} calls a sample), and whole/2 over this, paired per round")
for kind in kinds:
    base = ms[(kind, "whole (q S, kv S) / 2")]
    for c in cases:
        x = ms[(kind, c)]
        ratio = [b / y for b, y in zip(base, x)]
        print(f"  {kind} {c:30s} {statistics.median(x):8.3f} ms   whole/this {statistics.median(ratio):.3f} "
              f"[{min(ratio):.3f}-{max(ratio):.3f}]")
op.close()
