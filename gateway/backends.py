"""gRPC clients the gateway talks to: one encoder, and per model a round-robin of LLM services."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.settings import GatewaySettings
from shared import tracing
from shared.errors import ModelNotFound, clip
from shared.sdk import AsyncEncoderClient, AsyncLLMClient, ModelInfo

# How long a service that answered UNAVAILABLE is passed over while another one is up: a few of
# the channels' reconnect backoffs (shared.sdk.types.channel_options), so it is tried again soon
# after it is back, but not once per request while it is down.
PASS_OVER_S = 5.0


class Rotation:
    """One model's LLM services, taken in turn. A service that answered UNAVAILABLE a moment ago
    is passed over while another is not; when all did, they are taken in turn all the same, so
    the first to come back is found."""

    def __init__(self, clients: list[AsyncLLMClient]) -> None:
        self.clients = clients
        self._next = 0
        self._down_until: dict[str, float] = {}

    def pick(self, avoid: AsyncLLMClient | None = None) -> AsyncLLMClient | None:
        """The next service not recently down and not `avoid`; None when there is none such and
        `avoid` is set, else the next one in turn."""
        now, count = time.monotonic(), len(self.clients)
        order = [self.clients[(self._next + step) % count] for step in range(count)]
        live = [c for c in order if c is not avoid and self._down_until.get(c.target, 0.0) <= now]
        if not live and avoid is not None:
            return None
        chosen = live[0] if live else order[0]
        self._next = (self.clients.index(chosen) + 1) % count
        return chosen

    def mark_down(self, client: AsyncLLMClient) -> None:
        self._down_until[client.target] = time.monotonic() + PASS_OVER_S


class Backends:
    def __init__(self, settings: GatewaySettings) -> None:
        # The trace context goes with every call when tracing is on (shared/tracing.py).
        config = settings.channel_config(tracing.client_interceptors(), tracing.client_call_metadata())
        timeout = settings.request_timeout_s
        self._health_config = config
        self.encoder = AsyncEncoderClient(settings.encoder_target, timeout, config)
        self._models: dict[str, list[AsyncLLMClient]] = {
            name: [AsyncLLMClient(target, timeout, config, settings.generate_streams) for target in targets]
            for name, targets in settings.models.items()
        }
        self._rotations = {name: Rotation(clients) for name, clients in self._models.items()}
        self._model_info: dict[str, ModelInfo] = {}

    @property
    def model_names(self) -> list[str]:
        return sorted(self._models)

    def check_model(self, model: str) -> Rotation:
        """`model`'s services, without taking a turn; ModelNotFound when none serves it."""
        rotation = self._rotations.get(model)
        if rotation is None:
            known = ", ".join(self.model_names) or "none"
            raise ModelNotFound(f"model {clip(model)!r} does not exist; available: {known}", param="model")
        return rotation

    def llm_for(self, model: str) -> AsyncLLMClient:
        """The next LLM service for `model` (round robin, passing over those recently down).
        Take one per call you make: each pick is a turn."""
        chosen = self.check_model(model).pick()
        assert chosen is not None  # pick() without `avoid` always chooses
        return chosen

    def instead_of(self, model: str, failed: AsyncLLMClient) -> AsyncLLMClient | None:
        """Marks `failed` down (it answered UNAVAILABLE); another service of `model` that is not, if any."""
        rotation = self.check_model(model)
        rotation.mark_down(failed)
        return rotation.pick(avoid=failed)

    async def model_info(self, model: str) -> ModelInfo:
        """What a model's service reports (accepted encoder ids, hidden size), asked once."""
        if model not in self._model_info:
            infos = await self.llm_for(model).list_models()
            self._model_info[model] = next(info for info in infos if info.name == model)
        return self._model_info[model]

    async def health(self) -> dict[str, bool]:
        """SERVING state of every backend, by target. Asked all at once: a backend that hangs
        costs its 1 s timeout once, not once per backend ahead of it, so /readyz answers within
        the probe's timeout however many backends hang."""
        targets = sorted({self.encoder.target, *(c.target for clients in self._models.values() for c in clients)})
        return dict(zip(targets, await asyncio.gather(*map(self._is_serving, targets)), strict=True))

    async def health_by_name(self) -> dict[str, bool]:
        """SERVING state of every backend, named by what it is ("encoder", "<model>/<i>" for the
        model's i-th service), not where it is: /health is open to anyone who can reach the
        gateway, and a backend's address tells an outside client the deployment's topology."""
        serving = await self.health()
        named = {"encoder": serving[self.encoder.target]}
        for model in self.model_names:
            for index, client in enumerate(self._models[model]):
                named[f"{model}/{index}"] = serving[client.target]
        return named

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
