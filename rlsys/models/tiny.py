"""Tiny-model factory: a Qwen2-architecture model (or, with experts, a Qwen3-MoE, Qwen2-MoE or
Mixtral one) with a character-level tokenizer, written as a real Hugging Face directory.

The directory loads with `transformers` (AutoModelForCausalLM / AutoTokenizer)
and with vLLM, so every stage runs on a CPU-only machine with no downloads.

    python -m rlsys.models.tiny --out runs/tiny-init
"""

from __future__ import annotations

import argparse
import string
from dataclasses import asdict, dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen2Tokenizer,
    Qwen3MoeConfig,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

PAD, EOS = "<|pad|>", "<|end|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, EOS, *ROLE_TOKENS]
CHARACTERS = string.printable[:-2]  # letters, digits, punctuation, space, \t, \n
TOOL_TOKEN = "<|tool|>"
"""The tool role's token, last in the vocabulary so that the other tokens keep their ids."""

# One special token per role keeps prompts short: <|user|>12+7=<|end|><|assistant|>. Tools given
# to the template are named in a system turn: <|system|>tools: calculator<|end|>.
CHAT_TEMPLATE = (
    "{%- if tools -%}<|system|>tools:{%- for t in tools %} {{ t['function']['name'] }}{%- endfor -%}<|end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    vocab_size: int = 128
    tie_word_embeddings: bool = False
    """Untied by default, so tensor parallelism can split the embedding and the LM head."""
    num_experts: int = 0
    """With experts, an MoE model (`moe_type`): every decoder layer's MLP is a mixture of this many experts."""
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    moe_type: str = "qwen3_moe"
    """qwen3_moe, qwen2_moe (with a shared expert as wide as one expert) or mixtral."""
    mlp_only_layers: tuple[int, ...] = ()
    """A Qwen-MoE model's layers whose MLP is dense (the others' are mixtures); a Mixtral has none."""
    reward_head: bool = False
    """A reward model: the same body with a one-logit sequence-classification head in place of the LM head."""
    sliding_window: int | None = None
    """Odd layers attend within this many positions (as Gemma's alternate layers): a Qwen2 or Qwen2-MoE model."""
    seed: int = 0


def build_tokenizer() -> Qwen2Tokenizer:
    """A real Qwen2 (byte-level BPE) tokenizer whose vocabulary is single
    characters and which has no merges: character-level, and loaded the same
    way by transformers and vLLM (both pick Qwen2Tokenizer for a qwen2 model)."""
    byte_chars = bytes_to_unicode()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in CHARACTERS:
        vocab[byte_chars[ord(char)]] = len(vocab)
    vocab[TOOL_TOKEN] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[*ROLE_TOKENS, TOOL_TOKEN],
        model_max_length=TinyModelSpec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(spec: TinyModelSpec, tokenizer: Qwen2Tokenizer):
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"vocab_size {spec.vocab_size} < tokenizer size {len(tokenizer)}")
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if spec.sliding_window:
        if spec.num_experts and spec.moe_type != "qwen2_moe":
            raise ValueError(f"sliding_window: a qwen2 or qwen2_moe model, not {spec.moe_type}")
        kinds = ["sliding_attention" if i % 2 else "full_attention" for i in range(spec.num_hidden_layers)]
        common.update(use_sliding_window=True, sliding_window=spec.sliding_window, layer_types=kinds)
    config = _moe_config(spec, common) if spec.num_experts else Qwen2Config(**common)
    torch.manual_seed(spec.seed)
    if spec.reward_head:
        config.num_labels = 1
        return AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _moe_config(spec: TinyModelSpec, common: dict):
    experts = dict(num_experts_per_tok=spec.num_experts_per_tok)
    if spec.moe_type == "mixtral":
        return MixtralConfig(**{**common, "intermediate_size": spec.moe_intermediate_size},
                             num_local_experts=spec.num_experts, **experts)
    experts.update(num_experts=spec.num_experts, moe_intermediate_size=spec.moe_intermediate_size,
                   mlp_only_layers=list(spec.mlp_only_layers))
    if spec.moe_type == "qwen2_moe":
        return Qwen2MoeConfig(**common, shared_expert_intermediate_size=spec.moe_intermediate_size, **experts)
    if spec.moe_type == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=spec.hidden_size // spec.num_attention_heads, norm_topk_prob=True,
                              **experts)
    raise ValueError(f"moe_type: {spec.moe_type!r} (qwen3_moe, qwen2_moe or mixtral)")


def write_tiny_model(out_dir: str, spec: TinyModelSpec = TinyModelSpec()) -> str:
    """Write a randomly initialised tiny model and its tokenizer to `out_dir`."""
    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer)
    if model.can_generate():
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write")
    for name, value in asdict(TinyModelSpec()).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    write_tiny_model(out, TinyModelSpec(**args))
    print(f"wrote tiny model to {out}")


if __name__ == "__main__":
    main()
