"""Chat rendering with the checkpoint's own chat template, and image placeholder expansion.

The template renders one `<|image_pad|>` per image; the language model needs one pad token per
embedding row, so each is expanded to `prod(grid_thw) // merge_size**2` copies, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"


@dataclass(frozen=True)
class ImageSlot:
    """Marks where an image goes inside a turn; its embeddings travel separately."""


@dataclass
class ChatTurn:
    role: str
    parts: list[str | ImageSlot] = field(default_factory=list)


def image_token_counts(image_grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """Pad tokens per image for a [n, 3] grid: prod(grid_thw) // merge_size**2 each."""
    return [int(row.prod()) // merge_size**2 for row in image_grid_thw.reshape(-1, 3)]


class PromptBuilder:
    """Turns chat turns plus per-image token counts into prompt token ids."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.chat_template is None:
            raise ValueError("tokenizer has no chat template")
        image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if image_token_id is None or image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no {IMAGE_PAD} token")
        self.tokenizer = tokenizer
        self.image_token_id: int = image_token_id

    def build(self, turns: list[ChatTurn], image_token_counts: list[int]) -> list[int]:
        """Render with add_generation_prompt=True and expand image i's pad to image_token_counts[i]."""
        n_slots = sum(isinstance(p, ImageSlot) for turn in turns for p in turn.parts)
        if n_slots != len(image_token_counts):
            raise ValueError(
                f"messages hold {n_slots} image part(s) but {len(image_token_counts)} image(s) were supplied"
            )
        for index, count in enumerate(image_token_counts):
            if count < 1:
                raise ValueError(f"image {index} has {count} tokens; every image needs at least one")
        text = self.tokenizer.apply_chat_template(
            [self._to_message(turn) for turn in turns], tokenize=False, add_generation_prompt=True
        )
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._expand(ids, image_token_counts)

    def _expand(self, ids: list[int], counts: list[int]) -> list[int]:
        pads = ids.count(self.image_token_id)
        if pads != len(counts):  # the template dropped or added a placeholder
            raise ValueError(f"rendered prompt has {pads} image placeholder(s), expected {len(counts)}")
        remaining = iter(counts)
        expanded: list[int] = []
        for token in ids:
            if token == self.image_token_id:
                expanded.extend([token] * next(remaining))
            else:
                expanded.append(token)
        return expanded

    @staticmethod
    def _to_message(turn: ChatTurn) -> dict:
        content: list[dict] = []
        for part in turn.parts:
            if isinstance(part, ImageSlot):
                content.append({"type": "image"})
            elif isinstance(part, str):
                # A literal pad token in user text would shift every image's rows; refuse it.
                if IMAGE_PAD in part or VIDEO_PAD in part:
                    raise ValueError(f"text may not contain {IMAGE_PAD} or {VIDEO_PAD}")
                content.append({"type": "text", "text": part})
            else:
                raise ValueError(f"unsupported message part type {type(part).__name__}")
        return {"role": turn.role, "content": content}
