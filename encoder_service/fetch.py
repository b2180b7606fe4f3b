"""Fetching an image from an http(s) URL: one deadline, a byte cap, and an address check that holds.

Private, loopback and link-local addresses are refused unless explicitly allowed, so a client
cannot make the encoder reach into the cluster network. The check only holds if the connection
goes where the check looked: a host that resolves to a public address for the check and to
127.0.0.1 for the connection (DNS rebinding) would otherwise get through. So each hop resolves
its host once, checks every address, and connects only to those addresses (`_PinnedBackend`),
while the URL, the Host header and TLS (SNI, certificate) keep the hostname. Redirect hops are
resolved, checked and pinned the same way. No proxy from the environment is used: a proxy would
resolve the host itself.

One deadline covers the whole fetch (resolution, connection, headers and body, over every
hop): a per-read timeout lets a server that trickles a byte now and then hold a worker without
end. Any failure to fetch is the client's URL at fault: ImageFetchFailed (400, never retried).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import httpcore
import httpx

from shared.errors import ImageFetchFailed, TooLarge, clip

MAX_REDIRECTS = 3
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# Every way httpcore reports a failed exchange (refused, reset, timed out, not HTTP).
_TRANSPORT_ERRORS = (
    httpcore.TimeoutException,
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
)


@dataclass(frozen=True)
class FetchPolicy:
    timeout_s: float  # for the whole fetch, every redirect hop included
    max_bytes: int
    allow_private: bool
    allowed_schemes: tuple[str, ...] = ("http", "https")
    allowed_domains: tuple[str, ...] = ()  # empty = any host; else the host or a subdomain of one

    def domain_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return not self.allowed_domains or any(host == d or host.endswith("." + d) for d in self.allowed_domains)


class ByteBudget:
    """Bytes that the images of one call may hold together, charged as they arrive.

    Each image is bounded by its own limit, but a video's frames are fetched at once: 64 frames
    within 20 MiB each could hold 1.3 GB of downloads for one call. Frames sent as bytes are
    charged too, so the rule is the same whatever the frames' form."""

    def __init__(self, limit: int, setting: str) -> None:
        self.limit = limit
        self.setting = setting  # what sets the limit, for the error
        self.used = 0

    def take(self, count: int) -> None:
        self.used += count
        if self.used > self.limit:
            raise TooLarge(
                f"the video's frames exceed {self.limit} bytes together (the limit, {self.setting})", param="frames"
            )


async def fetch_image(
    url: str, policy: FetchPolicy, param: str = "image_url", budget: ByteBudget | None = None
) -> bytes:
    """The bytes at `url`, following at most MAX_REDIRECTS checked redirects, within policy.timeout_s;
    the body's bytes are charged to `budget` as they arrive."""
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _follow(_parse(url, param), policy, param, budget)
    except TimeoutError:
        raise ImageFetchFailed(f"image URL did not answer within {policy.timeout_s}s", param=param) from None


async def _follow(url: httpx.URL, policy: FetchPolicy, param: str, budget: ByteBudget | None) -> bytes:
    for _ in range(MAX_REDIRECTS + 1):
        addresses = await _checked_addresses(url, policy, param)
        body, location = await _get(url, addresses, policy.max_bytes, param, budget)
        if location is None:
            return body
        url = _parse(location, param, base=url)
    raise ImageFetchFailed(f"image URL redirected more than {MAX_REDIRECTS} times", param=param)


def _parse(url: str, param: str, base: httpx.URL | None = None) -> httpx.URL:
    try:
        return base.join(url) if base is not None else httpx.URL(url)
    except (httpx.InvalidURL, UnicodeError):
        raise ImageFetchFailed(f"image URL is malformed: {clip(url, 60)!r}", param=param) from None


