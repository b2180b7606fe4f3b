"""What a client expects of the API, checked with the official openai client:
choices, sampling, stop, usage, multi-image conversations, embeddings in and out,
API keys and load shedding."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch
from fastapi import FastAPI
from openai import OpenAI

from gateway.unsupported import NEUTRAL
from shared.blob import BlobRules, decode_blob
from shared.sdk import EncoderClient, ImageKey, LLMClient, Message, Sampling
from tests.harness import Stack
from tests.images import data_url, png_bytes


def _image_message(url: str, text: str) -> dict:
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
    }


def test_n_choices_with_a_seed_are_indexed_and_reproducible(stack: Stack, openai_client: OpenAI) -> None:
    kwargs = dict(
        model="ft-a", max_tokens=8, temperature=1.0, seed=7, n=2, messages=[{"role": "user", "content": "Tell a story"}]
    )
    first = openai_client.chat.completions.create(**kwargs)
    again = openai_client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.choices[0].message.content != first.choices[1].message.content
    assert first.usage.completion_tokens == 16


def test_the_top_seed_with_n_choices_wraps_around_instead_of_failing(stack: Stack, openai_client: OpenAI) -> None:
    """Choice i is seeded with seed + i, wrapped into 0..2**63-1: the top seed's second choice is
    seed 0's first (it was a 500: seed + 1 did not fit the gRPC field)."""
    kwargs = dict(model="ft-a", max_tokens=6, temperature=1.0, messages=[{"role": "user", "content": "Tell a story"}])
    top = openai_client.chat.completions.create(**kwargs, seed=2**63 - 1, n=2)
    zero = openai_client.chat.completions.create(**kwargs, seed=0)
    assert top.choices[1].message.content == zero.choices[0].message.content


def test_nulls_where_openai_allows_them_are_answered(stack: Stack) -> None:
    """null for an optional field is its default, and an assistant turn may have null content
    (both were 400s): raw JSON, since the openai client leaves unset fields out."""
    body = {"model": "ft-a", "max_tokens": 2, "n": None, "stream": None, "logprobs": None, "temperature": None,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                         {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]}  # fmt: skip
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    body["messages"] = [{"role": "user", "content": None}]
    refused = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and "content" in refused.json()["error"]["param"], refused.text


def test_streaming_n_choices_each_end_with_a_finish_reason(stack: Stack, openai_client: OpenAI) -> None:
    stream = openai_client.chat.completions.create(
        model="ft-b", max_tokens=5, n=2, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}],
    )  # fmt: skip
    chunks = list(stream)
    finishes = {
        c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    }
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 10


