#!/usr/bin/env bash
# Run HERE before a device call, and carry the file it writes (run's carry: [".whl", ".tsgen-commit"]):
# the device's copy of the tree carries the git metadata of the session's first commit, not of
# HEAD (on 2026-11-26 a bench stamped its results 36d3cfd-dirty while the code was 78c80cd's), so
# tools/device_env.sh takes TSGEN_COMMIT from this file. "-dirty" when tsgen/ or templates/ differ
# from HEAD, as tsgen.bench.results.commit() says it.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=$(git rev-parse --short HEAD)
git diff --quiet HEAD -- tsgen templates || stamp="$stamp-dirty"
echo "$stamp" > .tsgen-commit
echo "$stamp"
