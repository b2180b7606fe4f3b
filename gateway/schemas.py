"""OpenAI-style request bodies. One documented form per content part; unknown
top-level fields are accepted (clients send them) and ignored. Types are strict, as OpenAI's and
vLLM's are: `"max_tokens": "12"` or `"stream": "yes"` is a 400 naming the field, not a guess."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gateway.unicode_text import first_surrogate
from gateway.unsupported import PLAIN_TEXT
from shared.blob import Modality
from shared.errors import InvalidInput
from shared.sampling_limits import MAX_STOP_STRINGS, SAMPLING_BOUNDS

# Bounds that keep values inside the gRPC field types (int32/int64); the services
# apply their own, tighter limits and say so in their errors.
MAX_PIXELS_BOUND = 1_000_000_000
MAX_GRID_SIDE = 65_535
MAX_FRAMES_BOUND = 1024  # the encoder applies its own, tighter frame limit


class StrictRequest(BaseModel):
    """Base of every request body: an int must be a JSON integer, a bool a JSON boolean, a string
    a JSON string; a float field takes integers too (`"temperature": 1`), never strings, and
    never NaN or Infinity: Python's JSON parser reads those words, and a range check would then
    answer "should be less than or equal to 2" for a value that is no number at all."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """OpenAI's API reads null in an optional field as "not set" (`"n": null`, `"stream": null`,
        as its own clients may send): where the field has a default, null is that default. A
        required field's null stays, for the field to judge (`"image_url": null` names a key)."""
        if not isinstance(data, dict) or not any(value is None for value in data.values()):
            return data
        defaulted = {name for name, field in cls.model_fields.items() if not field.is_required()}
        return {key: value for key, value in data.items() if value is not None or key not in defaulted}


class RequestBody(StrictRequest):
    """Base of every endpoint's body: before any field is read, no string or key in it may hold a
    lone UTF-16 surrogate (gateway/unicode_text.py). Raised as InvalidInput, not ValueError, so
    the error names the field by its JSON path whatever model or union it sits in."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, data: Any) -> Any:
        where = first_surrogate(data)
        if where is not None:
            raise InvalidInput(
                f"{where or 'the body'} holds a lone UTF-16 surrogate (an escape such as \\ud800 with no pair), "
                "which is not a character; send text as valid Unicode",
                param=where or None,
            )
        return data


class TextPart(StrictRequest):
    model_config = ConfigDict(extra="ignore")  # e.g. cache_control, which vLLM ignores too
    type: Literal["text"]
    text: str = Field(description="Plain text.")


class ImageUrl(StrictRequest):
    model_config = ConfigDict(extra="ignore")
    url: str = Field(min_length=1, description="An http(s) URL or a data:image/...;base64 URL.")
    # OpenAI's three values (its API refuses others): accepted for compatibility, and ignored.
    detail: Literal["auto", "low", "high"] | None = Field(None, description="auto, low or high; ignored.")


class ImageUrlPart(StrictRequest):
    """An image by URL, or (vLLM's form) `"image_url": null` with `uuid` naming a stored key. Beside
    an image a `uuid` is accepted and not used: the image's key comes from its content, so a
    client's name for it can neither share nor split what is stored."""

    model_config = ConfigDict(extra="forbid")
    modality: ClassVar[Modality] = "image"
    type: Literal["image_url"]
    image_url: ImageUrl | None = Field(description="The image, encoded once by the encoder service.")
    uuid: str | None = Field(
        None, min_length=1, description="With image_url null: the key of a stored image (/v1/images/encode)."
    )

    @property
    def source(self) -> str | None:
        """The image's URL; None for a stored key named by uuid."""
        return self.image_url.url if self.image_url is not None else None

    @model_validator(mode="after")
    def _image_or_key(self) -> Self:
        if self.image_url is None and self.uuid is None:
            raise ValueError("image_url is null: name a stored image with uuid, or give the image's url")
        return self


class VideoPart(StrictRequest):
    """A video as its frames, in order (Qwen2-VL's list-of-frames form): encoded once into a
    grid with t = ceil(frames / 2)."""

    model_config = ConfigDict(extra="forbid")
    modality: ClassVar[Modality] = "video"
    type: Literal["video"]
    video: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1, max_length=MAX_FRAMES_BOUND, description="Frame images: http(s) or data:image/...;base64 URLs."
    )

    @property
    def source(self) -> tuple[str, ...]:
        return tuple(self.video)


