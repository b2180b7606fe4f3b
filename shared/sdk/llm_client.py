"""Clients for llm.v1 (async and sync). Errors arrive as `shared.errors.ServiceError`.

Each RPC is one plan below (request and reply mapping); both clients run it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing

from shared.grpc_auth import call_metadata
from shared.grpc_errors import raising_service_errors
from shared.pb.llm.v1 import llm_pb2, llm_pb2_grpc
from shared.sdk.calls import AsyncClient, BlockingClient, Call
from shared.sdk.generate_mux import GenerateMultiplexer, MultiplexUnsupported
from shared.sdk.types import ChannelConfig, GenerationChunk, Message, ModelInfo, Sampling, generate_request

SERVICE = "LLM service"  # how errors name it: "LLM service at host:port"


def _generate(
    model: str, messages: list[Message], sampling: Sampling | None, request_id: str | None, single_chunk: bool
) -> Call[llm_pb2.GenerateChunk, GenerationChunk]:
    # Always a request id: the service names the generation by it (and logs it).
    request_id = request_id or uuid.uuid4().hex
    request = generate_request(model, messages, sampling or Sampling(), request_id, single_chunk)
    return Call("Generate", request, GenerationChunk.from_pb, request_id)


def _models(reply: llm_pb2.ListModelsReply) -> list[ModelInfo]:
    return [ModelInfo.from_pb(m) for m in reply.models]


def _list_models() -> Call[llm_pb2.ListModelsReply, list[ModelInfo]]:
    return Call("ListModels", llm_pb2.ListModelsRequest(), _models)


class AsyncLLMClient(AsyncClient):
    """`async for chunk in llm.generate("model", [Message("user", ["hi"])]): ...`.

    multiplex: generate() calls share this many GenerateMany streams instead of being calls of their
    own (shared/sdk/generate_mux.py): the same chunks and errors for a fraction of gRPC's CPU per
    call, for a caller that makes many at once, as the gateway does. At least the number of
    servers `target` names, so that each gets calls. 0: calls of their own."""

    def __init__(
        self, target: str, timeout_s: float | None = 300.0, config: ChannelConfig | None = None, multiplex: int = 0
    ) -> None:
        super().__init__(SERVICE, llm_pb2_grpc.LLMServiceStub, target, timeout_s, config)
        token, extra = call_metadata(self._config.token), self._config.call_metadata
        self._mux = (
            GenerateMultiplexer(self._channel, token, extra, multiplex, self._config.max_message_bytes)
            if multiplex
            else None
        )
        self._unsupported_mux: GenerateMultiplexer | None = None  # closed with the client

    async def generate(
        self, model: str, messages: list[Message], sampling: Sampling | None = None, request_id: str | None = None,
        single_chunk: bool = False,
    ) -> AsyncIterator[GenerationChunk]:  # fmt: skip
        """Streams chunks; leaving the loop early cancels the generation on the server.
        single_chunk: the completion held back and sent as one chunk at its end (a few past 4 MiB):
        cheaper for a caller that does not stream."""
        call = _generate(model, messages, sampling, request_id, single_chunk)
        # aclosing: closing this generator closes the call's at once (which cancels it), not at GC.
        async with aclosing(self._stream(call) if self._mux is None else self._multiplexed(call)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def list_models(self) -> list[ModelInfo]:
        return await self._unary(_list_models())

    async def close(self) -> None:
        await self._stop_multiplexing()
        await super().close()

    async def _multiplexed(
        self, call: Call[llm_pb2.GenerateChunk, GenerationChunk]
    ) -> AsyncGenerator[GenerationChunk, None]:
        assert self._mux is not None and isinstance(call.request, llm_pb2.GenerateRequest)
        chunks = self._mux.generate(call.request, call.request_id, self.timeout_s)
        try:
            async with aclosing(chunks):
                with raising_service_errors(self._errors):
                    async for chunk in chunks:
                        yield call.result(chunk)
        except MultiplexUnsupported:  # an older service: this call and the next ones as calls of their own
            # Not closed now: calls still on its streams learn of this from their own stream.
            if self._mux is not None:
                self._unsupported_mux, self._mux = self._mux, None
            async with aclosing(self._stream(call)) as own:
                async for result in own:
                    yield result

    async def _stop_multiplexing(self) -> None:
        muxes, self._mux, self._unsupported_mux = (self._mux, self._unsupported_mux), None, None
        for mux in muxes:
            if mux is not None:
                await mux.close()


class LLMClient(BlockingClient):
    """Blocking twin of AsyncLLMClient."""

    def __init__(self, target: str, timeout_s: float | None = 300.0, config: ChannelConfig | None = None) -> None:
        super().__init__(SERVICE, llm_pb2_grpc.LLMServiceStub, target, timeout_s, config)

    def generate(
        self, model: str, messages: list[Message], sampling: Sampling | None = None, request_id: str | None = None,
        single_chunk: bool = False,
    ) -> Iterator[GenerationChunk]:  # fmt: skip
        """Streams chunks; leaving the loop early cancels the generation on the server.
        single_chunk: the completion held back and sent as one chunk at its end (a few past 4 MiB):
        cheaper for a caller that does not stream."""
        yield from self._stream(_generate(model, messages, sampling, request_id, single_chunk))

    def list_models(self) -> list[ModelInfo]:
        return self._unary(_list_models())
