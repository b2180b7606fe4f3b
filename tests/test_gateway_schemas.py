"""The gateway's request schema on the forms clients written for vLLM or newer OpenAI SDKs send."""

from __future__ import annotations

import json

import pytest
from fastapi.routing import APIRoute
from pydantic import ValidationError

from gateway.app import create_app
from gateway.schemas import ChatCompletionRequest, ImageUrlPart, RequestBody
from gateway.settings import GatewaySettings
from shared.errors import InvalidInput


def _request(message: dict) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [message]})


def test_the_developer_role_is_taken_as_system() -> None:
    assert _request({"role": "developer", "content": "Be brief."}).messages[0].role == "system"


def test_an_unknown_role_is_refused_naming_the_roles() -> None:
    with pytest.raises(ValidationError, match="'system', 'developer', 'user' or 'assistant'"):
        _request({"role": "tool", "content": "x"})


def test_image_url_null_with_a_uuid_is_a_stored_key_and_a_uuid_beside_an_image_is_not_its_key() -> None:
    stored = ImageUrlPart.model_validate({"type": "image_url", "image_url": None, "uuid": "emb:v1:x:k"})
    assert (stored.source, stored.uuid) == (None, "emb:v1:x:k")
    named = ImageUrlPart.model_validate({"type": "image_url", "image_url": {"url": "https://a/b.png"}, "uuid": "mine"})
    assert named.source == "https://a/b.png"


def test_image_url_null_without_a_uuid_is_refused() -> None:
    with pytest.raises(ValidationError, match="name a stored image with uuid"):
        ImageUrlPart.model_validate({"type": "image_url", "image_url": None})


def test_every_endpoint_body_refuses_lone_surrogates() -> None:
    """The surrogate check lives in RequestBody; a new endpoint whose body skips it would let one
    through to protobuf or the logs, and answer 500."""
    app = create_app(GatewaySettings())
    bodies = [r.body_field.field_info.annotation for r in app.routes if isinstance(r, APIRoute) and r.body_field]
    assert len(bodies) >= 3
    for body in bodies:
        assert isinstance(body, type) and issubclass(body, RequestBody), body


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ('{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        ('{"model": "m\\udfff", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["x", "\\ud83d"]}', "stop[1]"),
        ('{"model": "m", "\\udc00": 1, "messages": [{"role": "user", "content": "hi"}]}', "\\udc00"),
    ],
)
def test_a_lone_surrogate_is_refused_naming_where_it_is(raw: str, param: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        ChatCompletionRequest.model_validate(json.loads(raw))
    assert raised.value.param == param
    raised.value.message.encode()  # the error itself must be sendable as UTF-8


def test_a_surrogate_pair_is_one_character_and_accepted() -> None:
    body = json.loads('{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00 h\\u00e9"}]}')
    assert ChatCompletionRequest.model_validate(body).messages[0].content == "\U0001f600 h\u00e9"


def test_null_in_a_field_with_a_default_is_that_default() -> None:
    """OpenAI's API reads null as "not set": n, stream and logprobs have defaults other than null."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    request = ChatCompletionRequest.model_validate({**body, "n": None, "stream": None, "logprobs": None})
    assert (request.n, request.stream, request.logprobs) == (1, False, False)
    with pytest.raises(ValidationError, match="model"):  # a required field's null is still refused
        ChatCompletionRequest.model_validate({**body, "model": None})


def test_an_assistants_null_content_is_empty_and_anyone_elses_is_refused() -> None:
    assert _request({"role": "assistant", "content": None}).messages[0].content == ""
    with pytest.raises(ValidationError, match="content"):
        _request({"role": "user", "content": None})


def test_a_text_part_takes_fields_it_does_not_know_as_vllm_does() -> None:
    part = {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}
    assert _request({"role": "user", "content": [part]}).messages[0].content[0].text == "hi"
