# Sourced by the device-run scripts: safety variables, carried wheels, caches.
# NVLink multicast is never used on the shared machines: the variables come from tsgen/env.py (the one
# place that names them) and also reach every child process.
eval "$(python3 -m tsgen.env)" && [ "${NCCL_NVLS_ENABLE:-}" = 0 ] || { echo "device_env: cannot set the no-multicast environment" >&2; exit 2; }
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tsgen-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the device image lacks (pydantic), see docs/running.md
  # once per machine: a script that runs others sources this file again
  [ -f /tmp/site/.tsgen-wheels ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.tsgen-wheels; } || exit 2
  export PYTHONPATH=/tmp/site:$PWD
elif [ -f /tmp/site/.tsgen-wheels ]; then  # a warm machine that an earlier call gave the wheels: a call
  export PYTHONPATH=/tmp/site:$PWD         # may carry other things instead (tools/fa4_wheels.sh's parts)
else
  export PYTHONPATH=$PWD
fi
# the compile cache: tsgen loads the libraries it finds there, so a folder of this user's alone (0700),
# never a fixed name in /tmp another user could make first (tsgen refuses a folder others can write)
export TSGEN_CACHE_DIR=${TSGEN_CACHE_DIR:-${TMPDIR:-/tmp}/tsgen-cache-$(id -u)} TSGEN_RESULTS_DIR="$OUT"
(umask 077 && mkdir -p "$TSGEN_CACHE_DIR") || { echo "device_env: cannot make $TSGEN_CACHE_DIR" >&2; exit 2; }
# the commit the results name, where the tree's git metadata is stale (tools/stamp_commit.sh says why)
if [ -z "${TSGEN_COMMIT:-}" ]; then
  stamp=$(bash "$(dirname "${BASH_SOURCE[0]}")/stamp_commit.sh" --read)
  [ -z "$stamp" ] || export TSGEN_COMMIT=$stamp
fi
