"""A Hugging Face model directory as a stage reads it: a config transformers reads and rlsys can
train, weights, tokenizer files. Checked before Ray starts; a failure is a ConfigError naming the key."""

from __future__ import annotations

import glob
import os

from rlsys.config.limits import MODEL_FAMILIES, not_built
from rlsys.config.loader import ConfigError, first_line
from rlsys.config.model import ModelConfig
from rlsys.models.moe import moe_family

_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def read_model_config(path: str, key: str):
    """The config of the model directory `path`, which transformers reads and rlsys can train."""
    from transformers import AutoConfig

    if not path:
        raise ConfigError(f"{key}: is required")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{key}: not a Hugging Face model directory (no config.json): {path}")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as err:  # transformers raises several types for unreadable configs
        raise ConfigError(f"{key}: {path}/config.json cannot be read by transformers: {first_line(err)}") from None
    try:
        moe_family(config)
    except ValueError as err:  # an MoE model of another family
        raise not_built(MODEL_FAMILIES, f"{key}: {err}") from None
    return config


def check_model_dir(model: ModelConfig, key: str):
    """A Hugging Face causal-LM directory: a config transformers reads, weights, tokenizer files.
    Returns the model's config."""
    config = read_model_config(model.path, key)
    if not model.random_init and not any(glob.glob(os.path.join(model.path, pattern)) for pattern in _WEIGHT_FILES):
        raise ConfigError(f"{key}: no weights in {model.path} (expected *.safetensors or pytorch_model*.bin)")
    if not any(os.path.isfile(os.path.join(model.path, name)) for name in _TOKENIZER_FILES):
        raise ConfigError(f"{key}: no tokenizer files in {model.path} (expected one of {', '.join(_TOKENIZER_FILES)})")
    return config
