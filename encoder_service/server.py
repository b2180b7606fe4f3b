"""Builds and starts the encoder gRPC server from settings (used by __main__ and tests)."""

from __future__ import annotations

import logging
import time

import grpc
import torch

from encoder_service import metrics
from encoder_service.batcher import LanedBatcher
from encoder_service.core import EncoderCore, EncoderLimits
from encoder_service.fetch import FetchPolicy
from encoder_service.resize import PixelPolicy
from encoder_service.servicer import EncoderServicer
from encoder_service.settings import EncoderSettings
from encoder_service.vision import Preprocessed, VisionEncoder
from shared import readiness
from shared.encoder_id import compute_encoder_id
from shared.grpc_subcalls import SubcallChain
from shared.model_paths import resolve_checkpoint
from shared.pb.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from shared.progress_watch import ProgressWatch
from shared.service_server import ServiceServer, start_service
from shared.store import EmbeddingStore

logger = logging.getLogger(__name__)
SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name


class EncoderServer(ServiceServer[EncoderCore]):
    async def release(self) -> None:
        await self.core.batcher.aclose()
        await self.core.store.aclose()

    def failure(self) -> str | None:
        return self.core.progress.stalled()  # a hung device: passes that never finish

    def readiness_checks(self) -> dict[str, readiness.Check]:
        # SERVING only while Redis answers (every Encode stores its result there) and the tower works.
        return {"redis": self.core.store.ping, "vision tower": self.serves}


def _observe_batch(batch_size: int, queue_depth: int) -> None:
    metrics.BATCH_SIZE.observe(batch_size)
    metrics.QUEUE_DEPTH.set(queue_depth)


def build_core(settings: EncoderSettings) -> EncoderCore:
    checkpoint = resolve_checkpoint(settings.checkpoint)
    vision = VisionEncoder.load(
        str(checkpoint), settings.device, getattr(torch, settings.dtype), settings.cpu_matmul, settings.cuda_graphs
    )
    if settings.warmup_pixels:
        started = time.perf_counter()
        vision.warm_up(settings.warmup_pixels)
        logger.info("warm-up forward pass took %.2fs", time.perf_counter() - started)
    encoder_id = settings.encoder_id or compute_encoder_id(checkpoint)
    store = EmbeddingStore(settings.store_config())
    progress = ProgressWatch("the vision tower", settings.stall_s)
    batcher = _batcher(settings, vision, progress)
    return EncoderCore(vision, encoder_id, store, _limits(settings, vision), batcher, progress)


def _batcher(
    settings: EncoderSettings, vision: VisionEncoder, progress: ProgressWatch
) -> LanedBatcher[Preprocessed, torch.Tensor]:
    # One image at the processor's own max_pixels is the largest a default request makes; anything
    # costlier (a raised limit, a long video) takes the large lane (see batcher.py).
    default_patches = vision.default_max_pixels // vision.patch_pixels

    def timed_forward(items: list[Preprocessed]) -> list[torch.Tensor]:
        with metrics.FORWARD_SECONDS.time(), progress.working():
            results = vision.encode_batch(items)
        progress.progressed()
        return results

    return LanedBatcher(
        timed_forward,
        cost=lambda item: int(item[0].shape[0]),  # patch rows of pixel_values
        large_cost=default_patches,
        max_batch_size=settings.max_batch_size,
        max_wait_s=settings.batch_wait_ms / 1000,
        on_batch=_observe_batch,
        max_hold_s=settings.batch_hold_ms / 1000,
        max_batch_cost=settings.max_batch_size * default_patches,
    )


def _limits(settings: EncoderSettings, vision: VisionEncoder) -> EncoderLimits:
    # A video frame's bounds: the operator's, else the checkpoint's, as AutoProcessor and vLLM take them.
    video_min = settings.video_min_pixels or vision.frame_bounds[0]
    video_max = settings.video_max_pixels or vision.frame_bounds[1]
    return EncoderLimits(
        max_image_bytes=settings.max_image_bytes,
        max_decoded_pixels=settings.max_decoded_pixels,
        max_video_frames=settings.max_video_frames,
        max_video_bytes=settings.max_video_bytes,
        image_pixels=PixelPolicy(
            vision.default_min_pixels,
            vision.default_max_pixels,
            settings.max_pixels_limit or vision.default_max_pixels,
            vision.resize_factor,
        ),
        video_pixels=PixelPolicy(
            video_min,
            video_max,
            settings.video_max_pixels_limit or video_max,
            vision.resize_factor,
        ),
        max_video_total_pixels=settings.max_video_total_pixels,
        fetch=FetchPolicy(
            settings.fetch_timeout_s,
            settings.max_image_bytes,
            settings.allow_private_urls,
            tuple(settings.url_schemes),
            tuple(d.lower().strip(".") for d in settings.url_allowed_domains),
        ),
    )


async def start_encoder_server(settings: EncoderSettings, core: EncoderCore | None = None) -> EncoderServer:
    """Loads the vision tower (unless `core` is given), starts serving, and reports SERVING
    while Redis answers and the tower is not hung."""
    core = core or build_core(settings)
    core.batcher.start()

    def register(server: grpc.aio.Server, _subcalls: SubcallChain) -> None:
        encoder_pb2_grpc.add_EncoderServiceServicer_to_server(EncoderServicer(core), server)

    return await start_service(EncoderServer, core, settings, SERVICE_NAME, register)
