"""The host's time a call of tsgen's attention torch op takes, beside PyTorch SDPA's on the same tensors: what an
eager caller pays on the CPU before the kernel runs (docs/design/attention.md, "Splitting the suite's path from the
kernel": 95.6 us a forward call through the op against 34.8 through the runtime). Short sequences, so that the
GPU's queue never fills and the host's loop is all that is timed; the GPU is synchronized after each block.

    python3 tools/torch_op_overhead.py OUT [--forward specs/attention_hd128.yaml]
        [--backward specs/attention_backward_hd128.yaml] [--seq 256] [--calls 200] [--rounds 5] [--profile]

Per implementation the median over rounds of (host seconds for `calls` calls) / calls: the op's forward
(`op(q, k, v)`), its forward with LSE, `op.grads`, forward + backward through autograd, and SDPA's forward and
forward + backward (cuDNN's backend where it takes the shape, else the default). --profile also writes cProfile's
25 costliest functions of the op's forward calls and of its forward + backward (OUT/profile_forward.txt, profile_autograd.txt). Speed of the host only: outputs are
checked once against SDPA (a wrong op is not a fast one), not timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def host_us(fn, calls: int, sync) -> float:
    """us a call of the host's loop of `calls` calls of fn, the GPU synchronized before and after (untimed)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) * 1e6 / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--forward", default="specs/attention_hd128.yaml")
    ap.add_argument("--backward", default="specs/attention_backward_hd128.yaml")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--torch-profile", action="store_true", help="torch.profiler's CPU table of 20 forward + "
                    "autograd.grad calls, tsgen's and SDPA's (every thread: the autograd engine's too)")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    import tsgen.torch as tt

    args.out.mkdir(parents=True, exist_ok=True)
    op = tt.attention(args.forward, args.backward)
    sig = op.signature
    if sig.layout != "bshd":
        ap.error(f"{args.forward}: layout {sig.layout}; the tool's tensors are bshd")
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[sig.dtype]
    q, k, v = (torch.randn(1, args.seq, h, sig.head_dim, device="cuda", dtype=dt)
               for h in (sig.heads, sig.kv_heads, sig.kv_heads))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    o, lse = op(q, k, v, return_lse=True)
    # SDPA's layout is [batch, heads, seq, hd]; GQA through enable_gqa
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    qtg, ktg, vtg = (t.clone().requires_grad_() for t in (qt, kt, vt))
    gqa = sig.heads != sig.kv_heads

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=sig.causal, scale=sig.scale, enable_gqa=gqa)

    ref = sdpa(qt, kt, vt).transpose(1, 2)
    err = (o.float() - ref.float()).abs().max().item()
    if not err < 2e-2:
        print(f"the op's output differs from SDPA's by {err:.3g}: not timed", file=sys.stderr)
        return 1

    def fwd_bwd():
        op(qg, kg, vg).backward(dout)

    def sdpa_fwd_bwd():
        sdpa(qtg, ktg, vtg).backward(dout.transpose(1, 2))

    def grad_only():
        torch.autograd.grad(op(qg, kg, vg), (qg, kg, vg), dout)

    def sdpa_grad_only():
        torch.autograd.grad(sdpa(qtg, ktg, vtg), (qtg, ktg, vtg), dout.transpose(1, 2))

    impls = {
        "tsgen op forward": lambda: op(q, k, v),
        "tsgen op forward + LSE": lambda: op(q, k, v, return_lse=True),
        "tsgen op forward, inputs requiring grad": lambda: op(qg, kg, vg),
        "tsgen op.grads": lambda: op.grads(q, k, v, o, dout, lse),
        "tsgen forward + backward (autograd)": fwd_bwd,
        "tsgen forward + autograd.grad": grad_only,
        "SDPA forward": lambda: sdpa(qt, kt, vt),
        "SDPA forward, inputs requiring grad": lambda: sdpa(qtg, ktg, vtg),
        "SDPA forward + backward (autograd)": sdpa_fwd_bwd,
        "SDPA forward + autograd.grad": sdpa_grad_only,
    }
    sync = torch.cuda.synchronize
    for fn in impls.values():  # first calls (compiles, caches) outside the timing
        fn()
    samples = {name: [] for name in impls}
    for _ in range(args.rounds):
        for name, fn in impls.items():
            samples[name].append(host_us(fn, args.calls, sync))
    result = {"forward": args.forward, "backward": args.backward, "seq": args.seq, "calls": args.calls,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "samples_us": samples,
              "median_us": {n: statistics.median(s) for n, s in samples.items()}}
    print(f"| host us a call ({args.seq} rows, {sig.heads} / {sig.kv_heads} heads, hd {sig.head_dim}) | median | "
          "min | max |")
    print("|---|---|---|---|")
    for name, s in samples.items():
        print(f"| {name} | {statistics.median(s):.1f} | {min(s):.1f} | {max(s):.1f} |")
    if args.profile:
        import cProfile
        import io
        import pstats

        for what, fn in (("forward", impls["tsgen op forward"]), ("autograd", fwd_bwd)):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            sync()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            (args.out / f"profile_{what}.txt").write_text(text.getvalue())
            print(text.getvalue()[:5000])
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        for what, fn in (("tsgen", grad_only), ("sdpa", sdpa_grad_only)):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(20):
                    fn()
                sync()
            table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70)
            (args.out / f"torch_profile_{what}.txt").write_text(table)
            print(what, table[:7000])
    (args.out / "torch_op_overhead.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
