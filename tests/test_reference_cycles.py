"""Serving a request leaves no reference cycle of ours behind.

An object in a reference cycle is not freed when its last user lets go of it: it waits for the
garbage collector, and everything it holds waits with it. A cycle per request made every exchange
of the gateway (its ClientWatch, response, ASGI cycle, transport: 66 objects) garbage for the
collector, which ran a full collection of 26 ms every ~600 requests on 2 cores, with every stream
on the gateway stalled meanwhile. Here the whole stack (gateway, encoder, both LLM services, in
this process) serves requests of every kind while the collector is off; then one collection
shows what only it could have freed.
"""

from __future__ import annotations

import asyncio
import gc
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from openai import OpenAI

from shared.store import EmbeddingStore, StoreConfig
from tests.harness import RedisServer, Stack
from tests.images import data_url, png_bytes

REPO = Path(__file__).resolve().parents[1]
OUR_PACKAGES = ("gateway", "llm_service", "encoder_service", "shared")


_CODE_ATTRIBUTE = {
    types.FrameType: "f_code", types.FunctionType: "__code__", types.CoroutineType: "cr_code",
    types.AsyncGeneratorType: "ag_code", types.GeneratorType: "gi_code",
}  # fmt: skip


def _code_of(thing: object) -> types.CodeType | None:
    attribute = _CODE_ATTRIBUTE.get(type(thing))
    return getattr(thing, attribute) if attribute is not None else None


def _ours(thing: object) -> str | None:
    """What names `thing` as ours: an instance of a class of our packages, or code of our files."""
    module = type(thing).__module__ or ""
    if module.split(".")[0] in OUR_PACKAGES:
        return f"{module}.{type(thing).__qualname__}"
    code = _code_of(thing)
    if code is not None and Path(code.co_filename).resolve().is_relative_to(REPO):
        relative = Path(code.co_filename).resolve().relative_to(REPO)
        if relative.parts[0] in OUR_PACKAGES:
            return f"{type(thing).__name__} {code.co_qualname} ({relative})"
    return None


def _requests(stack: Stack, client: OpenAI, image: str) -> None:
    """One of each: streamed and not, n=2, one refused (400), and a stream its client leaves."""
    question = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is it?"}]
    messages = [{"role": "user", "content": question}]
    for model in ("ft-a", "ft-b"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
        for _ in client.chat.completions.create(model=model, messages=messages, max_tokens=4, stream=True):
            pass
    client.chat.completions.create(model="ft-b", messages=messages, max_tokens=3, n=2, temperature=0)
    refused = httpx.post(f"{stack.base_url}/v1/chat/completions", json={"model": "ft-a", "max_tokens": -1,
                                                                       "messages": messages}, timeout=60)  # fmt: skip
    assert refused.status_code == 400
    with client.chat.completions.create(model="ft-b", messages=messages, max_tokens=64, stream=True) as left:
        next(iter(left))  # the client reads one chunk, then closes the connection


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_serving_requests_leaves_no_reference_cycle_of_ours(stack: Stack, collector_off: None) -> None:
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    image = data_url(png_bytes(921))
    _requests(stack, client, image)  # first use: caches, lazy imports, connections
    gc.collect()
    for _ in range(3):
        _requests(stack, client, image)
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable stays in gc.garbage, to read
    try:
        gc.collect()
        ours = sorted({name for thing in gc.garbage if (name := _ours(thing)) is not None})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not ours, f"left for the garbage collector: {ours}"


def test_a_store_that_reconnects_leaves_no_frames_in_a_cycle(redis_server: RedisServer) -> None:
    """redis-py 8 sent each new connection CLIENT SETINFO and a request for maintenance
    notifications, which Redis before 7.2 refuses; each refusal it caught stayed in a reference
    cycle with the frames that were connecting, and their callers' coroutines with them (a CI
    rehearsal failed the test above so: a readiness check's coroutine, `_passes`, after a slow
    PING dropped its connection). The store asks for neither."""

    async def frames_left_after_reconnects() -> list[str]:
        store = EmbeddingStore(StoreConfig(url=redis_server.url))
        killer = redis.Redis.from_url(redis_server.url)
        try:
            assert await store.ping()
            gc.collect()
            gc.disable()
            for _ in range(3):
                killer.client_kill_filter(_type="normal", skipme=True)  # the store's connection
                assert await store.ping()  # on a new connection
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            return sorted({thing.f_code.co_qualname for thing in gc.garbage if isinstance(thing, types.FrameType)})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
            killer.close()
            await store.aclose()

    assert asyncio.run(frames_left_after_reconnects()) == []
