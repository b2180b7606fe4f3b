"""logprobs / top_logprobs and presence / frequency penalties through the gateway, checked with
the official openai client on both engines (ft-a: vLLM where installed, ft-b: transformers)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import fastapi.routing
import openai
import pytest
from openai import OpenAI

from gateway.openai_logprobs import logprobs_body
from shared.sdk import TokenLogprob, TopLogprob
from tests.harness import Stack

MODELS = ("ft-a", "ft-b")
ASK = [{"role": "user", "content": "Tell me about the weather today."}]


@pytest.mark.parametrize("model", MODELS)
def test_logprobs_match_tokens_and_stream_alike(stack: Stack, openai_client: OpenAI, model: str) -> None:
    kwargs = dict(model=model, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3, messages=ASK)
    reply = openai_client.chat.completions.create(**kwargs)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one, and the alternatives come sorted.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob >= max(top.logprob for top in entry.top_logprobs) - 1e-6
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    # The text skips special tokens (<|...|>); their logprobs are still listed.
    spoken = [bytes(entry.bytes) for entry in content if not re.fullmatch(r"<\|\w+\|>", entry.token)]
    assert b"".join(spoken).decode("utf-8", "replace").startswith(reply.choices[0].message.content)

    chunks = list(openai_client.chat.completions.create(stream=True, **kwargs))
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content  # the whole choice in one message is the same text


@pytest.mark.parametrize("model", MODELS)
def test_logprobs_without_alternatives_or_not_requested(stack: Stack, openai_client: OpenAI, model: str) -> None:
    reply = openai_client.chat.completions.create(model=model, max_tokens=4, logprobs=True, messages=ASK)
    content = reply.choices[0].logprobs.content
    assert len(content) == 4 and all(entry.top_logprobs == [] for entry in content)
    plain = openai_client.chat.completions.create(model=model, max_tokens=4, messages=ASK)
    assert plain.choices[0].logprobs is None
    chunks = list(openai_client.chat.completions.create(model=model, max_tokens=4, stream=True, messages=ASK))
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
    ],
)
def test_bad_logprobs_or_penalties_are_400_naming_the_param(
    stack: Stack, openai_client: OpenAI, extra: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model="ft-a", max_tokens=2, messages=ASK, **extra)
    assert caught.value.response.json()["error"]["param"] == param


@pytest.mark.parametrize("model", MODELS)
def test_penalties_change_the_output(stack: Stack, openai_client: OpenAI, model: str) -> None:
    def tokens(**penalties: float) -> list[str]:
        reply = openai_client.chat.completions.create(
            model=model, max_tokens=16, temperature=0, logprobs=True, messages=ASK, **penalties
        )
        return [entry.token for entry in reply.choices[0].logprobs.content]

    plain = tokens()
    # Negative values reward repeats: the tiny model's greedy text rarely repeats on its own.
    assert tokens(frequency_penalty=-2.0) != plain
    assert tokens(presence_penalty=-2.0) != plain
    assert tokens(presence_penalty=0.0, frequency_penalty=0.0) == plain


def test_a_logprob_json_cannot_carry_goes_out_as_vllms_floor() -> None:
    """-inf (a token the model rules out) and NaN (a broken checkpoint) have no JSON form: a
    non-streamed answer failed to serialize (500), a streamed one sent `-Infinity`."""
    entry = TokenLogprob(
        "a", -math.inf, b"a", [TopLogprob("a", -math.inf, b"a", 64), TopLogprob("b", math.nan, b"b", 65)]
    )
    body = json.loads(json.dumps(logprobs_body([entry]), allow_nan=False))
    (content,) = body["content"]
    assert [content["logprob"]] + [top["logprob"] for top in content["top_logprobs"]] == [-9999.0] * 3


def test_a_chat_answer_skips_fastapis_encoder(
    stack: Stack, openai_client: OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FastAPI walks a returned dict with jsonable_encoder, ~7x json.dumps's cost, on the event loop:
    a third of a second for 1,000 tokens with top_logprobs 20, every stream on the gateway stalled."""
    walked: list[Any] = []
    encoder = fastapi.routing.jsonable_encoder

    def spying(obj: Any, *args: Any, **kwargs: Any) -> Any:
        walked.append(obj)
        return encoder(obj, *args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "jsonable_encoder", spying)  # the gateway runs in this process
    reply = openai_client.chat.completions.create(
        model="ft-a", max_tokens=8, temperature=0, logprobs=True, top_logprobs=20, messages=ASK
    )
    assert len(reply.choices[0].logprobs.content) == reply.usage.completion_tokens
    assert not [obj for obj in walked if isinstance(obj, dict) and obj.get("object") == "chat.completion"]
