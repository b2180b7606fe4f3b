"""gRPC servicer for llm.v1: protos in, LLMCore calls, protos out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from llm_service import metrics
from llm_service.chat_request import ChatRequest, SamplingLimits
from llm_service.core import LLMCore
from llm_service.logprobs_pb import TokenNamer
from shared.pb.llm.v1 import llm_pb2, llm_pb2_grpc

_FINISH_REASONS = {"stop": llm_pb2.FINISH_REASON_STOP, "length": llm_pb2.FINISH_REASON_LENGTH}


class LLMServicer(llm_pb2_grpc.LLMServiceServicer):
    def __init__(self, core: LLMCore, limits: SamplingLimits, engine_name: str) -> None:
        self._core = core
        self._limits = limits
        self._engine_name = engine_name
        self._namer = TokenNamer(core.engine.tokenizer)

    async def Generate(
        self, request: llm_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[llm_pb2.GenerateChunk]:
        chat = ChatRequest.from_pb(request, self._limits)
        streaming = 0.0  # our share of the stream: building and sending messages, not awaiting the engine
        async for delta in self._core.generate(chat):
            began = time.perf_counter()
            chunk = llm_pb2.GenerateChunk(
                text=delta.text, token_ids=delta.token_ids, logprobs=self._namer.to_pb(delta.logprobs)
            )
            if delta.finish_reason is not None:
                chunk.finish_reason = _FINISH_REASONS[delta.finish_reason]
                chunk.usage.prompt_tokens = delta.prompt_tokens
                chunk.usage.completion_tokens = delta.completion_tokens
            yield chunk  # resumes once gRPC has taken the message
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
