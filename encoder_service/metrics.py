"""Prometheus metrics of the encoder service (served on ENCODER_METRICS_PORT)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

IMAGES_ENCODED = Counter("encoder_images_encoded_total", "Images run through the vision tower.")
CACHE_HITS = Counter("encoder_cache_hits_total", "Encode calls answered from Redis without encoding.")
COALESCED = Counter("encoder_coalesced_total", "Encode calls that joined an identical call in flight.")
ENCODE_SECONDS = Histogram(
    "encoder_encode_seconds", "Time to encode and store one image (cache misses only).",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40),
)  # fmt: skip
BLOB_BYTES = Histogram(
    "encoder_blob_bytes", "Size of stored embedding blobs.", buckets=(1e4, 1e5, 5e5, 1e6, 4e6, 1.6e7, 6.4e7)
)  # fmt: skip
QUEUE_DEPTH = Gauge("encoder_batch_queue_depth", "Images waiting for a vision-tower forward pass.")
BATCH_SIZE = Histogram("encoder_batch_size", "Images per vision-tower forward pass.", buckets=(1, 2, 4, 8, 16, 32))
