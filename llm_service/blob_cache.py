"""A bounded in-memory LRU of decoded blobs, so many questions on one image cost
one Redis GET (and one decode) per pod. Keys are content addresses, so an entry
never goes stale; it only ages out when the byte budget is needed."""

from __future__ import annotations

from collections import OrderedDict

from llm_service import metrics
from shared.blob import EmbeddingBlob


def blob_bytes(blob: EmbeddingBlob) -> int:
    return int(blob.embeds.nbytes + blob.grid_thw.nbytes)


class BlobCache:
    """Least-recently-used eviction by total array bytes; max_bytes 0 disables it. Hits and misses
    are counted once, in the service's Prometheus metrics."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, EmbeddingBlob] = OrderedDict()
        self._bytes = 0

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> EmbeddingBlob | None:
        blob = self._entries.get(key)
        if blob is None:
            metrics.BLOB_CACHE_MISSES.inc()
            return None
        self._entries.move_to_end(key)
        metrics.BLOB_CACHE_HITS.inc()
        return blob

    def put(self, key: str, blob: EmbeddingBlob) -> None:
        size = blob_bytes(blob)
        if size > self.max_bytes or key in self._entries:
            return
        while self._bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= blob_bytes(evicted)
        self._entries[key] = blob
        self._bytes += size
