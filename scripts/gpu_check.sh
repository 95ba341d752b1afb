#!/usr/bin/env bash
# Every GPU path rlsys can run on the machine it is on; prints one line per check.
#
#   bash scripts/gpu_check.sh --fetch-wheels   # here, with a package registry: wheels for the GPU machine
#   bash scripts/gpu_check.sh                  # on the GPU machine (device tool: carry [".gpu_wheels"])
#
# The lent GPU machines (Python 3.12, torch, transformers) have no package registry and lack
# pydantic, which rlsys's configs need: --fetch-wheels downloads it into .gpu_wheels/
# (git-ignored), and the check installs from there into a temporary directory.
# Always: the training engine on CUDA (nccl; fp32 and bf16 mixed precision) against one plain
# HF process, and its throughput beside HF's (scripts/gpu_check.py).
# Where Ray and CUDA vLLM import as well: a short RLVR run with a colocated engine
# (sleep mode, the weight sync) and the weight-sync benchmark on the GPU.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wheels="$repo/.gpu_wheels"
py="${PYTHON:-python3}"
cd "$repo"

if [ "${1:-}" = "--fetch-wheels" ]; then
  rm -rf "$wheels"
  pip download --quiet --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    -d "$wheels" pydantic 2>&1 | grep -v "^WARNING: Location"
  ls "$wheels"
  exit 0
fi

if ! "$py" -c "import pydantic" 2>/dev/null; then
  deps="$(mktemp -d)"
  "$py" -m pip install --quiet --no-index --no-deps --target "$deps" "$wheels"/*.whl || {
    echo "[gpu_check] pydantic is missing and $wheels holds no wheels for it: run --fetch-wheels first"; exit 2; }
  export PYTHONPATH="$deps${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "[gpu_check] no nvidia-smi"

status=0
"$py" scripts/gpu_check.py || status=1

if "$py" -c "import ray, vllm" 2>/dev/null; then
  out="$(mktemp -d)"
  "$py" examples/arith/prepare.py --out "$out/arith" >/dev/null
  "$py" -m rlsys.run rlvr --config examples/arith/rlvr.yaml "output_dir=$out/rlvr" "model.path=$out/arith/tiny-init" \
    "data.train_files=[$out/arith/data/rl_train.parquet]" "eval.files=[$out/arith/data/test.parquet]" \
    train.steps=5 train.save_every=0 parallel.dp_shard=1 ray.gpus_per_worker=1 ray.include_dashboard=false \
    || status=1
  "$py" benchmarks/sync.py parallel.dp_shard=1 ray.gpus_per_worker=1 || status=1
else
  echo "[gpu_check] SKIP: ray or vllm does not import here; the rollout engine on CUDA, sleep mode and the"
  echo "[gpu_check]       colocated weight sync are not checked (neither fits the device tool's 64 MiB carry)"
fi
exit $status
