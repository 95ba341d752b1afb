"""Held-out evaluation: generate on a test split with vLLM and judge with a reward.

The `eval` stage, the evaluation after pretrain/SFT and RL validation all go
through `Evaluator`: the prompts through a rollout engine (a Ray actor), the
responses through the reward actors, so a reward that raises scores 0 and is
counted the same way everywhere. The `eval` stage writes
output_dir/eval_results.jsonl (one row per prompt) and eval_summary.json.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace

from rlsys.actors.cluster import ensure_ray
from rlsys.actors.phases import set_phase
from rlsys.actors.reward_pool import RewardPool
from rlsys.actors.rollout_group import RolloutGroup
from rlsys.config.rl import RewardConfig
from rlsys.config.rollout import EvalConfig, RolloutConfig, ToolsConfig
from rlsys.config.schema import EvalJobConfig
from rlsys.data.image_tokens import image_expander_of
from rlsys.data.rl import load_prompts, prompt_budget
from rlsys.data.tokenizer import load_tokenizer
from rlsys.models.vision import IMAGES_PER_PROMPT
from rlsys.rewards.loading import eval_term
from rlsys.rewards.scoring import reward_inputs
from rlsys.rollout.engine_length import check_kv_budget, run_length
from rlsys.stages.agent_setup import AgentSetup, Harness, agent_setup
from rlsys.stages.preflight import check_eval_job
from rlsys.stages.run_dir import prepare_run_dir, write_summary

log = logging.getLogger(__name__)


class Evaluator:
    def __init__(self, cfg: EvalConfig, tokenizer, seed: int, model_path: str, reward_timeout_s: float = 10.0,
                 loop: str = "single_turn", tools: list[dict] | None = None, response_tokens: int | None = None,
                 max_images: int = IMAGES_PER_PROMPT):
        """Loads and tokenises the split (for the context of the model at `model_path`, with the
        `tools` schemas in its chat prompts) and checks the reward; starts nothing. `loop`: the
        agent loop that answers each prompt; `response_tokens`: a whole response's budget;
        `max_images`: the pictures a prompt may hold in the engines that answer."""
        self.cfg, self.seed, self.loop = cfg, seed, loop
        self.response_tokens = max(response_tokens or cfg.max_new_tokens, cfg.max_new_tokens)
        self.prompts, self.stats = load_prompts(cfg.files, tokenizer, prompt_budget(model_path, self.response_tokens),
                                                cfg.limit, tools=tools,
                                                expander=image_expander_of(model_path, max_images))
        self.rewards = RewardPool(RewardConfig(terms=[eval_term(cfg.reward)], timeout_s=reward_timeout_s),
                                    role="val_reward")

    @property
    def engine_length(self) -> int | None:
        """The longest sequence the split asks of an engine (None: a harness-driven loop's, the model's context)."""
        return run_length((prompt.engine_tokens for prompt in self.prompts), self.response_tokens, self.loop)

    def check_engine(self, model_path: str, on_gpu: bool) -> None:
        """The split's own engine (the eval stage's, an SFT run's evaluation) holds one of its sequences."""
        check_kv_budget(model_path, self.engine_length, self.cfg.engine_memory_gib, "auto", on_gpu, None,
                        "eval.engine_memory_gib", "eval.max_new_tokens")

    def run(self, rollout: RolloutGroup) -> tuple[dict, list[dict]]:
        """Accuracy and reward errors on the split, and one result row per prompt."""
        prompts = [(index, prompt.ids, prompt.row) for index, prompt in enumerate(self.prompts)]
        sampling = replace(rollout.sampling(self.cfg.temperature, self.cfg.max_new_tokens),
                           max_response_tokens=self.response_tokens)
        samples, _ = rollout.rollout(prompts, self.loop, 1, sampling, self.seed)
        inputs = reward_inputs(samples, self.prompts)
        scored, metrics = self.rewards.score(inputs)
        rows = [{"prompt": self.prompts[s.prompt_index].text, "response": s.text, "ground_truth": item.ground_truth,
                 "score": result.score, "response_tokens": len(s.response_ids)}
                for s, item, result in zip(samples, inputs, scored)]
        summary = {
            "accuracy": sum(r["score"] for r in rows) / len(rows),
            "num_prompts": len(rows),
            "reward_errors": metrics["reward/errors"],
            "skipped_rows": self.stats.skipped,
            "mean_response_tokens": sum(r["response_tokens"] for r in rows) / len(rows),
        }
        return summary, rows

    def shutdown(self) -> None:
        self.rewards.shutdown()


def run_eval(cfg: EvalJobConfig) -> dict:
    check_eval_job(cfg)
    started = time.time()
    tokenizer = load_tokenizer(cfg.model.path, "model.path")
    agents = eval_agents(cfg.eval, cfg.tools)
    agents.check_template(tokenizer)
    evaluator = Evaluator(cfg.eval, tokenizer, cfg.seed, cfg.model.path, loop=evaluator_loop(cfg.eval),
                          tools=agents.schemas, response_tokens=cfg.eval.max_response_tokens)
    evaluator.check_engine(cfg.model.path, on_gpu=cfg.ray.gpus_per_worker > 0)
    prepare_run_dir(cfg, "eval")
    ensure_ray(cfg.ray)
    set_phase("eval: generate and score")
    summary = evaluate_model(cfg.model.path, evaluator, agents, cfg.output_dir, cfg.ray.cpus_per_worker,
                             cfg.ray.gpus_per_worker)
    summary = {"stage": "eval", **summary, "time_s": round(time.time() - started, 1)}
    write_summary(cfg.output_dir, summary)
    return summary


def evaluator_loop(cfg: EvalConfig) -> str:
    return cfg.agent_loop or "single_turn"


def eval_agents(cfg: EvalConfig, tools: ToolsConfig) -> AgentSetup:
    return agent_setup({"eval.agent_loop": evaluator_loop(cfg)}, tools,
                       Harness(cfg.agent_entry, cfg.agent_timeout_s, "eval.agent_entry"))


def evaluate_model(model_path: str, evaluator: Evaluator, agents: AgentSetup, output_dir: str, cpus: float,
                   gpus: float) -> dict:
    """Evaluate the model directory with an engine of its own (`cpus` CPUs, from `ray.cpus_per_worker`;
    `gpus` GPUs), its agent loop and tools, and write eval_results.jsonl and eval_summary.json to output_dir."""
    engine = RolloutConfig(num_engines=1, placement="separate", cpus_per_engine=cpus, gpus_per_engine=gpus,
                           engine_memory_gib=evaluator.cfg.engine_memory_gib, max_model_len=evaluator.engine_length)
    tools = agents.start_tools()
    rollout = None
    try:
        rollout = RolloutGroup(model_path, engine, evaluator.seed, None, cpus, loops=agents.loops, tools=agents.tools,
                               tool_client=tools.client() if tools else None, tool_schemas=agents.schemas,
                               cpus_key="ray.cpus_per_worker")
        summary, rows = evaluator.run(rollout)
    finally:
        for group in (rollout, tools):
            if group is not None:
                group.shutdown()
        evaluator.shutdown()
    summary = {"model": model_path, **summary}
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "eval_results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(output_dir, "eval_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    log.info("eval: accuracy %.4f on %d prompts (%s)", summary["accuracy"], len(rows), model_path)
    return summary
