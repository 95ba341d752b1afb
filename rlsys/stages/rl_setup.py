"""What an RL stage sets up before its actors start: the prompts and the validation split,
loaded and checked, the rollout engines' length and every engine's KV budget (all before Ray
starts, so that bad input costs no start-up), and the shape of the job's actors."""

from __future__ import annotations

from dataclasses import dataclass

from rlsys.agents.context_hooks import resolve_context_hook
from rlsys.config.loader import ConfigError
from rlsys.config.rl import DistillConfig
from rlsys.config.rollout import RolloutConfig
from rlsys.config.schema import RLJobConfig
from rlsys.data.files import DataError
from rlsys.data.image_tokens import ImageExpander, image_expander_of
from rlsys.data.rl import Prompt, load_prompts, prompt_budget
from rlsys.data.tokenizer import load_tokenizer
from rlsys.models.vision import images_per_prompt
from rlsys.rollout.engine_length import check_kv_budget, run_length
from rlsys.stages.agent_setup import AgentSetup, Harness, agent_setup
from rlsys.stages.eval import Evaluator


@dataclass
class RLData:
    """The prompts, tokenised, and the validation split: loaded and checked before Ray starts,
    and kept across restarts."""

    tokenizer: object
    prompts: list[Prompt]
    evaluator: Evaluator | None
    agents: AgentSetup
    expander: ImageExpander | None = None
    """A vision-language model's processor: the trainer's rows carry the prompts' pictures expanded."""
    engine_length: int | None = None
    """The rollout engines' max_model_len (None: the model's context)."""


def load_rl_data(cfg: RLJobConfig) -> RLData:
    tokenizer = load_tokenizer(cfg.model.path, "model.path")
    agents = agent_setup(_loops(cfg), cfg.tools,
                         Harness(cfg.rollout.agent_entry, cfg.rollout.agent_timeout_s, "rollout.agent_entry"),
                         resolve_context_hook(cfg.rollout.context_hook, cfg.rollout.context_budget))
    agents.check_template(tokenizer)
    max_images = images_per_prompt(cfg.rollout.engine_kwargs)
    expander = image_expander_of(cfg.model.path, max_images)
    budget = prompt_budget(cfg.model.path, cfg.rollout.response_budget)
    prompts, _ = load_prompts(cfg.data.train_files, tokenizer, budget, tools=agents.schemas, expander=expander)
    if len(prompts) < cfg.train.prompts_per_step:
        raise DataError(f"data.train_files: {len(prompts)} prompts cannot fill train.prompts_per_step "
                        f"({cfg.train.prompts_per_step})")
    evaluator = Evaluator(cfg.eval, tokenizer, cfg.seed, cfg.model.path, cfg.reward.timeout_s,
                          loop=cfg.eval.agent_loop or cfg.rollout.agent_loop, tools=agents.schemas,
                          response_tokens=cfg.eval.max_response_tokens or cfg.rollout.response_budget,
                          max_images=max_images) if cfg.eval else None
    length = _engine_length(cfg.rollout, prompts, evaluator)
    shortened_by = "rollout.max_model_len" if cfg.rollout.max_model_len or not length else "rollout.max_response_tokens"
    check_kv_budget(cfg.model.path, length, cfg.rollout.engine_memory_gib, cfg.rollout.dtype,
                    cfg.ray.gpus_per_worker > 0 or cfg.rollout.gpus_per_engine > 0, cfg.rollout.block_size,
                    "rollout.engine_memory_gib", shortened_by, cfg.rollout.tensor_parallel_size)
    _check_served_budgets(cfg, length)
    return RLData(tokenizer, prompts, evaluator, agents, expander, length)


def _check_served_budgets(cfg: RLJobConfig, rollout_length: int | None) -> None:
    """Each served model's engine holds one of its sequences: a teacher's are the rollout's (prompt and
    response, its length by default); a reward model's or a judge's its own rendering of them, the
    model's context unless its serving.max_model_len says."""
    on_gpu = cfg.ray.gpus_per_worker > 0
    served = [(term.model, term.serving, f"reward.terms[{i}].serving", term.serving.max_model_len)
              for i, term in enumerate(cfg.reward.terms) if term.model]
    distill = cfg.algorithm.distill
    if distill is not None and distill.source == "engine":
        served.append((distill.teacher, distill.serving, "algorithm.distill.serving",
                       teacher_length(distill, rollout_length)))
    for model, serving, key, length in served:
        check_kv_budget(model, length, serving.engine_memory_gib, serving.dtype, on_gpu or serving.gpus_per_engine > 0,
                        None, f"{key}.engine_memory_gib", f"{key}.max_model_len", serving.tensor_parallel_size)


def teacher_length(distill: DistillConfig, rollout_length: int | None) -> int | None:
    """The teacher's engines take the policy's sequences, and sample one token after each (its
    prompt log-probs come with a generation): the rollout engines' length and one, unless set."""
    if distill.serving.max_model_len or rollout_length is None:
        return distill.serving.max_model_len
    return rollout_length + 1


def _engine_length(rollout: RolloutConfig, prompts: list[Prompt], evaluator: Evaluator | None) -> int | None:
    """The rollout engines' length: as configured, else the longest sequence of the training prompts
    and of the validation split, which the same engines answer. A configured length that cannot hold
    the longest prompt and a whole response is refused (vLLM would reject its requests)."""
    lengths = [run_length((p.engine_tokens for p in prompts), rollout.response_budget, rollout.agent_loop)]
    if evaluator is not None:
        lengths.append(evaluator.engine_length)
    longest = None if None in lengths else max(lengths)
    configured = rollout.engine_kwargs.get("max_model_len") or rollout.max_model_len
    if not configured:
        return longest
    prompt = max(p.engine_tokens for p in [*prompts, *(evaluator.prompts if evaluator else [])])
    needed = longest if longest is not None else prompt + 1
    if configured < needed:
        key = "rollout.engine_kwargs.max_model_len" if "max_model_len" in rollout.engine_kwargs else \
            "rollout.max_model_len"
        response = "a whole response (rollout.max_response_tokens, else max_new_tokens)" if longest else "a token"
        raise ConfigError(f"{key}: {configured} tokens cannot hold the longest prompt ({prompt} tokens, training or "
                          f"validation) and {response}: {needed} tokens; set at least {needed}, or leave it empty "
                          f"(the run's longest sequence)")
    return configured


def _loops(cfg: RLJobConfig) -> dict[str, str]:
    """The agent loops an RL stage's engines run (the rollout's, validation's), by config key."""
    loops = {"rollout.agent_loop": cfg.rollout.agent_loop}
    if cfg.eval and cfg.eval.agent_loop:
        loops["eval.agent_loop"] = cfg.eval.agent_loop
    return loops


def teacher_in_trainer(distill: DistillConfig | None) -> str | None:
    """The teacher's directory when the training group holds it (`algorithm.distill.source: trainer`)."""
    return distill.teacher if distill is not None and distill.source == "trainer" else None


def colocated_engines(cfg: RLJobConfig) -> int:
    """Engines of each kind that share a training rank's devices: the rollout's, each model term's,
    the teacher's."""
    return sum(engines.placement == "colocated" for _, engines in cfg.engine_groups())
