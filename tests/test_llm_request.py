"""The LLM service's request conversion and settings, as pure logic: sampling bounds come from the
one table (shared/sampling_limits.py) on both sides of the engine boundary, and the media limit
is read under its new and its old name."""

from __future__ import annotations

import pytest
import torch

from llm_service.chat_request import ChatRequest, MediaInput, PromptMessage, SamplingLimits
from llm_service.engines.base import EngineRequest, MediaItem, SamplingParams
from llm_service.settings import LLMSettings
from shared.errors import InvalidInput
from shared.pb.llm.v1 import llm_pb2
from shared.sampling_limits import MAX_TOP_LOGPROBS, SAMPLING_BOUNDS

LIMITS = SamplingLimits(default_max_tokens=16, max_tokens_limit=64)


def _pb(**sampling: object) -> llm_pb2.GenerateRequest:
    content = [
        llm_pb2.ContentPart(video=llm_pb2.VideoRef(key="emb:v1:enc:v")),
        llm_pb2.ContentPart(text="what happens?"),
        llm_pb2.ContentPart(image=llm_pb2.ImageRef(embedding_blob=b"blob")),
    ]
    return llm_pb2.GenerateRequest(
        model="m",
        messages=[llm_pb2.ChatMessage(role="user", content=content)],
        sampling=llm_pb2.SamplingParams(**sampling),
        request_id="r",
    )


def test_messages_keep_their_parts_in_order_and_media_lists_them() -> None:
    chat = ChatRequest.from_pb(_pb(), LIMITS)
    video = MediaInput("video", key="emb:v1:enc:v", at="messages[0].content[0]")
    image = MediaInput("image", blob=b"blob", at="messages[0].content[2]")
    assert chat.messages == [PromptMessage("user", [video, "what happens?", image])]
    assert chat.media == [video, image]
    # An error about an item names its field by its path in the GenerateRequest.
    assert (video.param, image.param) == (
        "messages[0].content[0].video.key",
        "messages[0].content[2].image.embedding_blob",
    )
    assert chat.sampling == SamplingParams(max_tokens=16)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", 2.5, "temperature must be in [0, 2]"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("presence_penalty", -2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", float("nan"), "frequency_penalty must be in [-2, 2]"),
        ("top_logprobs", MAX_TOP_LOGPROBS + 1, f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}"),
        ("max_tokens", 65, "max_tokens must be in 1..64"),  # this service's own limit
        ("seed", -1, f"seed must be in 0..{2**63 - 1}"),
    ],
)
def test_out_of_bounds_sampling_is_invalid_input_naming_the_field(field: str, value: float, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        ChatRequest.from_pb(_pb(**{field: value, "logprobs": True}), LIMITS)
    assert str(caught.value) == message and caught.value.param == field


def test_stop_strings_are_bounded_by_the_table() -> None:
    with pytest.raises(InvalidInput, match="stop takes at most 4 non-empty strings"):
        ChatRequest.from_pb(_pb(stop=["a", "b", "c", "d", "e"]), LIMITS)


@pytest.mark.parametrize("knob", ["temperature", "top_p", "presence_penalty", "frequency_penalty"])
def test_engine_sampling_params_refuse_what_the_table_refuses(knob: str) -> None:
    """An engine handed params directly (tests, the bench) refuses the same values."""
    bound = SAMPLING_BOUNDS[knob]
    SamplingParams(**{knob: bound.high})
    with pytest.raises(ValueError, match=f"{knob} must be in"):
        SamplingParams(**{knob: bound.high + 0.5})
    with pytest.raises(ValueError, match="top_logprobs must be in"):
        SamplingParams(logprobs=MAX_TOP_LOGPROBS + 1)


def test_prompt_tokens_count_each_pad_as_its_rows() -> None:
    """One pad per item in the prompt; the context and usage count what the model reads."""
    grid = torch.tensor([[1, 4, 6]])
    media = [MediaItem("image", torch.zeros(6, 8), grid), MediaItem("video", torch.zeros(12, 8), grid * 2)]
    assert EngineRequest("r", [1, 2, 3, 4], media).prompt_tokens == 4 - 2 + 6 + 12


def test_media_limit_reads_its_new_and_its_old_name(monkeypatch: pytest.MonkeyPatch) -> None:
    def limit() -> int:
        return LLMSettings(checkpoint="c", model_name="m").max_media_per_request

    assert limit() == 16
    monkeypatch.setenv("LLM_MAX_IMAGES_PER_REQUEST", "3")  # the name deployments already set
    assert limit() == 3
    monkeypatch.setenv("LLM_MAX_MEDIA_PER_REQUEST", "5")
    assert limit() == 5
    monkeypatch.setenv("MAX_MEDIA_PER_REQUEST", "7")  # the prefix still applies
    monkeypatch.delenv("LLM_MAX_MEDIA_PER_REQUEST")
    assert limit() == 3
    assert LLMSettings(checkpoint="c", model_name="m", max_media_per_request=9).max_media_per_request == 9
