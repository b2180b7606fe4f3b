"""Async Redis store for embedding blobs: TTL on every key, bounded timeouts and retries.

A dead Redis must turn into a fast, clear `Unavailable` (503), and the store
must work again as soon as Redis is back, without restarting the service:
redis-py's pool reconnects on the next call, and we cap its retries so a
failure is reported in about `op_timeout_s` instead of redis-py's ~4.6 s default.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from opentelemetry.trace import SpanKind
from prometheus_client import Counter, Histogram
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

from shared import tracing
from shared.errors import TooLarge, Unavailable
from shared.redis_urls import RedisTarget, parse_redis_url

T = TypeVar("T")
logger = logging.getLogger(__name__)
REDIS_ERRORS = Counter("redis_errors_total", "Redis operations that failed (after retries), by error type.", ["error"])
# Every round trip of every service, by command: the LLM service's GET/MGET (also in
# llm_blob_fetch_seconds), the encoder's GETEX and SET, pings. Failed ones count too.
REDIS_SECONDS = Histogram(
    "redis_operation_seconds", "Time of one Redis operation, retries included, by command.", ["operation"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)  # fmt: skip
# Redis refuses values over 512 MB; we say so before sending them.
REDIS_MAX_VALUE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class StoreConfig:
    url: str = "redis://127.0.0.1:6379/0"
    ttl_s: int = 24 * 3600
    socket_timeout_s: float = 0.5
    op_timeout_s: float = 1.0
    retries: int = 1
    max_value_bytes: int = REDIS_MAX_VALUE_BYTES


class EmbeddingStore:
    """Blob bytes by key. Every method raises `Unavailable` when Redis cannot be reached."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.target = parse_redis_url(config.url)
        self._redis = _connect(self.target, config)

    async def _call(self, command: str, operation: Awaitable[T], keys: Sequence[str] = ()) -> T:
        started = time.perf_counter()
        attributes = {"db.system": "redis", "db.operation.name": command, tracing.MEDIA_KEYS: list(keys)}
        try:
            with tracing.step_span(f"redis {command}", attributes, SpanKind.CLIENT):
                async with asyncio.timeout(self.config.op_timeout_s):
                    return await operation
        except (RedisError, OSError, TimeoutError) as error:
            REDIS_ERRORS.labels(type(error).__name__).inc()
            # Clients are told the store is unavailable; the operator is told why, in Redis's own
            # words ("OOM command not allowed when used memory > 'maxmemory'", a refused connection).
            logger.warning("Redis %s failed: %s: %s", command, type(error).__name__, error)
            raise Unavailable(f"embedding store (Redis) is unavailable: {type(error).__name__}") from error
        finally:
            REDIS_SECONDS.labels(command).observe(time.perf_counter() - started)

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        """Blobs for several keys in one round trip (per cluster slot); None where a key is missing."""
        if not keys:
            return []
        if len(keys) == 1:  # the common case (one image): GET saves MGET's list handling (~0.01 ms)
            return [await self._call("GET", _blob_or_none(self._redis.get(keys[0]), keys[0]), keys)]
        if isinstance(self._redis, RedisCluster):  # one MGET per hash slot, as a cluster requires
            return await self._call("MGET", _list_of_bytes(self._redis.mget_nonatomic(keys)), keys)
        return await self._call("MGET", _list_of_bytes(self._redis.mget(keys)), keys)

    async def get_and_touch(self, key: str) -> bytes | None:
        """The blob under `key`, refreshing its TTL (GETEX), or None."""
        return await self._call("GETEX", _blob_or_none(self._redis.getex(key, ex=self.config.ttl_s), key), [key])

    async def put(self, key: str, data: bytes) -> None:
        """Stores a blob with the configured TTL."""
        if len(data) > self.config.max_value_bytes:
            raise TooLarge(
                f"embedding blob of {len(data)} bytes exceeds the store's limit of {self.config.max_value_bytes}"
            )
        await self._call("SET", self._redis.set(key, data, ex=self.config.ttl_s), [key])

    async def delete(self, key: str) -> None:
        await self._call("DEL", self._redis.delete(key), [key])

    async def ping(self) -> bool:
        """True when Redis answers now."""
        try:
            return bool(await self._call("PING", self._redis.ping()))
        except Unavailable:
            return False

    async def aclose(self) -> None:
        await self._redis.aclose()


async def _blob_or_none(reply: Awaitable[Any], key: str) -> bytes | None:
    """A single-key read's (GET, GETEX) reply: bytes, since no client here decodes responses
    (redis-py types replies as bytes | str whatever the client's decode_responses), or None.

    A key holding a list, a hash or any other non-string holds no blob: None, as MGET answers nil
    for it, rather than the WRONGTYPE error, which would read as a store outage (503) on every
    request for that image, forever. The encoder's SET then replaces the value; an LLM service
    answers 404. Every other error reply is still the store failing (see EmbeddingStore._call)."""
    try:
        return cast("bytes | None", await reply)
    except ResponseError as error:
        if not str(error).startswith("WRONGTYPE"):
            raise
        logger.warning("Redis key %s holds a value that is not a string; read as no blob", key)
        return None


def _list_of_bytes(reply: Awaitable[Any]) -> Awaitable[list[bytes | None]]:
    """An MGET reply; see _blob_or_none."""
    return cast("Awaitable[list[bytes | None]]", reply)


# redis-py 8 sends every new connection CLIENT SETINFO and a request for maintenance notifications,
# which Redis before 7.2 refuses: round trips per (re)connect, and each refusal it catches is left
# in a reference cycle holding the frames that were connecting (our coroutines among them) until a
# collection. Neither is used here.
_QUIET_CONNECT: dict[str, Any] = {
    "driver_info": None,
    "maint_notifications_config": MaintNotificationsConfig(enabled=False),
}


def _connect(target: RedisTarget, config: StoreConfig) -> aioredis.Redis | RedisCluster:
    timeout = config.socket_timeout_s
    retry = Retry(ExponentialBackoff(cap=0.1, base=0.02), config.retries)
    if target.topology == "single":
        return aioredis.Redis.from_url(
            target.url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=retry,
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            **_QUIET_CONNECT,
        )
    if target.topology == "cluster":
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            ssl=target.tls,
            username=target.username,
            password=target.password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=retry,
            **_QUIET_CONNECT,
        )
    if target.service_name is None:  # parse_redis_url names one for every sentinel URL
        raise ValueError(f"sentinel URL without a service name: {target.url!r}")
    # The sentinels' own connections: the same timeout, and quiet too.
    sentinel = Sentinel(list(target.nodes), sentinel_kwargs={"socket_timeout": timeout, **_QUIET_CONNECT})
    return sentinel.master_for(
        target.service_name,
        db=target.db,
        username=target.username,
        password=target.password,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=retry,
        **_QUIET_CONNECT,
    )
