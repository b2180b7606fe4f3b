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
from shared.errors import InvalidInput

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# Unicode normalisation (NFC, NFKC) may join a few characters into one before tokenizing (a
# letter and its combining marks; Hangul jamo, 3 to 1): a token may stand for this many times its
# own length in characters of the text as sent.
NORMALIZATION_SLACK = 4


class PromptBuilder:
    """Turns chat messages into prompt token ids, one pad per image or video part."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.chat_template is None:
            raise ValueError("tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.image_token_id: int = _token_id(tokenizer, IMAGE_PAD)
        self.video_token_id: int = _token_id(tokenizer, VIDEO_PAD)
        # The most characters of text one token stands for: a vocabulary entry's length bounds it
        # (byte-level BPE spells each byte as one character, and a character is at least a byte;
        # SentencePiece spells characters as they are), times the normalisation slack.
        self.max_chars_per_token = NORMALIZATION_SLACK * max(len(token) for token in tokenizer.get_vocab())

    def build(self, messages: list[PromptMessage]) -> list[int]:
        """Renders with add_generation_prompt=True and tokenizes; see render and tokenize."""
        return self.tokenize(self.render(messages), messages)

    def render(self, messages: list[PromptMessage]) -> str:
        """The chat template's text (add_generation_prompt=True): cheap next to tokenizing it."""
        text = self.tokenizer.apply_chat_template(
            [_template_message(message, i) for i, message in enumerate(messages)], tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip
        if not isinstance(text, str):  # tokenize=False renders text; the type admits more
            raise TypeError(f"chat template rendered {type(text).__name__}, not text")
        return text

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` becomes, from its length alone: a text far too long
        for the context is refused without the tokenizer's time (~0.5 s per million characters)."""
        return len(text) // self.max_chars_per_token

    def tokenize(self, text: str, messages: list[PromptMessage]) -> list[int]:
        """`text` (rendered from `messages`) as token ids. Raises ValueError when the rendered pads
        are not the messages' image and video parts, one each, in order. Safe on a worker thread:
        the tokenizer is only read, and it lets go of the GIL while it works."""
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


def _template_message(message: PromptMessage, index: int) -> dict:
    """The message (messages[index]) in the form chat templates take: {"role", "content": [typed
    parts]}."""
    content: list[dict] = []
    for j, part in enumerate(message.parts):
        if isinstance(part, MediaInput):
            content.append({"type": part.modality})
        else:
            # A literal pad token in user text would take the place of an image's rows; refuse it,
            # naming the part (a request may hold thousands).
            for pad in (IMAGE_PAD, VIDEO_PAD):
                if pad in part:
                    raise InvalidInput(
                        f"text may not contain {pad}: send images and videos as content parts, not as "
                        "their placeholder token", param=f"messages[{index}].content[{j}].text",
                    )  # fmt: skip
            content.append({"type": "text", "text": part})
    return {"role": message.role, "content": content}


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        raise ValueError(f"tokenizer has no {token} token")
    return token_id
