"""Fetching an image from an http(s) URL with a timeout, a byte cap and an address check.

Private, loopback and link-local addresses are refused after DNS resolution
(and on every redirect hop) unless explicitly allowed, so a client cannot make
the encoder reach into the cluster network.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpx

from shared.errors import InvalidInput, TooLarge, Unavailable, clip

MAX_REDIRECTS = 3


@dataclass(frozen=True)
class FetchPolicy:
    timeout_s: float
    max_bytes: int
    allow_private: bool
    allowed_schemes: tuple[str, ...] = ("http", "https")
    allowed_domains: tuple[str, ...] = ()  # empty = any host; else the host or a subdomain of one

    def domain_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return not self.allowed_domains or any(host == d or host.endswith("." + d) for d in self.allowed_domains)


async def _check_host(url: str, policy: FetchPolicy, param: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in policy.allowed_schemes or not parts.hostname:
        schemes = "/".join(policy.allowed_schemes)
        raise InvalidInput(f"image URL must be {schemes} or a data URL (got {clip(url, 60)!r})", param=param)
    if not policy.domain_allowed(parts.hostname):
        raise InvalidInput(
            f"image URL host {clip(parts.hostname, 60)!r} is not on the allowed domain list", param=param
        )
    if policy.allow_private:
        return
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, parts.port or 443, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise InvalidInput(f"image URL host {clip(parts.hostname, 60)!r} does not resolve", param=param) from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if not address.is_global:
            raise InvalidInput(
                f"image URL host {clip(parts.hostname, 60)!r} resolves to a non-public address; refused", param=param
            )


async def _read_capped(response: httpx.Response, max_bytes: int, param: str) -> bytes:
    declared = response.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise TooLarge(f"image at URL is {declared} bytes, over the limit of {max_bytes}", param=param)
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body.extend(chunk)
        if len(body) > max_bytes:
            raise TooLarge(f"image at URL exceeds the limit of {max_bytes} bytes", param=param)
    return bytes(body)


async def fetch_image(url: str, policy: FetchPolicy, param: str = "image_url") -> bytes:
    """The bytes at `url`, following at most MAX_REDIRECTS checked redirects."""
    try:
        async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                await _check_host(url, policy, param)
                async with client.stream("GET", url) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise InvalidInput(f"image URL answered HTTP {response.status_code}", param=param)
                    return await _read_capped(response, policy.max_bytes, param)
    except httpx.TimeoutException:
        raise Unavailable(f"image URL timed out after {policy.timeout_s}s", param=param) from None
    except httpx.HTTPError as error:
        raise InvalidInput(f"image URL could not be fetched: {type(error).__name__}", param=param) from None
    raise InvalidInput(f"image URL redirected more than {MAX_REDIRECTS} times", param=param)
