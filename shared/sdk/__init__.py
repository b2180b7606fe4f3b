"""Python gRPC SDK for the encoder and LLM services (sync and async)."""

from shared.sdk.encoder_client import AsyncEncoderClient, EncoderClient
from shared.sdk.llm_client import AsyncLLMClient, LLMClient
from shared.sdk.types import (
    ChannelConfig,
    EncodedImage,
    EncodedMedia,
    EncoderStats,
    GenerationChunk,
    ImageKey,
    InlineEmbedding,
    Message,
    ModelInfo,
    Sampling,
    TokenLogprob,
    TopLogprob,
    VideoKey,
)

__all__ = [
    "AsyncEncoderClient",
    "AsyncLLMClient",
    "ChannelConfig",
    "EncodedImage",
    "EncodedMedia",
    "EncoderClient",
    "EncoderStats",
    "GenerationChunk",
    "ImageKey",
    "InlineEmbedding",
    "LLMClient",
    "Message",
    "ModelInfo",
    "Sampling",
    "TokenLogprob",
    "TopLogprob",
    "VideoKey",
]
