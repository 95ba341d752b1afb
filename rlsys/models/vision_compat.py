"""Qwen2-VL's processors without torchvision.

The CPU build of vLLM installs CUDA builds of torchvision, torchaudio and torchcodec, with which
transformers' models fail to import; rlsys's setup removes them. Two places of transformers 5.19
then fail for Qwen2-VL:

- `transformers.models.qwen2_vl.image_processing_qwen2_vl` imports torchvision at the top, and
  vLLM's Qwen2-VL model imports `smart_resize` from it: the module is aliased to the PIL image
  processor's module, which defines the same `smart_resize`;
- `Qwen2VLProcessor.__init__` checks its video processor against a class torchvision provides,
  even when there is none: the processor is built without one (images and text only), and holds
  in its place a stand-in that names the video options (vLLM reads them) and refuses videos.

`allow_qwen2_vl_without_torchvision` does both, and nothing where torchvision is installed. It has
to run in every process that loads such a processor: vLLM's (rlsys's vLLM plugin calls it, in every
process vLLM starts) and whatever else builds or loads one (`rlsys.models.tiny_vl`).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys


def allow_qwen2_vl_without_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl, processing_qwen2_vl

    sys.modules.setdefault("transformers.models.qwen2_vl.image_processing_qwen2_vl", image_processing_pil_qwen2_vl)
    processor = processing_qwen2_vl.Qwen2VLProcessor
    if "video_processor" not in inspect.signature(processor.__init__).parameters:
        return
    with_video = processor.__init__

    def images_and_text(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        kwargs.pop("video_processor", None)
        with_video(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        self.video_processor = NoVideos()

    processor.__init__ = images_and_text


class NoVideos:
    """A video processor's stand-in: the options a video processor takes, and no videos."""

    @property
    def valid_kwargs(self):
        from transformers.processing_utils import VideosKwargs

        return VideosKwargs

    def __call__(self, *args, **kwargs):
        raise ValueError("videos need torchvision, which this environment does not have")
