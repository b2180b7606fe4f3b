"""Logging configured once, in each service's __main__: structured JSON lines that name the
request being served (shared.request_context), or plain text for a terminal."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from shared.request_context import request_id_var


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, logger, message, request_id, exception."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = request_id_var.get()
        if request_id:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(service: str, level: str, json_logs: bool) -> None:
    """Called once, in each service's __main__."""
    handler = logging.StreamHandler()
    if json_logs:
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
