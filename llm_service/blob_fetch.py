"""Stored and inline blobs to validated embeddings: one Redis round trip, then decode where it is
cheapest. The benchmark (bench/s3_transport.py) times exactly this path."""

from __future__ import annotations

import asyncio
import time

from llm_service import metrics
from shared.blob import BlobRules, EmbeddingBlob, decode_blob
from shared.errors import EmbeddingNotFound, InvalidEmbedding
from shared.store import EmbeddingStore

# Decoding is zero-copy plus one pass for the finite check (~0.1 ms per MB). Below this many bytes
# a worker-thread hand-off (~0.1 ms) would cost as much as the work, so the event loop decodes.
INLINE_DECODE_BYTES = 2 * 1024 * 1024


def decode_items(blobs: list[bytes | None], rules: BlobRules, where: str) -> list[EmbeddingBlob]:
    """Each blob validated and decoded; each must hold exactly one image or video."""
    decoded = []
    for index, data in enumerate(blobs):
        blob = decode_blob(data or b"", rules, where=f"{where} {index}")
        if blob.grid_thw.shape[0] != 1:
            raise InvalidEmbedding(
                f"{where} {index} must hold exactly one image or video (grid_thw [1, 3])", param="image"
            )
        decoded.append(blob)
    return decoded


async def decode_items_async(blobs: list[bytes | None], rules: BlobRules, where: str) -> list[EmbeddingBlob]:
    """decode_items, on a worker thread once the blobs are large enough to be worth one."""
    if sum(len(data or b"") for data in blobs) < INLINE_DECODE_BYTES:
        return decode_items(blobs, rules, where)
    return await asyncio.to_thread(decode_items, blobs, rules, where)


async def fetch_items(store: EmbeddingStore, keys: list[str], rules: BlobRules) -> list[EmbeddingBlob]:
    """The blobs stored under `keys`, in one round trip, validated. EmbeddingNotFound names every
    missing key, so a caller that still has the images can re-encode exactly those."""
    started = time.perf_counter()
    stored = await store.get_many(keys)
    metrics.BLOB_FETCH_SECONDS.observe(time.perf_counter() - started)
    missing = [key for key, data in zip(keys, stored, strict=True) if data is None]
    if missing:
        metrics.BLOB_NOT_FOUND.inc(len(missing))
        raise EmbeddingNotFound(f"no embedding stored under {', '.join(missing)}", keys=missing, param="image.key")
    return await decode_items_async(stored, rules, "stored embedding")
