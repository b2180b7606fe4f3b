"""A service's running gRPC server together with the core it serves: what the encoder's and the
LLM service's servers share.

Each service's server.py builds its core, registers its servicer, and says what its core releases
on stop and what readiness needs; binding, serving, readiness and stopping are written once, here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Generic, NoReturn, TypeVar

from opentelemetry.sdk.trace import TracerProvider

from shared import readiness
from shared.grpc_server import Register, RunningServer, serve_until_signal, start_server
from shared.settings import GrpcServerSettings

CoreT = TypeVar("CoreT")
ServerT = TypeVar("ServerT", bound="ServiceServer")  # type: ignore[type-arg]  # any core
FAILURE_POLL_S = 0.2
# After a failure, calls in flight get this long to end (those the failure already failed, to send
# their errors) before the service exits to be restarted.
FAILURE_GRACE_S = 2.0
FAILURE_RELEASE_S = 10.0
logger = logging.getLogger(__name__)


@dataclass
class ServiceServer(Generic[CoreT]):
    running: RunningServer
    core: CoreT

    @property
    def port(self) -> int:
        return self.running.port

    async def stop(self, grace_s: float = 0) -> None:
        """Readiness goes NOT_SERVING, RPCs drain (up to grace_s), then the core's resources go."""
        await self.running.stop(grace_s)
        await self.release()

    async def release(self) -> None:
        """Frees what the core holds beyond its RPCs (store connections, batcher, engine)."""
        raise NotImplementedError

    def readiness_checks(self) -> dict[str, readiness.Check]:
        """What must answer for the service to report SERVING (shared/readiness.py)."""
        raise NotImplementedError

    def failure(self) -> str | None:
        """Why the service can no longer serve at all (its engine process died, its compute
        hangs), or None. Such a service exits non-zero to be restarted (`until_failed`)."""
        return None

    async def until_failed(self) -> str:
        """Returns `failure()` once there is one. Each check is a few attribute reads, so polling
        often costs little and notices a failure quickly."""
        while (reason := self.failure()) is None:
            await asyncio.sleep(FAILURE_POLL_S)
        return reason

    async def serve_until_stopped(self, grace_s: float, tracer_provider: TracerProvider | None) -> None:
        """Serves until SIGTERM (calls in flight get `grace_s`, then resources are released) or
        until a `failure()` (FAILURE_GRACE_S, then `exit_failed`). Spans still queued are
        exported first either way."""
        failure = await serve_until_signal(self.running, grace_s, self.until_failed(), FAILURE_GRACE_S)
        if tracer_provider is not None:
            tracer_provider.shutdown()
        if failure is not None:
            await self.exit_failed()
        await self.release()

    async def exit_failed(self) -> NoReturn:
        """Ends the process with code 1 after a failure, once what can be released is released
        (for up to FAILURE_RELEASE_S). A plain exit could wait forever: a hung compute holds a
        worker thread, which the interpreter joins at exit. Engine processes die with this one
        (shared/process_tree.py)."""
        try:
            await asyncio.wait_for(self.release(), FAILURE_RELEASE_S)
        except Exception as error:  # TimeoutError included: a hung compute may never let go
            logger.warning("exiting with resources not released: %s", type(error).__name__)
        logging.shutdown()  # flushes the log handlers, which os._exit would not
        os._exit(1)

    async def serves(self) -> bool:
        """A readiness check: passes while there is no `failure()`."""
        return self.failure() is None


async def start_service(
    server_class: type[ServerT],
    core: object,
    settings: GrpcServerSettings,
    service_name: str,
    register: Register,
) -> ServerT:
    """Binds and starts the gRPC server with the servicer `register` adds, then reports SERVING
    only while the server's readiness checks pass (until stop)."""
    running = await start_server(
        register,
        [service_name],
        f"{settings.host}:{settings.port}",
        settings.grpc_max_message_bytes,
        settings.server_security(),
    )
    server = server_class(running, core)
    await running.follow_readiness(server.readiness_checks())
    return server
