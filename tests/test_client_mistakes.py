"""Every client mistake is a 4xx in OpenAI's form, with a request id, on both engines.

One table of bad requests goes through the real stack (gateway over HTTP, encoder and LLM services
over gRPC, a real Redis): ft-a decodes with vLLM where installed, ft-b with transformers, and each
request is sent streaming and not. Each answer must be the expected 4xx with the body
`{"error": {"message", "type", "param", "code"}}` and an `x-request-id` header, and the stack must
answer a good request afterwards.
"""

from __future__ import annotations

import base64
import io
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
from PIL import Image

from shared.sdk import EncoderClient
from tests.harness import Stack
from tests.images import data_url, png_bytes

MODELS = ("ft-a", "ft-b")
HIDDEN = 256  # the tiny checkpoints' LM hidden size
CONTEXT = 2048  # the test stack's LLM max_model_len (tests/harness.py VLLM_LIMITS)
STRICT_KEY = {"authorization": "Bearer test-key-1"}  # the strict gateway's API key


@dataclass(frozen=True)
class BadRequest:
    """A request body (or raw bytes) and what the gateway must answer."""

    name: str
    build: Callable[[str, bool, str], dict | bytes]  # (model, stream, encoder_id) -> JSON body or raw bytes
    status: int
    code: str | None = None
    param: str | None = None
    inline: bool = False  # needs the gateway with inline embeddings on


def _chat(model: str, stream: bool, content: list | str, **fields: object) -> dict:
    return {"model": model, "stream": stream, "max_tokens": 4, "messages": [{"role": "user", "content": content}],
            **fields}  # fmt: skip


def _image(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return data_url(buffer.getvalue())


def _npy_claiming_rows(rows: int) -> str:
    """A .npy whose header claims [rows, HIDDEN] float32 but carries one row of data."""
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {HIDDEN}), }}"
    header += " " * (63 - (len(header) + 10) % 64) + "\n"
    raw = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + b"\0" * (4 * HIDDEN)
    return base64.b64encode(raw).decode()


def _npy(rows: int) -> str:
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((rows, HIDDEN), dtype=np.float32))
    return base64.b64encode(buffer.getvalue()).decode()


def _inline(embeds: str, grid: list[int]) -> dict:
    return {"type": "image_embeds", "image_embeds": embeds, "image_grid_thw": grid}


def _keyed(key: str) -> dict:
    return {"type": "image_embeds", "image_embeds": None, "uuid": key}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


LONG_TEXT = "apple banana cherry " * 1200  # thousands of tokens, past the 2048-token context
# An image part whose embeddings alone (2100 rows: grid 1 x 60 x 140 / 2**2) overflow the context.
WIDE_GRID = [1, 60, 140]

