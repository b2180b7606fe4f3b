"""Chat rendering with the checkpoint's own chat template.

The template renders one `<|image_pad|>` per image part and one `<|video_pad|>` per video part,
and the prompt keeps exactly that: one pad per media item. vLLM expands each pad into the item's
embedding rows itself; the transformers engine expands them before scattering the rows
(engines/transformers_engine.py). The prompt's length as the model reads it, pads counted as rows,
is `EngineRequest.prompt_tokens`.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from llm_service.chat_request import MediaInput, PromptMessage

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"


class PromptBuilder:
    """Turns chat messages into prompt token ids, one pad per image or video part."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.chat_template is None:
            raise ValueError("tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.image_token_id: int = _token_id(tokenizer, IMAGE_PAD)
        self.video_token_id: int = _token_id(tokenizer, VIDEO_PAD)

    def build(self, messages: list[PromptMessage]) -> list[int]:
        """Renders with add_generation_prompt=True. Raises ValueError when the rendered pads are
        not the messages' image and video parts, one each, in order."""
        text = self.tokenizer.apply_chat_template(
            [_template_message(message) for message in messages], tokenize=False, add_generation_prompt=True
        )
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        pad_of = {"image": self.image_token_id, "video": self.video_token_id}
        modalities = [part.modality for message in messages for part in message.parts if isinstance(part, MediaInput)]
        rendered = [token for token in ids if token in pad_of.values()]
        if rendered != [pad_of[m] for m in modalities]:  # the template dropped, added or reordered one
            raise ValueError(
                f"rendered prompt has {len(rendered)} image/video placeholder(s) that do not match the "
                f"{len(modalities)} part(s) given ({', '.join(modalities) or 'none'})"
            )
        return ids


def _template_message(message: PromptMessage) -> dict:
    """The message in the form chat templates take: {"role", "content": [typed parts]}."""
    content: list[dict] = []
    for part in message.parts:
        if isinstance(part, MediaInput):
            content.append({"type": part.modality})
        else:
            # A literal pad token in user text would take the place of an image's rows; refuse it.
            if IMAGE_PAD in part or VIDEO_PAD in part:
                raise ValueError(f"text may not contain {IMAGE_PAD} or {VIDEO_PAD}")
            content.append({"type": "text", "text": part})
    return {"role": message.role, "content": content}


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        raise ValueError(f"tokenizer has no {token} token")
    return token_id
