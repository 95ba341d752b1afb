#!/usr/bin/env bash
# The main job: tiny model + arithmetic data, then pretrain -> SFT on 2 FSDP2 ranks
# (local Ray cluster), then greedy eval on the held-out test split. Re-running resumes.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bash "$repo/scripts/setup_env.sh"
cd "$repo"
py="${RLSYS_VENV:-$repo/.venv}/bin/python"
start=$(date +%s)
"$py" examples/arith/prepare.py --out runs/arith
"$py" -m rlsys.run pretrain --config examples/arith/pretrain.yaml "$@"
"$py" -m rlsys.run sft --config examples/arith/sft.yaml "$@"
echo "[arith] pretrain + sft + eval took $(( $(date +%s) - start )) s"
"$py" - <<'PY'
import json
summary = json.load(open("runs/arith/sft/summary.json"))
print(f"[arith] held-out greedy exact match: {summary['eval']['accuracy']:.1%} "
      f"on {summary['eval']['num_prompts']} problems (runs/arith/sft/eval_results.jsonl)")
PY
