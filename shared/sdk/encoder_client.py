"""Clients for encoder.v1 (async and sync). Errors arrive as `shared.errors.ServiceError`.

Each RPC is one plan below (request and reply mapping); both clients run it."""

from __future__ import annotations

from shared.pb.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from shared.sdk.calls import AsyncClient, BlockingClient, Call
from shared.sdk.types import ChannelConfig, EncodedMedia, EncoderStats, encode_request, encode_video_request

SERVICE = "encoder"  # how errors name it: "encoder at host:port"


def _encode(
    image_bytes: bytes | None, image_url: str | None, min_pixels: int, max_pixels: int, request_id: str | None
) -> Call[encoder_pb2.EncodeReply, EncodedMedia]:
    request = encode_request(image_bytes, image_url, min_pixels, max_pixels)
    return Call("Encode", request, EncodedMedia.from_pb, request_id)


def _encode_video(
    frames: list[bytes | str], min_pixels: int, max_pixels: int, request_id: str | None
) -> Call[encoder_pb2.EncodeReply, EncodedMedia]:
    return Call("EncodeVideo", encode_video_request(frames, min_pixels, max_pixels), EncodedMedia.from_pb, request_id)


def _blob(reply: encoder_pb2.GetEmbeddingReply) -> bytes:
    return reply.blob


def _get_embedding(key: str) -> Call[encoder_pb2.GetEmbeddingReply, bytes]:
    return Call("GetEmbedding", encoder_pb2.GetEmbeddingRequest(key=key), _blob)


def _stats() -> Call[encoder_pb2.EncoderStats, EncoderStats]:
    return Call("GetStats", encoder_pb2.GetStatsRequest(), EncoderStats.from_pb)


class AsyncEncoderClient(AsyncClient):
    """`async with AsyncEncoderClient("host:50051") as encoder: await encoder.encode(image_bytes=...)`."""

    def __init__(self, target: str, timeout_s: float | None = 60.0, config: ChannelConfig | None = None) -> None:
        super().__init__(SERVICE, encoder_pb2_grpc.EncoderServiceStub, target, timeout_s, config)

    async def encode(
        self, *, image_bytes: bytes | None = None, image_url: str | None = None, min_pixels: int = 0, max_pixels: int = 0,
        request_id: str | None = None,
    ) -> EncodedMedia:  # fmt: skip
        """Stores the image's embeddings (once) and returns their key, grid and token count."""
        return await self._unary(_encode(image_bytes, image_url, min_pixels, max_pixels, request_id))

    async def encode_video(
        self, frames: list[bytes | str], *, min_pixels: int = 0, max_pixels: int = 0, request_id: str | None = None
    ) -> EncodedMedia:
        """Stores a video's embeddings (once) from its frames (image bytes or URLs, in order); grid t > 1."""
        return await self._unary(_encode_video(frames, min_pixels, max_pixels, request_id))

    async def get_embedding(self, key: str) -> bytes:
        """The stored safetensors blob for `key`."""
        return await self._unary(_get_embedding(key))

    async def stats(self) -> EncoderStats:
        return await self._unary(_stats())


class EncoderClient(BlockingClient):
    """Blocking twin of AsyncEncoderClient, for scripts and pipelines."""

    def __init__(self, target: str, timeout_s: float | None = 60.0, config: ChannelConfig | None = None) -> None:
        super().__init__(SERVICE, encoder_pb2_grpc.EncoderServiceStub, target, timeout_s, config)

    def encode(
        self, *, image_bytes: bytes | None = None, image_url: str | None = None, min_pixels: int = 0, max_pixels: int = 0,
        request_id: str | None = None,
    ) -> EncodedMedia:  # fmt: skip
        """Stores the image's embeddings (once) and returns their key, grid and token count."""
        return self._unary(_encode(image_bytes, image_url, min_pixels, max_pixels, request_id))

    def encode_video(
        self, frames: list[bytes | str], *, min_pixels: int = 0, max_pixels: int = 0, request_id: str | None = None
    ) -> EncodedMedia:
        """Stores a video's embeddings (once) from its frames (image bytes or URLs, in order); grid t > 1."""
        return self._unary(_encode_video(frames, min_pixels, max_pixels, request_id))

    def get_embedding(self, key: str) -> bytes:
        """The stored safetensors blob for `key`."""
        return self._unary(_get_embedding(key))

    def stats(self) -> EncoderStats:
        return self._unary(_stats())
