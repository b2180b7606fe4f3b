"""Which Redis deployment a URL names: one server, a Cluster, or a Sentinel-managed primary.

redis://[user:password@]host:port/db          one server (rediss:// for TLS)
redis-cluster://[user:password@]h1:p1,h2:p2   a Redis Cluster, via any of its nodes (rediss-cluster:// for TLS)
redis-sentinel://[:password@]h1:p1,h2:p2/service[/db]
                                              the primary that Sentinels report for `service`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote

Topology = Literal["single", "cluster", "sentinel"]


@dataclass(frozen=True)
class RedisTarget:
    topology: Topology
    url: str  # the original URL (for "single", handed to redis-py as is)
    nodes: tuple[tuple[str, int], ...] = ()
    username: str | None = None
    password: str | None = None
    tls: bool = False
    service_name: str | None = None
    db: int = 0


def _nodes(hosts: str) -> tuple[tuple[str, int], ...]:
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"Redis node {item!r} must be host:port")
        nodes.append((host, int(port)))
    return tuple(nodes)


def _credentials(authority: str) -> tuple[str | None, str | None, str]:
    userinfo, _, hosts = authority.rpartition("@")
    if not userinfo:
        return None, None, hosts
    user, _, password = userinfo.partition(":")
    return unquote(user) or None, unquote(password) or None, hosts


def parse_redis_url(url: str) -> RedisTarget:
    """Parses the URL forms above; ValueError names what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"Redis URL must start with a scheme such as redis:// (got {url[:20]!r})")
    if scheme in ("redis", "rediss", "unix"):
        return RedisTarget("single", url)
    authority, _, path = rest.partition("/")
    user, password, hosts = _credentials(authority)
    if scheme in ("redis-cluster", "rediss-cluster"):
        return RedisTarget("cluster", url, _nodes(hosts), user, password, tls=scheme.startswith("rediss"))
    if scheme == "redis-sentinel":
        service, _, db = path.partition("/")
        if not service:
            raise ValueError("redis-sentinel:// URLs need the service name as their path: .../mymaster")
        return RedisTarget("sentinel", url, _nodes(hosts), user, password, service_name=service, db=int(db or 0))
    raise ValueError(
        f"unknown Redis URL scheme {scheme!r}; use redis, rediss, redis-cluster, rediss-cluster or redis-sentinel"
    )
