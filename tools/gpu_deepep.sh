#!/usr/bin/env bash
# Issue 34 item 2 on GPUs: DeepEP (v1.2.1, a wheel built off the device and carried in .whl/:
# docs/lab/deepep.md) as the moe baseline at world 2, without tsgen's kernels: for every moe entry of
# suites/moe-w2.yaml, `python -m tsgen.bench.moe_deepep` starts 2 workers (tsgen launch, as `tsgen
# bench` does) that time DeepEP's intranode normal dispatch, layout + dispatch, combine and the pair
# (bf16 / fp8 dispatch) or its low-latency dispatch (bf16, fp8) / combine / pair (NVSHMEM over
# NVLink), check every timed output, and time the peer-copy ceiling (cudaMemcpyPeerAsync, both
# directions at once). Needs 2 GPUs. NVLink multicast stays off (tools/device_env.sh; DeepEP's Buffer
# sets NVSHMEM_DISABLE_NVLS=1 too). Logs under $OUT/deepep, rows in $OUT/deepep.jsonl, the table last.
# Under 360 s (BUDGET, default 340; normal mode at three SM counts).
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/device_env.sh
LOG=$OUT/deepep BUDGET=${BUDGET:-340}
source tools/steps.sh
whl=$(ls .whl/deep_ep-*.whl 2>/dev/null | head -1)
if [ -z "$whl" ]; then
  echo "no .whl/deep_ep-*.whl: the DeepEP rows say 'not timed'; the peer-copy ceiling is still timed"
elif [ ! -d /tmp/site/deep_ep ]; then  # device_env.sh may have installed the wheels before this one came
  step "install $(basename "$whl")" 60 python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target /tmp/site "$whl"
fi
export PYTHONPATH=/tmp/site:$PWD
step "environment" 60 python3 -c "
import glob, subprocess, sys, torch
n = torch.cuda.device_count()
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', n,
      [torch.cuda.get_device_name(i) for i in range(n)])
from tsgen.bench.moe_deepep import import_deep_ep
try:
    ep = import_deep_ep()
    print('deep_ep', ep.__file__, 'sm90', ep.Buffer.is_sm90_compiled())
    so = glob.glob('/tmp/site/deep_ep_cpp*.so')
    if so:
        print(subprocess.run(['ldd', so[0]], capture_output=True, text=True).stdout)
except ImportError as e:
    print('deep_ep not importable:', e)
sys.exit(0 if n >= 2 else 1)" || { summary "DeepEP baseline: needs 2 GPUs" deepep_summary.md; exit 1; }
cat "$LOG/environment.log"
step "DeepEP moe-w2 world 2" 260 python3 -m tsgen.bench.moe_deepep --suite moe-w2 --gpus 2 --jsonl "$OUT/deepep.jsonl"
summary "DeepEP baseline at world 2" deepep_summary.md
rc=$?
echo
sed -n '/^entry /,$p' "$LOG/DeepEP_moe-w2_world_2.log"
exit $rc
