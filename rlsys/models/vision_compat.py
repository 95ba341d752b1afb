"""Qwen's vision-language processors (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) without torchvision.

The CPU build of vLLM installs CUDA builds of torchvision, torchaudio and torchcodec, with which
transformers' models fail to import; rlsys's setup removes them. Two places of transformers 5.19
then fail for these models:

- `transformers.models.qwen2_vl.image_processing_qwen2_vl` imports torchvision at the top, and
  vLLM's Qwen-VL models import `smart_resize` from it: the module is aliased to the PIL image
  processor's module, which defines the same `smart_resize`;
- each processor's `__init__` checks its video processor against a class torchvision provides,
  even when there is none: the processor is built without one (images and text only), and holds
  in its place a stand-in that names the video options and refuses videos. vLLM reads the options,
  and for Qwen3-VL the video processor's sizes too, which the stand-in takes from Qwen3-VL's video
  processor (it imports without torchvision) set to the image processor's patches.

`allow_qwen_vl_without_torchvision` does both, and nothing where torchvision is installed. It has
to run in every process that loads such a processor: vLLM's (rlsys's vLLM plugin calls it, in every
process vLLM starts) and whatever else builds or loads one (`rlsys.models.tiny_vl`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys

_PATCH_SETTINGS = ("patch_size", "temporal_patch_size", "merge_size")


def _qwen3_video_settings(image_processor):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(**{name: getattr(image_processor, name) for name in _PATCH_SETTINGS})


_PROCESSORS = (("qwen2_vl", "Qwen2VLProcessor", None), ("qwen2_5_vl", "Qwen2_5_VLProcessor", None),
               ("qwen3_vl", "Qwen3VLProcessor", _qwen3_video_settings))
"""transformers' module (under `transformers.models`) and class of each family's processor, and what
gives its stand-in video processor the sizes vLLM reads (None: none are read)."""


def allow_qwen_vl_without_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl

    sys.modules.setdefault("transformers.models.qwen2_vl.image_processing_qwen2_vl", image_processing_pil_qwen2_vl)
    for family, name, video_settings in _PROCESSORS:
        if importlib.util.find_spec(f"transformers.models.{family}") is None:
            continue  # a transformers older than the family
        module = importlib.import_module(f"transformers.models.{family}.processing_{family}")
        _build_without_videos(getattr(module, name), video_settings)


def _build_without_videos(processor: type, video_settings=None) -> None:
    if "video_processor" not in inspect.signature(processor.__init__).parameters:
        return  # already replaced, or a transformers whose processor takes no video processor
    with_video = processor.__init__

    def images_and_text(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        kwargs.pop("video_processor", None)
        with_video(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        self.video_processor = NoVideos(video_settings(image_processor) if video_settings else None)

    processor.__init__ = images_and_text


class NoVideos:
    """A video processor's stand-in: the options a video processor takes, the sizes of `settings`
    (a video processor that is never called), and no videos."""

    def __init__(self, settings=None):
        self._settings = settings

    @property
    def valid_kwargs(self):
        from transformers.processing_utils import VideosKwargs

        return VideosKwargs

    def __getattr__(self, name: str):
        if name.startswith("_") or self._settings is None:
            raise AttributeError(name)
        return getattr(self._settings, name)

    def __call__(self, *args, **kwargs):
        raise ValueError("videos need torchvision, which this environment does not have")