CASES = [
    BadRequest("text longer than the context", lambda m, s, e: _chat(m, s, LONG_TEXT), 400,
               "context_length_exceeded", "messages"),
    BadRequest("image tokens longer than the context",
               lambda m, s, e: _chat(m, s, [_inline(_npy(2100), WIDE_GRID), _text("hi")]), 400,
               "context_length_exceeded", "messages", inline=True),
    BadRequest("npy header claims ~95 GiB", lambda m, s, e: _chat(
        m, s, [_inline(_npy_claiming_rows(100_000_000), [1, 20_000, 20_000]), _text("hi")]), 400, inline=True),
    BadRequest("max_tokens as a string", lambda m, s, e: _chat(m, s, "hi", max_tokens="12"), 400,
               param="max_tokens"),
    BadRequest("stream as a string", lambda m, s, e: {**_chat(m, s, "hi"), "stream": "yes"}, 400, param="stream"),
    BadRequest("temperature as a string", lambda m, s, e: _chat(m, s, "hi", temperature="0.5"), 400,
               param="temperature"),
    BadRequest("body not UTF-8", lambda m, s, e: b'{"model": "' + m.encode() + b'", "messages": "\xff\xfe"}', 400),
    BadRequest("body not JSON", lambda m, s, e: b"{not json", 400),
    BadRequest("aspect ratio over 200", lambda m, s, e: _chat(
        m, s, [{"type": "image_url", "image_url": {"url": _image(2010, 10)}}, _text("hi")]), 400),
    BadRequest("image bytes that are no image", lambda m, s, e: _chat(
        m, s, [{"type": "image_url", "image_url": {"url": data_url(b"plain text")}}, _text("hi")]), 400),
    BadRequest("file URL", lambda m, s, e: _chat(
        m, s, [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, _text("hi")]), 400),
    BadRequest("key that is not an embedding key", lambda m, s, e: _chat(m, s, [_keyed("secret"), _text("hi")]), 400),
    BadRequest("10,000-character key", lambda m, s, e: _chat(
        m, s, [_keyed(f"emb:v1:{e}:" + "a" * 10_000), _text("hi")]), 400),
    BadRequest("unknown model", lambda m, s, e: _chat("no-such-model", s, "hi"), 404, "model_not_found", "model"),
    BadRequest("max_tokens over the service's limit", lambda m, s, e: _chat(m, s, "hi", max_tokens=100_000), 400),
    BadRequest("too many images", lambda m, s, e: _chat(
        m, s, [{"type": "image_url", "image_url": {"url": data_url(png_bytes(1))}}] * 17 + [_text("hi")]), 400),
    BadRequest("unknown content part", lambda m, s, e: _chat(m, s, [{"type": "audio", "audio": "x"}]), 400),
    BadRequest("image_url null and no uuid", lambda m, s, e: _chat(
        m, s, [{"type": "image_url", "image_url": None}, _text("hi")]), 400, param="messages[0].content[0]"),
    BadRequest("image_url null, uuid naming nothing stored", lambda m, s, e: _chat(
        m, s, [{"type": "image_url", "image_url": None, "uuid": f"emb:v1:{e}:" + "0" * 64}, _text("hi")]), 404,
        "embedding_not_found"),
    # JSON escapes of lone UTF-16 surrogates: valid JSON, but no character; 500 before RequestBody.
    BadRequest("lone surrogate in text", lambda m, s, e: json.dumps(_chat(m, s, [_text("a\ud800b")])).encode(), 400,
               param="messages[0].content[0].text"),
    BadRequest("lone surrogate in a stop string", lambda m, s, e: json.dumps(_chat(m, s, "hi", stop=["\udc00"])).encode(),
               400, param="stop[0]"),
    BadRequest("tool role", lambda m, s, e: {**_chat(m, s, "hi"), "messages": [{"role": "tool", "content": "x"}]},
               400, param="messages[0].role"),
]  # fmt: skip


@pytest.fixture(scope="module")
def encoder_id(stack: Stack) -> str:
    with EncoderClient(stack.encoder_target) as encoder:
        return encoder.stats().encoder_id


def _send(base_url: str, body: dict | bytes, headers: dict[str, str]) -> httpx.Response:
    url = f"{base_url}/v1/chat/completions"
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={**headers, "content-type": "application/json"}, timeout=120)
    return httpx.post(url, json=body, headers=headers, timeout=120)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_client_mistake_is_a_4xx_in_openai_form_with_a_request_id(
    stack: Stack, strict_gateway: str, encoder_id: str, case: BadRequest, model: str, stream: bool
) -> None:
    base_url, headers = (strict_gateway, STRICT_KEY) if case.inline else (stack.base_url, {})
    response = _send(base_url, case.build(model, stream, encoder_id), {**headers, "x-request-id": "mistake-1"})
    assert response.status_code == case.status, response.text[:500]
    assert response.headers.get("x-request-id") == "mistake-1"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"] and len(error["message"]) < 1000
    assert error["type"] == ("not_found_error" if case.status == 404 else "invalid_request_error")
    if case.code is not None:
        assert error["code"] == case.code, error
    if case.param is not None:
        assert error["param"] == case.param, error


