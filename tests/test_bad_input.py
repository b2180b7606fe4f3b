"""Bad input gets a clear error naming what is wrong, and nothing else breaks."""

from __future__ import annotations

import base64
import io
import resource
import struct
import time
import zlib

import httpx
import numpy as np
import pytest
from openai import OpenAI
from PIL import Image

from shared.blob import BlobRules, EmbeddingBlob, encode_blob, serialize_unvalidated
from shared.errors import EmbeddingNotFound, IncompatibleEncoder, InvalidEmbedding, ServiceError
from shared.keys import embedding_key
from shared.sdk import EncoderClient, ImageKey, InlineEmbedding, LLMClient, Message, Sampling
from tests.harness import RedisServer, Stack
from tests.images import data_url, png_bytes

HIDDEN = 256  # the tiny checkpoints' LM hidden size


def _chat(stack: Stack, body: object, raw: bytes | None = None) -> httpx.Response:
    url = f"{stack.base_url}/v1/chat/completions"
    if raw is not None:
        return httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(url, json=body, timeout=60)


def _image_chat(model: str, part: dict) -> dict:
    return {
        "model": model,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}],
    }


def _url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_malformed_json_is_400(stack: Stack) -> None:
    _assert_error(_chat(stack, None, raw=b'{"model": "ft-a", "messages": ['), 400)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests"),
        (b'{"model": "ft-a", "messages": [], "max_tokens": ' + b"9" * 5000 + b"}", "too many digits"),
    ],
    ids=["nested-100k-deep", "5000-digit-integer"],
)
def test_json_the_parser_gives_up_on_is_400_saying_why(stack: Stack, raw: bytes, says: str) -> None:
    """Valid JSON that Python's parser refuses (its recursion limit, its 4300-digit integer limit):
    before, FastAPI's bare "There was an error parsing the body"."""
    error = _assert_error(_chat(stack, None, raw=raw), 400)
    assert says in error["message"], error


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "ft-a", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        b'{"model": "ft-a", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
        b'{"model": "ft-a", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": -Infinity}',
    ],
    ids=["NaN", "Infinity", "-Infinity"],
)
def test_a_float_that_is_no_number_is_400_saying_so(stack: Stack, raw: bytes) -> None:
    """NaN and Infinity are not JSON, but Python's parser reads them; they were refused by a range
    check that said "should be less than or equal to 2" of a value that is not a number."""
    error = _assert_error(_chat(stack, None, raw=raw), 400)
    assert "finite number" in error["message"], error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "ft-a"}, "messages"),
        ({"model": "ft-a", "messages": []}, "messages"),
        ({"model": "ft-a", "messages": [{"role": "user", "content": "hi"}], "temperature": 7}, "temperature"),
        ({"model": "ft-a", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        (
            {"model": "ft-a", "messages": [{"role": "user", "content": [{"type": "audio", "x": 1}]}]},
            "messages[0].content",
        ),
        ({"model": "ft-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_fields_are_400_naming_the_param(stack: Stack, body: dict, param: str) -> None:
    error = _assert_error(_chat(stack, body), 400)
    assert error["param"] is not None and error["param"].startswith(param)


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "image_url", "image_url": {"url": 5}}, "messages[0].content[0].image_url.url"),
        ({"type": "image_url", "image_url": "https://example.com/a.png"}, "messages[0].content[0].image_url"),
        ({"type": "text"}, "messages[0].content[0].text"),
        ({"type": "text", "text": 5}, "messages[0].content[0].text"),
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}, "min_pixels": -5},
         "messages[0].content[0].min_pixels"),
        # OpenAI refuses a detail other than auto, low or high; it was accepted.
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "ultra"}},
         "messages[0].content[0].image_url.detail"),
    ],
)  # fmt: skip
def test_a_bad_content_part_is_400_naming_the_part_and_field(stack: Stack, part: dict, param: str) -> None:
    """content is a string or a list of parts: the error is the list's, naming the field at fault
    (it used to be the string form's "messages[0].content: Input should be a valid string")."""
    body = {"model": "ft-a", "messages": [{"role": "user", "content": [part]}]}
    error = _assert_error(_chat(stack, body), 400, param=param, code="invalid_value")
    assert error["message"].startswith(f"{param}: ")


