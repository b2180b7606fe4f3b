"""Runs the gateway: `python -m gateway` (settings from GATEWAY_* env)."""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from gateway.http_protocol import uvicorn_config
from gateway.settings import GatewaySettings
from shared.gc_heap import freeze_startup_heap
from shared.logging_setup import configure_logging
from shared.tracing import TracingSettings, init_tracing


def main() -> None:
    settings = GatewaySettings()
    configure_logging("gateway", settings.log_level, settings.json_logs)
    tracer_provider = init_tracing("gateway", TracingSettings())
    # log_config=None: uvicorn's loggers go through our (JSON) handler instead of its own.
    # A keep-alive shorter than the client's lets the server close a connection the client is
    # about to reuse (a ReadError on its next request); see GATEWAY_KEEP_ALIVE_S.
    app = create_app(settings)
    freeze_startup_heap()  # the app and every module it needs exist now, for the life of the process
    config = uvicorn_config(
        app,
        settings,
        host=settings.host,
        port=settings.port,
        log_config=None,
        # The summary line (gateway.requests) is the access log: uvicorn's own would add a second,
        # thinner line per request and one per probe, which the summary leaves out on purpose.
        access_log=False,
        # Named, not "auto": without it uvicorn falls back, silently, to asyncio, which spends
        # several times the CPU per request and per streamed chunk (it is a dependency).
        loop="uvloop",
    )
    uvicorn.Server(config).run()
    if tracer_provider is not None:
        tracer_provider.shutdown()  # exports the spans still queued


if __name__ == "__main__":
    main()
