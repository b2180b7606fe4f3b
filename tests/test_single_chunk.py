"""A chat that is not streamed: its client reads nothing before the end, so each LLM service holds
its choice back and sends it whole, not a message per token (GenerateRequest.single_chunk)."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from llm_service.servicer import _HeldChunks
from tests.harness import Stack
from tests.metrics_text import GENERATE_LABELS, metric_sum

ASK = [{"role": "user", "content": "Count to twenty."}]


def _messages_sent(stack: Stack) -> float:
    return metric_sum(httpx.get(f"{stack.base_url}/metrics").text, "grpc_server_msg_sent_total", **GENERATE_LABELS)


@pytest.mark.parametrize("model", ["ft-a", "ft-b"])  # both engines
def test_a_chat_not_streamed_costs_one_grpc_message_per_choice(stack: Stack, openai_client: OpenAI, model: str) -> None:
    """And with no first token to time, the TTFT histogram is left alone."""
    before = httpx.get(f"{stack.base_url}/metrics").text
    reply = openai_client.chat.completions.create(model=model, max_tokens=12, n=2, temperature=0, messages=ASK)
    after = httpx.get(f"{stack.base_url}/metrics").text
    assert reply.usage.completion_tokens > 2 * 2  # more tokens than messages
    sent = metric_sum(after, "grpc_server_msg_sent_total", **GENERATE_LABELS)
    assert sent == metric_sum(before, "grpc_server_msg_sent_total", **GENERATE_LABELS) + 2
    for name in ("gateway_ttft_seconds_count", "gateway_time_per_output_token_seconds_count"):
        assert metric_sum(after, name, model=model) == metric_sum(before, name, model=model), name


@pytest.mark.parametrize("model", ["ft-a", "ft-b"])
def test_a_choice_past_the_held_size_comes_in_a_few_messages_and_whole(
    stack: Stack, openai_client: OpenAI, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long completion with top_logprobs can outgrow a gRPC message: past the held size it goes
    out in pieces, and the client still gets every token and logprob, as a stream gives them."""
    kwargs = dict(model=model, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5, messages=ASK)
    streamed = list(openai_client.chat.completions.create(stream=True, **kwargs))
    monkeypatch.setattr(_HeldChunks, "MAX_BYTES", 300)  # the services run in this process
    before = _messages_sent(stack)
    reply = openai_client.chat.completions.create(**kwargs)
    sent = _messages_sent(stack) - before
    assert 1 < sent < reply.usage.completion_tokens
    content = [c.choices[0] for c in streamed if c.choices]
    assert reply.choices[0].message.content == "".join(choice.delta.content or "" for choice in content)
    entries = [entry for choice in content if choice.logprobs for entry in choice.logprobs.content]
    assert [(e.token, e.top_logprobs[-1].token) for e in reply.choices[0].logprobs.content] == [
        (e.token, e.top_logprobs[-1].token) for e in entries
    ]
    assert reply.choices[0].finish_reason == content[-1].finish_reason
