#!/usr/bin/env bash
# The test command: sets up the environment, then runs the whole suite on CPU, on as many pytest
# workers as the machine has cores (at most 2: each worker starts its own Ray cluster, and the
# suite's heaviest tests run 8 ranks and a vLLM engine); an idle worker takes tests queued on the other.
# RLSYS_TEST_WORKERS overrides the number of workers (0: one process). The 30 slowest tests are listed
# at the end: where the suite's time goes.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup_env.sh"
cd "$repo"
exec "${RLSYS_VENV:-$repo/.venv}/bin/python" -m pytest -p no:cacheprovider \
  -n "${RLSYS_TEST_WORKERS:-auto}" --maxprocesses 2 --dist worksteal --durations=30 "$@"
