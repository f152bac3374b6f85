#!/usr/bin/env bash
# The commit that device runs name their results after.
#   bash tools/stamp_commit.sh          HERE, before a device call: writes .tsgen-commit (git-ignored;
#                                       carry it: run's carry [".whl", ".tsgen-commit"])
#   bash tools/stamp_commit.sh --read   THERE (tools/device_env.sh): prints the stamped commit if the
#                                       tree still matches it, else warns and prints nothing
# Why: the device's copy of the tree carries the git metadata of the session's first commit, not of
# HEAD (on 2026-11-26 a bench stamped its results 36d3cfd-dirty while the code was 78c80cd's). The
# stamp holds the commit ("-dirty" when tsgen/ or templates/ differ from it, as
# tsgen.bench.results.commit() says) and a hash of tsgen/ and templates/, so a stamp left from an
# earlier call (a warm machine keeps ignored files) or written before later edits is not believed.
set -euo pipefail
cd "$(dirname "$0")/.."
tree_hash() {  # the files of tsgen/ and templates/, as both machines have them (no caches)
  find tsgen templates -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z \
    | xargs -0 sha1sum | sha1sum | cut -c1-16
}
if [ "${1:-}" = --read ]; then
  [ -s .tsgen-commit ] || exit 0
  read -r stamp hash < .tsgen-commit
  if [ "$hash" = "$(tree_hash)" ]; then echo "$stamp"
  else echo "stamp_commit: .tsgen-commit ($stamp) does not match tsgen/ and templates/ here: not used" >&2; fi
  exit 0
fi
stamp=$(git rev-parse --short HEAD)
git diff --quiet HEAD -- tsgen templates || stamp="$stamp-dirty"
echo "$stamp $(tree_hash)" > .tsgen-commit
echo "$stamp"
