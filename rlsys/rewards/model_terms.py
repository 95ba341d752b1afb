"""What a model-served reward term sees and how its output becomes a score, pure: the prompt and
response rendered for a reward model, a judge's request from its template, and the parser that
reads a judge's verdict. The engines that serve the models live in `rlsys.actors.served_models`."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlsys.config.loader import ConfigError
from rlsys.config.model import ModelConfig
from rlsys.config.rl import JudgeConfig, RewardTerm
from rlsys.data.examples import conversation_text
from rlsys.models.directory import check_model_dir
from rlsys.user_code import load_function, split_entry

TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")


@dataclass(frozen=True)
class Exchange:
    """One scored response with the context a model needs: the prompt's chat messages (None
    when the prompt was a plain string), the prompt as the policy saw it, and the response."""

    messages: tuple[dict, ...] | None
    prompt_text: str
    response: str
    ground_truth: Any = None


def exchanges(trajectories: list, prompts: list) -> list[Exchange]:
    """One exchange per trajectory (`Trajectory`), with its prompt (`Prompt`)."""
    return [Exchange(tuple(p.messages) if p.messages is not None else None, p.text, t.text, p.ground_truth)
            for t in trajectories for p in (prompts[t.prompt_index],)]


def reward_model_text(tokenizer, exchange: Exchange) -> str:
    """The conversation as the reward model reads it (`conversation_text`: its own chat template,
    else the policy's prompt text followed by the response)."""
    messages = list(exchange.messages) if exchange.messages is not None else None
    return conversation_text(tokenizer, messages, exchange.prompt_text, exchange.response)


def read_template(path: str, key: str) -> str:
    """A judge's template, checked for its fields; a ConfigError naming `key` otherwise."""
    try:
        template = open(path).read()
    except OSError as err:
        raise ConfigError(f"{key}: cannot read {path}: {err.strerror}") from None
    try:
        template.format(**dict.fromkeys(TEMPLATE_FIELDS, ""))
    except (KeyError, IndexError, ValueError) as err:
        raise ConfigError(f"{key}: {path}: fields are {', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)} "
                          f"(double other braces): {type(err).__name__}: {err}") from None
    return template


def judge_request(template: str, exchange: Exchange) -> str:
    """The judge's user message for one response."""
    prompt = exchange.messages[-1]["content"] if exchange.messages else exchange.prompt_text
    return template.format(prompt=prompt, response=exchange.response, ground_truth=exchange.ground_truth)


class VerdictError(ValueError):
    """A judge's verdict that gives no score."""


def verdict_parser(judge: JudgeConfig, key: str) -> Callable[[str], float]:
    """The judge's parser: a user function (`file.py:function`) or a regular expression."""
    if judge.parse.endswith(".py") or ".py:" in judge.parse:
        fn, _ = load_function(*split_entry(judge.parse, "parse"), f"{key}.parse")
        return fn
    try:
        pattern = re.compile(judge.parse, re.DOTALL)
    except re.error as err:
        raise ConfigError(f"{key}.parse: not a regular expression: {err}") from None
    return lambda verdict: _match_score(pattern, verdict)


def _match_score(pattern: re.Pattern, verdict: str) -> float:
    match = pattern.search(verdict)
    if match is None:
        raise VerdictError(f"no match for {pattern.pattern!r}")
    return float(match.group(1) if match.groups() else match.group(0))


def parse_verdict(parser: Callable[[str], float], verdict: str) -> float:
    """The verdict's score; VerdictError naming the verdict when it has none."""
    try:
        score = float(parser(verdict))
    except Exception as err:  # the user's parser failing is one counted failure
        raise VerdictError(f"judge verdict {verdict[:200]!r}: {type(err).__name__}: {err}") from None
    if not math.isfinite(score):
        raise VerdictError(f"judge verdict {verdict[:200]!r} parsed to {score}")
    return score


def normalized(scores: list[float], how: str) -> list[float]:
    """A model term's scores as the term asks: as is, through a sigmoid, or standardised over the batch."""
    if how == "sigmoid":
        return [0.5 * (1 + math.tanh(s / 2)) for s in scores]  # the sigmoid, without overflow
    if how == "batch" and len(scores) > 1:
        mean = sum(scores) / len(scores)
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (len(scores) - 1))
        return [(s - mean) / (std + 1e-6) for s in scores]
    return list(scores)


def model_label(term: RewardTerm) -> str:
    """reward/<label> for a model term: its name, else the model directory's name."""
    return term.name or term.model.rstrip("/").rsplit("/", 1)[-1]


def check_model_term(term: RewardTerm, key: str) -> None:
    """A reward term's model: a one-logit sequence-classification (reward) model, or with `judge` a
    causal LM; the judge's template and parser readable."""
    if term.path:
        raise ConfigError(f"{key}: give a model or a path, not both")
    if term.model.startswith("stage:"):
        raise ConfigError(f"{key}.model: {term.model!r} names a pipeline's rm stage; only a pipeline's rlvr stage "
                          "can use it")
    config = check_model_dir(ModelConfig(path=term.model), f"{key}.model")
    kinds = getattr(config, "architectures", None) or ["?"]
    if term.judge is not None:
        if not kinds[0].endswith("ForCausalLM"):
            raise ConfigError(f"{key}.model: a judge generates, so it must be a causal LM; {term.model} is {kinds[0]}")
        read_template(term.judge.template, f"{key}.judge.template")
        verdict_parser(term.judge, f"{key}.judge")
        return
    if not kinds[0].endswith(("ForSequenceClassification", "ForRewardModel")) or config.num_labels != 1:
        raise ConfigError(f"{key}.model: a reward model has a one-logit sequence-classification head; {term.model} "
                          f"is {kinds[0]} with {config.num_labels} labels (for a generative judge add {key}.judge)")
