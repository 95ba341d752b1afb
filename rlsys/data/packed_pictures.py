"""Packing the rows of a vision-language micro-batch (`rlsys.data.packing`), pictures and all.

A row's pictures travel in fields that are not per token (`rlsys.data.image_tokens`: each row's
image tokens' patches and its pictures' grids), which packing cannot move as it moves tokens.
Here each image token carries instead the index of its patches and of its picture among the
micro-batch's, packing moves those, and the packed rows' patches and grids are gathered from them
in the packed token order, the order the vision tower reads them in. The rotary positions of such
a model are 3-D and derived per row from its pictures (`rlsys.models.vision.rope_positions`): they
are derived from the unpacked rows and packed as a per-token field (`ROPE_POSITIONS`).

All image tokens share one id, so rows are compared for sharing by keys that tell pictures apart:
an image token's key names the picture's content and the token's place in it. Rows that repeat a
prompt and its picture (a GRPO group's) lay both out once, and the vision tower encodes the
picture once for all of them; rows whose text is alike but whose pictures differ part at the
first image token. A picture is read whole: a tree that would repeat one of its tokens in each
child (its last, were the rows to part right after it) is not used, its rows laid out alone.
"""

from __future__ import annotations

import torch

from rlsys.data.batching import Batch
from rlsys.data.image_tokens import GRIDS, IMAGE_TOKENS, PIXELS
from rlsys.data.packing import Packing, pack_rows
from rlsys.models.vision import rope_positions

ROPE_POSITIONS = "rope_positions"
"""A packed micro-batch's field: each token's 3-D rotary positions (those of its row), [rows, width, 3]."""

_PATCH = "picture_patch"
"""Per image token: 1 + the index of its patches among the micro-batch's (0: not an image token)."""
_PICTURE = "picture_index"
"""Per image token: 1 + the index of its picture among the micro-batch's."""
_HASHED_VALUES = 4096
"""How many of a picture's patch values its hash reads (a picture holds millions)."""


def pack_pictured_rows(batch: Batch, share_prompts: bool, model) -> Packing:
    """`pack_rows` for a micro-batch of the vision-language `model`, which may hold pictures: each
    token keeps its row's 3-D rotary positions, and the packed rows carry their own patches and
    grids. A micro-batch cut from a batch with pictures may have picture fields and no picture: its
    rows pack as text."""
    fields = {name: value for name, value in batch.items() if name not in (PIXELS, GRIDS)}
    fields[ROPE_POSITIONS] = rope_positions(model, batch["input_ids"], batch.get(IMAGE_TOKENS), batch.get(GRIDS),
                                            batch["attention_mask"])
    images = batch[IMAGE_TOKENS].bool() if PIXELS in batch else None
    if images is None or not images.any():
        return pack_rows(fields, share_prompts)
    patches = torch.cat([row[:count] for row, count in zip(batch[PIXELS], images.sum(1).tolist())])
    grids = batch[GRIDS][batch[GRIDS][..., 0] > 0]
    picture_tokens = grids.prod(-1) // model.config.vision_config.spatial_merge_size ** 2
    fields[_PATCH] = torch.zeros_like(batch["input_ids"])
    fields[_PATCH][images] = torch.arange(1, len(patches) + 1)
    fields[_PICTURE] = torch.zeros_like(batch["input_ids"])
    fields[_PICTURE][images] = torch.arange(1, len(grids) + 1).repeat_interleave(picture_tokens)
    keys = batch["input_ids"].clone()
    keys[images] = -1 - _same_picture_patches(patches, grids, picture_tokens)
    packing = pack_rows(fields, share_prompts, keys)
    packing.batch = _with_pictures(packing.batch, patches, grids)
    return packing


def _same_picture_patches(patches: torch.Tensor, grids: torch.Tensor, picture_tokens: torch.Tensor) -> torch.Tensor:
    """For each image token (in micro-batch order), the index of the same token of the first picture
    whose grid and patches equal its picture's: pictures are looked up by their grid and a hash of a
    sample of their values, then compared whole."""
    firsts: dict[tuple, int] = {}
    same = []
    start = 0
    for grid, count in zip(grids.tolist(), picture_tokens.tolist()):
        content = patches[start:start + count]
        sample = content.flatten()[::max(1, content.numel() // _HASHED_VALUES)]
        key = (*grid, hash(sample.contiguous().view(torch.uint8).numpy().tobytes()))
        first = firsts.setdefault(key, start)
        if first != start and not torch.equal(patches[first:first + count], content):
            first = start  # alike in the sample only: a picture of its own
        same.append(torch.arange(first, first + count))
        start += count
    return torch.cat(same)


def _with_pictures(packed: Batch, patches: torch.Tensor, grids: torch.Tensor) -> Batch:
    """The packed rows' image fields, from the patch and picture indices their image tokens carry:
    each packed row's patches in token order, its pictures' grids in the order they come."""
    patch_of, picture_of = packed.pop(_PATCH), packed.pop(_PICTURE)
    rows = len(patch_of)
    row_patches = [patch_of[row][patch_of[row] > 0] - 1 for row in range(rows)]
    row_pictures = [torch.unique_consecutive(picture_of[row][picture_of[row] > 0]) - 1 for row in range(rows)]
    pixels = torch.zeros(rows, max(1, *map(len, row_patches)), patches.shape[1], dtype=patches.dtype)
    packed_grids = torch.zeros(rows, max(1, *map(len, row_pictures)), 3, dtype=grids.dtype)
    for row, (patch_index, picture_index) in enumerate(zip(row_patches, row_pictures)):
        pixels[row, :len(patch_index)] = patches[patch_index]
        packed_grids[row, :len(picture_index)] = grids[picture_index]
    return {**packed, PIXELS: pixels, GRIDS: packed_grids}
