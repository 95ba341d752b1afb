#!/usr/bin/env bash
# The main job: tiny model + arithmetic data, then the pretrain -> SFT -> RLVR -> eval pipeline
# (pretrain and SFT on 2 FSDP2 ranks, RL on one rank beside a vLLM engine, on a local Ray
# cluster). Re-running skips finished stages and resumes an interrupted one.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bash "$repo/scripts/setup_env.sh"
cd "$repo"
py="${RLSYS_VENV:-$repo/.venv}/bin/python"
start=$(date +%s)
"$py" examples/arith/prepare.py --out runs/arith
"$py" -m rlsys.run pipeline --config examples/arith/pipeline.yaml "$@"
echo "[arith] took $(( $(date +%s) - start )) s; table: runs/arith/summary.md, report: runs/arith/report.html"