GridThw = list[Annotated[int, Field(ge=1, le=MAX_GRID_SIDE)]]


class MediaEmbedsPart(StrictRequest):
    """Embeddings instead of an image or a video's frames: a stored key (`uuid`), or inline in
    vLLM's form. The wire shapes of the two modalities differ only in their names
    (`{modality}_embeds`, `{modality}_grid_thw`, which each subclass declares); the rule and its
    words are here, once."""

    model_config = ConfigDict(extra="forbid")
    modality: ClassVar[Modality]
    type: Literal["image_embeds", "video_embeds"]  # each subclass narrows it to its own
    uuid: str | None = Field(
        None,
        min_length=1,
        description="Key of stored embeddings, as returned by /v1/images/encode (a video's: /v1/videos/encode).",
    )

    @property
    def embeds(self) -> str | None:
        """The inline tensor (base64), or None with `uuid`."""
        embeds: str | None = getattr(self, f"{self.modality}_embeds")
        return embeds

    @property
    def grid_thw(self) -> list[int] | None:
        grid: list[int] | None = getattr(self, f"{self.modality}_grid_thw")
        return grid

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        embeds, grid = f"{self.modality}_embeds", f"{self.modality}_grid_thw"
        if (self.uuid is None) == (self.embeds is None):
            raise ValueError(f"set exactly one of uuid (a stored key) or {embeds} (inline, with {grid})")
        if self.embeds is not None and self.grid_thw is None:
            raise ValueError(f"inline {embeds} need {grid} [t, h, w]")
        return self


INLINE_EMBEDS = "null with `uuid`; else base64 of a [tokens, hidden] tensor as .npy or safetensors bytes."


def _inline_grid(modality: Modality) -> Any:
    return Field(
        None,
        min_length=3,
        max_length=3,
        description=f"[t, h, w] of inline embeddings (required with {modality}_embeds).",
    )


class ImageEmbedsPart(MediaEmbedsPart):
    """Embeddings instead of an image: a stored key (`uuid`), or inline in vLLM's form (`image_embeds`,
    `image_grid_thw`)."""

    modality: ClassVar[Modality] = "image"
    type: Literal["image_embeds"]
    image_embeds: str | None = Field(None, description=INLINE_EMBEDS)
    image_grid_thw: GridThw | None = _inline_grid("image")


class VideoEmbedsPart(MediaEmbedsPart):
    """Embeddings instead of a video's frames: a stored key (`uuid`), or inline like image_embeds
    (`video_embeds`, `video_grid_thw`)."""

    modality: ClassVar[Modality] = "video"
    type: Literal["video_embeds"]
    video_embeds: str | None = Field(None, description=INLINE_EMBEDS)
    video_grid_thw: GridThw | None = _inline_grid("video")


# A part that stands for an image or a video; each says which by its `modality`.
MediaPart = ImageUrlPart | VideoPart | MediaEmbedsPart
ContentPart = Annotated[
    TextPart | ImageUrlPart | ImageEmbedsPart | VideoPart | VideoEmbedsPart, Field(discriminator="type")
]


class ChatMessage(StrictRequest):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="Who speaks; developer (OpenAI's newer name for system instructions) is taken as system."
    )
    content: str | list[ContentPart] = Field(
        description="A string, or a list of content parts in order; an assistant's may be null (no text)."
    )
    # Read only to refuse: a past assistant turn's calls would be left out of the prompt, and the
    # model would answer a conversation other than the one sent (this gateway takes no tools).
    tool_calls: list[Any] | None = Field(None, description="Refused unless empty: no tools here.")
    function_call: Any = Field(None, description="Refused unless null: no tools here.")

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, role: str) -> str:
        # OpenAI: "developer messages replace the previous system messages". Chat templates know system.
        return "system" if role == "developer" else role

    @field_validator("content", mode="before")
    @classmethod
    def _an_assistants_null_is_empty(cls, content: Any, info: ValidationInfo) -> Any:
        # OpenAI and vLLM take an assistant turn with null content (one that made tool calls) as
        # an empty one; anyone else's null stays a type error naming the field.
        return "" if content is None and info.data.get("role") == "assistant" else content

    @field_validator("content")
    @classmethod
    def _parts_are_not_empty(cls, content: str | list[Any]) -> str | list[Any]:
        # OpenAI refuses an empty list; taken as no text, the turn would vanish from the prompt.
        if isinstance(content, list) and not content:
            raise ValueError("must hold at least one content part (or be a string)")
        return content

    @field_validator("tool_calls", "function_call")
    @classmethod
    def _no_calls(cls, calls: Any) -> Any:
        if calls:
            raise ValueError(f"tool calls are not supported: {PLAIN_TEXT}")
        return calls


