"""OpenAI request fields this gateway cannot honour, refused instead of ignored.

Unknown top-level fields are ignored (clients and SDKs send vendor fields), but these change what
a right answer is: a client that asks for JSON output, tool calls, biased logits or vLLM's top_k
and gets a 200 with something else has been misled. So a request that sets one of them to anything but its
neutral value ("no tools", `{"type": "text"}`) is a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shared.errors import InvalidInput

PLAIN_TEXT = "this server generates plain text only"
# vLLM's sampling extensions: a client written for vLLM sends them expecting them honoured.
SAMPLING = "this server samples with temperature, top_p, seed and the penalties documented in its README"


def _off(*neutral: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in neutral


# field -> (whether a value asks for nothing this gateway cannot do, why another value is refused)
NEUTRAL: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    "response_format": (lambda value: value is None or value == {"type": "text"}, PLAIN_TEXT),
    "tools": (lambda value: not value, PLAIN_TEXT),
    "tool_choice": (_off("none"), PLAIN_TEXT),
    "functions": (lambda value: not value, PLAIN_TEXT),
    "function_call": (_off("none"), PLAIN_TEXT),
    "logit_bias": (lambda value: not value, PLAIN_TEXT),
    "audio": (_off(), PLAIN_TEXT),
    "modalities": (_off(["text"]), PLAIN_TEXT),
    "prediction": (_off(), PLAIN_TEXT),
    "top_k": (_off(-1, 0), SAMPLING),  # -1 and 0 both mean "off" in vLLM
    "min_p": (_off(0), SAMPLING),
    "repetition_penalty": (_off(1), SAMPLING),
}


def refuse_unsupported(extra: Mapping[str, Any]) -> None:
    """InvalidInput for the first field of `extra` (a request's unknown fields) that asks for
    something NEUTRAL says this gateway cannot do."""
    for field, value in extra.items():
        rule = NEUTRAL.get(field)
        if rule is not None and not rule[0](value):
            raise InvalidInput(f"{field} is not supported: {rule[1]}", param=field)
