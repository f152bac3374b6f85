#!/usr/bin/env bash
# Issue 31 on GPUs: tsgen kernels as torch ops (tsgen.torch), one process per GPU under torchrun.
# Needs 2 GPUs (the shared or the attention step alone: 1), torch with CUDA, nvcc (and pydantic: carry it in .whl/
# where the image lacks it, docs/running.md). One command; every step has a timeout and the script starts no step
# after BUDGET s (default 540), so it ends inside a 10-minute device call. Logs under $OUT/torch;
# the CHECK / TIME table ($OUT/torch_checks.md) and the steps' PASS/FAIL table ($OUT/torch_summary.md)
# last. NVLink multicast stays off
# (tools/device_env.sh sets the variables; tsgen.torch refuses a multicast handle).
#   1. tests/torch_checks.py: allgather / reduce_scatter against NCCL (poisoned outputs, exact on
#      integer data), all_reduce / all_to_all / broadcast against NCCL, op.empty zero copy, CUDA graph
#      capture + 100 replays, gradients against the torch-only twins, CUDA IPC heaps, argument errors,
#      the out= form of allgather / reduce_scatter;
#      Ulysses pre / post (and packed GQA pre) against all_to_all_single + permutes, bit for bit, their
#      gradients against the twins' autograd, pre -> post in a CUDA graph, 100 replays; allgather_gemm /
#      gemm_reduce_scatter against NCCL + cuBLAS, their gradients, AG-GEMM -> GEMM-RS in a CUDA graph, their
#      out= form bit for bit against the functional form and in a CUDA graph; MoE
#      dispatch / combine against all_to_all_single + index_add, the gradient, a CUDA graph
#   2. tests/torch_checks.py --probe: a peer that never arrives -> the timeout diagnosis as an error
#   3. examples/torch/tp_mlp.py --compile: TP MLP forward + backward against its NCCL twin: AG-GEMM ->
#      GEMM-RS eager, on the out= form and torch.compile(fullgraph=True), allgather / reduce_scatter + torch
#      GEMMs; step times
#   4. examples/torch/ulysses_attention.py: Ulysses attention layer (torch SDPA inside) forward +
#      backward against its all_to_all_single twin, step times of both
#   5. examples/torch/moe_layer.py: MoE layer (dispatch -> per-expert torch GEMMs -> combine) forward +
#      backward against its all_to_all_single twin, step times of both
#   6. tests/torch_checks.py --attention, one GPU, no torchrun: tsgen.torch.attention (the attention forward and
#      its attention_backward as one differentiable op) on bf16 hd128, hd128 causal GQA 32:8 and hd64 causal at S 1000
#      (batch 2: tails) and 4096, O / LSE / dQ / dK / dV against torch autograd of SDPA in float32 (the families'
#      per-element bounds, and 1e-2 in norm), outputs in NaN-poisoned memory; negative controls (a wrong LSE, dK and
#      dV swapped, a zeroed row of O) that the comparison must catch; torch.compile(fullgraph=True) (Inductor) of a
#      tiny module; forward + backward in a CUDA graph, 20 replays, each checked; the forward and op.grads from a
#      new host thread with no CUDA context (attention_fresh_thread); a new thread's first launches captured in a
#      CUDA graph, replayed 3 times (attention_fresh_thread_captured); step times beside SDPA's
#   6b. tests/torch_checks.py --cp (TORCH_STEPS=cp, 2 ranks, NCCL): tsgen.torch.cp_attention, zig-zag causal GQA and
#      contiguous not causal at S 2048 and 8192, every rank's O / LSE / dQ / dK / dV against float32 SDPA autograd over
#      the whole sequence (by default, kv_together, overlap_backward, kv_push), negative controls (no reduce-scatter;
#      kv_push without its wait under a lag); step
#      times at each S of CP_TIME_SEQS (default 2048 8192 16384 32768) beside NCCL all_gather + SDPA and the
#      single-GPU ideal, in CP_TIME_ROUNDS interleaved rounds (default 8; TIME lines: medians and ideal/this paired
#      per round, RAW lines: every round), each timed S's O / dQ / dK / dV against the single-GPU op's (2e-2 in
#      norm); cp_shared (under MPS, below): the same at W 2, 4 and 8 on GPU 0, S 2048, no times
#   7. tests/torch_checks.py --shared, last: 4 ranks on GPU 0 alone (CUDA_VISIBLE_DEVICES=0), a gloo
#      group (no NCCL), TSGEN_SHARE_GPUS=1, under an MPS control daemon started for this step and
#      stopped after it (tools/mps.sh; the steps before run without MPS): allgather / reduce_scatter /
#      all_to_all / Ulysses pre + post, 20 calls each, and a CUDA graph of 20 replays, against local
#      references; once with CUDA IPC heaps, once with torch symmetric memory
#      (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1; where torch refuses, a SKIP line says why). The
#      ranks run with CUDA_DEVICE_MAX_CONNECTIONS at the driver's default: under MPS the clients'
#      hardware queues come out of one pool (docs/lab/shared_gpu.md: 4 clients x 32 fail).
# Environment: TP_ARGS, ULYSSES_ARGS, MOE_ARGS (extra arguments of the examples), TSGEN_TORCH_HEAP (auto | symm_mem | ipc),
# CP_TIME_SEQS (the cp step's timed S, space-separated; default "2048 8192 16384 32768"), CP_TIME_VARIANTS (of tsgen
# tsgen_graph tsgen_fused tsgen_kv_together tsgen_overlap tsgen_push twin twin_cudnn ideal; default "tsgen ideal twin twin_cudnn"),
# CP_TIME_ROUNDS
# (default 8), CP_TIME_JSON (a path: rank 0 writes every round's samples there; e.g. $OUT/torch/cp_times.json),
# TORCH_STEPS (run only these of: checks probe tp_mlp ulysses moe attention cp shared cp_shared; default all; environment and
# compile always run; cp_pieces, run only when named: tools/torch_cp_pieces.py, the cp step's time piece by piece).
# One GPU: TORCH_STEPS=shared bash tools/gpu_torch.sh, TORCH_STEPS=attention bash tools/gpu_torch.sh
# (the attention step alone: about a minute after the compile step).
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/device_env.sh
LOG=$OUT/torch
BUDGET=${BUDGET:-540}
source tools/steps.sh
RUN="python3 -m torch.distributed.run --standalone --nproc-per-node 2"

