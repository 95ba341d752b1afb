"""The benchmarks' random 22.7 M-parameter Qwen2 (hidden 512, 8 layers), written where it is
missing. Light to import (no Ray, no vLLM): the attention benchmark runs it on machines without them."""

from __future__ import annotations

import os

RANDOM22M = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=512)


def ensure_random_model(path: str) -> None:
    """The vocabulary is exactly the tokenizer's. With 128 ids for 103 tokens, HF generate's
    responses averaged 84 tokens and vLLM's 72 (both stop at a sampled end token): not the
    same work. With 103 ids both generate the same number of tokens."""
    from rlsys.models.tiny import TinyModelSpec, build_tokenizer, write_tiny_model

    if not os.path.isdir(path):
        write_tiny_model(path, TinyModelSpec(**RANDOM22M, vocab_size=len(build_tokenizer())))
