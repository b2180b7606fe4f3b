"""The gateway's one mapping from exceptions to HTTP responses with OpenAI error bodies.

A client's mistake (4xx) is told as the service that found it said it: precise, naming the field.
A server-side error (5xx) is told in the client's words, as what failed (the model it asked for,
the encoding of its images and videos) and whether a retry may help: the services' own words name
addresses and parts of the deployment ("LLM service at 10.0.3.7:50062 is unavailable: ..."),
which are no business of an outside client. The full detail goes to the request's summary line
(gateway.summary), under the request id the response carries in x-request-id.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from gateway import summary
from shared.errors import ERROR_CLASSES, DeadlineExceeded, InvalidInput, ServiceError, Unavailable, clip
from shared.request_context import request_id_var

# What a server-side error names as failed when no call site named anything (a gateway bug).
SERVER = "the server"
# The encoder, as a client knows it: what turns its images and videos into what a model reads.
ENCODING = "image and video encoding"


def model_subject(model: str) -> str:
    """A model's LLM services, as a client knows them: the model it asked for."""
    return f"the model {clip(model)!r}"


@contextmanager
def failing_as(subject: str) -> Iterator[None]:
    """A server-side error raised in the block is told to the client as `subject`'s failure. The
    innermost block names it: a key re-encoded while a model's call is retried is the encoding's."""
    try:
        yield
    except ServiceError as error:
        if error.kind.http_status >= 500 and error.subject is None:
            error.subject = subject
        raise


def public_message(error: ServiceError) -> str:
    """What a client is told of a server-side error: what failed, and whether to retry."""
    subject = error.subject or SERVER
    if isinstance(error, Unavailable):
        return f"{subject} is unavailable right now; retry later"
    if isinstance(error, DeadlineExceeded):
        return f"{subject} did not finish in time; retry later"
    request_id = request_id_var.get()
    quote = f"; quote request id {request_id} when you report it" if request_id else ""
    return f"{subject} failed with an internal error{quote}"


def error_body(error: ServiceError) -> dict[str, Any]:
    """The OpenAI error object. Every error a client is told of, as a response or as a stream's
    error event, is shaped here, so here it is also noted, in full, on the request's summary line."""
    summary.current().note_error(error.code, error.message)
    message = public_message(error) if error.kind.http_status >= 500 else error.message
    return {"error": {"message": message, "type": error.kind.openai_type, "param": error.param, "code": error.code}}


def error_response(error: ServiceError) -> JSONResponse:
    headers = {"Retry-After": str(Unavailable.retry_after_s)} if error.kind.http_status in (429, 503) else None
    return JSONResponse(error_body(error), status_code=error.kind.http_status, headers=headers)


def _param_from_loc(loc: tuple[int | str, ...]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content".

    pydantic also names the union member each error comes from ("str", "list[...]",
    "function-after[...]") and, under a union tagged by `type`, the tag ("image_url"): none of
    them is a field the client wrote, so they are left out."""
    path = ""
    tag_follows = False  # under a tagged union, the next name is the member's tag
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            path += f"[{item}]"
        elif item == "str" or item.startswith(("list[", "function-", "tagged-union[")):
            tag_follows = tag_follows or "tagged-union[" in item
        elif tag_follows:
            tag_follows = False
        else:
            path += f".{item}" if path else item
    return path or None


def _is_json(content_type: str) -> bool:
    """Whether FastAPI parses a body of this type as JSON. A body with no type is not parsed
    (FastAPI's strict_content_type, on by default in the FastAPI we pin)."""
    media_type = content_type.split(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


def validation_error(exc: RequestValidationError, content_type: str) -> InvalidInput:
    errors = exc.errors()
    if any(error.get("type") == "json_invalid" for error in errors):
        return InvalidInput("request body is not valid JSON", param=None)
    if any(tuple(error.get("loc", ())) == ("body",) for error in errors):
        # The body as a whole is wrong: pydantic would say "Input should be a valid dictionary or
        # object to extract fields from". The usual cause is a client that sent JSON under another
        # type (curl -d sends application/x-www-form-urlencoded), which FastAPI does not parse.
        if not _is_json(content_type):
            came = f"came as {clip(content_type)!r}" if content_type else "came with no Content-Type"
            return InvalidInput(
                f"request body must be a JSON object sent with Content-Type: application/json (this one {came})",
                param=None,
            )
        return InvalidInput("request body must be a JSON object", param=None)
    # A field that takes one of several forms (content: a string or a list of parts) fails once
    # per form; the form that got deepest into the input is the one the client meant, and its
    # error names the part at fault ("messages[0].content[1].image_url.url", not "...content").
    deepest = max(errors, key=lambda error: len(error.get("loc", ())))
    param = _param_from_loc(tuple(deepest.get("loc", ())))
    message = str(deepest.get("msg", "invalid value"))
    return InvalidInput(f"{param}: {message}" if param else message, param=param)


def _body_parse_message(exc: HTTPException) -> str | None:
    """What FastAPI's "There was an error parsing the body" was: a body that is not UTF-8, or JSON
    Python's parser gives up on (nesting past its recursion limit, an integer of thousands of
    digits), said in words the client can act on; None for any other HTTP error."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return "request body is not valid UTF-8 JSON"
    if isinstance(cause, RecursionError):
        return "request body is not valid JSON here: it nests arrays or objects too deeply"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "request body is not valid JSON here: a number in it has too many digits"
    return None


def http_error_response(exc: HTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own HTTP errors (unknown route, wrong method, a body that is not
    UTF-8) in the OpenAI shape, as the domain class with that status (its most general one)."""
    message = _body_parse_message(exc) or exc.detail
    classes = [cls for cls in ERROR_CLASSES if cls.kind.http_status == exc.status_code]
    if classes:
        error = classes[-1](str(message))
        response = error_response(error)
    else:  # a status no domain error has (405): the status is kept, the body still OpenAI's
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = {"error": {"message": str(message), "type": kind, "param": None, "code": None}}
        response = JSONResponse(body, status_code=exc.status_code)
    response.headers.update(exc.headers or {})
    return response


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc, request.headers.get("content-type", "")))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return http_error_response(exc)

    # Any other exception is answered by gateway.exchange, outside the app, with the request id.
