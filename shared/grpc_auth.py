"""A shared token on gRPC: servers refuse calls without `authorization: Bearer <token>`.

Health checks stay open (Kubernetes' gRPC probes cannot send metadata).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid gRPC token")


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        presented_bytes = presented if isinstance(presented, bytes) else presented.encode()
        # The scheme in any case, as HTTP reads it (RFC 9110); the token exactly, in constant time.
        scheme, _, token = presented_bytes.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token, self._expected):
            return await continuation(handler_call_details)
        return grpc.unary_unary_rpc_method_handler(_refuse)


def call_metadata(token: str | None, request_id: str | None = None) -> tuple[tuple[str, str], ...]:
    """Metadata a client sends with each call."""
    metadata = []
    if token:
        metadata.append(("authorization", f"Bearer {token}"))
    if request_id:
        metadata.append(("x-request-id", request_id))
    return tuple(metadata)
