"""The disaggregated path end to end: gateway -> encoder -> Redis -> LLM service,
checked against transformers' own Qwen2-VL given the pixels (float32, greedy)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from scripts.fanout import run_fanout
from shared.sdk import EncoderClient, ImageKey, LLMClient, Message, Sampling
from tests.harness import Stack
from tests.images import data_url, pil_image, png_bytes
from tests.reference import reference_greedy_tokens

QUESTIONS = ("What is in this image?", "Count the red things.")
MAX_TOKENS = 12


def _ask(client: OpenAI, model: str, image_url: str, question: str, **extra: object) -> tuple[str, int, str]:
    reply = client.chat.completions.create(
        model=model,
        max_tokens=MAX_TOKENS,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": question}],
            }
        ],
        **extra,
    )
    assert reply.usage is not None
    return reply.choices[0].message.content or "", reply.usage.completion_tokens, reply.choices[0].finish_reason


def _reference_text(checkpoint: Path, tokens: list[int]) -> str:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("model", ["ft-a", "ft-b"])
def test_gateway_greedy_output_equals_transformers_given_pixels(
    stack: Stack, openai_client: OpenAI, checkpoints: dict[str, Path], model: str
) -> None:
    image = png_bytes(seed=11)
    outputs = set()
    for question in QUESTIONS:
        text, completion_tokens, _ = _ask(openai_client, model, data_url(image), question)
        expected = reference_greedy_tokens(checkpoints[model], pil_image(image), question, MAX_TOKENS)
        assert text == _reference_text(checkpoints[model], expected)
        assert completion_tokens == len(expected)
        outputs.add(text)
    assert len(outputs) == len(QUESTIONS), "questions should lead to different answers, else this test proves little"


@pytest.mark.parametrize("model", ["ft-a", "ft-b"])
def test_a_resized_image_gives_the_tokens_of_transformers_default_processor(
    stack: Stack, openai_client: OpenAI, checkpoints: dict[str, Path], model: str
) -> None:
    """100x60 is resized (to 112x56): the encoder must resample as AutoProcessor's default does,
    or the greedy answer drifts from the reference after a few tokens (seen before pixels.py)."""
    image = png_bytes(seed=13, size=(100, 60))
    for question in QUESTIONS:
        text, completion_tokens, _ = _ask(openai_client, model, data_url(image), question)
        expected = reference_greedy_tokens(checkpoints[model], pil_image(image), question, MAX_TOKENS)
        assert (text, completion_tokens) == (_reference_text(checkpoints[model], expected), len(expected))


def test_sdk_tokens_equal_reference_tokens_and_differ_across_models_and_images(
    stack: Stack, checkpoints: dict[str, Path]
) -> None:
    question = QUESTIONS[0]
    seen = {}
    with EncoderClient(stack.encoder_target) as encoder:
        for seed in (21, 22):
            image = png_bytes(seed)
            key = encoder.encode(image_bytes=image).key
            for model in ("ft-a", "ft-b"):
                ask = [Message("user", [ImageKey(key), question])]
                with LLMClient(stack.llm_target(model)) as llm:
                    chunks = list(llm.generate(model, ask, Sampling(max_tokens=MAX_TOKENS)))
                    (whole,) = llm.generate(model, ask, Sampling(max_tokens=MAX_TOKENS), single_chunk=True)
                tokens = [t for c in chunks for t in c.token_ids]
                assert tokens == reference_greedy_tokens(checkpoints[model], pil_image(image), question, MAX_TOKENS)
                assert (whole.token_ids, whole.text) == (tokens, "".join(c.text for c in chunks))
                assert (whole.finish_reason, whole.completion_tokens) == (chunks[-1].finish_reason, len(tokens))
                seen[(seed, model)] = tuple(tokens)
    assert len(set(seen.values())) == 4, f"outputs should differ across images and models: {seen}"


def test_fanout_encodes_each_image_once(stack: Stack) -> None:
    report = run_fanout(stack.base_url, stack.encoder_target, png_bytes(seed=31), ["ft-a", "ft-b"])
    assert len(report.answers) == 6
    assert report.images_encoded == 1
    assert report.cache_hits == 5
    assert all(answer.completion_tokens > 0 for answer in report.answers)


def test_streaming_matches_non_streaming_and_ends_with_usage(stack: Stack, openai_client: OpenAI) -> None:
    url = data_url(png_bytes(seed=41))
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]}
    ]
    full = openai_client.chat.completions.create(model="ft-a", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    stream = openai_client.chat.completions.create(
        model="ft-a",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_image_embeds_part_by_key_answers_like_image_url(stack: Stack, openai_client: OpenAI) -> None:
    image = png_bytes(seed=51)
    encoded = httpx.post(f"{stack.base_url}/v1/images/encode", json={"image_url": data_url(image)}).json()
    assert encoded["grid_thw"][0] == 1 and encoded["num_tokens"] > 0 and encoded["key"].startswith("emb:v1:")
    by_key = openai_client.chat.completions.create(
        model="ft-b",
        max_tokens=MAX_TOKENS,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_embeds", "image_embeds": None, "uuid": encoded["key"]},
                    {"type": "text", "text": QUESTIONS[1]},
                ],
            }
        ],
    )
    text, _, _ = _ask(openai_client, "ft-b", data_url(image), QUESTIONS[1])
    assert by_key.choices[0].message.content == text


def test_text_only_and_multi_turn_conversations_work(stack: Stack, openai_client: OpenAI) -> None:
    reply = openai_client.chat.completions.create(
        model="ft-a",
        max_tokens=5,
        temperature=0,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(png_bytes(61))}},
                    {"type": "text", "text": "And this?"},
                ],
            },
        ],
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.prompt_tokens > 20


def test_models_health_and_request_id(stack: Stack, openai_client: OpenAI) -> None:
    assert sorted(m.id for m in openai_client.models.list()) == ["ft-a", "ft-b"]
    health = httpx.get(f"{stack.base_url}/health")
    assert health.status_code == 200 and all(health.json()["backends"].values())
    assert httpx.get(f"{stack.base_url}/v1/models", headers={"x-request-id": "abc"}).headers["x-request-id"] == "abc"
    assert httpx.get(f"{stack.base_url}/livez").status_code == 200
    assert httpx.get(f"{stack.base_url}/readyz").status_code == 200


def test_stop_string_cuts_the_answer_before_it(stack: Stack, openai_client: OpenAI) -> None:
    url = data_url(png_bytes(seed=11))
    full, _, _ = _ask(openai_client, "ft-a", url, QUESTIONS[0])
    stop = full[3:6]
    assert len(stop) == 3 and full.index(stop) >= 1, f"pick another cut for {full!r}"
    cut, _, finish = _ask(openai_client, "ft-a", url, QUESTIONS[0], stop=[stop])
    assert cut == full[: full.index(stop)]
    assert finish == "stop"
