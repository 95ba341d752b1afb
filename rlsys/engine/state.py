"""A rank's state on disk: the distributed checkpoint a run resumes from (model, optimizer,
schedule and RNG under HF names, so any layout can read it) and the Hugging Face directory a stage
exports. It takes the model's parts, optimizers and schedules, not the engine."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from rlsys.config.model import ModelConfig
from rlsys.engine.schedule import follow_schedule
from rlsys.engine.weights import RankWeights
from rlsys.models import lora
from rlsys.models.moe import moe_family
from rlsys.models.vision import checkpoint_name


class RankState:
    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                 schedulers: list[torch.optim.lr_scheduler.LambdaLR], model_cfg: ModelConfig, peak_lr: float):
        """`peak_lr`: this run's `optim.lr`, which a restored schedule follows (`follow_schedule`)."""
        self.parts, self.optimizers, self.schedulers = parts, optimizers, schedulers
        self.model_cfg, self.peak_lr = model_cfg, peak_lr

    def save(self, path: str, rank: int) -> None:
        dcp.save(self._state(), checkpoint_id=os.path.join(path, "model_optim"))
        extra = {"schedulers": [s.state_dict() for s in self.schedulers], "rng": torch.get_rng_state()}
        torch.save(extra, os.path.join(path, f"rank{rank}.pt"))

    def load(self, path: str, rank: int) -> None:
        state = self._state()
        dcp.load(state, checkpoint_id=os.path.join(path, "model_optim"))
        flat = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        for part, optimizer in zip(self.parts, self.optimizers):
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, optimizer, state["optim"], options=flat)
        extra = torch.load(os.path.join(path, f"rank{rank}.pt"), weights_only=False)
        for scheduler, scheduler_state in zip(self.schedulers, extra["schedulers"]):
            scheduler.load_state_dict(scheduler_state)
            follow_schedule(scheduler, self.peak_lr)
        torch.set_rng_state(extra["rng"])

    def _state(self) -> dict:
        """Model and optimizer state of every part, keyed by HF names (so any layout can read it)."""
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        model, optim = {}, {}
        for part in self.parts:
            model.update(get_model_state_dict(part))
        if self.model_cfg.lora.rank:  # the frozen base is the model on disk
            model = {name: tensor for name, tensor in model.items() if lora.is_adapter(name)}
        for part, optimizer in zip(self.parts, self.optimizers):
            optim.update(get_optimizer_state_dict(part, optimizer, options=flat))
        return {"model": model, "optim": optim}


def export_hf(weights: RankWeights, model_cfg: ModelConfig, out_dir: str, pp_rank: int, pp: int,
              writes_stage: bool, writes_config: bool, reward_head: bool = False) -> None:
    """A Hugging Face directory of the full model (a collective), under the names on disk
    `save_pretrained` writes (`rlsys.models.moe` for MoE experts). Each pipeline stage's
    writer saves that stage's full tensors as one safetensors shard; with several
    stages, the config writer then adds the index mapping names to shards. `reward_head`:
    the one-output head is a reward model's, written as a `*ForSequenceClassification`
    model's `score` with one label."""
    os.makedirs(out_dir, exist_ok=True)
    shard_name = "model.safetensors" if pp == 1 else f"model-{pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    config = weights.parts[0].config
    family = moe_family(config)
    tensors, adapters = {}, {}
    named = weights.full_tensors(list(weights.parameter_nbytes()))
    if model_cfg.lora.rank:
        named = lora.merged(_keep_adapters(named, adapters), model_cfg.lora)
    for name, tensor in named:
        if reward_head and name == "lm_head.weight":
            name = "score.weight"
        name = checkpoint_name(name, config.model_type)
        if writes_stage:  # an MoE model's experts under their names on disk, one tensor each
            for disk_name, disk_tensor in family.to_disk(name, tensor) if family else [(name, tensor)]:
                split = disk_tensor.numel() < tensor.numel()  # a view: safetensors stores no shared memory
                tensors[disk_name] = disk_tensor.cpu().clone() if split else disk_tensor.cpu().contiguous()
    if writes_stage:
        save_file(tensors, os.path.join(out_dir, shard_name), metadata={"format": "pt"})
        if adapters:  # the peft adapter, beside the model it is merged into
            lora.write_adapter(os.path.join(out_dir, "adapter"), adapters, model_cfg.lora, model_cfg.path)
    del tensors, adapters
    dist.barrier()
    if writes_config:
        _write_hf_metadata(model_cfg.path, out_dir, indexed=pp > 1, reward_head=reward_head)
    dist.barrier()


def _keep_adapters(named: Iterator[tuple[str, torch.Tensor]], adapters: dict[str, torch.Tensor]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """`named`, passed on, with a CPU copy of each adapter weight put into `adapters`."""
    for name, tensor in named:
        if lora.is_adapter(name):
            adapters[name] = tensor.cpu().clone()
        yield name, tensor


_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.jinja")


def _write_hf_metadata(src: str, out_dir: str, indexed: bool, reward_head: bool = False) -> None:
    """Config, tokenizer and generation config from `src` (a reward model's config as a one-label
    sequence classifier, which generates nothing); with `indexed` (several stages' shards) the index
    mapping each tensor to its shard."""
    config = AutoConfig.from_pretrained(src)
    tokenizer = AutoTokenizer.from_pretrained(src)
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
    if indexed:
        weight_map = {}
        for shard in sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors")):
            with safe_open(os.path.join(out_dir, shard), framework="pt") as f:
                weight_map.update(dict.fromkeys(f.keys(), shard))
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
