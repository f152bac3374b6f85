"""The attention forward's kernels in back-to-back calls, tsgen's beside FlashAttention-4's, from the GPU's own
records (torch.profiler / CUPTI): per kernel its median duration, per call the span and the idle gaps between
kernels. The forward's counterpart of tools/gpu_attention_bwd.py --kernel-times, for the question the suite and
ncu left open (docs/design/attention.md, "hd 64 causal, profiled the same way": one isolated launch each is
level or near it, the suite's interleaved rounds are not).

    python3 tools/fwd_kernel_times.py OUT --variant hd64_causal_kv32_m192_rs4 --shape 8192x1,16384x1,8192x2
                                      [--calls 10] [--rounds 3]

Each round runs `calls` back-to-back calls of tsgen and of FA4 (in tsgen.bench.timing's balanced round order: for
two, alternating), eagerly
(the launches' own gaps show) or, with --graph, as one replay of a CUDA graph holding them, on the same tensors. Writes OUT/fwd_kernel_times.json
and prints one table row per shape and implementation. FA4 where tools/fa4_wheels.sh installed it, else tsgen
alone. With --runtime-spec SPEC also SPEC's kernel through tsgen's runtime, as the bench times it (RuntimeCalls):
beside the tool's own ctypes call of the same launcher, it tells a cost of the bench's path from the kernel's.
With --torch-spec SPEC also impl tsgen_torch: SPEC as the torch op users call (tsgen.torch.attention(SPEC), `op(q, k,
v)` on the tool's stream and tensors, a bshd spec), whose outputs are allocated a call.
With --events also the bench's own measure, per implementation: a sample of `calls` calls between two CUDA events
on the stream they run on, started on an idle GPU after a synchronize (as tsgen.bench.timing's Sampler with settle 0,
the forward suites' way) and started behind one untimed call (settle 1), in interleaved rounds, with the host's
time to enqueue the sample's calls: what a sample counts that the kernels' records do not.
Speed only: the outputs are not checked here (tools/gpu_attention.py checks the variants).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_attention as ga  # noqa: E402
import gpu_attention_bwd as bwd  # noqa: E402  (profile_rounds, summarize_kernels: its --kernel-times' pieces)


def summarize(blocks: list[list[tuple[str, float, float]]], calls: int) -> dict:
    """Over the blocks (profile_rounds' of one implementation): the main kernel (the name with the most time in
    all) and its median duration (us), the span per call and its blocks' (summarize_kernels'), and the median idle
    time between consecutive kernels."""
    s = bwd.summarize_kernels({"calls": calls, "blocks": {"one": blocks}})["one"]
    totals: dict[str, float] = {}
    for recs in blocks:
        for name, start, end in recs:
            totals[name] = totals.get(name, 0.0) + end - start
    main_kernel = max(totals, key=totals.get)
    gaps = []
    for recs in blocks:
        recs = sorted(recs, key=lambda r: r[1])
        gaps += [max(0.0, b[1] - a[2]) for a, b in zip(recs, recs[1:])]
    return {"kernels_per_call": sum(k["per_call"] for k in s["kernels"]), "main_kernel": main_kernel[:80],
            "kernel_us": next(k["median_us"] for k in s["kernels"] if k["name"] == main_kernel),
            "span_us": s["span_us"], "gap_us": statistics.median(gaps) if gaps else 0.0, "spans_us": s["spans_us"]}


class RuntimeCalls:
    """SPEC's kernel called as `tsgen bench` calls it: a single-process World of one GPU, the module rendered and
    loaded by the runtime, buffers of count = seq filled by the bench's fill_random, module.launch on the World's
    stream (tsgen/bench/runner.py's enqueue). One buffer set a sequence length (the bench rotates sets only where
    one set fits twice in L2, which no attention size here does)."""

    def __init__(self, spec: str):
        from tsgen.harness import render_to_cache
        from tsgen.runtime.world import World
        from tsgen.spec import load_spec

        loaded = load_spec(spec)
        self.batch = int(getattr(loaded.model.params, "batch", 1) or 1)
        self.world = World(1, backend="single")
        cached = render_to_cache(loaded)
        self.module = self.world.load(cached.manifest, source=cached.source)
        self.buffers: dict[int, object] = {}

    def calls(self, seq: int):
        from tsgen.bench.runner import fill_random

        if seq not in self.buffers:
            self.buffers[seq] = self.module.alloc(seq)
            fill_random(self.world, self.buffers[seq])
        bufs, w = self.buffers[seq], self.world
        return lambda: self.module.launch(bufs, ranks=[0], streams=w.streams)

    def close(self) -> None:
        for b in self.buffers.values():
            b.free()
        self.world.close()


def event_samples(torch, fns: dict, streams: dict, calls: int, rounds: int) -> dict:
    """--events: per implementation, us a call of `calls` calls between CUDA events on its stream, started idle
    (settle 0) or behind one untimed call (settle 1), and the host us a call to enqueue them (settle 0), over
    `rounds` rounds in tsgen.bench.timing.round_order: {impl: {"idle_us", "settled_us", "host_us": [samples]}}."""
    import time

    from tsgen.bench.timing import round_order

    out = {impl: {"idle_us": [], "settled_us": [], "host_us": []} for impl in fns}
    for r in range(rounds):
        for impl in round_order(list(fns), r):
            for settle in (0, 1):
                fn, stream = fns[impl], streams[impl]
                torch.cuda.synchronize()
                for _ in range(settle):
                    fn()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record(stream)
                for _ in range(calls):
                    fn()
                t1 = time.perf_counter()
                end.record(stream)
                end.synchronize()
                out[impl]["settled_us" if settle else "idle_us"].append(start.elapsed_time(end) * 1e3 / calls)
                if not settle:
                    out[impl]["host_us"].append((t1 - t0) * 1e6 / calls)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--variant", default="hd64_causal_kv32_m192_rs4")
    ap.add_argument("--shape", default="8192x1,16384x1,8192x2", help="SEQxBATCH, comma-separated")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtime-spec", metavar="SPEC", default=None,
                    help="also impl tsgen_runtime: SPEC (e.g. specs/attention_hd64_causal.yaml) through tsgen's runtime "
                    "as `tsgen bench` calls it (World, module.launch on the World's stream, the bench's random "
                    "inputs): at the spec's own batch only, so shapes whose batch differs skip it")
    ap.add_argument("--torch-spec", metavar="SPEC", default=None,
                    help="also impl tsgen_torch: SPEC (a bshd attention spec) as the torch op (tsgen.torch.attention)")
    ap.add_argument("--events", action="store_true", help="also the bench's own measure: samples between CUDA "
                    "events started idle and started behind one call, with the host's enqueue time")
    ap.add_argument("--graph", action="store_true", help="the calls captured in one CUDA graph, replayed (as the "
                    "bench times them where capture works)")
    args = ap.parse_args()
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    op = ga.Op(ga.build(args.out, args.variant))
    from tsgen.bench.attention_baselines import fa4_stream, import_fa4

    fa4, why = import_fa4()
    if fa4 is None:
        print(f"FA4 not importable ({why}): tsgen alone", flush=True)
    dt = ga.torch_dtype(torch, op.dtype)
    stream = torch.cuda.Stream()
    runtime = RuntimeCalls(args.runtime_spec) if args.runtime_spec else None
    torch_op = None
    if args.torch_spec:
        import tsgen.torch as tt

        torch_op = tt.attention(args.torch_spec)
        if torch_op.signature.layout != "bshd":
            ap.error(f"--torch-spec {args.torch_spec}: layout {torch_op.signature.layout}, the tool's tensors are bshd")
    result = {"variant": args.variant, "calls": args.calls, "rounds": args.rounds, "graph": args.graph, "shapes": {}}
    print("| shape | impl | kernels a call | kernel us (median) | span us a call (median) | gap us (median) |")
    print("|---|---|---|---|---|---|")
    for shape in args.shape.split(","):
        seq, batch = (int(x) for x in shape.split("x"))
        q, k, v = (torch.randn(batch, seq, h, op.head_dim, device="cuda", dtype=dt)
                   for h in (op.heads, op.kv_heads, op.kv_heads))
        o, lse = torch.empty_like(q), torch.empty(batch, op.heads, seq, device="cuda", dtype=torch.float32)
        fns = {"tsgen": lambda: op(q, k, v, o, lse, batch, seq, seq, stream)}
        if fa4 is not None:
            def call_fa4():
                with fa4_stream(torch, stream):
                    fa4.flash_attn_func(q, k, v, softmax_scale=op.scale, causal=op.causal)
            fns["fa4"] = call_fa4
        if torch_op is not None:
            def call_torch():
                with torch.cuda.stream(stream):
                    torch_op(q, k, v)
            fns["tsgen_torch"] = call_torch
        if runtime is not None and batch == runtime.batch:
            fns["tsgen_runtime"] = runtime.calls(seq)
        for fn in fns.values():  # first calls (compiles, caches) outside the records
            fn()
        torch.cuda.synchronize()
        # a block: `calls` calls, or one replay of a CUDA graph holding them
        enqueue = {name: (lambda fn=fn: [fn() for _ in range(args.calls)]) for name, fn in fns.items()}
        if args.graph:
            for name, fn in fns.items():
                if name == "tsgen_runtime":  # its own (CuPy) stream, not the capture's: eagerly, as the bench does
                    continue
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    enqueue[name]()
                graph.replay()  # upload, untimed
                enqueue[name] = graph.replay
            torch.cuda.synchronize()
        if args.events:
            # each implementation's stream: the runtime's own (CuPy) stream, the tool's for the others
            streams = {name: (torch.cuda.ExternalStream(runtime.world.streams[0].ptr) if name == "tsgen_runtime"
                              else stream) for name in fns}
            ev = event_samples(torch, fns, streams, args.calls, args.rounds)
            for e in ev.values():  # the medians the table prints, beside their samples
                e["median"] = {k: statistics.median(v) for k, v in list(e.items())}
            result.setdefault("events", {})[shape] = ev
            for name, e in ev.items():
                m = e["median"]
                print(f"| {shape} | {name} | events: idle start {m['idle_us']:.1f} us a call, settled "
                      f"{m['settled_us']:.1f}, host enqueue {m['host_us']:.1f} |", flush=True)
        blocks, _ = bwd.profile_rounds(torch, enqueue, args.rounds)
        result["shapes"][shape] = {}
        for name, bl in blocks.items():
            s = summarize(bl, args.calls)
            result["shapes"][shape][name] = s
            print(f"| {shape} | {name} | {s['kernels_per_call']:.0f} | {s['kernel_us']:.1f} | {s['span_us']:.1f} | "
                  f"{s['gap_us']:.1f} |", flush=True)
    (args.out / "fwd_kernel_times.json").write_text(json.dumps(result, indent=1))
    if runtime is not None:
        runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
