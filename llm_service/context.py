"""The context window rule, as vLLM applies it, checked once before any engine sees a request.

vLLM refuses a prompt that leaves no room for one generated token (prompt >= max_model_len) and
stops a generation when prompt plus output reaches max_model_len (finish reason "length"), even
when max_tokens asked for more. Both engines get the same: a prompt that does not fit is a
client error naming both counts (OpenAI's wording), and max_tokens is capped to the room left, so
the transformers engine ends where vLLM would. max_tokens alone never makes a request fail.
"""

from __future__ import annotations

from dataclasses import replace

from llm_service.engines.base import SamplingParams
from shared.errors import ContextLengthExceeded


def fit_to_context(prompt_tokens: int, sampling: SamplingParams, max_model_len: int) -> SamplingParams:
    """`sampling` with max_tokens capped to the room the prompt leaves; ContextLengthExceeded
    when it leaves none. prompt_tokens counts each image or video pad as the item's rows
    (EngineRequest.prompt_tokens): the length the model reads, as vLLM counts it."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your messages "
            f"resulted in {prompt_tokens} tokens (text plus image and video tokens), which leaves no room "
            "for a reply. Please reduce the length of the messages or the size of the images.",
            param="messages",
        )
    return sampling if sampling.max_tokens <= room else replace(sampling, max_tokens=room)


def refuse_text_over_context(text_chars: int, min_tokens: int, max_model_len: int) -> None:
    """ContextLengthExceeded when a prompt's text alone is surely too long (`min_tokens`, a lower
    bound from its length, PromptBuilder.min_tokens), before any time goes into tokenizing it."""
    if min_tokens >= max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your messages "
            f"hold {text_chars} characters of text, at least {min_tokens} tokens, which leaves no room "
            "for a reply. Please reduce the length of the messages.",
            param="messages",
        )
