"""The bounds of every sampling knob, written once.

The gateway's request schema, the LLM service's proto conversion and the engines' SamplingParams
all check against this table, so a bound changes in one place and every layer refuses the same
values with the same words. The bounds are OpenAI's (and vLLM's defaults).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidInput


@dataclass(frozen=True)
class Bound:
    """A closed range [low, high], open at the bottom when low_open (top_p may not be 0);
    integer bounds read as low..high in messages."""

    low: float
    high: float
    low_open: bool = False
    integer: bool = False

    def holds(self, value: float) -> bool:
        """False for NaN, too."""
        if math.isnan(value):
            return False
        above_low = value > self.low if self.low_open else value >= self.low
        return above_low and value <= self.high

    def describe(self) -> str:
        if self.integer:
            return f"{int(self.low)}..{int(self.high)}"
        opening = "(" if self.low_open else "["
        return f"{opening}{_number(self.low)}, {_number(self.high)}]"

    def pydantic(self) -> dict[str, float]:
        """Field(**bound.pydantic()): the same range as pydantic constraints."""
        return {"gt" if self.low_open else "ge": self.low, "le": self.high}


MAX_TOP_LOGPROBS = 20  # OpenAI's limit, and vLLM's default max_logprobs
MAX_STOP_STRINGS = 4
# The widest max_tokens any layer accepts; each LLM service also has its own, lower, limit.
MAX_TOKENS_BOUND = 1_000_000

SAMPLING_BOUNDS: dict[str, Bound] = {
    "temperature": Bound(0, 2),
    "top_p": Bound(0, 1, low_open=True),
    "top_logprobs": Bound(0, MAX_TOP_LOGPROBS, integer=True),
    "presence_penalty": Bound(-2, 2),
    "frequency_penalty": Bound(-2, 2),
    "seed": Bound(0, 2**63 - 1, integer=True),
    "max_tokens": Bound(1, MAX_TOKENS_BOUND, integer=True),
}


def check_sampling(param: str, value: float) -> None:
    """Raises InvalidInput naming `param` unless value is within its bound."""
    bound = SAMPLING_BOUNDS[param]
    if not bound.holds(value):
        raise InvalidInput(f"{param} must be in {bound.describe()}", param=param)


def check_stop(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise InvalidInput(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", param="stop")


def _number(value: Any) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
