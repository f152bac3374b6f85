#!/usr/bin/env bash
# One device call on ONE GPU (H100 or H200), under 4 minutes: the runtime paths that now take the
# lowered, typed Manifest (issue 13 item 1). Ranks share the GPU (TSGEN_SHARE_GPUS=1).
#   1. tsgen test, SM kernels, Manifest handed over in memory: reduce_scatter (4 ranks), allgather
#      (3 ranks, rank skew), all_to_all_v (2 ranks)
#   2. host-launcher modules (compile mode "shared"): gemm_bf16 (1 GPU), gemm_reduce_scatter (2 ranks)
#   3. a negative control (mutated source with the in-memory manifest) must FAIL: pytest's
#      test_negative_control_fails for reduce_scatter and allgather
#   4. the wait timeout probe (probe_timeout renders to the cache and loads in memory)
#   5. World.load(path): a module loaded from NAME.json (Manifest.load) and launched, and an
#      unversioned NAME.json refused with the rebuild message
#   6. tsgen bench (runner hands the Manifest over): allgather, 2 ranks sharing, 1M, no baselines
# Logs under $OUT/logs, a PASS/FAIL table last. BUDGET (default 225) seconds in all.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export TSGEN_SHARE_GPUS=1
LOG=$OUT/logs BUDGET=${BUDGET:-225}
source "$(dirname "$0")/steps.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -n 2 | head -n 1; date -u +%FT%TZ; } | tee "$OUT/device.txt"
TSGEN="python3 -m tsgen"

step "test reduce_scatter 4 ranks" 60 $TSGEN test specs/reduce_scatter.yaml --gpus 4 --share-gpus
step "test allgather 3 ranks skew" 60 $TSGEN test specs/allgather.yaml --gpus 3 --share-gpus --skew 1
step "test all_to_all_v 2 ranks" 60 $TSGEN test specs/all_to_all_v.yaml --gpus 2 --share-gpus
step "test gemm_bf16 (host launcher)" 90 $TSGEN test specs/gemm_bf16.yaml --gpus 1
step "test gemm_reduce_scatter 2 ranks (host launcher)" 90 $TSGEN test specs/gemm_reduce_scatter.yaml --gpus 2 --share-gpus
step "negative controls fail (mutated source)" 120 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
  -k "test_negative_control_fails and (reduce_scatter or allgather)"
step "probe timeout" 60 $TSGEN test specs/allgather.yaml --gpus 2 --share-gpus --probe-timeout
step "World.load(path) and an old manifest" 90 python3 - <<'PY'
import json
from tsgen.harness import materialize
from tsgen.manifest import ManifestError
from tsgen.runtime import World
from tsgen.spec import load_spec
path = materialize(load_spec("specs/allgather.yaml"))  # NAME.json + NAME.cu in the cache
old = path.with_name("old_manifest.json")
data = json.loads(path.read_text()); del data["manifest_version"]; old.write_text(json.dumps(data))
with World(2, share_gpus=True) as world:
    module = world.load(path)
    bufs = module.alloc(4096)
    for call in range(3):  # the kernel's own call counter: three calls in a row complete
        module.launch(bufs)
        world.synchronize()
    print("3 calls of", module.manifest.name, "loaded from", path)
    bufs.free()
    try:
        world.load(old)
        raise SystemExit("an unversioned manifest was loaded")
    except ManifestError as e:
        print("refused as it should:", e)
PY
step "bench allgather 2 ranks shared" 90 $TSGEN bench specs/allgather.yaml --gpus 2 --share-gpus --sizes 1M --no-baselines
summary "lowering / manifest on one GPU" lowering_table.txt
