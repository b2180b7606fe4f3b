"""Chat rendering with the checkpoint's own chat template, and image/video placeholder expansion.

The template renders one `<|image_pad|>` per image and one `<|video_pad|>` per video; the language
model needs one pad token per embedding row, so each is expanded to `prod(grid_thw) // merge_size**2`
copies, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from shared.blob import Modality

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"


@dataclass(frozen=True)
class MediaSlot:
    """Marks where an image or a video goes inside a turn; its embeddings travel separately."""

    modality: Modality = "image"


@dataclass
class ChatTurn:
    role: str
    parts: list[str | MediaSlot] = field(default_factory=list)


class PromptBuilder:
    """Turns chat turns plus per-item token counts into prompt token ids."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.chat_template is None:
            raise ValueError("tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.image_token_id: int = _token_id(tokenizer, IMAGE_PAD)
        self.video_token_id: int = _token_id(tokenizer, VIDEO_PAD)

    def build(self, turns: list[ChatTurn], token_counts: list[int]) -> list[int]:
        """Render with add_generation_prompt=True and expand the pad of media slot i (images and
        videos, in prompt order) to token_counts[i] copies."""
        slots = [p for turn in turns for p in turn.parts if isinstance(p, MediaSlot)]
        if len(slots) != len(token_counts):
            raise ValueError(f"messages hold {len(slots)} image/video part(s) but {len(token_counts)} were supplied")
        for index, (slot, count) in enumerate(zip(slots, token_counts, strict=True)):
            if count < 1:
                raise ValueError(f"{slot.modality} {index} has {count} tokens; every one needs at least one")
        text = self.tokenizer.apply_chat_template(
            [self._to_message(turn) for turn in turns], tokenize=False, add_generation_prompt=True
        )
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._expand(ids, [slot.modality for slot in slots], token_counts)

    def _expand(self, ids: list[int], modalities: list[Modality], counts: list[int]) -> list[int]:
        pad_of = {"image": self.image_token_id, "video": self.video_token_id}
        rendered = [token for token in ids if token in pad_of.values()]
        if rendered != [pad_of[m] for m in modalities]:  # the template dropped, added or reordered one
            raise ValueError(
                f"rendered prompt has {len(rendered)} image/video placeholder(s) that do not match the "
                f"{len(modalities)} part(s) given ({', '.join(modalities) or 'none'})"
            )
        remaining = iter(counts)
        expanded: list[int] = []
        for token in ids:
            expanded.extend([token] * next(remaining) if token in pad_of.values() else [token])
        return expanded

    @staticmethod
    def _to_message(turn: ChatTurn) -> dict:
        content: list[dict] = []
        for part in turn.parts:
            if isinstance(part, MediaSlot):
                content.append({"type": part.modality})
            elif isinstance(part, str):
                # A literal pad token in user text would shift every image's rows; refuse it.
                if IMAGE_PAD in part or VIDEO_PAD in part:
                    raise ValueError(f"text may not contain {IMAGE_PAD} or {VIDEO_PAD}")
                content.append({"type": "text", "text": part})
            else:
                raise ValueError(f"unsupported message part type {type(part).__name__}")
        return {"role": turn.role, "content": content}


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"tokenizer has no {token} token")
    return token_id