@pytest.mark.parametrize("model", ["ft-a", "ft-b"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(
    stack: Stack, openai_client: OpenAI, model: str
) -> None:
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries usage,
    the prompt's tokens and its choice's completion tokens so far (0 in the role chunk), and the
    last chunk the total, as without it; without include_usage no chunk has usage."""
    kwargs = dict(
        model=model, max_tokens=5, n=2, temperature=0, stream=True, messages=[{"role": "user", "content": "hi"}]
    )
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(openai_client.chat.completions.create(**kwargs, stream_options=options))
    total = chunks[-1].usage
    assert chunks[-1].choices == [] and total.prompt_tokens > 0 and total.completion_tokens == 10
    so_far = {0: -1, 1: -1}  # each choice's completion tokens in its chunks up to here
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        usage = chunk.usage
        assert usage is not None and usage.prompt_tokens == total.prompt_tokens, chunk
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        if choice.delta.role:
            assert usage.completion_tokens == 0
        elif choice.finish_reason:
            assert usage.completion_tokens == so_far[choice.index] == 5
        else:
            assert usage.completion_tokens > so_far[choice.index]
        so_far[choice.index] = usage.completion_tokens
    options["include_usage"] = False
    plain = list(openai_client.chat.completions.create(**kwargs, stream_options=options))
    assert len(plain) > 4 and all(chunk.usage is None for chunk in plain)


def test_max_completion_tokens_stop_list_and_unknown_fields(stack: Stack, openai_client: OpenAI) -> None:
    reply = openai_client.chat.completions.create(
        model="ft-a", max_completion_tokens=3, messages=[{"role": "user", "content": "hi"}],
        extra_body={"some_vendor_field": {"x": 1}}, user="someone",
    )  # fmt: skip
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    long = openai_client.chat.completions.create(
        model="ft-a", max_tokens=12, temperature=0, messages=[{"role": "user", "content": "hi"}]
    )
    text = long.choices[0].message.content
    cut = openai_client.chat.completions.create(
        model="ft-a",
        max_tokens=12,
        temperature=0,
        stop=["\u2603", text[4:6]],
        messages=[{"role": "user", "content": "hi"}],
    )
    assert cut.choices[0].message.content == text[: text.index(text[4:6])]


def test_several_images_across_messages_and_turns_match_the_sdk(stack: Stack, openai_client: OpenAI) -> None:
    first, second = png_bytes(301), png_bytes(302)
    with EncoderClient(stack.encoder_target) as encoder:
        key_first, key_second = encoder.encode(image_bytes=first).key, encoder.encode(image_bytes=second).key
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(first)}},
                                     {"type": "image_embeds", "image_embeds": None, "uuid": key_second},
                                     {"type": "text", "text": "Compare them."}]},
        {"role": "assistant", "content": "They differ."},
        _image_message(data_url(second), "And now?"),
    ]  # fmt: skip
    reply = openai_client.chat.completions.create(model="ft-b", max_tokens=8, temperature=0, messages=messages)
    sdk_messages = [
        Message("user", [ImageKey(key_first), ImageKey(key_second), "Compare them."]),
        Message("assistant", ["They differ."]),
        Message("user", [ImageKey(key_second), "And now?"]),
    ]
    with LLMClient(stack.llm_target("ft-b")) as llm:
        expected = "".join(c.text for c in llm.generate("ft-b", sdk_messages, Sampling(max_tokens=8)))
    assert reply.choices[0].message.content == expected


def test_vllm_image_forms_and_the_developer_role_answer_as_their_plain_forms(
    stack: Stack, openai_client: OpenAI
) -> None:
    """What a client written for vLLM sends: an image_url part with its own uuid (accepted, not
    used: the key comes from the content), `"image_url": null` with a stored key as uuid, and
    OpenAI's developer role, taken as system. Each must answer as its plain form does."""
    image = png_bytes(306)
    with EncoderClient(stack.encoder_target) as encoder:
        key = encoder.encode(image_bytes=image).key

    def answer(part: dict, role: str = "system") -> str | None:
        messages = [{"role": role, "content": "Answer briefly."},
                    {"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]  # fmt: skip
        reply = openai_client.chat.completions.create(model="ft-a", max_tokens=8, temperature=0, messages=messages)
        return reply.choices[0].message.content

    plain = answer({"type": "image_url", "image_url": {"url": data_url(image)}})
    assert answer({"type": "image_url", "image_url": {"url": data_url(image)}, "uuid": "my-own-name"}) == plain
    assert answer({"type": "image_url", "image_url": None, "uuid": key}) == plain
    assert answer({"type": "image_embeds", "image_embeds": None, "uuid": key}, role="developer") == plain
    other = answer({"type": "image_url", "image_url": {"url": data_url(png_bytes(307))}, "uuid": "my-own-name"})
    assert other != plain  # a reused client uuid does not stand for the first image


def test_too_many_images_is_400(stack: Stack) -> None:
    part = {"type": "image_url", "image_url": {"url": data_url(png_bytes(303))}}
    body = {"model": "ft-a", "messages": [{"role": "user", "content": [part] * 17}]}
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and "limit is 16" in response.json()["error"]["message"]


def test_encode_endpoint_returns_the_embeddings_on_request(stack: Stack) -> None:
    reply = httpx.post(
        f"{stack.base_url}/v1/images/encode", json={"image_url": data_url(png_bytes(304)), "return_embeddings": True}
    ).json()
    blob = decode_blob(base64.b64decode(reply["embeddings"]), BlobRules(2, 256, frozenset({reply["encoder_id"]})))
    assert blob.num_tokens == reply["num_tokens"] and blob.grid_thw[0].tolist() == reply["grid_thw"]
    plain = httpx.post(f"{stack.base_url}/v1/images/encode", json={"image_url": data_url(png_bytes(304))}).json()
    assert plain["embeddings"] is None and plain["cache_hit"]


def _keyed(strict_gateway: str, key: str = "test-key-2") -> OpenAI:
    return OpenAI(base_url=f"{strict_gateway}/v1", api_key=key, max_retries=0, timeout=120)


def test_api_keys_are_required_and_never_echoed(strict_gateway: str) -> None:
    assert [m.id for m in _keyed(strict_gateway).models.list()] == ["ft-a", "ft-b"]
    with pytest.raises(openai.AuthenticationError) as caught:
        _keyed(strict_gateway, "wrong-secret-value").models.list()
    assert "wrong-secret-value" not in caught.value.response.text
    assert caught.value.response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{strict_gateway}/health").status_code == 200  # probes need no key


def _npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def test_inline_embeddings_in_vllm_form_answer_like_the_stored_key(stack: Stack, strict_gateway: str) -> None:
    with EncoderClient(stack.encoder_target) as encoder:
        result = encoder.encode(image_bytes=png_bytes(305))
        blob = decode_blob(encoder.get_embedding(result.key), BlobRules(2, 256, frozenset({result.encoder_id})))
    inline = {"type": "image_embeds", "image_embeds": _npy_b64(blob.embeds), "image_grid_thw": result.grid_thw}
    by_key = {"type": "image_embeds", "image_embeds": None, "uuid": result.key}
    client = _keyed(strict_gateway)
    answers = [
        client.chat.completions.create(model="ft-a", max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}])
        .choices[0].message.content
        for part in (inline, by_key)
    ]  # fmt: skip
    assert answers[0] == answers[1]


def test_pickle_payloads_are_refused_naming_the_safe_formats(strict_gateway: str, stack: Stack) -> None:
    buffer = io.BytesIO()
    torch.save(torch.zeros(4, 256), buffer)
    part = {
        "type": "image_embeds",
        "image_embeds": base64.b64encode(buffer.getvalue()).decode(),
        "image_grid_thw": [1, 4, 4],
    }
    body = {"model": "ft-a", "messages": [{"role": "user", "content": [part]}]}
    response = httpx.post(
        f"{strict_gateway}/v1/chat/completions", json=body, headers={"authorization": "Bearer test-key-1"}
    )
    assert response.status_code == 400
    assert ".npy" in response.json()["error"]["message"] and "safetensors" in response.json()["error"]["message"]
    disabled = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body)
    assert disabled.status_code == 400 and "disabled" in disabled.json()["error"]["message"]


@pytest.mark.parametrize(
    ("first_path", "second_path"),
    [("/v1/chat/completions", "/v1/chat/completions"), ("/v1/chat/completions", "/v1/images/encode"),
     ("/v1/images/encode", "/v1/chat/completions")],
)  # fmt: skip
def test_over_the_concurrency_limit_is_429_with_retry_after(
    strict_gateway_app: FastAPI, first_path: str, second_path: str
) -> None:
    """Chats and encodes share the limit: an encode, which runs the vision tower, took no slot."""
    encoder = strict_gateway_app.state.backends.encoder
    original_encode, release = encoder.encode, threading.Event()

    async def held_encode(**kwargs: object):  # keeps the first request in flight until released
        await asyncio.to_thread(release.wait, 60)
        return await original_encode(**kwargs)

    base, headers = strict_gateway_app.state.base_url, {"authorization": "Bearer test-key-1"}
    url = data_url(png_bytes(306))
    bodies = {
        "/v1/chat/completions": {"model": "ft-a", "max_tokens": 2, "messages": [_image_message(url, "hi")]},
        "/v1/images/encode": {"image_url": url},
    }
    encoder.encode = held_encode
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, base + first_path, json=bodies[first_path], headers=headers, timeout=120)
            while strict_gateway_app.state.admission.in_flight == 0:
                time.sleep(0.01)
            second = httpx.post(base + second_path, json=bodies[second_path], headers=headers, timeout=60)
            release.set()
            assert first.result().status_code == 200
    finally:
        encoder.encode = original_encode
        release.set()
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert second.json()["error"]["code"] == "rate_limit_exceeded"


