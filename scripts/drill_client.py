"""The fault drill's clients: streaming chat completions in a loop, each outcome classified.

A request ends in exactly one of these ways, and only the last is a failure of ours:
- `completed`: HTTP 200, a stream that ends with a finish_reason chunk and `data: [DONE]`;
- `clean_503`: HTTP 503 with `Retry-After` and an OpenAI error body (the client waits and retries);
- `stream_error`: a stream that stopped with an OpenAI error event (the client knows what happened);
- `client_4xx`: any other 4xx with an OpenAI error body (counted, expected to stay 0);
- `disconnected`: the client hung up on purpose (before the response head or mid-stream);
- `lost`: no response (connection refused or reset, timeout), a stream cut without an error
  event, a 5xx other than a clean 503. The drill's target for `lost` is 0.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

OUTCOMES = ("completed", "clean_503", "stream_error", "client_4xx", "disconnected", "lost")


@dataclass
class Tally:
    """Outcome counts, the completion times of successes per model, and a sample of each loss."""

    counts: Counter[str] = field(default_factory=Counter)
    successes: dict[str, list[float]] = field(default_factory=dict)  # model -> monotonic end times
    lost_samples: list[str] = field(default_factory=list)

    def add(self, outcome: str, model: str, detail: str = "") -> None:
        self.counts[outcome] += 1
        if outcome == "completed":
            self.successes.setdefault(model, []).append(time.monotonic())
        if outcome == "lost" and len(self.lost_samples) < 20:
            self.lost_samples.append(f"{model}: {detail}")

    def first_success_after(self, moment: float, model: str | None = None) -> float | None:
        """Seconds from `moment` to the first success (of `model`, or of any model) completed after it."""
        times = [t for m, ends in self.successes.items() if model in (None, m) for t in ends if t >= moment]
        return min(times) - moment if times else None


@dataclass(frozen=True)
class Workload:
    base_url: str
    models: tuple[str, ...]
    image_urls: tuple[str, ...]  # data URLs; an image chat encodes (or finds) one of them
    max_tokens: int = 8
    disconnect_rate: float = 0.1  # share of requests the client abandons on purpose
    timeout_s: float = 120.0


def _body(workload: Workload, rng: random.Random, model: str) -> dict:
    content: list[dict] = [{"type": "text", "text": rng.choice(("What is it?", "Describe it.", "Which colors?"))}]
    if rng.random() < 0.75:  # most requests carry an image, so Redis faults reach them
        content.insert(0, {"type": "image_url", "image_url": {"url": rng.choice(workload.image_urls)}})
    return {"model": model, "stream": True, "max_tokens": workload.max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip


def _is_openai_error(payload: bytes | str) -> bool:
    try:
        error = json.loads(payload)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


async def _read_stream(response: httpx.Response) -> tuple[str, str]:
    """(outcome, detail) of a 200 event stream read to its end."""
    finished = done = False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            break
        if _is_openai_error(data):
            return "stream_error", data[:200]
        chunk = json.loads(data)
        finished = finished or any(choice.get("finish_reason") for choice in chunk.get("choices", ()))
    if finished and done:
        return "completed", ""
    return "lost", f"stream ended without [DONE] or an error event (finish seen: {finished})"


async def one_request(client: httpx.AsyncClient, workload: Workload, rng: random.Random, model: str) -> tuple[str, str]:
    """Sends one streaming chat completion; (outcome, detail)."""
    body = _body(workload, rng, model)
    hang_up = rng.random() < workload.disconnect_rate
    if hang_up and rng.random() < 0.5:  # before the response head: the request is sent, then dropped
        # On a connection of its own: a request cancelled mid-flight would leave the loop's pooled
        # connection unusable, and closing this client closes the socket, which the gateway sees.
        async with httpx.AsyncClient(base_url=workload.base_url, timeout=workload.timeout_s) as throwaway:
            task = asyncio.create_task(throwaway.post("/v1/chat/completions", json=body))
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return "disconnected", "before the head"
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                payload = await response.aread()
                if response.status_code == 503 and response.headers.get("retry-after") and _is_openai_error(payload):
                    return "clean_503", ""
                if 400 <= response.status_code < 500 and _is_openai_error(payload):
                    return "client_4xx", f"{response.status_code} {payload[:200]!r}"
                return "lost", f"HTTP {response.status_code} {payload[:200]!r}"
            if hang_up:  # mid-stream: read one line, then close the connection
                async for _ in response.aiter_lines():
                    break
                return "disconnected", "mid-stream"
            return await _read_stream(response)
    except httpx.HTTPError as error:
        return "lost", f"{type(error).__name__}: {error}"


async def client_loop(index: int, workload: Workload, tally: Tally, stop: asyncio.Event) -> None:
    """One client: requests back to back until `stop` is set, waiting Retry-After (1 s) after a 503."""
    rng = random.Random(index)
    model = workload.models[index % len(workload.models)]
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=workload.base_url, timeout=workload.timeout_s, limits=limits) as client:
        while not stop.is_set():
            outcome, detail = await one_request(client, workload, rng, model)
            tally.add(outcome, model, detail)
            if outcome in ("clean_503", "stream_error"):
                await asyncio.sleep(1.0)
