"""Builds and starts the LLM gRPC server from settings (used by __main__ and tests), and watches
its engine for a hang (shared/progress_watch.py): with a stall limit sized to the machine unless
LLM_STALL_S sets one, and a probe of the engine every LLM_ENGINE_PROBE_S, busy or idle."""

from __future__ import annotations

import asyncio
import logging

import grpc
from transformers import AutoConfig

from llm_service import metrics
from llm_service.blob_cache import BlobCache
from llm_service.chat_request import SamplingLimits
from llm_service.core import LLMCore
from llm_service.engines.base import Engine
from llm_service.engines.factory import load_engine, resolve_engine_name
from llm_service.prompt import PromptBuilder
from llm_service.servicer import LLMServicer
from llm_service.settings import LLMSettings
from llm_service.warm_up import time_prefill, warm_up
from shared import readiness
from shared.blob import BlobRules
from shared.encoder_id import compute_encoder_id
from shared.grpc_subcalls import SubcallChain
from shared.model_paths import resolve_checkpoint
from shared.pb.llm.v1 import llm_pb2, llm_pb2_grpc
from shared.progress_watch import ProgressWatch, stall_limit
from shared.service_server import ServiceServer, start_service
from shared.store import EmbeddingStore

SERVICE_NAME = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name
logger = logging.getLogger(__name__)


class LLMServer(ServiceServer[LLMCore]):
    probing: asyncio.Task[None] | None = None  # the engine probe (probe_engine), while it runs

    async def release(self) -> None:
        """The engine probe, the store's connections and the engine (vLLM's engine process too)."""
        if self.probing is not None:
            self.probing.cancel()
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
        # Unset, the limit is sized once the engine is warmed up (start_llm_server); the watch is
        # asked nothing before.
        ProgressWatch("the engine", 0.0 if settings.stall_s is None else settings.stall_s),
    )


async def start_llm_server(settings: LLMSettings, core: LLMCore | None = None) -> LLMServer:
    """Loads the model (unless `core` is given), warms the engine up (llm_service/warm_up.py),
    starts serving, and reports SERVING while Redis answers and the engine lives. The server that
    loads the engine also watches it: it sizes the stall limit and probes the engine; one handed a
    loaded `core` (tests share models so) leaves that to the server that loaded it."""
    loads = core is None
    core = core or build_core(settings)
    await warm_up(core.engine)
    # Warmed up, the engine's processes hold what they keep for life: out of the collector's reach.
    metrics.ENGINE_FROZEN_OBJECTS.set(await core.engine.freeze_startup_heaps())
    if loads:
        core.progress.stall_s = await size_stall_limit(settings, core.engine)
        metrics.STALL_LIMIT_SECONDS.set(core.progress.stall_s)
    limits = SamplingLimits(settings.default_max_tokens, settings.max_tokens_limit)

    def register(server: grpc.aio.Server, subcalls: SubcallChain) -> None:
        servicer = LLMServicer(core, limits, resolve_engine_name(settings.engine), subcalls)
        llm_pb2_grpc.add_LLMServiceServicer_to_server(servicer, server)

    server = await start_service(LLMServer, core, settings, SERVICE_NAME, register)
    if loads and settings.engine_probe_s > 0 and core.progress.stall_s > 0:  # no watch, no probe
        server.probing = asyncio.create_task(probe_engine(core.engine, core.progress, settings.engine_probe_s))
    return server


async def size_stall_limit(settings: LLMSettings, engine: Engine) -> float:
    """LLM_STALL_S where set; else 10 times the longest legitimate silence of the engine, at least
    60 s (shared/progress_watch.stall_limit), timed on this machine: the largest step the engine
    may take (probed, it answers between two steps) or a whole prompt's prefill (not probed, only
    tokens are progress), at the seconds per prompt token of a prefill timed now. So the limit
    follows the machine and the model: the fixed 600 s it replaces was sized for the longest step
    of the 2B model on CPU, and let a frozen engine on a GPU hold its requests for 10 minutes."""
    if settings.stall_s is not None:
        logger.info("stall limit %gs, set by LLM_STALL_S (0: the watch is off)", settings.stall_s)
        return settings.stall_s
    per_token_s = await time_prefill(engine)
    probed = settings.engine_probe_s > 0
    tokens = engine.longest_step_tokens if probed else engine.max_model_len
    limit = stall_limit(per_token_s * tokens)
    step = "one step's token budget" if probed else "a whole prompt: the engine is not probed"
    logger.info(
        "stall limit %.0fs (LLM_STALL_S unset): a prefill took %.3f ms per prompt token here, so the longest "
        "silence of the engine, %d tokens (%s), takes about %.2fs; the limit is 10 times that, at least 60s",
        limit, per_token_s * 1000, tokens, step, per_token_s * tokens,
        extra={"fields": {"stall_limit_s": limit, "prefill_s_per_token": per_token_s, "longest_step_tokens": tokens}},
    )  # fmt: skip
    return limit


async def probe_engine(engine: Engine, progress: ProgressWatch, interval_s: float) -> None:
    """Every `interval_s`, a probe of the engine (Engine.probe): work in hand for the hung-engine
    watch until its answer, which is progress. A frozen engine, idle or busy, answers nothing and
    counts as hung once the stall limit has passed. A probe that fails is no answer; the failure
    is logged (an engine that died is the engine's failure(), reported apart)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            with progress.working():
                await engine.probe()
        except Exception as error:
            logger.warning("the engine probe failed: %s: %s", type(error).__name__, error)
            continue
        progress.progressed()
