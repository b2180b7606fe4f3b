"""Runs one LLM service: `python -m llm_service` (settings from LLM_* env)."""

from __future__ import annotations

import logging
import sys

from llm_service.server import start_llm_server
from llm_service.settings import LLMSettings
from shared import event_loop
from shared.gc_heap import freeze_startup_heap
from shared.grpc_metrics import serve_metrics
from shared.logging_setup import configure_logging
from shared.tracing import TracingSettings, init_tracing


async def main() -> int:
    """Serves until SIGTERM (exit 0) or until the engine dies or hangs (exit 1: with a dead engine
    process the service can only answer 503, so it leaves, as vLLM's own server does, to be
    restarted; a hung one answers nothing)."""
    settings = LLMSettings()
    configure_logging("llm", settings.log_level, settings.json_logs)
    tracer_provider = init_tracing("llm", TracingSettings())
    serve_metrics(settings.metrics_port)
    server = await start_llm_server(settings)
    logging.getLogger(__name__).info("model %s ready on port %d", settings.model_name, server.port)
    freeze_startup_heap()  # engine loaded, server up: what exists now lives as long as the process
    await server.serve_until_stopped(settings.grace_s, tracer_provider)
    return 0


if __name__ == "__main__":
    sys.exit(event_loop.run(main()))
