"""Chat load against a running gateway, with the CPU each named process spent per request.

For the cost of one change, A/B, on a stack you started yourself (`scripts/stack.py serve
--tiny`): one image stored once, then `concurrency` clients each sending `requests` chats about
it by key (16 greedy tokens), streamed or not; a first pass of the same size warms up. CPU time
is read from /proc around the measured pass, per process and per request.

    python -m bench.chat_cpu --pids gateway=PID,llm=PID [--concurrency 16] [--requests 8] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import httpx

from bench.cpu import process_cpu_seconds
from bench.stats import percentile
from bench.workload import data_url, make_image


def _body(model: str, key: str, stream: bool) -> dict[str, Any]:
    image = {"type": "image_embeds", "image_embeds": None, "uuid": key}
    question = {"type": "text", "text": "What is in this image?"}
    return {"model": model, "max_tokens": 16, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": [image, question]}]}  # fmt: skip


async def _pass(client: httpx.AsyncClient, body: dict[str, Any], concurrency: int, requests: int) -> list[float]:
    latencies: list[float] = []

    async def one_client() -> None:
        for _ in range(requests):
            started = time.perf_counter()
            response = await client.post("/v1/chat/completions", json=body)  # a stream is read whole
            response.raise_for_status()
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return latencies


async def measure(
    base_url: str, model: str, pids: dict[str, int], concurrency: int, requests: int, stream: bool
) -> str:
    # One kept-alive connection per client: httpx keeps 20 by default, so past 20 clients most
    # requests paid a new connection, measured as the gateway's CPU per request.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        encoded = await client.post("/v1/images/encode", json={"image_url": data_url(make_image(7, 224))})
        body = _body(model, encoded.raise_for_status().json()["key"], stream)
        await _pass(client, body, concurrency, requests)  # warm-up
        cpu_before = {name: process_cpu_seconds(pid) for name, pid in pids.items()}
        started = time.perf_counter()
        latencies = await _pass(client, body, concurrency, requests)
        wall_s = time.perf_counter() - started
    count = len(latencies)
    cpu = " ".join(
        f"{name} {(process_cpu_seconds(pid) - cpu_before[name]) / count * 1000:.2f}" for name, pid in pids.items()
    )
    return (
        f"stream={stream} concurrency={concurrency} requests={count}: {count / wall_s:.1f} req/s, "
        f"p50 {percentile(latencies, 50) * 1000:.0f} ms; CPU ms per request: {cpu}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="ft-a")
    parser.add_argument("--pids", required=True, help="name=pid,name=pid: the processes to read CPU time of")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8, help="per client")
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    pids = {name: int(pid) for name, _, pid in (pair.partition("=") for pair in args.pids.split(","))}
    print(asyncio.run(measure(args.base_url, args.model, pids, args.concurrency, args.requests, args.stream)))


if __name__ == "__main__":
    main()
