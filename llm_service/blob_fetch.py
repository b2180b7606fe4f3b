"""Stored and inline blobs to validated embeddings: one Redis round trip, then decode where it is
cheapest. The benchmark (bench/s3_transport.py) times exactly this path."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llm_service import metrics
from shared.blob import BlobRules, EmbeddingBlob, decode_blob
from shared.errors import EmbeddingNotFound, InvalidEmbedding, ServiceError
from shared.store import EmbeddingStore

if TYPE_CHECKING:  # a type only: the benchmark imports this module without the engines
    from llm_service.chat_request import MediaInput

# Decoding is zero-copy plus one pass for the finite check (~0.1 ms per MB). Below this many bytes
# a worker-thread hand-off (~0.1 ms) would cost as much as the work, so the event loop decodes.
INLINE_DECODE_BYTES = 2 * 1024 * 1024


def decode_items(
    blobs: list[bytes | None], rules: BlobRules, what: str, items: Sequence[MediaInput] = ()
) -> list[EmbeddingBlob]:
    """Each blob validated and decoded; each must hold exactly one image or video. With `items`
    (the request's item each blob is for), an error names the item's part and its field (param);
    without, the blob by its index."""
    decoded = []
    for index, data in enumerate(blobs):
        item = items[index] if items else None
        where = f"{what} at {item.at}" if item is not None and item.at else f"{what} {index}"
        try:
            blob = decode_blob(data or b"", rules, where=where)
            if blob.grid_thw.shape[0] != 1:
                raise InvalidEmbedding(f"{where} must hold exactly one image or video (grid_thw [1, 3])", param=where)
        except ServiceError as error:
            if item is not None and item.param is not None:
                error.param = item.param  # the request's field, not the words decode_blob names it by
            raise
        decoded.append(blob)
    return decoded


async def decode_items_async(
    blobs: list[bytes | None], rules: BlobRules, what: str, items: Sequence[MediaInput] = ()
) -> list[EmbeddingBlob]:
    """decode_items, on a worker thread once the blobs are large enough to be worth one."""
    if sum(len(data or b"") for data in blobs) < INLINE_DECODE_BYTES:
        return decode_items(blobs, rules, what, items)
    return await asyncio.to_thread(decode_items, blobs, rules, what, items)


async def fetch_items(
    store: EmbeddingStore, keys: list[str], rules: BlobRules, items: Sequence[MediaInput] = ()
) -> list[EmbeddingBlob]:
    """The blobs stored under `keys`, in one round trip, validated; items[i], where given, is the
    request's item that names keys[i], which an error names. EmbeddingNotFound names every missing
    key, so a caller that still has the images can re-encode exactly those; its param is the first
    missing key's field."""
    started = time.perf_counter()
    stored = await store.get_many(keys)
    metrics.BLOB_FETCH_SECONDS.observe(time.perf_counter() - started)
    missing = [key for key, data in zip(keys, stored, strict=True) if data is None]
    if missing:
        metrics.BLOB_NOT_FOUND.inc(len(missing))
        param = items[keys.index(missing[0])].param if items else None
        raise EmbeddingNotFound(f"no embedding stored under {', '.join(missing)}", keys=missing, param=param)
    return await decode_items_async(stored, rules, "stored embedding", items)