_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("message", "param", "says"),
    [
        # OpenAI refuses an empty list of parts; taken as no text, the turn left the prompt.
        ({"role": "user", "content": []}, "messages[1].content", "at least one content part"),
        ({"role": "assistant", "content": []}, "messages[1].content", "at least one content part"),
        # This gateway takes no tools; a past turn's calls were dropped from the prompt unsaid.
        ({"role": "assistant", "content": None, "tool_calls": [_CALL]}, "messages[1].tool_calls", "tool calls"),
        ({"role": "assistant", "content": "x", "function_call": _CALL["function"]}, "messages[1].function_call",
         "tool calls"),
    ],
)  # fmt: skip
def test_a_message_the_prompt_would_lose_is_400_naming_it(stack: Stack, message: dict, param: str, says: str) -> None:
    """Each was a 200 answering a conversation other than the one sent."""
    messages = [{"role": "user", "content": "hi"}, message, {"role": "user", "content": "and?"}]
    error = _assert_error(_chat(stack, {"model": "ft-a", "messages": messages}), 400, param=param)
    assert says in error["message"], error


def test_an_answer_sent_back_as_the_openai_client_gives_it_is_taken(stack: Stack, openai_client: OpenAI) -> None:
    """The client's message object carries tool_calls, function_call, refusal... all null: no call, no refusal."""
    first = openai_client.chat.completions.create(
        model="ft-a", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    replayed = first.choices[0].message.model_dump()
    assert "tool_calls" in replayed and "function_call" in replayed, replayed
    messages = [{"role": "user", "content": "hi"}, replayed, {"role": "user", "content": "and?"}]
    second = openai_client.chat.completions.create(model="ft-a", messages=messages, max_tokens=3, temperature=0)
    assert second.choices[0].finish_reason == "length"


def test_unknown_model_is_404(stack: Stack, openai_client: OpenAI) -> None:
    _assert_error(
        _chat(stack, {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
        404,
        "model",
        "model_not_found",
    )


def _bomb_png(width: int = 60000, height: int = 60000) -> bytes:
    """A PNG whose header claims billions of pixels, with almost no data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1024)) + chunk(b"IEND", b"")
    )


def _dds_of_unknown_pixel_format() -> bytes:
    """A DDS file whose pixel-format flags are 0: Pillow's parser raises NotImplementedError on it,
    outside the errors an image decoder is usually expected to raise (found by fuzzing)."""
    out = io.BytesIO()
    Image.new("RGBA", (8, 8), (1, 2, 3, 255)).save(out, "DDS")
    data = bytearray(out.getvalue())
    data[80:84] = bytes(4)  # magic (4) + header fields (72) + pixel format size (4): its flags
    return bytes(data)


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (b"this is not an image at all", "not a recognized image"),
        (_dds_of_unknown_pixel_format(), "could not be decoded"),
        (png_bytes(71)[:200], "truncated or corrupt"),
        (_bomb_png(), "decompression bomb"),
    ],
)
def test_bad_images_are_400_and_memory_stays_bounded(stack: Stack, image: bytes, message: str) -> None:
    peak_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    error = _assert_error(_chat(stack, _image_chat("ft-a", _url_part(data_url(image)))), 400)
    assert message in error["message"]
    # The encode API names its own body's field (it named "image", a field no request has).
    encode = httpx.post(f"{stack.base_url}/v1/images/encode", json={"image_url": data_url(image)}, timeout=120)
    assert message in _assert_error(encode, 400, param="image_url")["message"]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before_kib < 200 * 1024


def test_bad_data_url_is_400(stack: Stack) -> None:
    """The error names the request's field by its path, not the encoder's (image_url)."""
    bad = _url_part("data:image/png;base64,@@@@")
    _assert_error(_chat(stack, _image_chat("ft-a", bad)), 400, "messages[0].content[0].image_url.url")
    body = _image_chat("ft-a", _url_part(data_url(png_bytes(94))))
    body["messages"][0]["content"] += [
        bad,
        {"type": "video", "video": [data_url(png_bytes(94)), "data:image/png;base64,"]},
    ]
    _assert_error(_chat(stack, body), 400, "messages[0].content[2].image_url.url")
    body["messages"][0]["content"].pop(2)
    _assert_error(_chat(stack, body), 400, "messages[0].content[2].video[1]")


def test_a_data_url_in_capitals_or_in_lines_of_base64_is_the_same_image(stack: Stack) -> None:
    """RFC 2397: the scheme and type may be in any case; RFC 2045 breaks base64 into lines. Both
    were 400s; both are the image the plain form is, so they get its key."""
    image = png_bytes(93)
    payload = base64.b64encode(image).decode()
    lines = "\r\n".join(payload[i : i + 76] for i in range(0, len(payload), 76))
    keys = []
    for url in (data_url(image), "DATA:IMAGE/PNG;BASE64," + payload, "data:image/png;base64," + lines):
        response = httpx.post(f"{stack.base_url}/v1/images/encode", json={"image_url": url}, timeout=120)
        assert response.status_code == 200, response.text
        keys.append(response.json()["key"])
    assert len(set(keys)) == 1


def test_unknown_key_is_404_at_gateway_and_llm_service(stack: Stack) -> None:
    encoder_id = EncoderClient(stack.encoder_target).stats().encoder_id
    key = embedding_key(encoder_id, b"never stored", 1, 2, dtype="float32")
    part = {"type": "image_embeds", "image_embeds": None, "uuid": key}
    _assert_error(_chat(stack, _image_chat("ft-a", part)), 404, code="embedding_not_found")
    with LLMClient(stack.llm_target("ft-a")) as llm, pytest.raises(EmbeddingNotFound) as caught:
        list(llm.generate("ft-a", [Message("user", [ImageKey(key), "hi"])]))
    assert caught.value.keys == [key]


def test_an_llm_services_complaint_names_the_requests_field(stack: Stack) -> None:
    """The LLM service names the fields of the GenerateRequest the gateway made (image.key, and
    max_tokens for either token limit): through the gateway the error names the request's own field,
    the part's uuid or image_url.url, and max_completion_tokens where that is what the client set."""
    encoder_id = EncoderClient(stack.encoder_target).stats().encoder_id
    frames = [data_url(png_bytes(95)), data_url(png_bytes(96))]
    video_key = httpx.post(f"{stack.base_url}/v1/videos/encode", json={"frames": frames}, timeout=120).json()["key"]
    text = {"type": "text", "text": "What?"}

    def stored(key: str) -> dict:
        return {"type": "image_embeds", "image_embeds": None, "uuid": key}

    never_stored = stored(embedding_key(encoder_id, b"never stored either", 1, 2, dtype="float32"))
    other_encoders = stored(embedding_key("qwen2vl-other", b"x", 1, 2, dtype="float32"))
    cases = [
        ([text, never_stored], 404, "messages[0].content[1].uuid"),
        ([other_encoders, text], 409, "messages[0].content[0].uuid"),
        ([text, text, stored(video_key)], 400, "messages[0].content[2].uuid"),  # a video's blob as an image
    ]
    for content, status, param in cases:
        body = {"model": "ft-b", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
        _assert_error(_chat(stack, body), status, param=param)
    limited = {"model": "ft-b", "max_completion_tokens": 5000, "messages": [{"role": "user", "content": "hi"}]}
    error = _assert_error(_chat(stack, limited), 400, param="max_completion_tokens")
    assert error["message"].startswith("max_completion_tokens must be in 1..")
    # gRPC SDK users get the GenerateRequest's own path.
    with LLMClient(stack.llm_target("ft-b")) as llm, pytest.raises(InvalidEmbedding) as caught:
        list(llm.generate("ft-b", [Message("user", ["What?", ImageKey(video_key)])]))
    assert caught.value.param == "messages[0].content[1].image.key"


def test_a_placeholder_token_in_text_is_400_naming_the_part_that_holds_it(stack: Stack) -> None:
    """`<|image_pad|>` in text would stand where an image's rows go; the refusal names the text
    part, among many, by the request's own path (it named only `messages` before)."""
    padded = {"type": "text", "text": "look: <|image_pad|>"}
    many = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "and"}, padded]}]  # fmt: skip
    cases = [
        ([{"role": "user", "content": "a <|video_pad|> b"}], "messages[0].content"),  # a string content
        (many, "messages[2].content[1].text"),
    ]
    for messages, param in cases:
        error = _assert_error(_chat(stack, {"model": "ft-b", "max_tokens": 2, "messages": messages}), 400, param=param)
        assert "text may not contain <|" in error["message"], error
    with LLMClient(stack.llm_target("ft-b")) as llm, pytest.raises(ServiceError) as caught:
        list(llm.generate("ft-b", [Message("user", ["fine"]), Message("user", ["x", "<|image_pad|>"])]))
    assert caught.value.param == "messages[1].content[1].text"


