"""The gateway's one mapping from exceptions to HTTP responses with OpenAI error bodies."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from gateway.openai_format import error_body
from shared.errors import Internal, InvalidInput, ServiceError, Unavailable

logger = logging.getLogger(__name__)


def error_response(error: ServiceError) -> JSONResponse:
    headers = {"Retry-After": str(Unavailable.retry_after_s)} if error.kind.http_status in (429, 503) else None
    return JSONResponse(error_body(error), status_code=error.kind.http_status, headers=headers)


def _param_from_loc(loc: tuple[int | str, ...]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    path = ""
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            path += f"[{item}]"
        elif item not in ("str", "list[...]") and not str(item).startswith(("function-", "tagged-union")):
            path += f".{item}" if path else str(item)
    return path or None


def validation_error(exc: RequestValidationError) -> InvalidInput:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return InvalidInput("request body is not valid JSON", param=None)
    param = _param_from_loc(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value"))
    return InvalidInput(f"{param}: {message}" if param else message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(Internal("internal error; see the gateway log"))
