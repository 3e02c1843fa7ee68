# Sourced by the device scripts. step NAME SECONDS COMMAND...: runs COMMAND under `timeout`, its output in
# $OUT/NAME.log, the limit shrunk to what is left of $DEADLINE seconds (when set; counted by bash's $SECONDS,
# from the script's start); prints the log's tail and returns COMMAND's exit status (124: timed out or skipped).
step() {
  local name=$1 limit=$2; shift 2
  if [ -n "${DEADLINE:-}" ]; then
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 20 ]; then echo "=== $name: skipped, ${left}s left of DEADLINE ==="; return 124; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "=== $name (limit ${limit}s) ==="
  local t0=$SECONDS
  timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1  # -k: the bench traps SIGTERM (rows kept); a hung kernel does not return to Python
  local rc=$?
  tail -25 "$OUT/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0)) s ==="
  return $rc
}
