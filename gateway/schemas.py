"""OpenAI-style request bodies. One documented form per content part; unknown
top-level fields are accepted (clients send them) and ignored. Types are strict, as OpenAI's and
vLLM's are: `"max_tokens": "12"` or `"stream": "yes"` is a 400 naming the field, not a guess."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# Bounds that keep values inside the gRPC field types (int32/int64); the services
# apply their own, tighter limits and say so in their errors.
MAX_TOKENS_BOUND = 1_000_000
MAX_PIXELS_BOUND = 1_000_000_000
MAX_GRID_SIDE = 65_535
MAX_FRAMES_BOUND = 1024  # the encoder applies its own, tighter frame limit


class StrictRequest(BaseModel):
    """Base of every request body: an int must be a JSON integer, a bool a JSON boolean, a string
    a JSON string; a float field takes integers too (`"temperature": 1`), never strings."""

    model_config = ConfigDict(strict=True)


class TextPart(StrictRequest):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str = Field(description="Plain text.")


class ImageUrl(StrictRequest):
    model_config = ConfigDict(extra="ignore")
    url: str = Field(min_length=1, description="An http(s) URL or a data:image/...;base64 URL.")
    detail: str | None = Field(None, description="Accepted for compatibility; ignored.")


class ImageUrlPart(StrictRequest):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageUrl = Field(description="The image, encoded once by the encoder service.")


class ImageEmbedsPart(StrictRequest):
    """Embeddings instead of an image: a stored key (`uuid`), or inline in vLLM's form."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["image_embeds"]
    uuid: str | None = Field(
        None, min_length=1, description="Key of stored embeddings, as returned by /v1/images/encode."
    )
    image_embeds: str | None = Field(
        None, description="null with `uuid`; else base64 of a [tokens, hidden] tensor as .npy or safetensors bytes."
    )
    image_grid_thw: list[Annotated[int, Field(ge=1, le=MAX_GRID_SIDE)]] | None = Field(
        None, min_length=3, max_length=3, description="[t, h, w] of inline embeddings (required with image_embeds)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> ImageEmbedsPart:
        if (self.uuid is None) == (self.image_embeds is None):
            raise ValueError("set exactly one of uuid (a stored key) or image_embeds (inline, with image_grid_thw)")
        if self.image_embeds is not None and self.image_grid_thw is None:
            raise ValueError("inline image_embeds need image_grid_thw [t, h, w]")
        return self


class VideoPart(StrictRequest):
    """A video as its frames, in order (Qwen2-VL's list-of-frames form): encoded once into a
    grid with t = ceil(frames / 2)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["video"]
    video: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1, max_length=MAX_FRAMES_BOUND, description="Frame images: http(s) or data:image/...;base64 URLs."
    )


class VideoEmbedsPart(StrictRequest):
    """Video embeddings instead of frames: a stored key (`uuid`), or inline like image_embeds."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["video_embeds"]
    uuid: str | None = Field(
        None, min_length=1, description="Key of stored video embeddings, as returned by /v1/videos/encode."
    )
    video_embeds: str | None = Field(
        None, description="null with `uuid`; else base64 of a [tokens, hidden] tensor as .npy or safetensors bytes."
    )
    video_grid_thw: list[Annotated[int, Field(ge=1, le=MAX_GRID_SIDE)]] | None = Field(
        None, min_length=3, max_length=3, description="[t, h, w] of inline embeddings (required with video_embeds)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> VideoEmbedsPart:
        if (self.uuid is None) == (self.video_embeds is None):
            raise ValueError("set exactly one of uuid (a stored key) or video_embeds (inline, with video_grid_thw)")
        if self.video_embeds is not None and self.video_grid_thw is None:
            raise ValueError("inline video_embeds need video_grid_thw [t, h, w]")
        return self


MediaPart = ImageUrlPart | ImageEmbedsPart | VideoPart | VideoEmbedsPart
ContentPart = Annotated[
    TextPart | ImageUrlPart | ImageEmbedsPart | VideoPart | VideoEmbedsPart, Field(discriminator="type")
]


class ChatMessage(StrictRequest):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"] = Field(description="Who speaks.")
    content: str | list[ContentPart] = Field(description="A string, or a list of content parts in order.")


class StreamOptions(StrictRequest):
    include_usage: bool = Field(False, description="Send a usage chunk before [DONE].")


class ChatCompletionRequest(StrictRequest):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, description="Model name, as listed by GET /v1/models.")
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation, oldest first.")
    stream: bool = Field(False, description="Stream chunks as server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_BOUND, description="Most tokens to generate.")
    max_completion_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS_BOUND, description="Alias of max_tokens (newer OpenAI name)."
    )
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Same seed, same output.")
    stop: str | list[str] | None = Field(None, description="Up to 4 stop strings.")
    n: int = Field(1, ge=1, le=8, description="Number of choices, generated independently (seed + index when seeded).")
    logprobs: bool = Field(False, description="Return each generated token's log probability (raw, before penalties).")
    # Declared after logprobs: its validator reads logprobs from the fields already validated.
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="Most likely alternatives to return per token, 0..20; needs logprobs."
    )
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, description="Lowers tokens already in the completion, once each; 0 = off."
    )
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, description="Lowers tokens by how often they are already in the completion; 0 = off."
    )

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop strings")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class EncodeImageRequest(StrictRequest):
    model_config = ConfigDict(extra="forbid")
    image_url: str = Field(min_length=1, description="An http(s) URL or a data:image/...;base64 URL.")
    min_pixels: int = Field(0, ge=0, le=MAX_PIXELS_BOUND, description="0 = the encoder's default.")
    max_pixels: int = Field(0, ge=0, le=MAX_PIXELS_BOUND, description="0 = the encoder's default.")
    return_embeddings: bool = Field(False, description="Also return the stored blob (safetensors, base64).")


class EncodeImageResponse(BaseModel):
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


class EncodeVideoRequest(StrictRequest):
    model_config = ConfigDict(extra="forbid")
    frames: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1, max_length=MAX_FRAMES_BOUND, description="Frame images in order: http(s) or data:image URLs."
    )
    min_pixels: int = Field(0, ge=0, le=MAX_PIXELS_BOUND, description="Per frame; 0 = the encoder's video default.")
    max_pixels: int = Field(0, ge=0, le=MAX_PIXELS_BOUND, description="Per frame; 0 = the encoder's video default.")
    return_embeddings: bool = Field(False, description="Also return the stored blob (safetensors, base64).")
