"""Clients for llm.v1 (async and sync). Errors arrive as `shared.errors.ServiceError`."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import grpc

from shared.grpc_auth import call_metadata
from shared.grpc_errors import raising_service_errors
from shared.pb.llm.v1 import llm_pb2, llm_pb2_grpc
from shared.sdk.types import ChannelConfig, GenerationChunk, Message, ModelInfo, Sampling, generate_request


class AsyncLLMClient:
    """`async for chunk in llm.generate("model", [Message("user", ["hi"])]): ...`."""

    def __init__(self, target: str, timeout_s: float = 300.0, config: ChannelConfig | None = None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._config = config or ChannelConfig()
        self._errors = f"LLM service at {target}"
        self._channel = self._config.open(target, aio=True)
        self._stub = llm_pb2_grpc.LLMServiceStub(self._channel)

    async def generate(
        self, model: str, messages: list[Message], sampling: Sampling | None = None, request_id: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Streams chunks; leaving the loop early cancels the generation on the server."""
        request_id = request_id or uuid.uuid4().hex
        request = generate_request(model, messages, sampling or Sampling(), request_id)
        call = self._stub.Generate(
            request, timeout=self.timeout_s, metadata=call_metadata(self._config.token, request_id)
        )
        try:
            with raising_service_errors(self._errors):
                async for chunk in call:
                    yield GenerationChunk.from_pb(chunk)
        finally:
            call.cancel()

    async def list_models(self) -> list[ModelInfo]:
        request, metadata = llm_pb2.ListModelsRequest(), call_metadata(self._config.token)
        with raising_service_errors(self._errors):
            reply = await self._stub.ListModels(request, timeout=self.timeout_s, metadata=metadata)
        return [ModelInfo.from_pb(m) for m in reply.models]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncLLMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class LLMClient:
    """Blocking twin of AsyncLLMClient."""

    def __init__(self, target: str, timeout_s: float = 300.0, config: ChannelConfig | None = None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._config = config or ChannelConfig()
        self._errors = f"LLM service at {target}"
        self._channel: grpc.Channel = self._config.open(target, aio=False)
        self._stub = llm_pb2_grpc.LLMServiceStub(self._channel)

    def generate(
        self, model: str, messages: list[Message], sampling: Sampling | None = None, request_id: str | None = None
    ) -> Iterator[GenerationChunk]:
        request_id = request_id or uuid.uuid4().hex
        request = generate_request(model, messages, sampling or Sampling(), request_id)
        call = self._stub.Generate(
            request, timeout=self.timeout_s, metadata=call_metadata(self._config.token, request_id)
        )
        try:
            with raising_service_errors(self._errors):
                for chunk in call:
                    yield GenerationChunk.from_pb(chunk)
        finally:
            call.cancel()

    def list_models(self) -> list[ModelInfo]:
        request, metadata = llm_pb2.ListModelsRequest(), call_metadata(self._config.token)
        with raising_service_errors(self._errors):
            reply = self._stub.ListModels(request, timeout=self.timeout_s, metadata=metadata)
        return [ModelInfo.from_pb(m) for m in reply.models]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> LLMClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
