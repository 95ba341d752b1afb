"""The Hugging Face directory a stage exports (a collective of the training ranks): the full model
under the names on disk `save_pretrained` writes (`rlsys.models.moe` for MoE experts), in the
model's own dtype (`model.export_dtype`), in safetensors shards of at most 5 GB with their index as
the Hub's tools expect (a model of one shard is `model.safetensors`), with its config, tokenizer,
chat template, generation config and a vision-language model's processor, and a LoRA run's adapter
beside it. Each pipeline stage's writer holds at most one shard while it writes; every file is
readable as the user's umask says (safetensors itself writes 0600)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from rlsys.config.model import ModelConfig
from rlsys.models import lora
from rlsys.models.moe import moe_family
from rlsys.models.vision import checkpoint_name
from rlsys.trainer.weights import RankWeights

MAX_SHARD_BYTES = 5 * 10**9
"""The Hub's shard size (`save_pretrained`'s max_shard_size="5GB")."""
_PART = re.compile(r"part-(\d+)-(\d+)\.safetensors")
_WEIGHTS = re.compile(r"(model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|part-\d+-\d+\.safetensors)")
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.jinja")


def export_hf(weights: RankWeights, model_cfg: ModelConfig, out_dir: str, pp_rank: int, pp: int,
              writes_stage: bool, writes_config: bool, reward_head: bool = False) -> None:
    """Write the directory (every rank calls this: the full tensors are gathered). Each pipeline
    stage's writer (`writes_stage`) writes that stage's shards; the config writer then names them
    and writes the index and the metadata. `reward_head`: the one-output head is a reward model's,
    written as a `*ForSequenceClassification` model's `score` with one label."""
    os.makedirs(out_dir, exist_ok=True)
    if writes_config:  # an earlier export's shards, which this one's may not all replace
        for name in os.listdir(out_dir):
            if _WEIGHTS.fullmatch(name):
                os.remove(os.path.join(out_dir, name))
    dist.barrier()
    config = weights.parts[0].config
    dtype = export_dtype(model_cfg)
    family = moe_family(config)
    adapters: dict[str, torch.Tensor] = {}
    named = weights.full_tensors(list(weights.parameter_nbytes()))
    if model_cfg.lora.rank:
        named = lora.merged(_keep_adapters(named, adapters), model_cfg.lora)
    shards = StageShards(out_dir, pp_rank, dtype) if writes_stage else None
    for name, tensor in named:
        if reward_head and name == "lm_head.weight":
            name = "score.weight"
        name = checkpoint_name(name, config.model_type)
        if shards is not None:
            for disk_name, disk_tensor in family.to_disk(name, tensor) if family else [(name, tensor)]:
                shards.add(disk_name, disk_tensor)
    if shards is not None:
        shards.close()
        if adapters:  # the peft adapter, beside the model it is merged into
            adapter_dir = os.path.join(out_dir, "adapter")
            lora.write_adapter(adapter_dir, adapters, model_cfg.lora, model_cfg.path)
            for name in os.listdir(adapter_dir):
                readable(os.path.join(adapter_dir, name))
    del adapters, shards
    dist.barrier()
    if writes_config:
        name_shards(out_dir)
        _write_hf_metadata(model_cfg.path, out_dir, dtype, reward_head)
    dist.barrier()


def export_dtype(model_cfg: ModelConfig) -> torch.dtype:
    """`model.export_dtype`; auto: the dtype the model's own config.json names (a Hub model's bf16),
    else float32."""
    if model_cfg.export_dtype != "auto":
        return getattr(torch, model_cfg.export_dtype)
    named = AutoConfig.from_pretrained(model_cfg.path).dtype
    named = getattr(torch, named, None) if isinstance(named, str) else named
    return named if isinstance(named, torch.dtype) and named.is_floating_point else torch.float32


class StageShards:
    """One pipeline stage's tensors, written as shards of at most MAX_SHARD_BYTES as they fill, named
    `part-<stage>-<k>.safetensors` until `name_shards` numbers them all."""

    def __init__(self, out_dir: str, stage: int, dtype: torch.dtype, max_bytes: int = MAX_SHARD_BYTES):
        self.out_dir, self.stage, self.dtype, self.max_bytes = out_dir, stage, dtype, max_bytes
        self.tensors: dict[str, torch.Tensor] = {}
        self.nbytes = self.written = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        # a copy of its own: safetensors stores no tensor that shares memory (an MoE expert's view)
        tensor = tensor.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.tensors and self.nbytes + size > self.max_bytes:
            self.flush()
        self.tensors[name] = tensor
        self.nbytes += size

    def flush(self) -> None:
        path = os.path.join(self.out_dir, f"part-{self.stage}-{self.written}.safetensors")
        save_file(self.tensors, path, metadata={"format": "pt"})
        readable(path)
        self.tensors, self.nbytes, self.written = {}, 0, self.written + 1

    def close(self) -> None:
        if self.tensors or not self.written:
            self.flush()


def name_shards(out_dir: str) -> None:
    """Number the stages' shards in order (`model-00001-of-00003.safetensors`, ...) and write their
    index; a single shard is `model.safetensors`, without one."""
    parts = sorted((f for f in os.listdir(out_dir) if _PART.fullmatch(f)),
                   key=lambda f: tuple(int(n) for n in _PART.fullmatch(f).groups()))
    if len(parts) == 1:
        os.replace(os.path.join(out_dir, parts[0]), os.path.join(out_dir, "model.safetensors"))
        return
    weight_map, total = {}, 0
    for i, part in enumerate(parts):
        shard = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(os.path.join(out_dir, part), os.path.join(out_dir, shard))
        with safe_open(os.path.join(out_dir, shard), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = shard
                piece = f.get_slice(key)
                total += math.prod(piece.get_shape()) * _element_size(piece.get_dtype())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def readable(path: str) -> None:
    """The file's mode as the umask gives a new file (safetensors writes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _element_size(name: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}.get(name, 1)


def _keep_adapters(named: Iterator[tuple[str, torch.Tensor]], adapters: dict[str, torch.Tensor]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """`named`, passed on, with a CPU copy of each adapter weight put into `adapters`."""
    for name, tensor in named:
        if lora.is_adapter(name):
            adapters[name] = tensor.cpu().clone()
        yield name, tensor


def _write_hf_metadata(src: str, out_dir: str, dtype: torch.dtype, reward_head: bool = False) -> None:
    """Config (naming the dtype written), tokenizer and generation config from `src` (a reward model's
    config as a one-label sequence classifier, which generates nothing), and a vision-language
    model's processor files."""
    config = AutoConfig.from_pretrained(src)
    tokenizer = AutoTokenizer.from_pretrained(src)
    config.dtype = dtype
    if reward_head:
        config.architectures = [a.replace("ForCausalLM", "ForSequenceClassification") for a in config.architectures]
        config.num_labels = 1
        config.tie_word_embeddings = False
        if config.pad_token_id is None:  # transformers finds each row's last token by the pad id
            pad = tokenizer.pad_token_id
            config.pad_token_id = pad if pad is not None else tokenizer.eos_token_id
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if not reward_head and os.path.isfile(os.path.join(src, "generation_config.json")):
        GenerationConfig.from_pretrained(src).save_pretrained(out_dir)
    for name in _PROCESSOR_FILES:  # a vision-language model's processor
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
