"""Frozen models served beside the policy: vLLM engines in Ray actors that score responses with a
reward model, write a judge's verdicts, or give a teacher's log-prob of every response token.

A `ServedModelGroup` is started with the run when a config names a model (a reward term's
`model`, `algorithm.distill.teacher`), placed as the rollout engines are (`place_engines`), and
shut down with the run; a dead engine is replaced and its share of the call sent again, as a
rollout engine is (`ActorGroup.wait_replacing`). Where actors are kept between groups
(`kept_actors`), the next group of the same role and placement builds its engines in these processes.
Each call's items are split across the engines in contiguous shares."""

from __future__ import annotations

import ray

from rlsys.actors.cluster import actor_name, spawn
from rlsys.actors.engine_placement import engine_keep_key, place_engines
from rlsys.actors.failures import CallLimit
from rlsys.actors.group import ENGINE_STOP_S, ActorGroup, Call, Method, contiguous_shares
from rlsys.actors.kept_actors import BuiltInPlace
from rlsys.algorithms.distill import TeacherTokens
from rlsys.config.rollout import ServingConfig
from rlsys.console import StartupClock, record_startup, redirect_actor_output
from rlsys.rewards.model_terms import Exchange, reward_model_text
from rlsys.rollout.vllm_engine import create_served_llm, free_stopped_engine, set_engine_threads, stop_engine
from rlsys.seeds import engine_seed


class ServedModelWorker(BuiltInPlace):
    def __init__(self, model_path: str, cfg: ServingConfig, seed: int, num_threads: int, pooling: bool):
        """`pooling`: a reward model (vLLM's pooling runner); else a causal LM."""
        startup = StartupClock()
        redirect_actor_output()
        self._build(startup, False, model_path, cfg, seed, num_threads, pooling)

    def _build(self, startup: StartupClock, reused: bool, model_path: str, cfg: ServingConfig, seed: int,
               num_threads: int, pooling: bool) -> None:
        set_engine_threads(num_threads, cfg.tensor_parallel_size)
        self.llm = create_served_llm(model_path, cfg, seed, pooling)
        self.tokenizer = self.llm.get_tokenizer()
        record_startup("served", startup, reused)

    def release(self) -> bool:
        """Stop the engine and drop it, keeping the process and its imports for the next group of this
        role (`reuse`; `rlsys.actors.kept_actors`). Calls run one at a time: none is in flight."""
        self.shutdown()
        self.llm = self.tokenizer = None
        free_stopped_engine()
        return True

    def reward_scores(self, exchanges: list[Exchange]) -> list[float]:
        """The reward model's logit for each exchange, rendered as it reads conversations
        (`reward_model_text`) and tokenised without added special tokens (the text has them)."""
        from vllm import PoolingParams, TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=self._ids(reward_model_text(self.tokenizer, e))) for e in exchanges]
        outputs = self.llm.classify(prompts, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        return [float(out.outputs.probs[0]) for out in outputs]

    def verdicts(self, requests: list[str], max_new_tokens: int, temperature: float, seed: int) -> list[str]:
        """The judge's reply to each request (a user message, in its chat template when it has one)."""
        from vllm import SamplingParams, TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=self._ids(self._user_turn(r))) for r in requests]
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
                  for i in range(len(requests))]
        return [out.outputs[0].text for out in self.llm.generate(prompts, params, use_tqdm=False)]

    def token_logprobs(self, sequences: list[tuple[list[int], int]], top_k: int = 0) -> list[TeacherTokens]:
        """For each (token ids, start), the model's log-prob of every token from `start` on, each
        given the tokens before it, and with `top_k` its k most likely tokens there and their
        log-probs (vLLM's prompt log-probs: one forward, nothing sampled that counts; flat and not
        detokenised, which keeps the per-token Python work small)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=top_k, temperature=1.0, detokenize=False,
                                flat_logprobs=True)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in sequences], params,
                                    use_tqdm=False)
        return [_prompt_token_logprobs(out.prompt_logprobs, ids, start, top_k)
                for (ids, start), out in zip(sequences, outputs)]

    def _user_turn(self, text: str) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return text

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def shutdown(self) -> None:
        stop_engine(self.llm)


def _prompt_token_logprobs(flat, ids: list[int], start: int, top_k: int) -> TeacherTokens:
    """The log-prob of each prompt token from `start` on, and its position's top-k tokens, out of
    vLLM's FlatLogprobs: a position holds its own token, then the k most likely in rank order
    (the first position holds none)."""
    tokens = TeacherTokens([])
    for position in range(start, len(ids)):
        first = flat.start_indices[position]
        if flat.token_ids[first] != ids[position] or flat.end_indices[position] - first != 1 + top_k:
            raise RuntimeError(f"prompt log-probs out of step with the tokens at position {position}")
        tokens.sampled.append(flat.logprobs[first])
        if top_k:
            tokens.top_ids.append(flat.token_ids[first + 1:first + 1 + top_k])
            tokens.top_logprobs.append(flat.logprobs[first + 1:first + 1 + top_k])
    return tokens


class ServedModelGroup(ActorGroup[ServedModelWorker]):
    stop_timeout_s = ENGINE_STOP_S

    def __init__(self, role: str, model_path: str, cfg: ServingConfig, seed: int, key: str, pooling: bool = False,
                 train_placement=None, train_cpus: float = 1.0, gpu_share: float = 0.0):
        """Engines rlsys/<role>/<i> serving `model_path`; `key` is the config key of their serving settings."""
        super().__init__([actor_name(role, i) for i in range(cfg.num_engines)])
        kept = self.take_kept(role, engine_keep_key(cfg, train_placement, gpu_share))
        if not kept:
            self.placement = place_engines(cfg, train_placement, train_cpus, gpu_share, f"{role} engines",
                                           f"{key}.cpus_per_engine")
        self.role, self.model_path, self.cfg, self.seed, self.pooling = role, model_path, cfg, seed, pooling
        try:
            if kept:
                self.reuse_kept(lambda i: (model_path, cfg, engine_seed(seed, i), self.placement.threads, pooling))
            else:
                self.start_engines(model_path)
            self.call_limit = CallLimit(cfg.timeout_s, f"{key}.timeout_s")  # for calls, not for starting
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, index: int):
        seat = self.placement.seat(index)
        return spawn(ray.remote(ServedModelWorker), self.role, index, self.model_path, self.cfg,
                     engine_seed(self.seed, index), self.placement.threads, self.pooling, env=seat.env,
                     num_cpus=seat.num_cpus, num_gpus=seat.num_gpus, scheduling_strategy=seat.strategy)

    def submit_split(self, method: Method, items: list, *args) -> list[Call]:
        """Start `method` on contiguous shares of `items`, one per engine; `gather` joins the results."""
        shares = contiguous_shares(items, len(self.actors))
        return [self.submit_call(i, method, share, *args) for i, share in enumerate(shares) if share]

    def gather(self, pending: list[Call]) -> list:
        """The results of `submit_split`, in item order; an engine that died is replaced and its share
        sent again."""
        return [value for share in self.wait_replacing(pending) for value in share]