def test_models_retrieve_reads_one_model_and_404s_an_unknown_one(openai_client: OpenAI) -> None:
    """The official client's models.retrieve (GET /v1/models/{model}) was a bare 404 for every model."""
    model = openai_client.models.retrieve("ft-a")
    assert (model.id, model.object) == ("ft-a", "model")
    assert time.time() - 24 * 3600 < model.created <= time.time(), model  # a real time, as OpenAI's; it was 0
    assert [listed.created for listed in openai_client.models.list()] == [model.created] * 2
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.models.retrieve("nope")
    error = caught.value.response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model") and "ft-a, ft-b" in error["message"]


# One value per field of gateway/unsupported.py that asks for more than plain text sampled as
# documented: each must be a 400 naming the field (a test below keeps this list complete).
ANSWER_CHANGING = {
    "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
    "tool_choice": "required",
    "functions": [{"name": "lookup"}],
    "function_call": "auto",
    "logit_bias": {"5": 100},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "top_k": 1,
    "min_p": 0.2,
    "repetition_penalty": 1.05,
    "structured_outputs": {"choice": ["yes", "no"]},
    "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": "root ::= 'a'",
    "web_search_options": {},
    "use_beam_search": True,
    "best_of": 2,
    "length_penalty": 0.5,
    "min_tokens": 2,
    "ignore_eos": True,
    "stop_token_ids": [5],
    "bad_words": ["no"],
    "allowed_token_ids": [5, 6],
    "thinking_token_budget": 10,
    "repetition_detection": {"max_pattern_size": 4},
    "watermarking": True,
    "vllm_xargs": {"k": 1},
    "chat_template": "{{ messages[0].content }}",
    "chat_template_kwargs": {"enable_thinking": False},
    "add_generation_prompt": False,
    "continue_final_message": True,
    "add_special_tokens": True,
    "documents": [{"title": "t", "text": "x"}],
    "mm_processor_kwargs": {"max_pixels": 3136},
    "media_io_kwargs": {"image": {"mode": "L"}},
    "truncate_prompt_tokens": 5,
    "echo": True,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "prompt_logprobs": 0,
    "logprob_token_ids": [5],
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
}
# The same fields at their neutral values (OpenAI's or vLLM's defaults): they ask for nothing more.
NEUTRAL_VALUES = {
    "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "functions": [], "function_call": "none",
    "logit_bias": {}, "audio": None, "modalities": ["text"], "prediction": None, "top_k": -1, "min_p": 0,
    "repetition_penalty": 1.0, "structured_outputs": None, "guided_json": None, "guided_regex": None,
    "guided_choice": None, "guided_grammar": None, "web_search_options": None, "use_beam_search": False,
    "best_of": 1, "length_penalty": 1.0, "min_tokens": 0, "ignore_eos": False, "stop_token_ids": [], "bad_words": [],
    "allowed_token_ids": None, "thinking_token_budget": None, "repetition_detection": None, "watermarking": False,
    "vllm_xargs": None, "chat_template": None, "chat_template_kwargs": {}, "add_generation_prompt": True,
    "continue_final_message": False, "add_special_tokens": False, "documents": None, "mm_processor_kwargs": {},
    "media_io_kwargs": {}, "truncate_prompt_tokens": None, "echo": False, "include_stop_str_in_output": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "prompt_logprobs": None,
    "logprob_token_ids": None, "return_tokens_as_token_ids": False, "return_token_ids": False,
}  # fmt: skip


def test_every_refused_field_has_a_case_here() -> None:
    assert set(ANSWER_CHANGING) == set(NEUTRAL) == set(NEUTRAL_VALUES)


@pytest.mark.parametrize(("field", "value"), ANSWER_CHANGING.items(), ids=list(ANSWER_CHANGING))
def test_fields_that_change_the_answer_are_refused_not_ignored(
    openai_client: OpenAI, field: str, value: object
) -> None:
    """A client asking for JSON, tool calls or biased logits used to get a 200 of plain text; one
    asking for vLLM's echo, beam search, min_tokens or its own chat template, a 200 without them."""
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model="ft-a", max_tokens=2, messages=messages, extra_body={field: value})
    error = caught.value.response.json()["error"]
    assert error["param"] == field and "not supported" in error["message"]


def test_fields_at_their_neutral_values_are_accepted(openai_client: OpenAI) -> None:
    reply = openai_client.chat.completions.create(
        model="ft-a", max_tokens=2, messages=[{"role": "user", "content": "hi"}], extra_body=NEUTRAL_VALUES
    )
    assert reply.choices[0].finish_reason == "length"
