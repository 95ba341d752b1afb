"""A vision-language example's pictures as the trainer's forward takes them.

The chat template writes one image pad token per picture (`<|image_pad|>`); the model's processor
resizes the picture, cuts it into patches and says how many tokens it becomes: one per
`merge_size` x `merge_size` patches, the pad repeated that many times (vLLM expands a prompt's
pads the same way). A batch carries a row's pictures in three fields:

    image_tokens    [B, T]: 1 on the row's image tokens (per token, as every other field)
    pixel_values    [B, P, merge_size ** 2 * patch values]: the row's image tokens' patches, in
                    token order, then zeros (P: the most image tokens of a row)
    image_grid_thw  [B, G, 3]: the (t, h, w) patch grid of each of the row's pictures, in order,
                    then zeros (G: the most pictures of a row)

Rows split and gather as every field does. The last two are not per token, yet the cuts a batch
goes through keep them whole: a micro-batch is trimmed to its longest row, and a row holds at least
as many tokens as image tokens, and those at least as many as pictures, so trimming to that length
drops only their trailing zeros. (Context parallel, which cuts each row into chunks, is not used with
these models; packing, which moves tokens between rows, rebuilds the last two for the packed rows:
`rlsys.data.packed_pictures`.) The model reads the patches in
row-major token order, the order its processor flattened them in (each merged token's patches
consecutive).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlsys.models.vision import IMAGES_PER_PROMPT, is_vision_language
from rlsys.models.vision_compat import allow_qwen_vl_without_torchvision

IMAGE_TOKENS = "image_tokens"
PIXELS = "pixel_values"
GRIDS = "image_grid_thw"


@dataclass(frozen=True)
class Pictures:
    """An example's pictures, not yet processed, and where their image tokens are."""

    images: list
    """PIL images, in the order their tokens come."""
    starts: list[int]
    """The position of each picture's first image token in the example."""
    counts: list[int]
    """The image tokens of each picture."""


@dataclass(frozen=True)
class ImagePixels:
    """An example's pictures, processed: where each starts, its patch grid, and every image token's patches."""

    starts: list[int]
    counts: list[int]
    grids: torch.Tensor
    """[pictures, 3]: (t, h, w) patches of each."""
    pixels: torch.Tensor
    """[image tokens, merge_size ** 2 * patch values], in token order."""


@dataclass(frozen=True)
class ImageExpander:
    """A vision-language model's processor, as far as expanding examples goes."""

    image_processor: object
    """The model's image processor (`AutoProcessor(...).image_processor`)."""
    image_token_id: int
    merge_size: int
    max_images: int = IMAGES_PER_PROMPT
    """The pictures a prompt may hold (the engines' `limit_mm_per_prompt`)."""

    def token_counts(self, images: list) -> list[int]:
        """The image tokens of each of `images` (PIL images), from the processor's patch grid without
        processing them; a ValueError when there are more pictures than a prompt may hold."""
        if len(images) > self.max_images:
            raise ValueError(f"images: {len(images)} pictures, over the {self.max_images} a prompt may hold "
                             "(rollout.engine_kwargs.limit_mm_per_prompt)")
        return [self.image_processor.get_number_of_image_patches(image.height, image.width, {}) // self.merge_size ** 2
                for image in images]

    def expanded_length(self, input_ids: list[int], images: list) -> int:
        """How many tokens `input_ids` become once their pads are expanded for `images`."""
        return len(input_ids) - len(images) + sum(self.token_counts(images))

    def expand(self, input_ids: list[int], loss_mask: list[int], images: list
               ) -> tuple[list[int], list[int], Pictures]:
        """`input_ids` with each image pad repeated to its picture's token count (and `loss_mask`
        alike, 0 on the image tokens), and where the pictures' tokens are; nothing is processed yet
        (`process`). A ValueError when pads and pictures differ in number."""
        pads = input_ids.count(self.image_token_id)
        if pads != len(images):
            raise ValueError(f"{pads} image tokens for {len(images)} images")
        counts = self.token_counts(images)
        left = iter(counts)
        ids, mask, starts = [], [], []
        for token, target in zip(input_ids, loss_mask):
            repeat = next(left) if token == self.image_token_id else 1
            if token == self.image_token_id:
                starts.append(len(ids))
            ids.extend([token] * repeat)
            mask.extend([0 if token == self.image_token_id else target] * repeat)  # a picture is not a target
        return ids, mask, Pictures(images, starts, counts)

    def process(self, pictures: Pictures) -> ImagePixels:
        """The pictures' patch grids and every image token's patches."""
        processed = self.image_processor(images=pictures.images, return_tensors="pt")
        grids = processed["image_grid_thw"]
        counts = (grids.prod(-1) // self.merge_size ** 2).tolist()
        if counts != pictures.counts:  # the processor's own grid against the one counted at load
            raise ValueError(f"the processor made {counts} image tokens of pictures counted as {pictures.counts}")
        return ImagePixels(pictures.starts, counts, grids, processed["pixel_values"].reshape(sum(counts), -1))

    def expand_prompts(self, prompts: list[tuple[list[int], list | None]]
                       ) -> tuple[list[list[int]], list[ImagePixels | None]]:
        """Rows' prompt ids with their pictures (None: none), expanded and processed; each distinct
        prompt once (a prompt's samples share it)."""
        done: dict[tuple, tuple[list[int], ImagePixels | None]] = {}
        rows = []
        for ids, images in prompts:
            key = (tuple(ids), id(images))
            if key not in done and images:
                expanded, _, pictures = self.expand(ids, [0] * len(ids), images)
                done[key] = expanded, self.process(pictures)
            elif key not in done:
                done[key] = ids, None
            rows.append(done[key])
        return [ids for ids, _ in rows], [pixels for _, pixels in rows]


def image_expander_of(path: str, max_images: int = IMAGES_PER_PROMPT) -> ImageExpander | None:
    """The processor of the vision-language model in `path`, to expand examples with; None for a text model."""
    from transformers import AutoConfig, AutoProcessor

    config = AutoConfig.from_pretrained(path)
    if not is_vision_language(config):
        return None
    allow_qwen_vl_without_torchvision()
    processor = AutoProcessor.from_pretrained(path)
    return ImageExpander(processor.image_processor, config.image_token_id, config.vision_config.spatial_merge_size,
                       max_images)


def image_fields(pixels: list[ImagePixels | None], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The image fields of a batch of `shape` [B, T] whose rows hold `pixels` (None: no pictures)."""
    rows = [p for p in pixels if p is not None]
    most_tokens = max(len(p.pixels) for p in rows)
    most_pictures = max(len(p.grids) for p in rows)
    tokens = torch.zeros(shape, dtype=torch.long)
    values = torch.zeros(shape[0], most_tokens, rows[0].pixels.shape[1])
    grids = torch.zeros(shape[0], most_pictures, 3, dtype=torch.long)
    for row, row_pixels in enumerate(pixels):
        if row_pixels is None:
            continue
        for start, count in zip(row_pixels.starts, row_pixels.counts):
            tokens[row, start:start + count] = 1
        values[row, :len(row_pixels.pixels)] = row_pixels.pixels
        grids[row, :len(row_pixels.grids)] = row_pixels.grids
    return {IMAGE_TOKENS: tokens, PIXELS: values, GRIDS: grids}
