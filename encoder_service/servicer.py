"""gRPC servicer for encoder.v1: protos in, EncoderCore calls, protos out."""

from __future__ import annotations

import grpc

from encoder_service.core import EncoderCore, EncodeResult, MediaSource
from shared.pb.encoder.v1 import encoder_pb2, encoder_pb2_grpc


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, core: EncoderCore) -> None:
        self._core = core

    async def Encode(
        self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EncodeReply:
        result = await self._core.encode(_source(request), request.min_pixels, request.max_pixels)
        return _reply(result)

    async def EncodeVideo(
        self, request: encoder_pb2.EncodeVideoRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EncodeReply:
        frames = [_source(frame) for frame in request.frames]
        return _reply(await self._core.encode_video(frames, request.min_pixels, request.max_pixels))

    async def GetEmbedding(
        self, request: encoder_pb2.GetEmbeddingRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.GetEmbeddingReply:
        return encoder_pb2.GetEmbeddingReply(blob=await self._core.get_blob(request.key))

    async def GetStats(
        self, request: encoder_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EncoderStats:
        counters = self._core.counters
        return encoder_pb2.EncoderStats(
            encoder_id=self._core.encoder_id,
            media_encoded=counters.images_encoded,
            cache_hits=counters.cache_hits,
            coalesced=counters.coalesced,
            forward_passes=self._core.batcher.batches_run,
        )


def _source(message: encoder_pb2.EncodeRequest | encoder_pb2.Frame) -> MediaSource:
    which = message.WhichOneof("source")
    return MediaSource(
        data=message.image_bytes if which == "image_bytes" else None,
        url=message.image_url if which == "image_url" else None,
    )


def _reply(result: EncodeResult) -> encoder_pb2.EncodeReply:
    return encoder_pb2.EncodeReply(
        key=result.key,
        grid_thw=result.grid_thw,
        num_tokens=result.num_tokens,
        cache_hit=result.cache_hit,
        encoder_id=result.encoder_id,
    )
