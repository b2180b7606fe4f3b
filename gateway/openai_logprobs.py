"""OpenAI's `logprobs` object of a choice or chunk: {"content": [{token, logprob, bytes, top_logprobs}]}."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from shared.sdk import TokenLogprob, TopLogprob


def logprobs_body(entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
    """None when there are no entries: the services send them only when logprobs was requested."""
    if not entries:
        return None
    return {"content": [_content(entry) for entry in entries], "refusal": None}


def _content(entry: TokenLogprob) -> dict[str, Any]:
    return {**_alternative(entry), "top_logprobs": [_alternative(top) for top in entry.top_logprobs]}


def _alternative(entry: TokenLogprob | TopLogprob) -> dict[str, Any]:
    # OpenAI sends bytes as a list of ints: a token may hold part of a multi-byte character.
    return {"token": entry.token, "logprob": openai_logprob(entry.logprob), "bytes": list(entry.bytes)}


def openai_logprob(logprob: float) -> float:
    """JSON has no -inf or NaN (a token the model rules out, a broken checkpoint): they become
    -9999.0, as vLLM's OpenAI server sends them. `max` alone would keep NaN."""
    return -9999.0 if math.isnan(logprob) else max(logprob, -9999.0)