class StreamOptions(StrictRequest):
    include_usage: bool = Field(False, description="Send a usage chunk before [DONE].")
    continuous_usage_stats: bool = Field(
        False,
        description="vLLM's extension: with include_usage, every chunk also carries usage so far (the prompt's "
        "tokens, its choice's completion tokens so far); without include_usage, no chunk does.",
    )

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM's rule, continuous_usage_stats counts only with include_usage."""
        return self.include_usage and self.continuous_usage_stats


def _sampling(param: str, description: str) -> Any:
    """An optional sampling field, bounded as shared.sampling_limits says (the table every layer checks)."""
    bounds: dict[str, Any] = dict(SAMPLING_BOUNDS[param].pydantic())
    return Field(None, description=description, **bounds)


class ChatCompletionRequest(RequestBody):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, description="Model name, as listed by GET /v1/models.")
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation, oldest first.")
    stream: bool = Field(False, description="Stream chunks as server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    max_tokens: int | None = _sampling("max_tokens", "Most tokens to generate.")
    max_completion_tokens: int | None = _sampling("max_tokens", "Alias of max_tokens (newer OpenAI name).")
    temperature: float | None = _sampling("temperature", "0 = greedy.")
    top_p: float | None = _sampling("top_p", "Nucleus sampling mass.")
    seed: int | None = _sampling("seed", "Same seed, same output.")
    stop: str | list[str] | None = Field(None, description=f"Up to {MAX_STOP_STRINGS} stop strings.")
    n: int = Field(1, ge=1, le=8, description="Number of choices, generated independently (seed + index when seeded).")
    logprobs: bool = Field(False, description="Return each generated token's log probability (raw, before penalties).")
    # Declared after logprobs: its validator reads logprobs from the fields already validated.
    top_logprobs: int | None = _sampling(
        "top_logprobs",
        f"Most likely alternatives to return per token, {SAMPLING_BOUNDS['top_logprobs'].describe()}; needs logprobs.",
    )
    presence_penalty: float | None = _sampling(
        "presence_penalty", "Lowers tokens already in the completion, once each; 0 = off."
    )
    frequency_penalty: float | None = _sampling(
        "frequency_penalty", "Lowers tokens by how often they are already in the completion; 0 = off."
    )

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Self:
        # OpenAI and vLLM refuse them too: options for a stream that will not happen are a client's mistake.
        if self.stream_options is not None and not self.stream:
            raise InvalidInput("stream_options can only be set when stream is true", param="stream_options")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class EncodeImageRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")
    image_url: str = Field(min_length=1, description="An http(s) URL or a data:image/...;base64 URL.")
    min_pixels: int = Field(0, ge=0, le=MAX_PIXELS_BOUND, description="0 = the encoder's default.")
    max_pixels: int = Field(0, ge=0, le=MAX_PIXELS_BOUND, description="0 = the encoder's default.")
    return_embeddings: bool = Field(False, description="Also return the stored blob (safetensors, base64).")


class EncodeMediaResponse(BaseModel):
    """The answer of /v1/images/encode and /v1/videos/encode."""

    key: str = Field(description="Use as `uuid` of an image_embeds (video: video_embeds) content part.")
    grid_thw: list[int] = Field(description="[t, h, w] in patches; t > 1 for a video of more than two frames.")
    num_tokens: int = Field(description="Prompt tokens the image (or video) occupies.")
    encoder_id: str
    cache_hit: bool
    embeddings: str | None = Field(
        None,
        description="With return_embeddings: base64 safetensors with image_embeds [tokens, hidden] and image_grid_thw "
        "[1, 3] (a video's: video_embeds, video_grid_thw).",
    )


class EncodeVideoRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")
    frames: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1, max_length=MAX_FRAMES_BOUND, description="Frame images in order: http(s) or data:image URLs."
    )
    min_pixels: int = Field(0, ge=0, le=MAX_PIXELS_BOUND, description="Per frame; 0 = the encoder's video default.")
    max_pixels: int = Field(0, ge=0, le=MAX_PIXELS_BOUND, description="Per frame; 0 = the encoder's video default.")
    return_embeddings: bool = Field(False, description="Also return the stored blob (safetensors, base64).")
