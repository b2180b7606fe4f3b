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
from shared.logging_setup import configure_logging
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
    await server.serve_until_stopped(settings.grace_s, tracer_provider)
    return 0


if __name__ == "__main__":
    sys.exit(event_loop.run(main()))
