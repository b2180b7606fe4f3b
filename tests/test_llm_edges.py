"""The context window through the real stack (tests/harness.py: ft-a on vLLM, ft-b on transformers):
a prompt that does not fit is a 400 `context_length_exceeded` naming both counts, streaming or not,
and max_tokens is capped to the room the prompt leaves, as vLLM does (llm_service/context.py)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx
import numpy as np
import pytest

from llm_service.chat_request import PromptMessage
from llm_service.prompt import IMAGE_PAD, VIDEO_PAD
from shared.blob import EmbeddingBlob, encode_blob
from shared.errors import InvalidEmbedding, InvalidInput
from shared.keys import embedding_key
from shared.sdk import InlineEmbedding, LLMClient, Message, Sampling
from tests.harness import VLLM_LIMITS, Stack

MAX_MODEL_LEN = VLLM_LIMITS["max_model_len"]  # both LLM services of the in-process stack get it
MODELS = ("ft-a", "ft-b")


def _prompt_tokens(stack: Stack, model: str, text: str) -> int:
    """What the service renders for one user message of `text`: the count its error must name."""
    return len(stack.llms[model].core.prompt_builder.build([PromptMessage("user", [text])]))


def _text_of(stack: Stack, model: str, tokens: int) -> str:
    """User text whose rendered prompt has exactly `tokens` tokens (the tiny tokenizer: one per 'a ')."""
    words = tokens
    while _prompt_tokens(stack, model, "a " * words) > tokens:
        words -= 1
    text = "a " * words
    assert _prompt_tokens(stack, model, text) == tokens, "could not hit the prompt length exactly"
    return text


def _chat(stack: Stack, body: dict[str, Any]) -> httpx.Response:
    if not body.get("stream"):
        return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=120) as response:
        response.read()
        return response


def _body(model: str, content: Any, stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip


def _assert_too_long(response: httpx.Response, prompt_tokens: int | None) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert error["type"] == "invalid_request_error"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    if prompt_tokens is not None:
        assert f"resulted in {prompt_tokens} tokens" in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", MODELS)
def test_text_longer_than_the_context_is_a_400_naming_both_counts(stack: Stack, model: str, stream: bool) -> None:
    text = "a " * (MAX_MODEL_LEN + 300)  # well past 2048: vLLM refused it with a 500 before
    _assert_too_long(_chat(stack, _body(model, text, stream)), _prompt_tokens(stack, model, text))


@pytest.mark.parametrize("model", MODELS)
def test_a_text_surely_too_long_is_refused_untokenized_while_others_are_served(stack: Stack, model: str) -> None:
    """~9 MB of text is refused from its length alone (PromptBuilder.min_tokens), with no tokenizing:
    it took ~5 s of this loop, and 40 MB 30-45 s, during which no other request was served."""
    huge = _body(model, "ab " * 3_000_000, max_tokens=2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        refused = pool.submit(_chat, stack, huge)
        small = pool.submit(_chat, stack, _body(model, "hi", max_tokens=2))
        assert small.result().status_code == 200, small.result().text
        response = refused.result()
    _assert_too_long(response, None)
    assert "characters of text, at least" in response.json()["error"]["message"]


@pytest.mark.parametrize("model", MODELS)
def test_the_length_bound_never_exceeds_the_tokens_a_text_becomes(stack: Stack, model: str) -> None:
    """min_tokens is a lower bound, or a prompt that fits would be refused: texts made of the
    vocabulary's longest entries, combining marks (joined by normalisation), CJK and emoji."""
    builder = stack.llms[model].core.prompt_builder
    vocab = builder.tokenizer.get_vocab()
    longest = [token for token in sorted(vocab, key=len, reverse=True) if token not in (IMAGE_PAD, VIDEO_PAD)][:20]
    texts = [builder.tokenizer.convert_tokens_to_string([token]) * 50 for token in longest]
    texts += ["e\u0301" * 500, "\u1100\u1161\u11a8" * 500, "漢字かな" * 300, "🙂👍🏽" * 300, " " * 5000, "a" * 5000]
    for text in texts:
        rendered = builder.render([PromptMessage("user", [text])])
        assert builder.min_tokens(rendered) <= len(builder.tokenize(rendered, [])), repr(text[:40])


