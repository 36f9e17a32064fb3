"""Image prompts of the multimodal Qwen3.5 checkpoints: the image processor from transformers
(the checkpoint's ``preprocessor_config.json``), the placeholder expansion of transformers'
``Qwen3VLProcessor`` and the 3-axis positions of ``Qwen3_5Model.get_rope_index``.

A prompt holds ``<|vision_start|><|image_pad|><|vision_end|>`` per image (the chat template
writes it for an image content part); ``<|image_pad|>`` becomes one token per merged patch,
``t * h * w / merge**2`` for an image of ``(t, h, w)`` patches. Text tokens sit at
``p, p, p`` on the (temporal, height, width) axes; an image's tokens at ``p + t, p + row,
p + col`` over its merged grid, after which ``p`` moves on by ``max(h, w) / merge``.
"""

from __future__ import annotations

import torch

from qllm.model.multimodal import EncoderInput, InputProcessor, MediaError, MultimodalInputs, \
    content_hash, items_of, placeholder_slots

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


class Qwen3_5InputProcessor(InputProcessor):
    placeholders = {"image": IMAGE_PLACEHOLDER}

    def __init__(self, model_dir: str, hf_config):
        self.model_dir = model_dir
        self.image_token_id = hf_config.image_token_id
        self.video_token_id = getattr(hf_config, "video_token_id", None)
        self.merge = hf_config.vision_config.spatial_merge_size
        self._image_processor = None

    @property
    def image_processor(self):
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            try:
                self._image_processor = AutoImageProcessor.from_pretrained(self.model_dir)
            except (OSError, ValueError) as exc:
                raise MediaError(f"{self.model_dir} has no usable image processor config "
                                 f"(preprocessor_config.json): {exc}") from exc
        return self._image_processor

    def _check_placeholders(self, token_ids: list[int], num_images: int) -> list[int]:
        if self.video_token_id is not None and self.video_token_id in token_ids:
            raise MediaError("video inputs are not supported (the prompt holds <|video_pad|>)")
        return placeholder_slots(token_ids, self.image_token_id, num_images, "image",
                                 "<|image_pad|>", "image(s)")

    def positions(self, token_ids: list[int]) -> MultimodalInputs | None:
        self._check_placeholders(token_ids, 0)
        return None

    def process(self, token_ids, media):
        images = items_of(media, "image", "images")
        slots = self._check_placeholders(token_ids, len(images))
        if not images:
            return list(token_ids), None
        try:
            processed = self.image_processor(images=images, return_tensors="pt")
        except (ValueError, OSError) as exc:
            raise MediaError(f"the image processor rejected an image: {exc}") from exc
        pixel_values, grids = processed["pixel_values"], processed["image_grid_thw"]
        expanded, items, previous, first_patch = [], [], 0, 0
        for slot, grid in zip(slots, grids.tolist()):
            expanded += token_ids[previous:slot]
            num_patches = grid[0] * grid[1] * grid[2]
            patches = pixel_values[first_patch:first_patch + num_patches]
            first_patch += num_patches
            length = num_patches // (self.merge * self.merge)
            items.append(EncoderInput(
                "image", len(expanded), length,
                {"pixel_values": patches, "image_grid_thw": torch.tensor([grid])},
                content_hash(patches, grid)))
            expanded += [self.image_token_id] * length
            previous = slot + 1
        expanded += token_ids[previous:]
        positions, delta = rope_index(len(expanded), items, self.merge)
        return expanded, MultimodalInputs(items, positions, delta)


def rope_index(num_tokens: int, items: list[EncoderInput], merge: int
               ) -> tuple[list[list[int]], int]:
    """``get_rope_index`` of one prompt: positions ``[3][num_tokens]`` and the delta of the
    tokens after the prompt (``max position + 1 - num_tokens``)."""
    axes: list[list[int]] = [[], [], []]
    position, index = 0, 0
    for item in items:
        text = item.offset - index  # the text run before the image
        for axis in axes:
            axis.extend(range(position, position + text))
        position += text
        t, h, w = item.data["image_grid_thw"][0].tolist()
        h, w = h // merge, w // merge
        for frame in range(t):
            for row in range(h):
                axes[0].extend([position + frame] * w)
                axes[1].extend([position + row] * w)
                axes[2].extend(range(position, position + w))
        position += max(h, w)
        index = item.end
    for axis in axes:
        axis.extend(range(position, position + num_tokens - index))
    position += num_tokens - index
    highest = max(max(axis) for axis in axes) if num_tokens else -1
    return axes, highest + 1 - num_tokens
