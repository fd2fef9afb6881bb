#!/usr/bin/env bash
# The test suite on a busy host, as trainers run: `npm test` with busy loops on the cores (default two, the
# issue-12 setting; TREEPACK_LOAD_LOOPS=N for more). Arguments go to vitest (e.g. a test file). The loops are
# stopped by their own pids whatever the outcome; the exit status is npm test's.
set -euo pipefail
cd "$(dirname "$0")/.."
loops="${TREEPACK_LOAD_LOOPS:-2}"
pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap stop EXIT INT TERM
for _ in $(seq "$loops"); do
  yes >/dev/null &
  pids+=("$!")
done
echo "test-under-load: ${loops} busy loop(s) running (pids ${pids[*]})"
npm test -- "$@"
