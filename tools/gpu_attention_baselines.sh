#!/usr/bin/env bash
# One device call for the attention baselines of issue 33 (tsgen/bench/attention_baselines.py):
#   tools/gpu_attention_baselines.sh attention   ONE GPU: suites attention (9 rows) and attention-gqa64
#       (cudnn-frontend's 64 / 8-head shape, 4 rows), tsgen against SDPA flash, SDPA cuDNN and cuDNN through
#       cudnn-frontend in 15 interleaved rounds. About 4-5 minutes on an H200 [computed: compiling the 5
#       kernels in parallel ~90 s; per row 15 rounds x (3-5 calls) x 4 implementations, the longest
#       (h64/kv8 16K not causal, ~13 ms a call, flash ~2x) ~5 s, ~60 s of timing in all; cuDNN graph
#       builds a few s each]
#   tools/gpu_attention_baselines.sh variants    ONE GPU (issue 33's schedule, docs/design/attention.md "The
#       persistent schedule"): tools/gpu_attention.py's correctness cases for the schedule variants (tails,
#       offsets, zig-zag, rows that see no key, 20 back-to-back calls, CUDA graph replays), then suite
#       attention-variants (16 entries, 38 rows, tsgen against cudnn-frontend alone, each entry in its own 15
#       interleaved rounds). About 4 minutes on an H200 [computed: compiling 16 + 9 kernels ~30 + ~20 s (27 s
#       for the 16 on 8 CPU jobs here); the checks' cases are <= 4097 rows, ~30 s; the suite's timed calls
#       ~10 s (sum over rows of 15 rounds x 2 implementations x 3 calls), the rest per-row set-up and checks
#       at ~3 s a row]
#   tools/gpu_attention_baselines.sh m192        ONE GPU (branch i33fwd: tile.m 192 at hd 64, three consumer
#       warpgroups): tools/gpu_attention.py's correctness cases for the m192 variants (--variants m192), then
#       suite attention-m192 (6 entries, 15 rows: the shipped hd 64 causal spec beside 192-row tiles, and hd 64
#       not causal 128 / 192 rows) against cudnn-frontend and flash-attn-4. About 4 minutes, a guess [as
#       variants: 6 + 5 kernels to compile, 15 rows at ~3 s each plus FA4's first-call compiles]
#   tools/gpu_attention_baselines.sh ilp         ONE GPU (branch i33ilp: params.row_max_chains, the row max in
#       independent chains then a tree): tools/gpu_attention.py's correctness cases for the ilp variants
#       (--variants ilp), then suite attention-ilp (7 entries, 14 rows: hd 128 not causal shipped / 2 / 8 chains /
#       ping-pong / ping-pong with 2 chains, causal GQA 32:8 shipped / 2 chains, at 8K and 16K) against
#       cudnn-frontend and flash-attn-4. About 4 minutes, a guess [as m192: 6 + 7 kernels to compile, 14 rows at
#       ~3-5 s each plus FA4's first-call compiles]
#   tools/gpu_attention_baselines.sh cp          TWO GPUs: suite cp-w2 (cp_attention at S = 16K, 32K against
#       the naive all_gather + masked SDPA and the zig-zag per-chunk SDPA + LSE merge; the ideal entries
#       with their interleaved attention baselines). About 3-4 minutes [computed: compiling 4 kernels
#       ~90 s, two worker launches (NCCL start ~15 s each), ~40 s of timing]; then, if time is left (alone:
#       STEPS=trace), tools/attention_trace.py's per-tile timeline at 16K and 32K (each ~30 s, a guess)
#   tools/gpu_attention_baselines.sh cp-nc       TWO GPUs (issue 33, not causal): the per-tile trace of specs/cp_attention.yaml
#       at 16K and 32K, shipped (static stride) and params.tile_counter, then suite cp-w2-nc (the two against the
#       single-GPU ideal, 11 samples each). About 5-6 minutes, a guess [cp's: 2 + 2 kernels to compile, four traces
#       ~30 s each, the suite's timing about twice cp-w2's not-causal half]
#   tools/gpu_attention_baselines.sh cp-gap      TWO GPUs (issue 33, not causal: docs/design/cp_attention.md
#       "Outside the tiles"): tools/cp_call_timeline.py on the bench's own call sequence (lineup + 3 back-to-back calls,
#       2 samples, S 16K and 32K) for the shipped spec (the own shard in place, params.local_kv) and with the own shard
#       copied (local_kv=false), the per-tile trace of one isolated call at 16K (tools/attention_trace.py: the first
#       tile's length against its summed waits), then suite cp-w2-nc (shipped and copied against the ideal). About 4
#       minutes [took 237 s with three timelines and five suite entries at ca9dd6e, 2026-11-27]
#   tools/gpu_attention_baselines.sh rescale     ONE GPU (issue 33): params.rescale_at's correctness cases (--variants
#       rescale), then suite attention-rescale (8 entries, 16 rows) against cudnn-frontend and flash-attn-4 with
#       --sm-clocks. About 6 minutes, a guess [as ilp: 8 + 6 kernels to compile, 16 rows at ~4-6 s each]
#   tools/gpu_attention_baselines.sh own-first   TWO GPUs (issue 33): params.own_copy_first's five GPU cases, then suites
#       cp-w2-nc and cp-w2-causal with --sm-clocks. About 8 minutes, a guess [precompile ~90 s, the cases ~60 s,
#       each suite ~150 s as cp-nc's]
#   tools/gpu_attention_baselines.sh clocks      ONE GPU: suite attention with --sm-clocks, then tools/gpu_attention_bwd.py
#       --sm-clocks on four backward rows (hd 128, 32 heads, not causal and causal, 8K and 16K; no checks: the
#       rows' kernels are the gated ones): each implementation's SM clock beside its time, to tell whether FA4's lead
#       is the clock (power) or the cycles. About 8 minutes, a guess [the attention suite ~4-5 min as above; the
#       backward's builds ~60 s and FA4's first-call compiles]
#   tools/gpu_attention_baselines.sh fa4-split   ONE GPU (issue 33, hd 64 causal forward: docs/design/attention.md "hd 64
#       causal, profiled the same way"): tools/fwd_kernel_times.py at 8K and 16K batch 1 with the spec also through the
#       runtime (--runtime-spec) and as the torch op (--torch-spec), eagerly (with --events: the bench's own event
#       samples, started idle and behind one call, and the host's enqueue time) then as graphs, then suites
#       attention-fa4-hd64-alone (FA4 alone) and attention-fa4-hd64 (with cudnn-frontend): where the suite's tsgen
#       time over the kernel's comes from (path, inputs, interleaving). About 7 minutes, a guess [two timelines ~60 s
#       each with FA4's first-call compiles, the suites ~90 + ~180 s]
# Needs the cudnn-frontend wheel in .whl/ (carry ".whl"); installed into /tmp/site when `import cudnn`
# fails. FlashAttention-4 is timed too where tools/fa4_wheels.sh installed it on this warm machine first
# (its header: three calls carrying .whl-fa4/part1..3), else its rows are notes; its first call in each
# shape compiles (the DSL's JIT: seconds to a minute each, not measured yet), before the timed calls.
# FA4_CUBINS=1 also brings back FA4's compiled kernels ($OUT/fa4_dsl_cache.tgz, for cuobjdump here).
# Logs under $OUT/attn_logs, results in the index layout in $OUT/results.tgz (tar xzf it into results/, then `tsgen results`), a table of ratios last.
set -uo pipefail
MODE=${1:-attention}
source "$(dirname "$0")/device_env.sh"
LOG="$OUT/attn_logs" BUDGET=${BUDGET:-470}  # 390 before flash-attn-4 (its compiles)
source "$(dirname "$0")/steps.sh"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; } | tee "$OUT/device.txt"
python3 -c "import torch, cudnn" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --target /tmp/site .whl/nvidia_cudnn_frontend-*.whl
export PYTHONPATH=/tmp/site:$PWD
# FlashAttention-4, where the earlier calls of this machine installed it (tools/fa4_wheels.sh: its wheels
# travel in parts); its kernels are compiled by the DSL at first call, kept on disk for the next suite
if [ -f "${FA4_SITE:-/tmp/site-fa4}/.fa4-installed" ]; then
  eval "$(bash tools/fa4_wheels.sh env)"
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-dsl-cache
  step "flash-attn-4 imports" 120 python3 -c "from tsgen.bench import attention_baselines as A; m, why = A.import_fa4(); print(A.fa4_versions(), why or 'imports'); raise SystemExit(bool(why))"