want() { [ -z "${TORCH_STEPS:-}" ] || [[ " $TORCH_STEPS " == *" $1 "* ]]; }
NEED=1  # GPUs: 2 for any step with one process per GPU, 1 for the shared or the attention step alone
for s in checks probe tp_mlp ulysses moe cp cp_pieces; do want $s && NEED=2; done
step "environment" 60 python3 -c "
import torch, sys
n = torch.cuda.device_count()
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', n, [torch.cuda.get_device_name(i) for i in range(n)])
print('peer access 0->1:', n > 1 and torch.cuda.can_device_access_peer(0, 1))
sys.exit(0 if n >= $NEED else 1)" || { summary "tsgen.torch on GPUs: needs $NEED GPU(s)" torch_summary.md; exit 1; }
cat "$LOG/environment.log"
# render + compile the modules once, in parallel, before the ranks ask for them (they would wait on the lock);
# those of the selected steps only (the attention step's pairs: tests/torch_checks.py ATTENTION_PAIRS)
COLLECTIVES=0; for s in checks probe tp_mlp ulysses moe shared cp cp_shared cp_pieces; do want $s && COLLECTIVES=1; done
ATTENTION=0; for s in attention cp cp_shared cp_pieces; do want $s && ATTENTION=1; done
CP_FUSED=0; want cp && CP_FUSED=1  # the fused forward's cp_attention specs (tests/torch_checks.py CP_FUSED)
CP_PUSH=0; want cp || want cp_shared || want cp_pieces && CP_PUSH=1  # the kv_push backward specs (tests/torch_checks.py CP_PUSH)
step "compile" 150 python3 -c "
from concurrent.futures import ThreadPoolExecutor
from tsgen.harness import render_to_cache
from tsgen.spec import load_spec
from tsgen.toolchain import compile_source
def one(spec):
    m = render_to_cache(load_spec(spec))
    return compile_source(m.source, mode='shared').output
specs = []
if $COLLECTIVES:
    specs += [f'specs/{s}.yaml' for s in ('allgather', 'reduce_scatter', 'all_reduce_one_shot', 'all_to_all', 'broadcast',
                                          'ulysses_pre_a2a', 'ulysses_post_a2a', 'ulysses_pre_a2a_gqa', 'allgather_gemm',
                                          'gemm_reduce_scatter', 'moe')]
    specs += [f'examples/torch/specs/{s}.yaml' for s in ('tp_mlp_ag_gemm', 'tp_mlp_gemm_rs')]
