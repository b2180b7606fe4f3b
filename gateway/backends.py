"""gRPC clients the gateway talks to: one encoder, and per model a round-robin of LLM services."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.settings import GatewaySettings
from shared.errors import ModelNotFound, clip
from shared.sdk import AsyncEncoderClient, AsyncLLMClient, ModelInfo


class Backends:
    def __init__(self, settings: GatewaySettings) -> None:
        timeout, config = settings.request_timeout_s, settings.channel_config()
        self._health_config = config
        self.encoder = AsyncEncoderClient(settings.encoder_target, timeout, config)
        self._models: dict[str, list[AsyncLLMClient]] = {
            name: [AsyncLLMClient(target, timeout, config) for target in targets]
            for name, targets in settings.models.items()
        }
        self._rotations: dict[str, Iterator[AsyncLLMClient]] = {
            name: itertools.cycle(clients) for name, clients in self._models.items()
        }
        self._model_info: dict[str, ModelInfo] = {}

    @property
    def model_names(self) -> list[str]:
        return sorted(self._models)

    def llm_for(self, model: str) -> AsyncLLMClient:
        """The next LLM service for `model` (round robin); ModelNotFound when none serves it."""
        rotation = self._rotations.get(model)
        if rotation is None:
            known = ", ".join(self.model_names) or "none"
            raise ModelNotFound(f"model {clip(model)!r} does not exist; available: {known}", param="model")
        return next(rotation)

    async def model_info(self, model: str) -> ModelInfo:
        """What a model's service reports (accepted encoder ids, hidden size), asked once."""
        if model not in self._model_info:
            infos = await self.llm_for(model).list_models()
            self._model_info[model] = next(info for info in infos if info.name == model)
        return self._model_info[model]

    async def health(self) -> dict[str, bool]:
        """SERVING state of every backend, by target."""
        targets = {self.encoder.target, *(c.target for clients in self._models.values() for c in clients)}
        return {target: await self._is_serving(target) for target in sorted(targets)}

    async def ready(self) -> bool:
        """The encoder reports SERVING. A model with no live service is left out of readiness:
        it answers 503 on its own, and must not take the gateway (and every other model) down."""
        return await self._is_serving(self.encoder.target)

    async def close(self) -> None:
        await self.encoder.close()
        for clients in self._models.values():
            for client in clients:
                await client.close()

    async def _is_serving(self, target: str) -> bool:
        async with self._health_config.open(target, aio=True) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