else
  echo "flash-attn-4 not installed on this machine (tools/fa4_wheels.sh: three calls first): its rows are notes"
fi
step "cudnn-frontend imports" 60 python3 -c "import torch, cudnn; print('cuDNN', cudnn.backend_version(), 'frontend', cudnn.__version__)"
step "baseline math (torch)" 60 python3 -m pytest -q -p no:cacheprovider tests/test_attention_baselines_cpu.py
[ "$MODE" = variants ] && BUDGET=${BUDGET_VARIANTS:-270}
[ "$MODE" = m192 ] && BUDGET=${BUDGET_VARIANTS:-330}
[ "$MODE" = ilp ] && BUDGET=${BUDGET_VARIANTS:-330}
[ "$MODE" = cp-nc ] && BUDGET=${BUDGET_CPNC:-560}  # four traces before the suite (the call's limit is 600 s)
[ "$MODE" = cp-gap ] && BUDGET=${BUDGET_CPGAP:-560}
[ "$MODE" = clocks ] && BUDGET=${BUDGET_CLOCKS:-560}
[ "$MODE" = own-first ] && BUDGET=${BUDGET_OWN:-560}
[ "$MODE" = fa4-split ] && BUDGET=${BUDGET_SPLIT:-560}
[ "$MODE" = rescale ] && BUDGET=${BUDGET_RESCALE:-500}
case "$MODE" in
  variants)
    step "precompile" 60 python3 tools/precompile_suites.py attention-variants --jobs 16
    step "schedule checks" 75 python3 tools/gpu_attention.py "$OUT/schedule_checks" --variants schedule --quick --deadline 70
    step "bench attention-variants" 170 python3 -m tsgen bench --suite attention-variants --results "$OUT/results" ;;
  m192)
    step "precompile" 60 python3 tools/precompile_suites.py attention-m192 --jobs 16
    step "m192 checks" 90 python3 tools/gpu_attention.py "$OUT/m192_checks" --variants m192 --quick --deadline 85
    step "bench attention-m192" 200 python3 -m tsgen bench --suite attention-m192 --results "$OUT/results" ;;
  ilp)
    step "precompile" 60 python3 tools/precompile_suites.py attention-ilp --jobs 16
    step "ilp checks" 90 python3 tools/gpu_attention.py "$OUT/ilp_checks" --variants ilp --quick --deadline 85
    step "bench attention-ilp" 200 python3 -m tsgen bench --suite attention-ilp --results "$OUT/results" ;;
  attention)
    step "precompile" 150 python3 tools/precompile_suites.py attention attention-gqa64
    step "bench attention" 260 python3 -m tsgen bench --suite attention --results "$OUT/results"
    step "bench attention-gqa64" 190 python3 -m tsgen bench --suite attention-gqa64 --results "$OUT/results" ;;
  cp)
    step "precompile" 150 python3 tools/precompile_suites.py cp-w2
    step "bench cp-w2" 300 python3 -m tsgen bench --suite cp-w2 --results "$OUT/results"
    # the per-tile timeline of the shipped zig-zag causal spec (tools/attention_trace.py; alone: STEPS=trace)
    step "trace 16K" 90 python3 tools/attention_trace.py "$OUT/trace_16k" --seq 16384
    step "trace 32K" 90 python3 tools/attention_trace.py "$OUT/trace_32k" --seq 32768
    tail -n 4 "$LOG"/trace_*.log 2>/dev/null ;;
  cp-nc)
    # issue 33, not causal (docs/design/cp_attention.md, "Where the not-causal time goes"): the traces first (each
    # checks its output and that every tile ran once: the counter variant's schedule check), then the suite
    step "precompile" 150 python3 tools/precompile_suites.py cp-w2-nc
    for S in 16384 32768; do
      step "trace $S static" 75 python3 tools/attention_trace.py "$OUT/trace_nc_${S}_static" --spec specs/cp_attention.yaml --seq $S
      step "trace $S counter" 75 python3 tools/attention_trace.py "$OUT/trace_nc_${S}_counter" --spec specs/cp_attention.yaml --seq $S --param tile_counter=true
    done
    tail -n 6 "$LOG"/trace_*.log 2>/dev/null
    step "bench cp-w2-nc" 300 python3 -m tsgen bench --suite cp-w2-nc --results "$OUT/results" ;;
  cp-gap)
    # issue 33, not causal (docs/design/cp_attention.md, "Outside the tiles"): where a call's time goes on the
    # bench's own sequence (each timeline writes a .txt report and one .json.gz: few files), then the suite
    step "precompile" 150 python3 tools/precompile_suites.py cp-w2-nc
    step "timeline shipped" 120 python3 tools/cp_call_timeline.py "$OUT/trace_timeline_shipped" --seq 16384,32768
    step "timeline copy" 120 python3 tools/cp_call_timeline.py "$OUT/trace_timeline_copy" --seq 16384,32768 --param local_kv=false
    step "trace 16384 static" 75 python3 tools/attention_trace.py "$OUT/trace_nc_16384_static" --spec specs/cp_attention.yaml --seq 16384
    cat "$OUT"/trace_timeline_*/cp_call_timeline.txt 2>/dev/null
    tail -n 6 "$LOG"/trace_*.log 2>/dev/null
    step "bench cp-w2-nc" 300 python3 -m tsgen bench --suite cp-w2-nc --results "$OUT/results" ;;
  fa4-split)
    step "precompile" 60 python3 tools/precompile_suites.py attention-fa4-hd64 --jobs 16
    for mode in eager graph; do
      step "timeline $mode" 120 python3 tools/fwd_kernel_times.py "$OUT/kt_$mode" --shape 8192x1,16384x1 --calls 3 \
        --rounds 6 --runtime-spec specs/attention_hd64_causal.yaml --torch-spec specs/attention_hd64_causal.yaml \
        $([ $mode = graph ] && echo --graph || echo --events)
      cp "$OUT/kt_$mode/fwd_kernel_times.json" "$OUT/fwd_kernel_times_$mode.json" 2>/dev/null
      rm -rf "$OUT/kt_$mode"  # the tool's build folder: sources and a .so, not results
      grep '^|' "$LOG/timeline_$mode.log"
    done
    step "bench attention-fa4-hd64-alone" 150 python3 -m tsgen bench --suite attention-fa4-hd64-alone --results "$OUT/results"
    step "bench attention-fa4-hd64" 200 python3 -m tsgen bench --suite attention-fa4-hd64 --results "$OUT/results" ;;
  rescale)
    # ONE GPU (issue 33, docs/design/attention.md "The O rescale inside the exp2 stream"): params.rescale_at's
    # correctness cases, then suite attention-rescale
    step "precompile" 90 python3 tools/precompile_suites.py attention-rescale --jobs 16
    step "rescale checks" 120 python3 tools/gpu_attention.py "$OUT/rescale_checks" --variants rescale --quick --deadline 110
    step "bench attention-rescale" 260 python3 -m tsgen bench --suite attention-rescale --sm-clocks --results "$OUT/results" ;;
  own-first)
    # TWO GPUs (issue 33, docs/design/cp_attention.md "Own rows copied first"): params.own_copy_first's GPU cases
    # (tests/test_cp_attention_gpu.py CE_KNOBS: one GPU per rank), then suites cp-w2-nc and cp-w2-causal with the
    # SM clocks read (their own_first entries beside the shipped spec and the ideal)
    step "precompile" 150 python3 tools/precompile_suites.py cp-w2-nc cp-w2-causal --jobs 14
    step "own_copy_first GPU cases" 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cp_attention_gpu.py \
      -k own_copy_first -rfEs
    step "bench cp-w2-nc" 190 python3 -m tsgen bench --suite cp-w2-nc --sm-clocks --results "$OUT/results"
    step "bench cp-w2-causal" 190 python3 -m tsgen bench --suite cp-w2-causal --sm-clocks --results "$OUT/results" ;;
  clocks)
    # FA4's lead, clock or cycles (issue 33 item 3, issue 35): suite attention and four backward rows with NVML's SM
    # clock read while timing (--sm-clocks, tsgen/bench/clocks.py); the backward's report in $OUT/bwd
    step "precompile" 150 python3 tools/precompile_suites.py attention
    step "bench attention (SM clocks)" 240 python3 -m tsgen bench --suite attention --sm-clocks --results "$OUT/results"
    step "backward (SM clocks)" 220 python3 tools/gpu_attention_bwd.py "$OUT/bwd" --no-check --sm-clocks \
      --bench-shapes hd128_full_kv32:8192,hd128_causal_kv32:8192,hd128_full_kv32:16384,hd128_causal_kv32:16384
    [ -d "$OUT/bwd" ] && (cd "$OUT/bwd" && tar czf ../bwd.tgz --exclude='*.tgz' . ) ;;
  *) echo "usage: $0 attention|variants|m192|ilp|cp|cp-nc|cp-gap|clocks|own-first|rescale|fa4-split" >&2; exit 2 ;;
