"""Logging configured once, in each service's __main__: structured JSON lines that name the
request being served (shared.request_context), or plain text for a terminal.

A line may carry fields of its own, for whoever reads the logs as data (the gateway's one summary
line per request): `logger.info(message, extra={FIELDS: {...}})` puts each of them in the JSON
object beside the standard ones, which they never replace."""

from __future__ import annotations

import json
import logging
import logging.config
import time
from typing import Any

from shared.request_context import request_id_var

FIELDS = "fields"  # the `extra` key of a line's own fields


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, logger, message, request_id, exception, and
    the line's own fields."""

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
        fields = getattr(record, FIELDS, None)
        if isinstance(fields, dict):
            for name, value in fields.items():
                entry.setdefault(name, value)
        return json.dumps(entry, ensure_ascii=False, default=str)


def logging_config(service: str, level: str, json_logs: bool) -> dict[str, Any]:
    """The whole setup as `logging.config.dictConfig` data: one stream handler on the root logger.
    Data, so that processes we do not start ourselves (vLLM's engine processes, which it configures
    from a file of this) log the same way."""
    formatter: dict[str, Any] = (
        {"()": f"{__name__}.JsonFormatter", "service": service}
        if json_logs
        else {"format": f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"}
    )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"service": formatter},
        "handlers": {"service": {"class": "logging.StreamHandler", "formatter": "service"}},
        "root": {"handlers": ["service"], "level": level},
    }


_active: dict[str, Any] | None = None


def configure_logging(service: str, level: str, json_logs: bool) -> None:
    """Called once, in each service's __main__."""
    global _active
    _active = logging_config(service, level, json_logs)
    logging.config.dictConfig(_active)


def active_logging_config() -> dict[str, Any] | None:
    """What configure_logging set up in this process (None when it was not called: a library use,
    a test), for code that must configure another process the same way."""
    return _active
