"""`eval`: generate on a test split with vLLM and judge with a reward.

Writes output_dir/eval_results.jsonl (one row per prompt) and returns the
summary that also goes to output_dir/eval_summary.json.
"""

from __future__ import annotations

import json
import logging
import os
import time

from transformers import AutoTokenizer

from rlsys.config.checks import check_eval_job
from rlsys.config.schema import EvalConfig, EvalJobConfig
from rlsys.data.rl import load_prompts
from rlsys.rewards import get_reward, score_of
from rlsys.rollout.vllm_engine import create_llm
from rlsys.trainers.run_dir import prepare_run_dir, write_summary

log = logging.getLogger(__name__)


def run_eval(cfg: EvalJobConfig) -> dict:
    check_eval_job(cfg)
    started = time.time()
    prepare_run_dir(cfg, "eval")
    summary = evaluate_model(cfg.model.path, cfg.eval, cfg.output_dir, cfg.seed)
    summary = {"stage": "eval", **summary, "time_s": round(time.time() - started, 1)}
    write_summary(cfg.output_dir, summary)
    return summary


def evaluate_model(model_path: str, cfg: EvalConfig, output_dir: str, seed: int = 0) -> dict:
    from vllm import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts, stats = load_prompts(cfg.files, tokenizer, cfg.limit)
    reward = get_reward(cfg.reward)
    llm = create_llm(model_path, cfg.engine_memory_gib, seed)
    params = SamplingParams(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=seed)
    outputs = llm.generate([p.text for p in prompts], params, use_tqdm=False)
    rows = []
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        score = score_of(reward(prompt.data_source, completion.text, prompt.ground_truth, prompt.extra_info))
        rows.append({"prompt": prompt.text, "response": completion.text, "ground_truth": prompt.ground_truth,
                     "score": score, "response_tokens": len(completion.token_ids)})
    del llm
    summary = {
        "model": model_path,
        "accuracy": sum(r["score"] for r in rows) / len(rows),
        "num_prompts": len(rows),
        "skipped_rows": stats.skipped,
        "mean_response_tokens": sum(r["response_tokens"] for r in rows) / len(rows),
    }
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "eval_results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(output_dir, "eval_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    log.info("eval: accuracy %.4f on %d prompts (%s)", summary["accuracy"], len(rows), model_path)
    return summary
