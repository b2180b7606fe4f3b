"""Clients for encoder.v1 (async and sync). Errors arrive as `shared.errors.ServiceError`."""

from __future__ import annotations

import grpc

from shared.grpc_errors import raising_service_errors
from shared.pb.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from shared.sdk.types import EncodedImage, EncoderStats, channel_options, encode_request
from shared.settings import DEFAULT_GRPC_MAX_MESSAGE_BYTES


class AsyncEncoderClient:
    """`async with AsyncEncoderClient("host:50051") as encoder: await encoder.encode(image_bytes=...)`."""

    def __init__(self, target: str, timeout_s: float = 60.0, max_message_bytes: int = DEFAULT_GRPC_MAX_MESSAGE_BYTES) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._errors = f"encoder at {target}"
        self._channel = grpc.aio.insecure_channel(target, options=channel_options(max_message_bytes))
        self._stub = encoder_pb2_grpc.EncoderServiceStub(self._channel)

    async def encode(
        self, *, image_bytes: bytes | None = None, image_url: str | None = None, min_pixels: int = 0, max_pixels: int = 0
    ) -> EncodedImage:
        """Stores the image's embeddings (once) and returns their key, grid and token count."""
        request = encode_request(image_bytes, image_url, min_pixels, max_pixels)
        with raising_service_errors(self._errors):
            return EncodedImage.from_pb(await self._stub.Encode(request, timeout=self.timeout_s))

    async def get_embedding(self, key: str) -> bytes:
        """The stored safetensors blob for `key`."""
        with raising_service_errors(self._errors):
            reply = await self._stub.GetEmbedding(encoder_pb2.GetEmbeddingRequest(key=key), timeout=self.timeout_s)
        return reply.blob

    async def stats(self) -> EncoderStats:
        with raising_service_errors(self._errors):
            return EncoderStats.from_pb(await self._stub.GetStats(encoder_pb2.GetStatsRequest(), timeout=self.timeout_s))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncEncoderClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class EncoderClient:
    """Blocking twin of AsyncEncoderClient, for scripts and pipelines."""

    def __init__(self, target: str, timeout_s: float = 60.0, max_message_bytes: int = DEFAULT_GRPC_MAX_MESSAGE_BYTES) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._errors = f"encoder at {target}"
        self._channel = grpc.insecure_channel(target, options=channel_options(max_message_bytes))
        self._stub = encoder_pb2_grpc.EncoderServiceStub(self._channel)

    def encode(
        self, *, image_bytes: bytes | None = None, image_url: str | None = None, min_pixels: int = 0, max_pixels: int = 0
    ) -> EncodedImage:
        request = encode_request(image_bytes, image_url, min_pixels, max_pixels)
        with raising_service_errors(self._errors):
            return EncodedImage.from_pb(self._stub.Encode(request, timeout=self.timeout_s))

    def get_embedding(self, key: str) -> bytes:
        with raising_service_errors(self._errors):
            return self._stub.GetEmbedding(encoder_pb2.GetEmbeddingRequest(key=key), timeout=self.timeout_s).blob

    def stats(self) -> EncoderStats:
        with raising_service_errors(self._errors):
            return EncoderStats.from_pb(self._stub.GetStats(encoder_pb2.GetStatsRequest(), timeout=self.timeout_s))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EncoderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
