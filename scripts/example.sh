#!/usr/bin/env bash
# Run one example end to end: set up the environment, write the example's model and data
# (examples/<name>/prepare.py), run its pipeline (examples/<name>/pipeline.yaml) under runs/<name>.
#   bash scripts/example.sh <name> [dotted.key=value overrides of the pipeline]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
name="$1"
shift
bash "$repo/scripts/setup_env.sh"
cd "$repo"
py="${RLSYS_VENV:-$repo/.venv}/bin/python"
start=$(date +%s)
"$py" "examples/$name/prepare.py" --out "runs/$name"
"$py" -m rlsys.run pipeline --config "examples/$name/pipeline.yaml" "$@"
echo "[$name] took $(( $(date +%s) - start )) s; table: runs/$name/summary.md, report: runs/$name/report.html"
