"""The model directory's tokenizer, loaded once per stage by the driver."""

from __future__ import annotations

from rlsys.config.loader import ConfigError, first_line


def load_tokenizer(path: str, key: str):
    """The tokenizer in `path` (a pad token set to EOS where it has none), or a ConfigError
    naming `key`."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:  # missing or broken tokenizer files
        raise ConfigError(f"{key}: the tokenizer in {path} cannot be loaded: {first_line(err)}") from None
    if len(tokenizer) == 0:
        raise ConfigError(f"{key}: the tokenizer in {path} has an empty vocabulary")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
