"""OpenAI request fields this gateway cannot honour, refused instead of ignored.

Unknown top-level fields are ignored (clients and SDKs send vendor fields), but these change what
a right answer is: a client that asks for JSON output, tool calls or biased logits and gets a
200 with plain text has been misled. So a request that sets one of them to anything but its
neutral value ("no tools", `{"type": "text"}`) is a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shared.errors import InvalidInput

# field -> whether a value asks for nothing more than plain text generation
NEUTRAL: Mapping[str, Callable[[Any], bool]] = {
    "response_format": lambda value: value is None or value == {"type": "text"},
    "tools": lambda value: not value,
    "tool_choice": lambda value: value in (None, "none"),
    "functions": lambda value: not value,
    "function_call": lambda value: value in (None, "none"),
    "logit_bias": lambda value: not value,
    "audio": lambda value: value is None,
    "modalities": lambda value: value in (None, ["text"]),
    "prediction": lambda value: value is None,
}


def refuse_unsupported(extra: Mapping[str, Any]) -> None:
    """InvalidInput for the first field of `extra` (a request's unknown fields) that asks for
    something NEUTRAL says this gateway cannot do."""
    for field, value in extra.items():
        neutral = NEUTRAL.get(field)
        if neutral is not None and not neutral(value):
            raise InvalidInput(f"{field} is not supported: this server generates plain text only", param=field)
