"""The twins of bench/epd_checks.py, run against our live stack after its measurement: the same
topics, seen through the gateway (what a client gets) and Redis (what is stored).

Forged values go in under keys the encoder never wrote, with a short TTL, so nothing a later
request could hit is changed.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import redis

from bench.epd_checks import ENCODE_API, EVICTION, FORGED, STORE, TRUNCATED, UNKNOWN
from bench.workload import data_url
from shared.keys import embedding_key

FORGED_TTL_S = 300
NAN_BITS = {"BF16": b"\xc0\x7f", "F16": b"\x00\x7e", "F32": b"\x00\x00\xc0\x7f"}  # quiet NaN, little-endian


def nan_filled(blob: bytes, tensor: str = "image_embeds") -> bytes:
    """The blob with every value of `tensor` a NaN: header, shapes and sizes untouched."""
    header_len = int.from_bytes(blob[:8], "little")
    entry = json.loads(blob[8 : 8 + header_len])[tensor]
    begin, end = (8 + header_len + offset for offset in entry["data_offsets"])
    nan = NAN_BITS[entry["dtype"]]
    return blob[:begin] + nan * ((end - begin) // len(nan)) + blob[end:]


def _said(response: httpx.Response) -> str:
    try:
        error = response.json().get("error") or {}
    except ValueError:
        error = {}
    code = f" {error.get('code')}: {str(error.get('message'))[:120]!r}" if error else ""
    return f"HTTP {response.status_code}{code}"


async def _chat(client: httpx.AsyncClient, base_url: str, model: str, key: str) -> httpx.Response:
    body = {
        "model": model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image_embeds", "image_embeds": None, "uuid": key},
            {"type": "text", "text": "What is in this image?"}]}],
    }  # fmt: skip
    return await client.post(f"{base_url}/v1/chat/completions", json=body)


async def _then(client: httpx.AsyncClient, base_url: str, model: str, key: str, real: str, what: str) -> str:
    said = _said(await _chat(client, base_url, model, key))
    after = await _chat(client, base_url, model, real)
    return f"{what}, sent to {model} by key: {said}; the next request with a real key: HTTP {after.status_code}"


async def check_ours(base_url: str, redis_url: str, model: str, image: bytes) -> dict[str, str]:
    """Runs every check through the gateway; `image` is one of the workload's (already encoded)."""
    seen: dict[str, str] = {}
    store: Any = redis.Redis.from_url(redis_url)
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            encode = await client.post(f"{base_url}/v1/images/encode", json={"image_url": data_url(image)})
            encode.raise_for_status()
            stored = encode.json()
            key, encoder_id = stored["key"], stored["encoder_id"]
            seen[ENCODE_API] = (f"POST /v1/images/encode with a workload image: HTTP {encode.status_code}, "
                                f"cache_hit={stored['cache_hit']}, {stored['num_tokens']} tokens, key {key[:24]}...; "
                                "the key names the image in any later request to any fine-tune")  # fmt: skip
            seen[STORE] = (f"Redis at a URL ({redis_url}; cluster and sentinel URLs too), reached over TCP: "
                           f"{len(store.client_list())} client connections while serving")  # fmt: skip
            seen[EVICTION] = (f"every stored key has a TTL: the workload image's key has {store.ttl(key)} s left "
                              "(ENCODER_EMBEDDING_TTL_S, refreshed on each encode hit)")  # fmt: skip
            blob = store.get(key)
            forged = embedding_key(encoder_id, os.urandom(16), 0, 0, dtype="float32")
            store.set(forged, nan_filled(blob), ex=FORGED_TTL_S)
            seen[FORGED] = await _then(client, base_url, model, forged, key, "a forged blob of NaN")
            truncated = embedding_key(encoder_id, os.urandom(16), 0, 0, dtype="float32")
            store.set(truncated, blob[: len(blob) // 2], ex=FORGED_TTL_S)
            seen[TRUNCATED] = await _then(client, base_url, model, truncated, key, "a real blob cut to half its bytes")
            unknown = embedding_key(encoder_id, os.urandom(16), 0, 0, dtype="float32")
            seen[UNKNOWN] = await _then(client, base_url, model, unknown, key, "a key nothing was stored under")
    finally:
        store.close()
    return seen