def test_context_error_names_the_token_count_and_the_limit(stack: Stack) -> None:
    for model in MODELS:
        error = _send(stack.base_url, _chat(model, False, LONG_TEXT), {}).json()["error"]
        assert str(CONTEXT) in error["message"], error
        assert any(word.isdigit() and int(word) > CONTEXT for word in error["message"].replace(",", " ").split())


@pytest.mark.parametrize("model", MODELS)
def test_the_stack_answers_after_the_mistakes(stack: Stack, model: str) -> None:
    body = _chat(model, False, [{"type": "image_url", "image_url": {"url": data_url(png_bytes(5))}}, _text("What?")])
    response = _send(stack.base_url, body, {})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


ENCODE_CASES = [
    ("aspect ratio over 200", {"image_url": _image(2010, 10)}, 400, "ratio"),
    ("max_pixels past the server's limit", {"image_url": _image(64, 64), "max_pixels": 16_777_216}, 400, "limit"),
    ("min_pixels as a string", {"image_url": _image(64, 64), "min_pixels": "1000"}, 400, "min_pixels"),
    ("file URL", {"image_url": "file:///etc/passwd"}, 400, "image URL"),
    ("unreachable host", {"image_url": "http://127.0.0.1:9/cat.png"}, 400, "image URL"),
]


@pytest.mark.parametrize(("name", "body", "status", "says"), ENCODE_CASES, ids=[c[0] for c in ENCODE_CASES])
def test_encode_endpoint_mistakes_are_4xx_naming_the_problem(
    stack: Stack, name: str, body: dict, status: int, says: str
) -> None:
    response = httpx.post(f"{stack.base_url}/v1/images/encode", json=body, timeout=60)
    assert response.status_code == status, response.text[:500]
    assert response.headers.get("x-request-id")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and says in error["message"], error


@pytest.mark.parametrize("path", ["/v1/images/encode", "/v1/videos/encode"])
def test_encode_endpoints_refuse_a_lone_surrogate_naming_the_field(stack: Stack, path: str) -> None:
    body = {"image_url": "data:image/png;base64,\ud800"} if "images" in path else {"frames": ["\udfff"]}
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as a JSON escape
    response = httpx.post(f"{stack.base_url}{path}", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text[:500]
    assert response.json()["error"]["param"] == ("image_url" if "images" in path else "frames[0]")


BODY_FORMS = [
    # curl -d without -H: JSON under the form type, which FastAPI does not parse
    ("form type", "application/x-www-form-urlencoded", "Content-Type: application/json", "x-www-form-urlencoded"),
    ("text type", "text/plain", "Content-Type: application/json", "text/plain"),
    # httpx's content= and many scripts send no type; this one said only "must be a JSON object"
    ("no type", None, "Content-Type: application/json", "no Content-Type"),
    ("JSON array", "application/json", "must be a JSON object", None),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/images/encode"])
@pytest.mark.parametrize(("name", "content_type", "says", "names"), BODY_FORMS, ids=[form[0] for form in BODY_FORMS])
def test_a_body_that_is_not_a_json_object_is_a_400_saying_how_to_send_one(
    stack: Stack, path: str, name: str, content_type: str | None, says: str, names: str | None
) -> None:
    """These were 400 "Input should be a valid dictionary or object to extract fields from"."""
    body = json.dumps(_chat("ft-a", False, "hi") if name != "JSON array" else [_chat("ft-a", False, "hi")])
    headers = {"content-type": content_type} if content_type is not None else {}
    response = httpx.post(f"{stack.base_url}{path}", content=body, headers=headers, timeout=60)
    assert response.status_code == 400, response.text[:500]
    message = response.json()["error"]["message"]
    assert says in message and (names is None or names in message), message
