"""The gateway's request schema on the forms clients written for vLLM or newer OpenAI SDKs send."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.schemas import ChatCompletionRequest, ImageUrlPart


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
