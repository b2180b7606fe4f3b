"""Runs one LLM service: `python -m llm_service` (settings from LLM_* env)."""

from __future__ import annotations

import asyncio
import logging

from llm_service.server import start_llm_server
from llm_service.settings import LLMSettings
from shared.grpc_metrics import serve_metrics
from shared.grpc_server import serve_until_signal
from shared.request_context import configure_logging


async def main() -> None:
    settings = LLMSettings()
    configure_logging("llm", settings.log_level, settings.json_logs)
    serve_metrics(settings.metrics_port)
    server = await start_llm_server(settings)
    logging.getLogger(__name__).info("model %s ready on port %d", settings.model_name, server.port)
    await serve_until_signal(server.running, settings.grace_s)
    await server.stop()


if __name__ == "__main__":
    asyncio.run(main())
