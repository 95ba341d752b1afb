#!/usr/bin/env bash
# The whole suite from fresh clones, one after another, with the machine loaded by a busy loop on one
# core the whole time: a check that no test fails by chance on a loaded machine. Each clone sets up its
# own environment as CI does (.ci/run); a run's log and time go to <out>/run-N.log.
#   bash scripts/suite_under_load.sh [runs (default 2)] [out (default /tmp/rlsys-under-load)]
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
runs="${1:-2}"
out="${2:-/tmp/rlsys-under-load}"
mkdir -p "$out"
python3 -c "while True: pass" &
busy=$!
trap 'kill $busy 2>/dev/null' EXIT
failed=0
for n in $(seq 1 "$runs"); do
  clone="$out/clone-$n"
  rm -rf "$clone"
  git clone -q "$repo" "$clone"
  started=$(date +%s)
  (cd "$clone" && CI=true bash .ci/run) > "$out/run-$n.log" 2>&1
  code=$?
  echo "run $n: exit $code in $(( $(date +%s) - started )) s; $(grep -E '[0-9]+ (passed|failed)' "$out/run-$n.log" | tail -1)"
  [ "$code" -eq 0 ] || failed=1
done
exit "$failed"
