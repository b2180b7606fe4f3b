"""Clients for encoder.v1 (async and sync). Errors arrive as `shared.errors.ServiceError`."""

from __future__ import annotations

import grpc

from shared.grpc_auth import call_metadata
from shared.grpc_errors import raising_service_errors
from shared.pb.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from shared.sdk.types import ChannelConfig, EncodedImage, EncoderStats, encode_request, encode_video_request


class AsyncEncoderClient:
    """`async with AsyncEncoderClient("host:50051") as encoder: await encoder.encode(image_bytes=...)`."""

    def __init__(self, target: str, timeout_s: float = 60.0, config: ChannelConfig | None = None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._config = config or ChannelConfig()
        self._errors = f"encoder at {target}"
        self._channel = self._config.open(target, aio=True)
        self._stub = encoder_pb2_grpc.EncoderServiceStub(self._channel)

    async def encode(
        self, *, image_bytes: bytes | None = None, image_url: str | None = None, min_pixels: int = 0, max_pixels: int = 0,
        request_id: str | None = None,
    ) -> EncodedImage:  # fmt: skip
        """Stores the image's embeddings (once) and returns their key, grid and token count."""
        request = encode_request(image_bytes, image_url, min_pixels, max_pixels)
        metadata = call_metadata(self._config.token, request_id)
        with raising_service_errors(self._errors):
            return EncodedImage.from_pb(await self._stub.Encode(request, timeout=self.timeout_s, metadata=metadata))

    async def encode_video(
        self, frames: list[bytes | str], *, min_pixels: int = 0, max_pixels: int = 0, request_id: str | None = None
    ) -> EncodedImage:
        """Stores a video's embeddings (once) from its frames (image bytes or URLs, in order); grid t > 1."""
        request = encode_video_request(frames, min_pixels, max_pixels)
        metadata = call_metadata(self._config.token, request_id)
        with raising_service_errors(self._errors):
            reply = await self._stub.EncodeVideo(request, timeout=self.timeout_s, metadata=metadata)
        return EncodedImage.from_pb(reply)

    async def get_embedding(self, key: str) -> bytes:
        """The stored safetensors blob for `key`."""
        request, metadata = encoder_pb2.GetEmbeddingRequest(key=key), call_metadata(self._config.token)
        with raising_service_errors(self._errors):
            return (await self._stub.GetEmbedding(request, timeout=self.timeout_s, metadata=metadata)).blob

    async def stats(self) -> EncoderStats:
        request, metadata = encoder_pb2.GetStatsRequest(), call_metadata(self._config.token)
        with raising_service_errors(self._errors):
            return EncoderStats.from_pb(await self._stub.GetStats(request, timeout=self.timeout_s, metadata=metadata))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncEncoderClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class EncoderClient:
    """Blocking twin of AsyncEncoderClient, for scripts and pipelines."""

    def __init__(self, target: str, timeout_s: float = 60.0, config: ChannelConfig | None = None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._config = config or ChannelConfig()
        self._errors = f"encoder at {target}"
        self._channel: grpc.Channel = self._config.open(target, aio=False)
        self._stub = encoder_pb2_grpc.EncoderServiceStub(self._channel)

    def encode(
        self, *, image_bytes: bytes | None = None, image_url: str | None = None, min_pixels: int = 0, max_pixels: int = 0,
        request_id: str | None = None,
    ) -> EncodedImage:  # fmt: skip
        request = encode_request(image_bytes, image_url, min_pixels, max_pixels)
        metadata = call_metadata(self._config.token, request_id)
        with raising_service_errors(self._errors):
            return EncodedImage.from_pb(self._stub.Encode(request, timeout=self.timeout_s, metadata=metadata))

    def encode_video(
        self, frames: list[bytes | str], *, min_pixels: int = 0, max_pixels: int = 0, request_id: str | None = None
    ) -> EncodedImage:
        request = encode_video_request(frames, min_pixels, max_pixels)
        metadata = call_metadata(self._config.token, request_id)
        with raising_service_errors(self._errors):
            return EncodedImage.from_pb(self._stub.EncodeVideo(request, timeout=self.timeout_s, metadata=metadata))

    def get_embedding(self, key: str) -> bytes:
        request, metadata = encoder_pb2.GetEmbeddingRequest(key=key), call_metadata(self._config.token)
        with raising_service_errors(self._errors):
            return self._stub.GetEmbedding(request, timeout=self.timeout_s, metadata=metadata).blob

    def stats(self) -> EncoderStats:
        request, metadata = encoder_pb2.GetStatsRequest(), call_metadata(self._config.token)
        with raising_service_errors(self._errors):
            return EncoderStats.from_pb(self._stub.GetStats(request, timeout=self.timeout_s, metadata=metadata))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EncoderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
