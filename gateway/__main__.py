"""Runs the gateway: `python -m gateway` (settings from GATEWAY_* env)."""

from __future__ import annotations

import logging

import uvicorn

from gateway.app import create_app
from gateway.settings import GatewaySettings


def main() -> None:
    settings = GatewaySettings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s gateway %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level.lower())


if __name__ == "__main__":
    main()
