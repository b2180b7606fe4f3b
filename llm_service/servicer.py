"""gRPC servicer for llm.v1: protos in, LLMCore calls, protos out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from llm_service import metrics
from llm_service.chat_request import ChatRequest, SamplingLimits
from llm_service.core import LLMCore
from llm_service.logprobs_pb import TokenNamer
from llm_service.multiplex import GenerateManyServicer
from shared.grpc_subcalls import SubcallChain
from shared.pb.llm.v1 import llm_pb2, llm_pb2_grpc

_FINISH_REASONS = {"stop": llm_pb2.FINISH_REASON_STOP, "length": llm_pb2.FINISH_REASON_LENGTH}


class LLMServicer(GenerateManyServicer, llm_pb2_grpc.LLMServiceServicer):
    def __init__(self, core: LLMCore, limits: SamplingLimits, engine_name: str, subcalls: SubcallChain) -> None:
        self._core = core
        self._limits = limits
        self._engine_name = engine_name
        self._namer = TokenNamer(core.engine.tokenizer)
        self.subcalls = subcalls  # GenerateMany serves its calls through them

    async def Generate(
        self, request: llm_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[llm_pb2.GenerateChunk]:
        chat = ChatRequest.from_pb(request, self._limits)
        held = _HeldChunks() if request.single_chunk else None
        streaming = 0.0  # our share of the stream: building and sending messages, not awaiting the engine
        async for delta in self._core.generate(chat):
            began = time.perf_counter()
            chunk = llm_pb2.GenerateChunk(
                text=delta.text, token_ids=delta.token_ids, logprobs=self._namer.to_pb(delta.logprobs)
            )
            # Usage so far on every chunk, not only the last: a client that streams usage as it goes
            # (vLLM's continuous_usage_stats) needs the prompt's tokens from the first chunk on.
            chunk.usage.prompt_tokens = delta.prompt_tokens
            chunk.usage.completion_tokens = delta.completion_tokens
            if delta.finish_reason is not None:
                chunk.finish_reason = _FINISH_REASONS[delta.finish_reason]
            ready = chunk if held is None else held.add(chunk)
            if ready is not None:
                yield ready  # resumes once gRPC has taken the message
            streaming += time.perf_counter() - began
        metrics.REQUEST_STAGE_SECONDS.labels("stream").observe(streaming)

    async def ListModels(
        self, request: llm_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> llm_pb2.ListModelsReply:
        rules = self._core.rules
        model = llm_pb2.ModelInfo(
            name=self._core.model_name,
            accepted_encoder_ids=sorted(rules.accepted_encoder_ids),
            hidden_size=rules.hidden_size,
            engine=self._engine_name,
        )
        return llm_pb2.ListModelsReply(models=[model])


class _HeldChunks:
    """Chunks held back for a caller that asked for the completion in one (single_chunk), and
    joined: texts, token ids and logprobs in order, the last one's finish reason and usage."""

    # Held past this size, they go out early, as one chunk more: the completion then comes in a few
    # chunks, each well within the message size both ends accept (a long completion with
    # top_logprobs 20 reaches tens of MB).
    MAX_BYTES = 4 * 1024 * 1024

    def __init__(self) -> None:
        self._chunks: list[llm_pb2.GenerateChunk] = []
        self._bytes = 0

    def add(self, chunk: llm_pb2.GenerateChunk) -> llm_pb2.GenerateChunk | None:
        """Holds `chunk`; returns the joined chunk once the completion ends or the held chunks fill up."""
        self._chunks.append(chunk)
        self._bytes += chunk.ByteSize()
        if chunk.finish_reason == llm_pb2.FINISH_REASON_UNSPECIFIED and self._bytes < self.MAX_BYTES:
            return None
        chunks, self._chunks, self._bytes = self._chunks, [], 0
        joined = llm_pb2.GenerateChunk(
            text="".join(c.text for c in chunks),
            token_ids=[token for c in chunks for token in c.token_ids],
            logprobs=[entry for c in chunks for entry in c.logprobs],
            finish_reason=chunk.finish_reason,
        )
        if chunk.HasField("usage"):
            joined.usage.CopyFrom(chunk.usage)
        return joined