import sys
sys.path.insert(0, 'tests')
import torch_checks as tc  # the checks' own lists of the specs they load
if $ATTENTION:
    specs += [s for pair in tc.ATTENTION_PAIRS.values() for s in pair]
if $CP_FUSED:
    specs += list(tc.CP_FUSED.values())
if $CP_PUSH:
    specs += list(tc.CP_PUSH.values())
with ThreadPoolExecutor(12) as pool:
    print(*pool.map(one, specs), sep='\n')"
want checks && step "torch checks (2 ranks, NCCL group)" 240 $RUN tests/torch_checks.py
want probe && step "peer never arrives (2 ranks, gloo group)" 90 $RUN tests/torch_checks.py --probe
want tp_mlp && step "tp_mlp fused + collectives vs NCCL twin" 200 $RUN examples/torch/tp_mlp.py --compile ${TP_ARGS:-}
want ulysses && step "ulysses_attention vs all_to_all_single twin" 120 $RUN examples/torch/ulysses_attention.py ${ULYSSES_ARGS:-}
want moe && step "moe_layer vs all_to_all_single twin" 120 $RUN examples/torch/moe_layer.py ${MOE_ARGS:-}
# one GPU, no process group: plain python, not torchrun
want attention && step "attention fwd+bwd as one op (1 GPU)" 150 python3 tests/torch_checks.py --attention
want cp && step "cp_attention fwd+bwd (2 ranks, NCCL)" 400 $RUN tests/torch_checks.py --cp
[[ " ${TORCH_STEPS:-} " == *" cp_pieces "* ]] && \
  step "cp_attention step in pieces (2 ranks, lab)" 120 env S="${S:-8192}" $RUN tools/torch_cp_pieces.py
# last: the only step under MPS (the daemon serves GPU 0 alone, and is stopped however the step ends)
if want shared || want cp_shared; then
  source tools/mps.sh
  if CUDA_VISIBLE_DEVICES=0 mps_start; then
    trap 'mps_stop "$OUT/torch_mps_log"' EXIT  # a script stopped inside the step stops the daemon too
    want shared && for heap in ipc symm_mem; do
      CUDA_VISIBLE_DEVICES=0 TSGEN_SHARE_GPUS=1 TSGEN_TORCH_HEAP=$heap step "shared GPU, 4 ranks, $heap heaps (gloo, MPS)" 150 \
        env -u CUDA_DEVICE_MAX_CONNECTIONS python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
        tests/torch_checks.py --shared
    done
    want cp_shared && for w in ${CP_WORLDS:-2 4 8}; do  # issue 35: the cp backward at W 2, 4, 8 on one GPU
      CUDA_VISIBLE_DEVICES=0 TSGEN_SHARE_GPUS=1 step "cp_attention fwd+bwd, $w ranks on one GPU (gloo, MPS)" 240 \
        env -u CUDA_DEVICE_MAX_CONNECTIONS python3 -m torch.distributed.run --standalone --nproc-per-node $w \
        tests/torch_checks.py --cp --shared
    done
    mps_stop "$OUT/torch_mps_log"  # its server.log names refused clients
    trap - EXIT
  else
    RESULTS+=("$(printf '%-48s FAIL  the MPS control daemon did not start' "shared GPU (MPS)")"); FAILS=$((FAILS + 1))
  fi
fi

{
  echo "| check | result | detail |"
  echo "|---|---|---|"
  grep -h "^CHECK " "$LOG"/*.log | sed -E 's/^CHECK ([^ ]+) ([A-Z]+) ?(.*)$/| \1 | \2 | \3 |/'
  echo
  grep -h "^TIME " "$LOG"/*.log | sed -E 's/^TIME /- /'
} > "$OUT/torch_checks.md"
echo
cat "$OUT/torch_checks.md"
grep -qh "^CHECK [^ ]* FAIL" "$LOG"/*.log && FAILS=$((FAILS + 1))
# the checks and step times as results/torch/<date>-<commit>.{json,md} under $OUT/results (where some step
# printed checks: cp_pieces alone prints none, its log is its result)
if grep -qh "^CHECK " "$LOG"/*.log 2>/dev/null; then
  python3 tools/torch_results.py "$OUT/results" "${TSGEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" \
    "$(nvidia-smi -L | wc -l) x $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1), $(python3 -c 'import torch; print("torch", torch.__version__)')" \
    "bash tools/gpu_torch.sh" "$LOG" || FAILS=$((FAILS + 1))
fi
summary "tsgen.torch on GPUs" torch_summary.md
