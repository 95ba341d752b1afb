#!/usr/bin/env bash
# The test command: sets up the environment, then runs the whole suite on CPU.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup_env.sh"
cd "$repo"
exec "${RLSYS_VENV:-$repo/.venv}/bin/python" -m pytest -p no:cacheprovider "$@"