async def _checked_addresses(url: httpx.URL, policy: FetchPolicy, param: str) -> list[str]:
    """The addresses `url`'s host resolves to, each one allowed by `policy`; resolved once, here."""
    host = url.raw_host.decode("ascii")  # IDNA-encoded: what is resolved and matched
    if url.scheme not in policy.allowed_schemes or not host:
        schemes = "/".join(policy.allowed_schemes)
        raise ImageFetchFailed(f"image URL must be {schemes} or a data URL (got {clip(str(url), 60)!r})", param=param)
    if not policy.domain_allowed(host):
        raise ImageFetchFailed(f"image URL host {clip(host, 60)!r} is not on the allowed domain list", param=param)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, _port(url), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise ImageFetchFailed(f"image URL host {clip(host, 60)!r} does not resolve", param=param) from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for address in addresses:
        if not policy.allow_private and not _is_public(address):
            raise ImageFetchFailed(
                f"image URL host {clip(host, 60)!r} resolves to a non-public address; refused", param=param
            )
    return addresses


async def _get(
    url: httpx.URL, addresses: list[str], max_bytes: int, param: str, budget: ByteBudget | None
) -> tuple[bytes, str | None]:
    """One GET to the pinned `addresses`: (body, None), or (b"", the Location of a redirect)."""
    target = httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=_port(url), target=url.raw_path)
    headers = [(b"Host", url.netloc), (b"Accept", b"*/*"), (b"User-Agent", b"vlm-encode-once")]
    backend = _PinnedBackend(url.raw_host.decode("ascii"), addresses)
    try:
        async with httpcore.AsyncConnectionPool(network_backend=backend, max_connections=1) as pool:
            async with pool.stream("GET", target, headers=headers) as response:
                location = _header(response, b"location")
                if response.status in _REDIRECTS and location is not None:
                    return b"", location
                if response.status != 200:
                    raise ImageFetchFailed(f"image URL answered HTTP {response.status}", param=param)
                return await _read_capped(response, max_bytes, param, budget), None
    except _TRANSPORT_ERRORS as error:
        raise ImageFetchFailed(f"image URL could not be fetched: {type(error).__name__}", param=param) from None


def _is_public(address: str) -> bool:
    """A global address, and so is any IPv4 address inside it: a NAT64 gateway or a 6to4 relay
    would connect to that one (64:ff9b::a00:1 is 10.0.0.1), and Python 3.11 calls them global."""
    ip = ipaddress.ip_address(address.split("%")[0])  # an IPv6 scope (%eth0) is no part of it
    if not ip.is_global:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = [ip.ipv4_mapped, ip.sixtofour]
        if ip in _NAT64 or int(ip) >> 32 == 0:  # NAT64, or the deprecated IPv4-compatible ::a.b.c.d
            embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        return all(v4.is_global for v4 in embedded if v4 is not None)
    return True


def _port(url: httpx.URL) -> int:
    return url.port or (443 if url.scheme == "https" else 80)


def _header(response: httpcore.Response, name: bytes) -> str | None:
    for key, value in response.headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _read_capped(response: httpcore.Response, max_bytes: int, param: str, budget: ByteBudget | None) -> bytes:
    declared = _header(response, b"content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise TooLarge(f"image at URL is {declared} bytes, over the limit of {max_bytes}", param=param)
    body = bytearray()
    async for chunk in response.aiter_stream():
        body.extend(chunk)
        if budget is not None:
            budget.take(len(chunk))
        if len(body) > max_bytes:
            raise TooLarge(f"image at URL exceeds the limit of {max_bytes} bytes", param=param)
    return bytes(body)


class _PinnedBackend(httpcore.AsyncNetworkBackend):
    """Connects to addresses checked beforehand instead of resolving the host again.

    httpcore hands the URL's host to `connect_tcp` and keeps it for the Host header and TLS
    (SNI and certificate checks), so only where the socket connects changes.
    """

    def __init__(self, host: str, addresses: list[str]) -> None:
        self._host = host.lower()
        self._addresses = addresses
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        if host.lower() != self._host:
            raise ValueError(f"pinned to {self._host!r}, asked to connect to {host!r}")
        error: Exception = httpcore.ConnectError(f"{self._host} has no address")
        for address in self._addresses:
            try:
                return await self._inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except httpcore.ConnectError as refused:
                error = refused  # the next checked address may answer
        raise error

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)
