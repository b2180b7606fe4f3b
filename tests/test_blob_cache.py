"""The LLM service's pod cache: LRU by bytes, and one Redis round trip per image per pod."""

from __future__ import annotations

import asyncio

import numpy as np

from llm_service.blob_cache import BlobCache, blob_bytes
from shared.blob import EmbeddingBlob
from shared.errors import EmbeddingNotFound
from shared.keys import embedding_key
from shared.sdk import AsyncLLMClient, EncoderClient, ImageKey, LLMClient, Message, Sampling
from tests.harness import Stack
from tests.images import png_bytes


def _blob(rows: int) -> EmbeddingBlob:
    return EmbeddingBlob(np.zeros((rows, 4), np.float32), np.array([[1, 2, 2 * rows]]), "enc")


def test_lru_evicts_least_recently_used_within_the_byte_budget() -> None:
    size = blob_bytes(_blob(4))
    cache = BlobCache(max_bytes=2 * size)
    cache.put("a", _blob(4))
    cache.put("b", _blob(4))
    assert cache.get("a") is not None  # "b" is now least recently used
    cache.put("c", _blob(4))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.size_bytes == 2 * size and len(cache) == 2


def test_oversized_blobs_are_not_cached_and_zero_disables() -> None:
    assert BlobCache(max_bytes=10).put("a", _blob(4)) is None
    cache = BlobCache(max_bytes=0)
    cache.put("a", _blob(1))
    assert cache.get("a") is None and len(cache) == 0


def _blob_reads(stack: Stack) -> int:
    """GET and MGET calls Redis has served: how LLM services read blobs (the encoder uses GETEX)."""
    stats = stack.redis.client().info("commandstats")
    return sum(int(stats.get(f"cmdstat_{command}", {}).get("calls", 0)) for command in ("get", "mget"))


def test_many_questions_on_one_image_cost_one_redis_get_per_pod(stack: Stack) -> None:
    with EncoderClient(stack.encoder_target) as encoder:
        key = encoder.encode(image_bytes=png_bytes(201)).key
    before = _blob_reads(stack)
    with LLMClient(stack.llm_target("ft-a")) as llm:
        for question in ("one?", "two?", "three?"):
            list(llm.generate("ft-a", [Message("user", [ImageKey(key), question])], Sampling(max_tokens=2)))
    assert _blob_reads(stack) - before == 1


def test_concurrent_questions_on_a_new_image_share_one_redis_get(stack: Stack) -> None:
    with EncoderClient(stack.encoder_target) as encoder:
        key = encoder.encode(image_bytes=png_bytes(202)).key

    async def ask_all() -> list[str]:
        async with AsyncLLMClient(stack.llm_target("ft-a")) as llm:

            async def ask(question: str) -> str:
                messages = [Message("user", [ImageKey(key), question])]
                return "".join([d.text async for d in llm.generate("ft-a", messages, Sampling(max_tokens=2))])

            return await asyncio.gather(*(ask(f"question {i}?") for i in range(8)))

    before = _blob_reads(stack)
    # Redis holds every command for 300 ms, so all 8 requests reach the service while the first
    # GET is still waiting: without sharing it, each would send its own.
    stack.redis.client().execute_command("CLIENT", "PAUSE", 300, "ALL")
    answers = asyncio.run(ask_all())
    assert len(answers) == 8
    assert _blob_reads(stack) - before == 1


def test_concurrent_questions_on_a_missing_key_each_get_not_found(stack: Stack) -> None:
    with EncoderClient(stack.encoder_target) as encoder:
        key = embedding_key(encoder.stats().encoder_id, b"never stored (concurrent)", 1, 2, dtype="float32")

    async def ask(llm: AsyncLLMClient) -> BaseException | str:
        messages = [Message("user", [ImageKey(key), "hi"])]
        try:
            return "".join([d.text async for d in llm.generate("ft-a", messages, Sampling(max_tokens=2))])
        except EmbeddingNotFound as error:
            return error

    async def ask_all() -> list[BaseException | str]:
        async with AsyncLLMClient(stack.llm_target("ft-a")) as llm:
            return await asyncio.gather(*(ask(llm) for _ in range(4)))

    stack.redis.client().execute_command("CLIENT", "PAUSE", 200, "ALL")  # all 4 join the first fetch
    outcomes = asyncio.run(ask_all())
    assert all(isinstance(o, EmbeddingNotFound) and o.keys == [key] for o in outcomes), outcomes
