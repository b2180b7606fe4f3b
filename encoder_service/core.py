"""Encode-once logic: key, cache check, single flight, encode, store, counters.

No gRPC here: the servicer converts protos to these calls and back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from encoder_service import metrics
from encoder_service.batcher import LanedBatcher, MicroBatcher
from encoder_service.blob_arrays import blob_dtype, blob_from_tensors
from encoder_service.fetch import ByteBudget, FetchPolicy, fetch_image
from encoder_service.images import decode_data_url, is_data_url, load_image
from encoder_service.metrics import EncoderCounters
from encoder_service.resize import PixelPolicy
from encoder_service.single_flight import SingleFlight
from encoder_service.video import preprocess_video
from encoder_service.vision import Preprocessed, VisionEncoder
from shared import tracing
from shared.blob import BlobRules, EmbeddingBlob, Modality, decode_blob, encode_blob
from shared.errors import EmbeddingNotFound, IncompatibleEncoder, InvalidInput, ServiceError, TooLarge, clip
from shared.keys import embedding_key, parse_key, video_key
from shared.progress_watch import ProgressWatch
from shared.store import EmbeddingStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MediaSource:
    """An image, or one frame of a video: exactly one of `data` (file bytes) or `url` (data: or
    http(s) URL)."""

    data: bytes | None = None
    url: str | None = None


@dataclass(frozen=True)
class EncodeResult:
    key: str
    grid_thw: list[int]  # [t, h, w]
    num_tokens: int
    cache_hit: bool
    encoder_id: str


@dataclass(frozen=True)
class EncoderLimits:
    max_image_bytes: int
    max_decoded_pixels: int
    fetch: FetchPolicy
    image_pixels: PixelPolicy
    video_pixels: PixelPolicy  # per frame
    max_video_frames: int = 64
    max_video_bytes: int = 64 * 1024 * 1024  # a video's frames together (ByteBudget)
    max_video_total_pixels: int = 0  # a video's resized frames together (video.check_total_pixels); 0: no limit


@dataclass
class EncoderCore:
    vision: VisionEncoder
    encoder_id: str
    store: EmbeddingStore
    limits: EncoderLimits
    batcher: LanedBatcher[Preprocessed, torch.Tensor] | MicroBatcher[Preprocessed, torch.Tensor]
    progress: ProgressWatch  # forward passes finished, while one is under way
    counters: EncoderCounters = field(default_factory=EncoderCounters)
    _in_flight: SingleFlight[EncodeResult] = field(default_factory=SingleFlight)

    @property
    def rules(self) -> BlobRules:
        return BlobRules(self.vision.merge_size, self.vision.hidden_size, frozenset({self.encoder_id}))

    async def encode(self, source: MediaSource, min_pixels: int = 0, max_pixels: int = 0) -> EncodeResult:
        """Key of the image's stored embeddings, encoding only when Redis lacks it."""
        image_bytes = await self._image_bytes(source)
        min_px, max_px = self.limits.image_pixels.bounds(min_pixels, max_pixels)
        key = embedding_key(self.encoder_id, image_bytes, min_px, max_px, dtype=blob_dtype(self.vision.dtype))
        tracing.annotate({tracing.MEDIA_KEY: key})
        field = _image_field(source)

        def preprocess() -> Preprocessed:
            image = load_image(image_bytes, self.limits.max_decoded_pixels, param=field)
            return self.vision.preprocess(image, min_px, max_px, param=field)

        return await self._single_flight(key, "image", preprocess)

    async def encode_video(self, frames: list[MediaSource], min_pixels: int = 0, max_pixels: int = 0) -> EncodeResult:
        """Key of a video's stored embeddings (frames in order), encoding only when Redis lacks it."""
        if not frames:
            raise InvalidInput("a video needs at least one frame", param="frames")
        if len(frames) > self.limits.max_video_frames:
            raise InvalidInput(
                f"video has {len(frames)} frames; the limit is {self.limits.max_video_frames}", param="frames"
            )
        frame_bytes = await self._frames_bytes(frames)
        min_px, max_px = self.limits.video_pixels.bounds(min_pixels, max_pixels)
        key = video_key(self.encoder_id, frame_bytes, min_px, max_px, dtype=blob_dtype(self.vision.dtype))
        tracing.annotate({tracing.MEDIA_KEY: key})

        def preprocess() -> Preprocessed:
            # A generator: each frame is decoded only when the previous one has been resized.
            decoded = (
                load_image(data, self.limits.max_decoded_pixels, param=f"frames[{i}]")
                for i, data in enumerate(frame_bytes)
            )
            return preprocess_video(
                self.vision.processor, decoded, min_px, max_px, len(frame_bytes), self.limits.max_video_total_pixels
            )

        return await self._single_flight(key, "video", preprocess)

    async def _single_flight(
        self, key: str, modality: Modality, preprocess: Callable[[], Preprocessed]
    ) -> EncodeResult:
        """Encodes under `key` once, however many callers ask for it at the same time."""
        joining = self._in_flight.joining(key)
        if joining:
            self.counters.coalesced += 1
        result = await self._in_flight.run(key, lambda: self._encode_or_reuse(key, modality, preprocess))
        return dataclasses.replace(result, cache_hit=True) if joining else result

    async def get_blob(self, key: str) -> bytes:
        """The blob stored under `key`, only if it is an embedding this encoder made and would accept.

        Redis holds more than embeddings: a key is checked before Redis is asked, so no other value
        can be read through this call. Another encoder's key is IncompatibleEncoder (as the LLM
        service answers it), not NotFound: it says what to fix, and a retry here could never find it.
        """
        encoder_id = parse_key(key, param="key").encoder_id
        if encoder_id != self.encoder_id:
            raise IncompatibleEncoder(
                f"key was made by encoder {clip(encoder_id)!r}; this encoder is {self.encoder_id!r}", param="key"
            )
        (data,) = await self.store.get_many([key])
        if data is None:
            raise EmbeddingNotFound(f"no embedding stored under {clip(key)!r}", keys=[key], param="key")
        # where="key": the error names the request's field (param), not the whole key.
        await asyncio.to_thread(decode_blob, data, self.rules, "key")
        return data

    async def _frames_bytes(self, frames: list[MediaSource]) -> list[bytes]:
        """Every frame's bytes, fetched together. When one fails the others are cancelled: left
        to run, they went on fetching (up to the fetch deadline each) after the call had failed,
        outside every limit on calls in flight."""
        budget = ByteBudget(self.limits.max_video_bytes, "ENCODER_MAX_VIDEO_BYTES")
        fetches = [
            asyncio.ensure_future(self._image_bytes(frame, f"frames[{i}]", budget)) for i, frame in enumerate(frames)
        ]
        try:
            return await asyncio.gather(*fetches)
        finally:
            for fetch in fetches:
                fetch.cancel()

    async def _image_bytes(
        self, source: MediaSource, frame: str | None = None, budget: ByteBudget | None = None
    ) -> bytes:
        """The image file's bytes; errors name `frame` (frames[i]) when the image is a video frame,
        whose bytes are charged to the video's `budget`."""
        param = frame or _image_field(source)
        if source.data is not None and source.url is None:
            data = source.data
        elif source.url is not None and source.data is None and is_data_url(source.url):
            data = decode_data_url(source.url, self.limits.max_image_bytes, param)
        elif source.url is not None and source.data is None:
            # Charged as its bytes arrive: the download stops once the frames hold too much.
            data = await fetch_image(source.url, self.limits.fetch, param, budget)
            budget = None
        else:
            raise InvalidInput("exactly one of image_bytes or image_url must be set", param=frame or "source")
        if budget is not None:
            budget.take(len(data))
        if len(data) > self.limits.max_image_bytes:
            raise TooLarge(f"image is {len(data)} bytes, over the limit of {self.limits.max_image_bytes}", param=param)
        return data

    async def _encode_or_reuse(
        self, key: str, modality: Modality, preprocess: Callable[[], Preprocessed]
    ) -> EncodeResult:
        stored = await self.store.get_and_touch(key)
        reused = None if stored is None else self._reusable(key, stored, modality)
        if reused is not None:
            self.counters.cache_hits += 1
            return self._result(key, reused, cache_hit=True)
        started = time.perf_counter()
        # Announced before preparing: a burst of calls, each decoding its own image first, then
        # shares one forward pass instead of the first image going alone.
        async with self.batcher.reserve() as slot:
            pixel_values, grid_thw = await asyncio.to_thread(preprocess)
            embeds = await slot.submit((pixel_values, grid_thw))
        blob, data = await asyncio.to_thread(self._blob, embeds, grid_thw, modality)
        await self.store.put(key, data)
        self.counters.images_encoded += 1
        metrics.BLOB_BYTES.observe(len(data))
        elapsed = time.perf_counter() - started
        metrics.ENCODE_SECONDS.observe(elapsed)
        logger.info("encoded %s: %d tokens, %d bytes, %.3fs", key, blob.num_tokens, len(data), elapsed)
        return self._result(key, blob, cache_hit=False)

    def _reusable(self, key: str, stored: bytes, modality: Modality) -> EmbeddingBlob | None:
        """The stored blob, if it is exactly what this encoder would write under `key`; else None,
        and the caller re-encodes and overwrites it. So any bad value heals on the next encode of
        its image: one that breaks the contract, and one that keeps it but is not ours to serve
        here (a video under an image's key, another encoder's blob, another dtype than the key's)."""
        try:
            blob = decode_blob(stored, self.rules, where=key)
        except ServiceError as error:  # InvalidEmbedding, IncompatibleEncoder
            problem = error.message
        else:
            wanted = (modality, blob_dtype(self.vision.dtype), self.encoder_id)
            found = (blob.modality, blob.dtype, blob.encoder_id)
            if found == wanted:
                return blob
            problem = f"it holds (modality, dtype, encoder_id) {found}, this encoder writes {wanted}"
        logger.warning("stored blob %s is not what this encoder writes (%s); re-encoding", key, problem)
        return None

    def _blob(self, embeds: torch.Tensor, grid_thw: torch.Tensor, modality: Modality) -> tuple[EmbeddingBlob, bytes]:
        """The tower's output as a validated blob, and its bytes."""
        blob = blob_from_tensors(embeds, grid_thw, self.encoder_id, modality)
        return blob, encode_blob(blob, self.rules)

    def _result(self, key: str, blob: EmbeddingBlob, cache_hit: bool) -> EncodeResult:
        grid = [int(v) for v in blob.grid_thw[0].tolist()]
        return EncodeResult(key, grid, blob.num_tokens, cache_hit, self.encoder_id)


def _image_field(source: MediaSource) -> str:
    """The request's field that holds an image, which every complaint about it names: what is
    wrong with the bytes of an image sent by URL is wrong with the `image_url` the client sent."""
    return "image_url" if source.url is not None else "image_bytes"
