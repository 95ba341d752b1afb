"""What is not built yet, in one list: every refusal of a feature that is not built goes through
`not_built` with its limit here, and the README's "Not yet" row names each limit's `feature`
(tests/test_docs.py holds the three together). Refusals of input that could never work (a bad key,
a missing file, a combination with no meaning) are not limits and stay where they are raised."""

from __future__ import annotations

from dataclasses import dataclass

from rlsys.config.loader import ConfigError


@dataclass(frozen=True)
class Limit:
    feature: str
    """The words of the README's "Not yet" row that name it."""


R3_ON_CPU = Limit("routing replay from the rollout engine (R3) on CPU")
LORA_LAYOUTS = Limit("LoRA under tensor, pipeline or expert parallel")
LORA_MOE = Limit("on MoE models")
LORA_ADAPTER_SYNC_ASYNC = Limit("with adapter sync in asynchronous RL")
REWARD_MODEL_LORA = Limit("reward-model training with LoRA")
REWARD_MODEL_LAYOUTS = Limit("under pipeline or context parallel")
VISION_LANGUAGE = Limit("vision-language models in pretraining or reward-model training, under pipeline, context or "
                        "sequence parallel, with a teacher, the `openai` agent loop, engine-only processor settings")
MODEL_FAMILIES = Limit("MoE and vision-language model families other than those above")

LIMITS = {name: value for name, value in dict(globals()).items() if isinstance(value, Limit)}


def not_built(limit: Limit, message: str) -> ConfigError:
    """The one-line refusal `message` (it names the key) of a feature `limit` says is not built yet."""
    error = ConfigError(message)
    error.limit = limit
    return error
