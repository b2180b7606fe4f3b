"""Builds and starts the LLM gRPC server from settings (used by __main__ and tests)."""

from __future__ import annotations

import asyncio

import grpc
from transformers import AutoConfig

from llm_service import metrics
from llm_service.blob_cache import BlobCache
from llm_service.chat_request import SamplingLimits
from llm_service.core import LLMCore
from llm_service.engines.factory import load_engine, resolve_engine_name
from llm_service.prompt import PromptBuilder
from llm_service.servicer import LLMServicer
from llm_service.settings import LLMSettings
from llm_service.warm_up import warm_up
from shared import readiness
from shared.blob import BlobRules
from shared.encoder_id import compute_encoder_id
from shared.grpc_subcalls import SubcallChain
from shared.model_paths import resolve_checkpoint
from shared.pb.llm.v1 import llm_pb2, llm_pb2_grpc
from shared.progress_watch import ProgressWatch
from shared.service_server import ServiceServer, start_service
from shared.store import EmbeddingStore

SERVICE_NAME = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name


class LLMServer(ServiceServer[LLMCore]):
    async def release(self) -> None:
        """The store's connections and the engine (vLLM's engine process too)."""
        await self.core.store.aclose()
        await asyncio.to_thread(self.core.engine.close)

    def failure(self) -> str | None:
        return self.core.engine.failure() or self.core.progress.stalled()  # the engine died, or hangs

    def readiness_checks(self) -> dict[str, readiness.Check]:
        """SERVING needs both: blobs come from Redis, tokens from the engine."""
        return {"redis": self.core.store.ping, "engine": self.serves}


def build_core(settings: LLMSettings) -> LLMCore:
    checkpoint = resolve_checkpoint(settings.checkpoint)
    engine = load_engine(
        settings.engine, checkpoint, settings.device, settings.dtype, settings.max_model_len, settings.kv_cache_gib,
        settings.enforce_eager, settings.handoff_bytes,
    )  # fmt: skip
    merge_size = AutoConfig.from_pretrained(checkpoint).vision_config.spatial_merge_size
    accepted = settings.accepted_encoder_ids or [compute_encoder_id(checkpoint)]
    rules = BlobRules(merge_size, engine.hidden_size, frozenset(accepted))
    store = EmbeddingStore(settings.store_config())
    cache = BlobCache(settings.blob_cache_bytes)
    return LLMCore(
        settings.model_name,
        engine,
        PromptBuilder(engine.tokenizer),
        store,
        rules,
        settings.max_media_per_request,
        cache,
        ProgressWatch("the engine", settings.stall_s),
    )


async def start_llm_server(settings: LLMSettings, core: LLMCore | None = None) -> LLMServer:
    """Loads the model (unless `core` is given), warms the engine up (llm_service/warm_up.py),
    starts serving, and reports SERVING while Redis answers and the engine lives."""
    core = core or build_core(settings)
    await warm_up(core.engine)
    # Warmed up, the engine's processes hold what they keep for life: out of the collector's reach.
    metrics.ENGINE_FROZEN_OBJECTS.set(await core.engine.freeze_startup_heaps())
    limits = SamplingLimits(settings.default_max_tokens, settings.max_tokens_limit)

    def register(server: grpc.aio.Server, subcalls: SubcallChain) -> None:
        servicer = LLMServicer(core, limits, resolve_engine_name(settings.engine), subcalls)
        llm_pb2_grpc.add_LLMServiceServicer_to_server(servicer, server)

    return await start_service(LLMServer, core, settings, SERVICE_NAME, register)
