"""Domain errors, and their one mapping to gRPC status codes and HTTP/OpenAI errors.

Every service raises these classes; `shared.grpc_errors` turns them into gRPC
statuses (and back, on the client side), and the gateway turns them into HTTP
responses with OpenAI error bodies. Nothing else decides a status code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import grpc

# Error messages never carry more than this many characters of client input.
MAX_ECHO_CHARS = 120


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """Shortens client-supplied text before it goes into an error message."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


@dataclass(frozen=True)
class ErrorKind:
    """How one error class shows up in each protocol."""

    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str


class ServiceError(Exception):
    """Base of every error a client may see. `param` names the offending field."""

    kind: ClassVar[ErrorKind] = ErrorKind(grpc.StatusCode.INTERNAL, 500, "server_error")
    code: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        # What failed, in the words of a public API's client ("the model 'ft-a'"): set by the
        # gateway where it calls a backend, so that it can tell the client of a server-side error
        # without naming the backend's address (gateway/errors.py). Never sent over gRPC.
        self.subject: str | None = None


class InvalidInput(ServiceError):
    """The request is malformed: bad JSON, bad field, not an image, bad blob."""

    kind = ErrorKind(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")
    code = "invalid_value"


class InvalidEmbedding(InvalidInput):
    """An embedding blob breaks the contract (shape, dtype, grid, finite values)."""

    code = "invalid_embedding"


class ContextLengthExceeded(InvalidInput):
    """The prompt (text plus image and video tokens) does not fit the model's context."""

    code = "context_length_exceeded"


class ImageFetchFailed(InvalidInput):
    """An image URL could not be fetched (refused, unreachable, timed out, bad status): the
    client's URL is at fault, as OpenAI answers it (400). Never retried: a retry would hold
    a worker for another full fetch deadline."""

    code = "invalid_image_url"


class NotFound(ServiceError):
    kind = ErrorKind(grpc.StatusCode.NOT_FOUND, 404, "not_found_error")
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class EmbeddingNotFound(NotFound):
    """A key that is not (or no longer) in the store."""

    code = "embedding_not_found"

    def __init__(self, message: str, *, keys: list[str], param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.keys = keys


class IncompatibleEncoder(ServiceError):
    """A blob made by an encoder this model does not accept."""

    kind = ErrorKind(grpc.StatusCode.FAILED_PRECONDITION, 409, "invalid_request_error")
    code = "incompatible_encoder"


class TooLarge(ServiceError):
    kind = ErrorKind(grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "invalid_request_error")
    code = "too_large"


class Unavailable(ServiceError):
    """A dependency (Redis, a backend, an image host) cannot be reached now."""

    kind = ErrorKind(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable")
    code = "unavailable"
    retry_after_s: ClassVar[int] = 1


class RateLimited(ServiceError):
    """Too much load right now; the client should retry after a pause."""

    kind = ErrorKind(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error")
    code = "rate_limit_exceeded"


class Unauthenticated(ServiceError):
    kind = ErrorKind(grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error")
    code = "invalid_api_key"


class DeadlineExceeded(ServiceError):
    kind = ErrorKind(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout")
    code = "timeout"


class Internal(ServiceError):
    """A bug or an engine failure; the message is safe to show."""


# A status maps back to the class whose `code` matches the `error-code` metadata,
# else to the last (most general) class listed for that status.
ERROR_CLASSES: tuple[type[ServiceError], ...] = (
    InvalidEmbedding,
    ContextLengthExceeded,
    ImageFetchFailed,
    InvalidInput,
    ModelNotFound,
    EmbeddingNotFound,
    NotFound,
    IncompatibleEncoder,
    RateLimited,
    TooLarge,
    Unavailable,
    Unauthenticated,
    DeadlineExceeded,
    Internal,
)


def error_class_for(grpc_code: grpc.StatusCode, code: str | None) -> type[ServiceError]:
    """The class a gRPC status (and its `error-code` metadata) stands for."""
    by_status = [cls for cls in ERROR_CLASSES if cls.kind.grpc_code == grpc_code]
    for cls in by_status:
        if cls.code == code:
            return cls
    return by_status[-1] if by_status else Internal
