"""Bench-only EPD proxy: the protocol of vLLM's example proxy for encoder disaggregation
(`examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py` in vLLM's repository, not in
the wheel), routing by model instead of at random.

Per chat request:
1. every `image_url` part gets a uuid, the sha256 of its URL (the example's content key), so
   every fine-tune names an image alike and shares its stored encoder output;
2. the encoder instance gets a chat request holding only those parts, each with its uuid. It
   stores each item's encoder output through its EC connector and answers with
   `ec_transfer_params` = {uuid: {"item_indices": [...], "metadata": {"image_grid_thw": [t, h, w]}}};
3. the decode instance serving the request's model gets the original request with each image
   part replaced by a metadata-only `{"type": "image_embeds", "image_embeds": {"image_grid_thw":
   [t, h, w]}, "uuid": uuid}` and `ec_transfer_params` as received. An item the encoder reported
   no metadata for keeps its image, as the example does (the decode instance then encodes it).

It runs inside the load generator, not as an HTTP server of its own: a request's clock starts
before the encoder hop, so its TTFT includes that hop, and EPD is spared the proxy process's extra
HTTP hop and CPU that our gateway pays, which can only flatter EPD. Like the example, it sends one
encoder request per chat request and leaves deduplication to vLLM (the uuid).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.client import LoadResult, RequestTiming, stream_chat

Part = dict[str, Any]


@dataclass(frozen=True)
class EpdRoutes:
    encoder_url: str  # the encoder instance's /v1/chat/completions
    decode_urls: dict[str, str]  # model name -> its decode instance's /v1/chat/completions


def content_uuid(url: str) -> str:
    """The example proxy's item key: sha256 of the image URL (a data URL is the image itself)."""
    return hashlib.sha256(url.encode()).hexdigest()


def image_parts(body: dict[str, Any]) -> list[Part]:
    return [
        part
        for message in body["messages"]
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == "image_url"
    ]


def encoder_body(model: str, parts: list[Part]) -> dict[str, Any]:
    """What the encoder instance gets: the images alone, each with its uuid; no text, no sampling."""
    content = [{**part, "uuid": content_uuid(part["image_url"]["url"])} for part in parts]
    return {"model": model, "messages": [{"role": "user", "content": content}], "stream": False}


def metadata_part(part: Part, params: dict[str, Any]) -> Part:
    """An image part as the decode instance gets it: its grid and uuid, no pixels, no tensor."""
    uid = content_uuid(part["image_url"]["url"])
    metadata = params.get(uid, {}).get("metadata")
    if not metadata:
        return part
    return {"type": "image_embeds", "image_embeds": metadata, "uuid": uid}


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    messages = []
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, list):
            content = [metadata_part(p, params) if p.get("type") == "image_url" else p for p in content]
        messages.append({**message, "content": content})
    return {**body, "messages": messages, "ec_transfer_params": params}


async def encode(client: httpx.AsyncClient, encoder_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Step 2: the encoder hop; its ec_transfer_params, {} for a request without images."""
    parts = image_parts(body)
    if not parts:
        return {}
    response = await client.post(encoder_url, json=encoder_body(body["model"], parts))
    if response.status_code != 200:
        raise httpx.HTTPStatusError(
            f"encoder instance: HTTP {response.status_code}: {response.text[:300]}",
            request=response.request,
            response=response,
        )
    params: dict[str, Any] = response.json().get("ec_transfer_params") or {}
    return params


async def epd_chat(client: httpx.AsyncClient, routes: EpdRoutes, body: dict[str, Any]) -> RequestTiming:
    """One chat request through EPD; times from before the encoder hop, errors as a timing."""
    start = time.perf_counter()
    try:
        params = await encode(client, routes.encoder_url, body)
    except httpx.HTTPError as error:
        return RequestTiming(float("nan"), time.perf_counter() - start, 0, f"{type(error).__name__}: {error}"[:300])
    hop = time.perf_counter() - start
    timing = await stream_chat(client, routes.decode_urls[body["model"]], decode_body(body, params))
    return RequestTiming(timing.ttft_s + hop, timing.latency_s + hop, timing.completion_tokens, timing.error, hop)


async def run_epd_concurrent(routes: EpdRoutes, bodies: list[dict[str, Any]], timeout_s: float = 900) -> LoadResult:
    """Every request at once, as bench.client.run_concurrent sends them to the other systems."""
    limits = httpx.Limits(max_connections=2 * len(bodies) + 8, max_keepalive_connections=2 * len(bodies) + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        timings = await asyncio.gather(*(epd_chat(client, routes, body) for body in bodies))
        wall = time.perf_counter() - start
    return LoadResult(wall, list(timings))