def test_gateway_re_encodes_once_when_a_key_vanishes_before_generate(stack: Stack, openai_client: OpenAI) -> None:
    encoder = stack.gateway_app.state.backends.encoder
    original_encode = encoder.encode
    redis_client = stack.redis.client()

    evicted: list[str] = []

    async def encode_then_evict(**kwargs: object):  # simulates an eviction right after the first Encode
        result = await original_encode(**kwargs)
        if not evicted:
            redis_client.delete(result.key)
            evicted.append(result.key)
        return result

    stats = EncoderClient(stack.encoder_target)
    before = stats.stats().images_encoded
    encoder.encode = encode_then_evict
    try:
        reply = openai_client.chat.completions.create(**_image_chat("ft-a", _url_part(data_url(png_bytes(72)))))
    finally:
        encoder.encode = original_encode
    assert reply.choices[0].message.content is not None
    assert evicted and redis_client.exists(evicted[0])
    assert stats.stats().images_encoded - before == 2  # encoded, evicted, encoded again by the one retry


@pytest.mark.parametrize("model", ["ft-a", "ft-b"])  # ft-a runs vLLM where installed, which dies on bad shapes
def test_bad_blobs_are_rejected_before_the_engine_and_service_keeps_answering(stack: Stack, model: str) -> None:
    encoder_id = EncoderClient(stack.encoder_target).stats().encoder_id
    grid = np.array([[1, 4, 4]])
    cases = [
        (EmbeddingBlob(_randn(4, HIDDEN), grid, "qwen2vl-other"), IncompatibleEncoder, "qwen2vl-other"),
        (EmbeddingBlob(_randn(4, 64), grid, encoder_id), InvalidEmbedding, "hidden size"),
        (EmbeddingBlob(_randn(5, HIDDEN), grid, encoder_id), InvalidEmbedding, "implies 4"),
        (EmbeddingBlob(_randn(1, 4, HIDDEN), grid, encoder_id), InvalidEmbedding, "2-D"),
    ]
    with LLMClient(stack.llm_target(model)) as llm:
        for blob, error_class, message in cases:
            with pytest.raises(error_class, match=message):
                list(llm.generate(model, [Message("user", [InlineEmbedding(serialize_unvalidated(blob)), "hi"])]))
        good = EmbeddingBlob(_randn(4, HIDDEN), grid, encoder_id)
        rules = BlobRules(2, HIDDEN, frozenset({encoder_id}))
        chunks = list(
            llm.generate(
                model, [Message("user", [InlineEmbedding(encode_blob(good, rules)), "hi"])], Sampling(max_tokens=3)
            )
        )
    assert chunks[-1].finish_reason in ("stop", "length")