@pytest.mark.parametrize("model", MODELS)
def test_a_prompt_that_fills_the_context_exactly_leaves_no_room_and_is_refused(stack: Stack, model: str) -> None:
    """vLLM's rule: the prompt must leave room for one generated token."""
    _assert_too_long(_chat(stack, _body(model, _text_of(stack, model, MAX_MODEL_LEN))), MAX_MODEL_LEN)


@pytest.mark.parametrize("model", MODELS)
def test_max_tokens_is_capped_to_the_room_left_so_output_stops_at_the_context_end(stack: Stack, model: str) -> None:
    room = 3
    body = _body(model, _text_of(stack, model, MAX_MODEL_LEN - room), max_tokens=100)
    response = _chat(stack, body)
    assert response.status_code == 200, response.text
    usage, choice = response.json()["usage"], response.json()["choices"][0]
    assert usage["prompt_tokens"] == MAX_MODEL_LEN - room
    assert usage["completion_tokens"] <= room
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == room


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", MODELS)
def test_one_image_with_more_tokens_than_the_context_is_a_400(stack: Stack, model: str, stream: bool) -> None:
    """A stored blob of 2304 image tokens (grid 1 x 96 x 96, merged 2 x 2): the tiny test
    encoder's max_pixels keeps its own images far smaller, so the blob is put in Redis directly."""
    rules = stack.llms[model].core.rules
    encoder_id = next(iter(rules.accepted_encoder_ids))
    rows = np.random.default_rng(0).standard_normal((96 * 96 // 4, rules.hidden_size), dtype=np.float32)
    blob = EmbeddingBlob(rows, np.array([[1, 96, 96]]), encoder_id)
    key = embedding_key(encoder_id, b"an image larger than the context", 1, 2, dtype="float32")
    stack.redis.client().set(key, encode_blob(blob, rules), ex=60)
    image = {"type": "image_embeds", "image_embeds": None, "uuid": key}
    response = _chat(stack, _body(model, [image, {"type": "text", "text": "What is it?"}], stream))
    _assert_too_long(response, None)
    assert "resulted in 23" in response.json()["error"]["message"]  # 2304 image tokens plus the text


@pytest.mark.parametrize("model", MODELS)
def test_a_seed_outside_the_table_is_invalid_input_through_the_sdk(stack: Stack, model: str) -> None:
    """The gateway refuses a negative seed by the sampling table; a pipeline calling the LLM
    service directly gets the same rule, not whatever the engine does with it."""
    with LLMClient(stack.llm_target(model)) as llm:
        with pytest.raises(InvalidInput) as caught:
            list(llm.generate(model, [Message("user", ["hi"])], Sampling(max_tokens=2, temperature=1.0, seed=-1)))
    assert caught.value.param == "seed" and "seed must be in 0..9223372036854775807" in str(caught.value)


@pytest.mark.parametrize("model", MODELS)
def test_an_inline_blob_whose_header_nests_deeply_is_invalid_embedding(stack: Stack, model: str) -> None:
    """json recurses once per bracket: 100k of them raised RecursionError past the codec's error
    mapping, an internal error (500) for what is the client's malformed blob."""
    header = b"[" * 100_000 + b"]" * 100_000
    blob = len(header).to_bytes(8, "little") + header + bytes(8)
    with LLMClient(stack.llm_target(model)) as llm:
        with pytest.raises(InvalidEmbedding, match="nested too deeply"):
            list(llm.generate(model, [Message("user", [InlineEmbedding(blob), "hi"])], Sampling(max_tokens=2)))
