"""Global batches: deterministic, resumable order; padding; dp and micro splits.

A batch is a dict of [B, T] tensors: input_ids, attention_mask, loss_mask.
"""

from __future__ import annotations

import numpy as np
import torch

from rlsys.config.loader import ConfigError
from rlsys.config.training import TrainConfig
from rlsys.data.examples import Example
from rlsys.data.image_tokens import ImagePixels, image_fields

Batch = dict[str, torch.Tensor]


class EpochSampler:
    """Index batches over shuffled epochs; the state is (epoch, offset), so
    resuming continues with exactly the batches an uninterrupted run would see."""

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        if num_examples < batch_size:
            raise ValueError(f"{num_examples} examples cannot fill a global batch of {batch_size}")
        self.num_examples, self.batch_size, self.seed = num_examples, batch_size, seed
        self.epoch, self.offset = 0, 0

    def next_indices(self) -> list[int]:
        if self.offset + self.batch_size > self.num_examples:
            self.epoch, self.offset = self.epoch + 1, 0
        order = np.random.default_rng((self.seed, self.epoch)).permutation(self.num_examples)
        indices = order[self.offset:self.offset + self.batch_size]
        self.offset += self.batch_size
        return indices.tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]


def collate(examples: list[Example], pad_id: int) -> Batch:
    """Right-pad to the longest example. Built from the examples laid end to end in one
    tensor per field: per-row copies cost the driver far more on an RL step's many rows."""
    lengths = torch.tensor([len(e.input_ids) for e in examples])
    attention_mask = (torch.arange(int(lengths.max())) < lengths[:, None]).long()
    filled = attention_mask.bool()  # row-major, as the examples are concatenated
    input_ids = torch.full(attention_mask.shape, pad_id, dtype=torch.long)
    input_ids[filled] = torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.long)
    loss_mask = torch.zeros(attention_mask.shape, dtype=torch.float32)
    loss_mask[filled] = torch.tensor([m for e in examples for m in e.loss_mask], dtype=torch.float32)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
    if any(e.pixels is not None for e in examples):
        batch.update(image_fields([e.pixels for e in examples], tuple(input_ids.shape)))
    return batch


def num_targets(batch: Batch) -> int:
    """Target tokens: masked positions after the first (position 0 has nothing to predict from)."""
    return int(batch["loss_mask"][:, 1:].sum().item())


def split_rows(batch: Batch, parts: int) -> list[Batch]:
    """`parts` contiguous row ranges (sizes differ by at most one)."""
    return [dict(zip(batch, chunk)) for chunk in zip(*(t.tensor_split(parts) for t in batch.values()))]


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """Chunks of `size` rows, each trimmed to its longest row."""
    rows = batch["input_ids"].shape[0]
    return cut_rows(batch, [min(size, rows - start) for start in range(0, rows, size)])


def cut_rows(batch: Batch, sizes: list[int]) -> list[Batch]:
    """Consecutive chunks of `sizes` rows, each trimmed to its longest row."""
    chunks = []
    for values in zip(*(t.split(sizes) for t in batch.values())):
        chunk = dict(zip(batch, values))
        length = int(chunk["attention_mask"].sum(1).max().item())
        chunks.append({k: v[:, :length] for k, v in chunk.items()})
    return chunks


def token_budget_sizes(lengths: list[int], max_tokens: int) -> list[int]:
    """Rows per micro-batch when each takes consecutive rows up to `max_tokens` tokens (a row
    longer than that goes alone). Consecutive, so a prompt's samples stay together and share it."""
    sizes, tokens = [], 0
    for length in lengths:
        if sizes and tokens + length <= max_tokens:
            sizes[-1] += 1
            tokens += length
        else:
            sizes.append(1)
            tokens = length
    return sizes


def split_to_count(sizes: list[int], lengths: list[int], count: int) -> list[int]:
    """`sizes` with the micro-batch of most tokens halved, again and again, until there are
    `count` of them or every one is a single row."""
    sizes = list(sizes)
    while len(sizes) < count:
        starts = np.cumsum([0, *sizes[:-1]])
        tokens = [sum(lengths[start:start + size]) if size > 1 else -1 for start, size in zip(starts, sizes)]
        heaviest = int(np.argmax(tokens))
        if sizes[heaviest] == 1:
            break
        half = sizes[heaviest] // 2
        sizes[heaviest:heaviest + 1] = [half, sizes[heaviest] - half]
    return sizes


def collate_rollouts(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
                     response_masks: list[list[int]] | None = None,
                     prompt_pixels: list[ImagePixels | None] | None = None) -> Batch:
    """Prompt + response rows, right-padded; loss_mask is 1 on the response tokens the policy
    sampled (`response_masks`; all of them when not given), 0 on the prompt and on tool turns.
    `prompt_pixels`: a vision-language prompt's pictures, its `prompt_ids` expanded for them."""
    masks = response_masks or [[1] * len(r) for r in response_ids]
    pixels = prompt_pixels or [None] * len(prompt_ids)
    examples = [Example(p + r, [0] * len(p) + list(m), pixels=x)
                for p, r, m, x in zip(prompt_ids, response_ids, masks, pixels)]
    return collate(examples, pad_id)


def on_last_response_token(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """One value per row at that row's last response token ([B] -> [B, T], 0 elsewhere):
    an outcome reward as per-token rewards."""
    mask = batch["loss_mask"]
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    placed = torch.zeros(mask.shape, dtype=torch.float32)
    placed[torch.arange(mask.shape[0]), last] = values.float() * mask.any(1)
    return placed


def on_response_tokens(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Place one value per response token (all rows' responses, in row order, concatenated)
    at those tokens' positions ([N] -> [B, T], 0 elsewhere)."""
    placed = torch.zeros_like(batch["loss_mask"])
    placed[batch["loss_mask"].bool()] = values.float()
    return placed


def check_train_batch(train: TrainConfig, dp: int) -> None:
    """The global batch splits evenly over the data-parallel ranks (and their micro-batches)."""
    if train.micro_batch_tokens is not None:
        if train.global_batch_size % dp:
            raise ConfigError(f"train.global_batch_size: {train.global_batch_size} is not divisible by the "
                              f"data-parallel size ({dp})")
    elif train.global_batch_size % (train.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size: {train.global_batch_size} is not divisible by "
            f"train.micro_batch_size ({train.micro_batch_size}) x data-parallel size ({dp})"
        )
