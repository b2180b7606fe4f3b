"""Runs the encoder service: `python -m encoder_service` (settings from ENCODER_* env)."""

from __future__ import annotations

import logging
import sys

from encoder_service.allocator import retain_freed_memory
from encoder_service.server import start_encoder_server
from encoder_service.settings import EncoderSettings
from shared import event_loop
from shared.gc_heap import freeze_startup_heap
from shared.grpc_metrics import serve_metrics
from shared.grpc_server import serve_until_signal
from shared.logging_setup import configure_logging
from shared.service_server import FAILURE_GRACE_S
from shared.tracing import TracingSettings, init_tracing


async def main() -> int:
    """Serves until SIGTERM (exit 0) or until the vision tower hangs (exit 1, to be restarted)."""
    settings = EncoderSettings()
    configure_logging("encoder", settings.log_level, settings.json_logs)
    tracer_provider = init_tracing("encoder", TracingSettings())
    if settings.retain_freed_memory and retain_freed_memory():
        logging.getLogger(__name__).info("allocator keeps freed memory (no mmap for large blocks, no trimming)")
    serve_metrics(settings.metrics_port)
    server = await start_encoder_server(settings)
    logging.getLogger(__name__).info("encoder %s ready on port %d", server.core.encoder_id, server.port)
    freeze_startup_heap()  # tower loaded and warmed up, server up: what exists now lives as long as the process
    failure = await serve_until_signal(server.running, settings.grace_s, server.until_failed(), FAILURE_GRACE_S)
    if tracer_provider is not None:
        tracer_provider.shutdown()  # exports the spans still queued
    if failure is not None:
        await server.exit_failed()
    await server.release()
    return 0


if __name__ == "__main__":
    sys.exit(event_loop.run(main()))
