"""Runs one LLM service: `python -m llm_service` (settings from LLM_* env)."""

from __future__ import annotations

import logging
import sys

from llm_service.server import start_llm_server
from llm_service.settings import LLMSettings
from shared import event_loop
from shared.gc_heap import freeze_startup_heap
from shared.grpc_metrics import serve_metrics
from shared.grpc_server import serve_until_signal
from shared.logging_setup import configure_logging
from shared.service_server import FAILURE_GRACE_S
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
    failure = await serve_until_signal(server.running, settings.grace_s, server.until_failed(), FAILURE_GRACE_S)
    if tracer_provider is not None:
        tracer_provider.shutdown()  # exports the spans still queued
    if failure is not None:
        await server.exit_failed()
    await server.release()
    return 0


if __name__ == "__main__":
    sys.exit(event_loop.run(main()))
