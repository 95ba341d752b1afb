#!/usr/bin/env bash
# The test command: sets up the environment, then runs the whole suite on CPU, on as many pytest
# workers as the machine has cores (at most 2: each worker starts its own Ray cluster, and the
# suite's heaviest tests run 8 ranks and a vLLM engine). Tests that share an expensive fixture (a
# run compared against, an engine, a second Ray cluster) carry one xdist_group and run on one
# worker, so that it is built once; the longest groups start first (tests/group_order.py), single tests
# fill in. A group of
# actors that ends hands its processes to the next group of the same placement on that worker (training
# ranks, rollout engines, reward workers: `rlsys.actors.kept_actors`), so most tests start none.
#   --quick              the quick tier only (`-m quick`: unit and single-process tests, parity on 2 ranks,
#                        no fault injection), for the edit-test loop; CI runs everything
#   RLSYS_TEST_WORKERS   the number of workers (0: one process)
# The 30 slowest tests, and the start-ups (Ray clusters, actors, engines) per kind and per test, are
# listed at the end: where the suite's time goes.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup_env.sh"
cd "$repo"
tier=()
if [ "${1:-}" = "--quick" ]; then
  shift
  tier=(-m quick)
fi
exec "${RLSYS_VENV:-$repo/.venv}/bin/python" -m pytest -p no:cacheprovider \
  -n "${RLSYS_TEST_WORKERS:-auto}" --maxprocesses 2 --dist loadgroup --no-loadscope-reorder --durations=30 "${tier[@]}" "$@"
