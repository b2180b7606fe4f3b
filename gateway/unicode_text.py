"""Finding text that is not Unicode in a parsed JSON body.

JSON may escape a lone UTF-16 surrogate (`"\\ud800"`), and Python's parser keeps it as a str, but
it is no character: UTF-8 cannot carry it, so protobuf, the logs or the response would fail on it
later, as a server error. The request bodies refuse it up front (gateway/schemas.py).
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def first_surrogate(value: Any, path: str = "") -> str | None:
    """The path ("messages[0].content") of the first string, or object key, that holds a lone
    surrogate (a key is named with its surrogates escaped); "" for the value itself; None when
    there is none."""
    if isinstance(value, str):
        return path if not value.isascii() and _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                return where.encode("utf-8", "backslashreplace").decode()  # the path itself must be text
            if (found := first_surrogate(item, where)) is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if (found := first_surrogate(item, f"{path}[{index}]")) is not None:
                return found
    return None
