# Sourced by the device-run scripts after tools/device_env.sh: timed steps with logs.
#   step NAME TIMEOUT CMD...   run CMD with its output in $LOG/NAME.log (every character but letters,
#                              digits, '.', '-' -> _: the device tool brings back plain names only); PASS when it
#                              exits 0; no step starts once the script has used BUDGET seconds
#   summary TITLE FILE         print the PASS/FAIL table (also to $OUT/FILE); returns non-zero on a failure
# The caller sets LOG (a folder) and may set BUDGET (seconds, default 285). STEPS (an extended regular
# expression, optional) runs only the steps whose names match it; the others are listed as not selected.
BUDGET=${BUDGET:-285}
RESULTS=()
FAILS=0
mkdir -p "$LOG"

step() {
  local name=$1 limit=$2; shift 2
  local safe; safe=$(printf '%s' "$name" | tr -c 'A-Za-z0-9.-' _)
  local log="$LOG/$safe.log" left=$((BUDGET - SECONDS)) t0=$SECONDS rc
  if [ -n "${STEPS:-}" ] && ! printf '%s' "$name" | grep -Eq -- "$STEPS"; then
    RESULTS+=("$(printf '%-48s not selected (STEPS)' "$name")"); return 0
  fi
  if [ "$left" -lt 10 ]; then RESULTS+=("$(printf '%-48s SKIP (out of time)' "$name")"); FAILS=$((FAILS + 1)); return 1; fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout -k 30 "$limit" "$@" > "$log" 2>&1  # -k 30: a stopped suite writes what it finished (SIGTERM)
  rc=$?
  if [ $rc -eq 0 ]; then
    RESULTS+=("$(printf '%-48s PASS  %3d s' "$name" $((SECONDS - t0)))")
  else
    RESULTS+=("$(printf '%-48s FAIL  %3d s  rc=%d  %s' "$name" $((SECONDS - t0)) $rc "$log")")
    FAILS=$((FAILS + 1))
    echo "--- $name (rc=$rc), last lines of $log:"; tail -8 "$log"
  fi
  return $rc
}

summary() {
  echo
  echo "== $1 ($(date -u +%F), ${SECONDS} s): $FAILS failed"
  printf '%s\n' "${RESULTS[@]}" | tee "$OUT/$2"
  [ $FAILS -eq 0 ]
}
