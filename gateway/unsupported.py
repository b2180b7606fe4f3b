"""OpenAI request fields this gateway cannot honour, refused instead of ignored.

Unknown top-level fields are ignored (clients and SDKs send vendor fields: `user`, `metadata`,
vLLM's `priority`), but these change what a right answer is: a client that asks for JSON output,
tool calls, biased logits, vLLM's top_k, a custom chat template or the prompt echoed, and gets a
200 with something else, has been misled. So a request that sets one of them to anything but its
neutral value ("no tools", `{"type": "text"}`) is a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shared.errors import InvalidInput

PLAIN_TEXT = "this server generates plain text only"
# vLLM's sampling extensions: a client written for vLLM sends them expecting them honoured.
SAMPLING = "this server samples with temperature, top_p, seed and the penalties documented in its README"
PROMPT = "this server builds every prompt with the model's own chat template and default image processing"
OUTPUT = "this server answers with OpenAI's fields only, from text decoded as vLLM does by default"


def _off(*neutral: Any) -> Callable[[Any], bool]:
    """Neutral when absent (null) or one of `neutral`."""
    return lambda value: value is None or value in neutral


def _empty(value: Any) -> bool:
    """Neutral when absent or empty: no tools, no biases, no extra kwargs."""
    return not value


# field -> (whether a value asks for nothing this gateway cannot do, why another value is refused)
NEUTRAL: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    "response_format": (_off({"type": "text"}), PLAIN_TEXT),
    "tools": (_empty, PLAIN_TEXT),
    "tool_choice": (_off("none"), PLAIN_TEXT),
    "functions": (_empty, PLAIN_TEXT),
    "function_call": (_off("none"), PLAIN_TEXT),
    "logit_bias": (_empty, PLAIN_TEXT),
    "audio": (_off(), PLAIN_TEXT),
    "modalities": (_off(["text"]), PLAIN_TEXT),
    "prediction": (_off(), PLAIN_TEXT),
    "top_k": (_off(-1, 0), SAMPLING),  # -1 and 0 both mean "off" in vLLM
    "min_p": (_off(0), SAMPLING),
    "repetition_penalty": (_off(1), SAMPLING),
    # vLLM's other request extensions (its ChatCompletionRequest), each at vLLM's default value.
    "structured_outputs": (_off(), PLAIN_TEXT),
    "guided_json": (_off(), PLAIN_TEXT),  # the guided_* fields: structured_outputs' older names
    "guided_regex": (_off(), PLAIN_TEXT),
    "guided_choice": (_off(), PLAIN_TEXT),
    "guided_grammar": (_off(), PLAIN_TEXT),
    "web_search_options": (_off(), PLAIN_TEXT),
    "use_beam_search": (_off(False), SAMPLING),
    "best_of": (_off(1), SAMPLING),
    "length_penalty": (_off(1), SAMPLING),
    "min_tokens": (_off(0), SAMPLING),
    "ignore_eos": (_off(False), SAMPLING),
    "stop_token_ids": (_empty, SAMPLING),
    "bad_words": (_empty, SAMPLING),
    "allowed_token_ids": (_empty, SAMPLING),
    "thinking_token_budget": (_off(), SAMPLING),
    "repetition_detection": (_off(), SAMPLING),
    "watermarking": (_off(False), SAMPLING),
    "vllm_xargs": (_empty, SAMPLING),
    "chat_template": (_off(), PROMPT),
    "chat_template_kwargs": (_empty, PROMPT),
    "add_generation_prompt": (_off(True), PROMPT),
    "continue_final_message": (_off(False), PROMPT),
    "add_special_tokens": (_off(False), PROMPT),
    "documents": (_empty, PROMPT),
    "mm_processor_kwargs": (_empty, PROMPT),  # /v1/images/encode takes min/max_pixels
    "media_io_kwargs": (_empty, PROMPT),
    "truncate_prompt_tokens": (_off(), PROMPT),
    "echo": (_off(False), OUTPUT),
    "include_stop_str_in_output": (_off(False), OUTPUT),
    "skip_special_tokens": (_off(True), OUTPUT),
    "spaces_between_special_tokens": (_off(True), OUTPUT),
    "prompt_logprobs": (_off(), OUTPUT),
    "logprob_token_ids": (_empty, OUTPUT),
    "return_tokens_as_token_ids": (_off(False), OUTPUT),
    "return_token_ids": (_off(False), OUTPUT),
}


def refuse_unsupported(extra: Mapping[str, Any]) -> None:
    """InvalidInput for the first field of `extra` (a request's unknown fields) that asks for
    something NEUTRAL says this gateway cannot do."""
    for field, value in extra.items():
        rule = NEUTRAL.get(field)
        if rule is not None and not rule[0](value):
            raise InvalidInput(f"{field} is not supported: {rule[1]}", param=field)