esac
python3 - "$OUT" <<'PY' | tee "$OUT/attn_ratios.txt"
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).rglob("*.json")):
    try:
        rows = json.loads(f.read_text()).get("rows", [])
    except (ValueError, AttributeError):
        continue
    for r in rows:
        if r.get("impl") != "tsgen" or not r.get("ratios"):
            continue
        cells = []
        for impl, x in r["ratios"].items():
            s = (r.get("ratio_spread") or {}).get(impl)
            cells.append(f"{impl[:44]}: {x:.3f}" + (f" [{s['q1']:.3f}, {s['q3']:.3f}]" if s else ""))
        print(f"{r.get('label') or r.get('spec')} S={r['size']} {r.get('TFLOPs', 0):.0f} TFLOP/s | " + " | ".join(cells))
PY
summary "attention baselines ($MODE)" attn_summary.txt
rc=$?
# the device tool brings back folders a few levels deep only: the results index travels as one archive
[ -d "$OUT/results" ] && tar czf "$OUT/results.tgz" -C "$OUT/results" . && rm -rf "$OUT/results"
# and the traces' per-tile records (attention_trace.json, one folder per trace): one archive too (on
# 2026-11-27 the folders were left out, "count", and only the printed summaries came back)
traces=$(cd "$OUT" && ls -d trace_* 2>/dev/null)
[ -n "$traces" ] && (cd "$OUT" && tar czf traces.tgz $traces && rm -rf $traces)
# FA4_CUBINS=1: FlashAttention-4's kernels as its DSL compiled them (its on-disk cache), to read their SASS
# here with cuobjdump beside tsgen's (what FA4 does per block that tsgen does not); read, never committed
if [ -n "${FA4_CUBINS:-}" ] && [ -d /tmp/fa4-dsl-cache ]; then
  tar czf "$OUT/fa4_dsl_cache.tgz" -C /tmp fa4-dsl-cache && ls -l "$OUT/fa4_dsl_cache.tgz"
fi
exit $rc
