"""Load generator: streaming OpenAI chat completions over httpx, timing each request.

httpx rather than the openai client: on a 2-core machine the client's own CPU time competes with
the servers, and parsing SSE lines by hand is the cheapest way to see the first token. Both
systems under test get the same client.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.stats import percentile


@dataclass(frozen=True)
class RequestTiming:
    ttft_s: float  # request sent -> first non-empty content delta
    latency_s: float  # request sent -> stream finished
    completion_tokens: int
    error: str | None = None
    encoded_s: float = float("nan")  # request sent -> its images encoded, where the client sees it (EPD's hop)


@dataclass(frozen=True)
class LoadResult:
    wall_s: float
    timings: list[RequestTiming]

    @property
    def ok(self) -> list[RequestTiming]:
        return [t for t in self.timings if t.error is None]

    @property
    def errors(self) -> list[str]:
        return [t.error for t in self.timings if t.error is not None]

    @property
    def completion_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.ok)

    def summary(self) -> dict[str, float]:
        # A stream whose tokens never formed a whole character sends no text (vLLM drops an
        # incomplete UTF-8 tail), so it has no first-text time; percentiles skip it.
        ttfts = [t.ttft_s for t in self.ok if not math.isnan(t.ttft_s)]
        latencies = [t.latency_s for t in self.ok]
        return {
            "requests": len(self.timings),
            "errors": len(self.errors),
            "wall_s": self.wall_s,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p95_s": percentile(ttfts, 95),
            "latency_p50_s": percentile(latencies, 50),
            "latency_p95_s": percentile(latencies, 95),
            "completion_tokens": self.completion_tokens,
            "output_tok_s": self.completion_tokens / self.wall_s if self.wall_s else float("nan"),
            "requests_s": len(self.ok) / self.wall_s if self.wall_s else float("nan"),
        }


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestTiming:
    """One streaming chat completion; errors become a timing with `error` set, never an exception."""
    start = time.perf_counter()
    ttft, tokens, content_chunks = float("nan"), None, 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:300]
                return RequestTiming(
                    float("nan"), time.perf_counter() - start, 0, f"HTTP {response.status_code}: {text}"
                )
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        content_chunks += 1
                        if content_chunks == 1:
                            ttft = time.perf_counter() - start
    except httpx.HTTPError as error:
        return RequestTiming(float("nan"), time.perf_counter() - start, 0, f"{type(error).__name__}: {error}"[:300])
    return RequestTiming(ttft, time.perf_counter() - start, tokens if tokens is not None else content_chunks)


async def run_concurrent(requests: list[tuple[str, dict[str, Any]]], timeout_s: float = 900) -> LoadResult:
    """Sends every (url, body) at once and waits for all; wall time from first send to last byte."""
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        timings = await asyncio.gather(*(stream_chat(client, url, body) for url, body in requests))
        wall = time.perf_counter() - start
    return LoadResult(wall, list(timings))


async def run_sequential(requests: list[tuple[str, dict[str, Any]]], timeout_s: float = 300) -> LoadResult:
    """One request at a time, on one kept-alive connection: latency without queueing."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        start = time.perf_counter()
        timings = [await stream_chat(client, url, body) for url, body in requests]
        wall = time.perf_counter() - start
    return LoadResult(wall, timings)
