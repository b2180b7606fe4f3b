"""Test harness: a real redis-server on a free port, and the whole stack served
from one background event loop (gRPC servers on port 0, uvicorn on port 0), so
synchronous tests can use the official openai client, httpx and the sync SDK."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI

from encoder_service.server import EncoderServer, start_encoder_server
from encoder_service.settings import EncoderSettings
from gateway.app import create_app
from gateway.http_protocol import uvicorn_config
from gateway.settings import GatewaySettings
from llm_service.server import LLMServer, start_llm_server
from llm_service.settings import LLMSettings
from scripts.redis_process import RedisServer, free_port  # noqa: F401  (re-exported for tests)

T = TypeVar("T")
# ft-a decodes with vLLM where it is installed (the production engine), ft-b with the
# transformers reference engine, so every end-to-end test covers both engines.
ENGINES = {"ft-a": "auto", "ft-b": "transformers"}
VLLM_LIMITS = {"max_model_len": 2048, "kv_cache_gib": 1.0}


class BackgroundLoop:
    """An asyncio loop in a daemon thread; `run` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="stack-loop")
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


@dataclass
class Stack:
    encoder: EncoderServer
    llms: dict[str, LLMServer]
    gateway_port: int
    uvicorn_server: uvicorn.Server
    redis: RedisServer
    gateway_app: FastAPI  # its state.backends holds the gateway's gRPC clients

    @property
    def encoder_target(self) -> str:
        return f"127.0.0.1:{self.encoder.port}"

    def llm_target(self, model: str) -> str:
        return f"127.0.0.1:{self.llms[model].port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"


async def start_gateway(app: FastAPI) -> tuple[uvicorn.Server, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # Served as `python -m gateway` serves it: its HTTP protocol, with the limits in its settings.
    server = uvicorn.Server(uvicorn_config(app, app.state.settings, log_level="warning", lifespan="on"))
    asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.02)
    return server, port


def gateway_settings_for(encoder: EncoderServer, llms: dict[str, LLMServer], **overrides: Any) -> GatewaySettings:
    return GatewaySettings(
        encoder_target=f"127.0.0.1:{encoder.port}",
        models={name: [f"127.0.0.1:{server.port}"] for name, server in llms.items()},
        request_timeout_s=120,
        **overrides,
    )


async def start_stack(checkpoints: dict[str, Path], redis_server: RedisServer, models: tuple[str, ...]) -> Stack:
    common = {"redis_url": redis_server.url, "host": "127.0.0.1", "port": 0}
    encoder = await start_encoder_server(
        EncoderSettings(checkpoint=str(checkpoints["base"]), allow_private_urls=True, **common)
    )
    llms = {}
    for name in models:
        settings = LLMSettings(
            checkpoint=str(checkpoints[name]), model_name=name, engine=ENGINES[name], **VLLM_LIMITS, **common
        )
        llms[name] = await start_llm_server(settings)
    app = create_app(gateway_settings_for(encoder, llms))
    uvicorn_server, port = await start_gateway(app)
    return Stack(encoder, llms, port, uvicorn_server, redis_server, app)


async def stop_stack(stack: Stack) -> None:
    stack.uvicorn_server.should_exit = True
    await stack.encoder.stop()
    for server in stack.llms.values():
        await server.stop()
    await asyncio.sleep(0.2)