def _randn(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape, dtype=np.float32)


def test_corrupt_stored_blob_is_a_client_error_via_gateway(stack: Stack) -> None:
    encoder_id = EncoderClient(stack.encoder_target).stats().encoder_id
    key = embedding_key(encoder_id, b"corrupt entry", 1, 2, dtype="float32")
    # 3 rows for a grid that implies 4: what a buggy writer might store
    stored = serialize_unvalidated(EmbeddingBlob(_randn(3, HIDDEN), np.array([[1, 4, 4]]), encoder_id))
    stack.redis.client().set(key, stored, ex=60)
    part = {"type": "image_embeds", "image_embeds": None, "uuid": key}
    _assert_error(_chat(stack, _image_chat("ft-a", part)), 400, code="invalid_embedding")


def test_redis_down_is_503_fast_and_service_resumes_without_restart(stack: Stack, live_redis: RedisServer) -> None:
    body = _image_chat("ft-a", _url_part(data_url(png_bytes(81))))
    live_redis.stop()
    started = time.monotonic()
    response = _chat(stack, body)
    elapsed = time.monotonic() - started
    _assert_error(response, 503, code="unavailable")
    assert response.headers["retry-after"] == "1"
    assert elapsed < 2.5, f"503 took {elapsed:.2f}s"
    live_redis.start()
    response = _chat(stack, body)
    assert response.status_code == 200, response.text


def test_errors_never_echo_large_input(stack: Stack) -> None:
    response = _chat(stack, {"model": "x" * 100_000, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404 and len(response.text) < 1000


def test_sdk_raises_typed_errors(stack: Stack) -> None:
    with EncoderClient(stack.encoder_target) as encoder, pytest.raises(ServiceError, match="not a recognized image"):
        encoder.encode(image_bytes=b"nope")
