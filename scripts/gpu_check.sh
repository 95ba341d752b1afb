#!/usr/bin/env bash
# Every GPU path rlsys can run on the machine it is on; prints one line per check.
#
#   bash scripts/gpu_check.sh --fetch-wheels   # here, with a package registry: packages for the GPU machine
#   bash scripts/gpu_check.sh                  # on the GPU machine (device tool: carry [".gpu_wheels"])
#
# The lent GPU machines (Python 3.12, torch, transformers) reach no package registry and lack
# pydantic, datasets, Ray and vLLM. --fetch-wheels downloads into .gpu_wheels/ (git-ignored,
# about 51 MB) the first three: wheels, and Ray as a zip without its Java jars (its wheel is
# 79 MB, over the device tool's 64 MiB carry). Versions are those that ran on an H200 on
# 2026-11-25. vLLM's CUDA wheel is hundreds of MB: the rollout engine cannot be carried.
# Always: the training engine on CUDA (nccl; fp32 and bf16 mixed precision) against one plain
# HF process, the in-place weight sync's CUDA IPC reads of a rank's shards, and the engine's
# throughput beside HF's (scripts/gpu_check.py, tests/test_weight_placement.py), and the memory one
# 0.5B-shaped rank holds through a training step (benchmarks/memory.py).
# Where Ray imports: the pretrain stage through Ray, its rank on the GPU, then resumed from its
# checkpoint. Where CUDA vLLM imports as well: a short RLVR run with a colocated engine (sleep
# mode, the weight sync) and the weight-sync benchmark on the GPU.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wheels="$repo/.gpu_wheels"
py="${PYTHON:-python3}"
cd "$repo"

if [ "${1:-}" = "--fetch-wheels" ]; then
  rm -rf "$wheels"
  fetch() {
    pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$wheels" "$@" 2>&1 \
      | grep -v "^WARNING: Location"
  }
  fetch pydantic
  fetch --no-deps datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 jsonschema==4.26.0 \
    jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 ray==2.60.0
  "$py" - "$wheels"/ray-*.whl <<'PY'
import os, sys, zipfile
wheel = sys.argv[1]
with zipfile.ZipFile(wheel) as whole, zipfile.ZipFile(wheel[:-4] + ".nojars.zip", "w") as trimmed:
    for info in whole.infolist():
        if not info.filename.startswith("ray/jars/"):
            trimmed.writestr(info, whole.read(info))
os.remove(wheel)
PY
  ls "$wheels"; du -sh "$wheels"
  exit 0
fi

if ! "$py" -c "import pydantic, datasets, ray" 2>/dev/null; then
  deps="$(mktemp -d)"
  "$py" -m pip install --quiet --no-index --no-deps --target "$deps" "$wheels"/*.whl || {
    echo "[gpu_check] packages are missing and $wheels holds no wheels for them: run --fetch-wheels first"; exit 2; }
  for zip in "$wheels"/ray-*.zip; do  # zip extraction drops the executable bits of Ray's servers
    [ -e "$zip" ] && "$py" -m zipfile -e "$zip" "$deps" && chmod -R u+x "$deps/ray/core"
  done
  export PYTHONPATH="$deps${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "[gpu_check] no nvidia-smi"
gpus="$("$py" -c "import torch; print(int(torch.cuda.is_available()))")"

status=0
"$py" scripts/gpu_check.py || status=1
"$py" -m pytest -q -p no:cacheprovider tests/test_weight_placement.py || status=1
if [ "$gpus" = 1 ]; then  # a 0.5B-shaped model (Qwen2.5-0.5B's config, random init), one rank
  "$py" benchmarks/memory.py --device cuda --layout dp_shard=1 --hidden 896 --layers 24 --heads 14 --kv-heads 2 \
    --intermediate 4864 --vocab 151936 --tied --rows 4 --seq-len 512 --steps 2 || status=1
fi

out="$(mktemp -d)"
"$py" examples/arith/prepare.py --out "$out/arith" >/dev/null
if "$py" -c "import ray" 2>/dev/null; then
  pretrain() {
    "$py" -m rlsys.run pretrain --config examples/arith/pretrain.yaml "output_dir=$out/pretrain" \
      "model.path=$out/arith/tiny-init" "data.train_files=[$out/arith/data/pretrain.jsonl]" train.save_every=100 \
      parallel.dp_shard=1 "ray.gpus_per_worker=$gpus" "tracking.backends=[console,jsonl]" eval=null \
      ray.include_dashboard=false "$@"
  }
  { pretrain train.steps=200 && pretrain train.steps=300 && "$py" - "$out/pretrain" <<'PY'; } || status=1
import json, sys
run = sys.argv[1]
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
loss = {row["step"]: row["loss"] for row in rows}
times = sorted(row["step_time_s"] for row in rows)
resumed = json.load(open(f"{run}/summary.json"))["resumed_from_step"]
ok = resumed == 200 and sorted(loss) == list(range(1, 301)) and loss[300] < loss[1] / 2
print(f"[ray pretrain] {'ok  ' if ok else 'FAIL'} 1 rank through Ray: loss {loss[1]:.3f} -> {loss[200]:.3f} at step 200, "
      f"resumed from its checkpoint there -> {loss[300]:.3f} at 300; median step {times[len(times) // 2]:.3f} s")
sys.exit(0 if ok else 1)
PY
else
  echo "[gpu_check] SKIP: ray does not import here (--fetch-wheels carries it); no run through Ray"
fi

if "$py" -c "import ray, vllm" 2>/dev/null; then
  "$py" -m rlsys.run rlvr --config examples/arith/rlvr.yaml "output_dir=$out/rlvr" "model.path=$out/arith/tiny-init" \
    "data.train_files=[$out/arith/data/rl_train.parquet]" "eval.files=[$out/arith/data/test.parquet]" \
    train.steps=5 train.save_every=0 parallel.dp_shard=1 "ray.gpus_per_worker=$gpus" ray.include_dashboard=false \
    || status=1
  "$py" benchmarks/sync.py parallel.dp_shard=1 "ray.gpus_per_worker=$gpus" || status=1
else
  echo "[gpu_check] SKIP: vllm does not import here; the rollout engine on CUDA, sleep mode and the colocated"
  echo "[gpu_check]       weight sync through Ray are not checked (CUDA vLLM does not fit the device tool's carry)"
fi
exit $status
