"""Faults against the real processes (tests/process_stack.py): a key evicted between encode and
generate, a client that hangs up mid-stream, Redis restarted under traffic, an LLM service killed
mid-stream, SIGTERM drain, and connection ageing. One stack for the module; a test that kills a
service either restarts it itself or leaves it to the next test's `stack` fixture, so each test
starts with the whole stack up."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.settings import GatewaySettings
from shared.grpc_server import MAX_CONNECTION_AGE_GRACE_MS
from shared.sdk import EncoderClient
from tests.images import data_url, png_bytes
from tests.process_stack import GENERATE, ProcessStack, process_stack

# Greedy, the tiny ft-a and ft-b run for hundreds of tokens on this prompt before an end of text
# (measured: 957 and over 1000); other prompts stop after a few dozen. Tests that need a stream to
# outlive a fault check that it was still running.
LONG_PROMPT = "hi"
# Greedy, ft-a runs on this one to the end of its 2,048-token context (measured: 2,020 tokens, over
# 4 s a choice on a host with AMX, where LONG_PROMPT's 957 took 1.7 s and four choices ended
# before 6 s).
CONTEXT_LONG_PROMPT = "a"


@pytest.fixture(scope="module")
def processes(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessStack]:
    with process_stack(checkpoints, tmp_path_factory.mktemp("faults")) as running:
        yield running


@pytest.fixture
def stack(processes: ProcessStack) -> ProcessStack:
    """The module's stack with every process up (an earlier test may have stopped one)."""
    processes.ensure_running()
    return processes


def chat_body(
    model: str, text: str, image: dict[str, Any] | None = None, max_tokens: int = 8, stream: bool = False
) -> dict[str, Any]:
    content = [image, {"type": "text", "text": text}] if image else text
    return {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip


def chat(stack: ProcessStack, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)


def image_url_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The `data:` payloads of a server-sent-event stream."""
    for line in lines:
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def images_encoded(stack: ProcessStack) -> int:
    with EncoderClient(stack.service("encoder").target) as encoder:
        return encoder.stats().images_encoded


def embedding_keys(stack: ProcessStack) -> set[str]:
    return {key.decode() for key in stack.redis.client().scan_iter("emb:*")}


# --- a key evicted between encode and generate -------------------------------------------------


def test_key_deleted_after_encode_is_encoded_again_for_a_chat_with_the_image(stack: ProcessStack) -> None:
    url = data_url(png_bytes(301))
    key = httpx.post(f"{stack.base_url}/v1/images/encode", json={"image_url": url}, timeout=60).json()["key"]
    assert stack.redis.client().delete(key) == 1
    before = images_encoded(stack)
    reply = chat(stack, chat_body("ft-a", "What is it?", image_url_part(url)))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert images_encoded(stack) == before + 1
    assert stack.redis.client().exists(key)


@contextmanager
def frozen(stack: ProcessStack, name: str) -> Iterator[None]:
    """SIGSTOP the service for the block: requests reach it and wait, as on a slow pod."""
    stack.send(name, signal.SIGSTOP)
    try:
        yield
    finally:
        stack.send(name, signal.SIGCONT)


def test_key_evicted_before_the_llm_reads_it_is_re_encoded_by_the_gateway(stack: ProcessStack) -> None:
    """The race the gateway's re-encode-once exists for: Encode stored the key and answered, and
    the key is gone when the LLM service fetches it. ft-b is frozen so the eviction lands in between."""
    url = data_url(png_bytes(302))
    body = chat_body("ft-b", "Describe the picture.", image_url_part(url))
    not_found_before = stack.metric("ft-b", "grpc_server_handled_total", grpc_method=GENERATE, grpc_code="NOT_FOUND")
    encoded_before, keys_before = images_encoded(stack), embedding_keys(stack)
    with ThreadPoolExecutor(1) as pool:
        with frozen(stack, "ft-b"):
            pending = pool.submit(chat, stack, body)
            deadline = time.monotonic() + 30
            while not (new_keys := embedding_keys(stack) - keys_before):
                assert time.monotonic() < deadline and not pending.done(), "the encoder never stored the image"
                time.sleep(0.02)
            assert stack.redis.client().delete(*new_keys) == 1  # evicted before ft-b could read it
        reply = pending.result(timeout=60)
    assert reply.status_code == 200, reply.text
    assert (
        stack.metric("ft-b", "grpc_server_handled_total", grpc_method=GENERATE, grpc_code="NOT_FOUND")
        == not_found_before + 1
    )
    assert images_encoded(stack) == encoded_before + 2  # encoded, evicted, encoded once more
    again = chat(stack, body)  # nothing evicted now
    assert again.json()["choices"][0]["message"] == reply.json()["choices"][0]["message"]


@contextmanager
def evicting_every_embedding(stack: ProcessStack) -> Iterator[list[bytes]]:
    """A store that loses every embedding as soon as it is written, as a Redis at maxmemory evicts
    under load: each SET of an emb:* key is DELeted the moment Redis announces it (a keyspace
    event, published before the writer even has its reply). Yields the keys deleted."""
    client = stack.redis.client()
    client.config_set("notify-keyspace-events", "E$")
    subscription = client.pubsub(ignore_subscribe_messages=True)
    subscription.psubscribe("__keyevent@*__:set")
    deleted: list[bytes] = []
    stop = threading.Event()

    def evict() -> None:
        while not stop.is_set():
            message = subscription.get_message(timeout=0.05)
            if message is not None and message["data"].startswith(b"emb:"):
                client.delete(message["data"])
                deleted.append(message["data"])

    evictor = threading.Thread(target=evict, daemon=True)
    evictor.start()
    try:
        yield deleted
    finally:
        stop.set()
        evictor.join(timeout=5)
        subscription.close()
        client.config_set("notify-keyspace-events", "")


def test_a_key_evicted_again_after_its_re_encode_is_a_503_not_a_404_naming_it(stack: ProcessStack) -> None:
    """Seen live with Redis at maxmemory (allkeys-lru, 32 clients): 5 of 400 image chats got a 404
    "no embedding stored under emb:v1:..." naming a key the client never sent. The gateway had
    stored it, re-encoded it once when the LLM service missed it, and lost it again: the store's
    shortage, told as the client's mistake. Now a 503 (retry later), as any other store trouble."""
    body = chat_body("ft-a", "What is it?", image_url_part(data_url(png_bytes(304))))
    with evicting_every_embedding(stack) as deleted:
        reply = chat(stack, body)
    assert reply.status_code == 503, reply.text
    assert reply.headers["retry-after"] and reply.json()["error"]["code"] == "unavailable"
    assert "encoding" in reply.json()["error"]["message"] and "emb:" not in reply.text
    assert len(deleted) == 2, deleted  # stored, lost, stored again, lost again: one re-encode, no more
    assert chat(stack, body).status_code == 200  # a store that keeps what it is given serves it


def test_chat_naming_an_evicted_key_gets_a_clear_404(stack: ProcessStack) -> None:
    url = data_url(png_bytes(303))  # never sent to an LLM service, so none holds it in its blob cache
    key = httpx.post(f"{stack.base_url}/v1/images/encode", json={"image_url": url}, timeout=60).json()["key"]
    assert stack.redis.client().delete(key) == 1
    part = {"type": "image_embeds", "image_embeds": None, "uuid": key}
    reply = chat(stack, chat_body("ft-a", "What is it?", part))
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert error["code"] == "embedding_not_found" and key in error["message"]


# --- a client that disconnects mid-stream ------------------------------------------------------


def test_client_disconnect_mid_stream_frees_the_engine(stack: ProcessStack) -> None:
    def in_flight() -> float:
        return stack.metric("ft-a", "grpc_server_in_flight", grpc_method=GENERATE)

    def ended() -> dict[str, float]:
        codes = ("OK", "CANCELLED", "UNKNOWN")
        return {
            code: stack.metric("ft-a", "grpc_server_handled_total", grpc_method=GENERATE, grpc_code=code)
            for code in codes
        }

    assert in_flight() == 0
    before = ended()
    body = chat_body("ft-a", LONG_PROMPT, max_tokens=2000, stream=True)  # ~1,000 tokens: many seconds of decoding
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body) as response,
    ):
        events = sse_data(response.iter_lines())
        while not json.loads(next(events))["choices"][0]["delta"].get("content"):
            pass
        assert in_flight() == 1
        response.close()  # hang up mid-stream
    # The gateway notices at its next write and cancels the Generate call.
    stack.wait_for(lambda: in_flight() == 0, 3, "the engine freed of the abandoned generation")
    after = ended()
    assert after["UNKNOWN"] == before["UNKNOWN"], "a hang-up was counted as a server error"
    # Mostly CANCELLED; gRPC lets a few cancelled streams end as if complete, so the idle engine is the proof.
    assert after["OK"] + after["CANCELLED"] == before["OK"] + before["CANCELLED"] + 1
    # The engine stopped decoding: the process idles (a generation keeps at least one core busy).
    time.sleep(0.5)
    cpu_before, started = stack.cpu_seconds("ft-a"), time.monotonic()
    time.sleep(2)
    load = (stack.cpu_seconds("ft-a") - cpu_before) / (time.monotonic() - started)
    assert load < 0.25, f"ft-a still uses {load:.2f} cores after the cancel"
    reply = chat(stack, chat_body("ft-a", "hi", max_tokens=4))
    assert reply.status_code == 200, reply.text


def test_clients_that_leave_before_any_output_cancel_their_generations(stack: ProcessStack) -> None:
    """A client may give up before the response head: a non-streaming request still generating,
    or a stream still waiting for its first token. Nothing reads that output any more, so its
    generations must stop, and its admission slot be freed, when the client leaves."""

    def in_flight() -> float:
        return stack.metric("ft-a", "grpc_server_in_flight", grpc_method=GENERATE)

    def gone() -> float:
        return stack.metric("gateway", "gateway_http_requests_total", route="/v1/chat/completions", status="499")

    def give_up_after(timeout_s: float, body: dict[str, Any]) -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=timeout_s)

    assert in_flight() == 0
    gone_before, gateway_slots_before = gone(), stack.metric("gateway", "gateway_chat_in_flight")
    # The reference engine runs one generation at a time: four choices keep it busy for well over
    # the 6 s, and a later request waits behind them for its first token.
    busy = chat_body("ft-a", CONTEXT_LONG_PROMPT, max_tokens=4096) | {"n": 4}
    with ThreadPoolExecutor(1) as pool:
        busy_client = pool.submit(give_up_after, 6.0, busy)
        stack.wait_for(lambda: in_flight() == 4, 5, "the four choices at the LLM service")
        give_up_after(1.0, chat_body("ft-a", "hello", max_tokens=8, stream=True))
        stack.wait_for(lambda: in_flight() == 4, 3, "the end of a stream whose client left before its first token")
        busy_client.result()
    stack.wait_for(lambda: in_flight() == 0, 3, "the end of a non-streaming request whose client left")
    assert gone() == gone_before + 2
    assert stack.metric("gateway", "gateway_chat_in_flight") == gateway_slots_before
    reply = chat(stack, chat_body("ft-a", "hi", max_tokens=4))
    assert reply.status_code == 200, reply.text


# --- Redis restarted under traffic --------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    started: float
    ended: float
    status: int
    retry_after: str | None
    code: str | None


def test_redis_restart_under_traffic_fails_fast_then_recovers_without_restarts(stack: ProcessStack) -> None:
    pids = stack.pids()
    url = data_url(png_bytes(304))
    outcomes: list[Outcome] = []
    stop = threading.Event()

    def client_loop(model: str) -> None:
        with httpx.Client(base_url=stack.base_url, timeout=30) as client:
            while not stop.is_set():
                started = time.monotonic()
                reply = client.post(
                    "/v1/chat/completions", json=chat_body(model, "What is it?", image_url_part(url), max_tokens=2)
                )
                code = reply.json()["error"]["code"] if reply.status_code != 200 else None
                outcomes.append(
                    Outcome(started, time.monotonic(), reply.status_code, reply.headers.get("retry-after"), code)
                )

    with ThreadPoolExecutor(4) as pool:
        loops = [pool.submit(client_loop, model) for model in ("ft-a", "ft-b", "ft-a", "ft-b")]
        time.sleep(3)
        stack.redis.stop()
        down_since = time.monotonic()
        time.sleep(4)
        up_from = time.monotonic()
        stack.redis.start()
        up_since = time.monotonic()
        time.sleep(5)
        stop.set()
        for loop in loops:
            loop.result(timeout=60)

    assert {o.status for o in outcomes} <= {200, 503}, sorted({o.status for o in outcomes})
    assert all(o.status == 200 for o in outcomes if o.ended < down_since - 0.1)
    while_down = [o for o in outcomes if o.started >= down_since and o.ended <= up_from]
    assert len(while_down) >= 4
    assert all(o.status == 503 and o.retry_after == "1" and o.code == "unavailable" for o in while_down)
    slowest = max(o.ended - o.started for o in while_down)
    print(f"Redis down {up_from - down_since:.1f}s: {len(while_down)} requests got 503, slowest {slowest:.2f}s")
    assert slowest < 2.0, f"a 503 took {slowest:.2f}s"
    after = [o for o in outcomes if o.started >= up_since + 1.0]
    assert len(after) >= 4 and all(o.status == 200 for o in after), [o.status for o in after]
    assert stack.pids() == pids and all(stack.alive(name) for name in pids)


# --- an LLM service killed mid-stream -----------------------------------------------------------


def replay_through_openai(payloads: list[str]) -> tuple[list[str], openai.APIError | None]:
    """What the official client makes of these SSE payloads: the text it yields, and what it raises."""
    wire = "".join(f"data: {payload}\n\n" for payload in payloads).encode()
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=wire)
    )
    client = openai.OpenAI(base_url="http://replay/v1", api_key="unused", http_client=httpx.Client(transport=transport))
    texts: list[str] = []
    try:
        for chunk in client.chat.completions.create(
            model="ft-a", messages=[{"role": "user", "content": "x"}], stream=True
        ):
            texts.extend(choice.delta.content or "" for choice in chunk.choices)
    except openai.APIError as error:
        return texts, error
    return texts, None


def test_llm_killed_mid_stream_ends_that_stream_with_an_error_and_other_models_serve(stack: ProcessStack) -> None:
    gateway_pid = stack.pid("gateway")
    body = chat_body("ft-a", LONG_PROMPT, max_tokens=2000, stream=True)
    payloads: list[str] = []
    killed_at = None
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for data in sse_data(response.iter_lines()):
            payloads.append(data)
            if len(payloads) == 2:  # the role chunk, then the first text
                stack.send("ft-a", signal.SIGKILL)
                killed_at = time.monotonic()
    assert killed_at is not None, "the stream ended before the kill"
    assert time.monotonic() - killed_at < 10, "the stream did not end promptly after the kill"
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == "unavailable" and error["type"] == "service_unavailable"
    chunks = [json.loads(p) for p in payloads[:-2]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("error" not in c and c["choices"][0]["finish_reason"] is None for c in chunks)

    # The request's summary line counts what the client got before the cut, not 0/0.
    def cut_summary() -> list[str]:
        lines = stack.log_tail("gateway", 400).splitlines()
        return [
            line for line in lines if "POST /v1/chat/completions 200 model=ft-a" in line and "error=unavailable" in line
        ]

    stack.wait_for(cut_summary, 10, "the cut stream's summary line")
    (line,) = cut_summary()
    tokens = re.search(r"tokens=(\d+)/(\d+)", line)
    assert tokens is not None and int(tokens[1]) > 0 and int(tokens[2]) >= 1, line

    texts, raised = replay_through_openai(payloads)  # an openai client user sees an APIError, not a short answer
    assert isinstance(raised, openai.APIError) and raised.body["code"] == "unavailable"
    assert "".join(texts) == "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)

    assert stack.wait_exit("ft-a", 10) == -signal.SIGKILL
    down = chat(stack, chat_body("ft-a", "hi"))
    assert down.status_code == 503 and down.headers["retry-after"] == "1"
    for stream in (False, True):
        other = chat(stack, chat_body("ft-b", "hi", stream=stream))
        assert other.status_code == 200, other.text
    stack.restart("ft-a")  # same port; the gateway is not restarted and reconnects by itself
    deadline = time.monotonic() + 15  # its channel may still be in reconnect backoff for a moment
    while (again := chat(stack, chat_body("ft-a", "hi"))).status_code != 200:
        assert again.status_code == 503 and time.monotonic() < deadline, again.text
        time.sleep(0.5)
    assert stack.pid("gateway") == gateway_pid


# --- SIGTERM: readiness first, then drain -------------------------------------------------------


def test_sigterm_goes_not_serving_then_drains_the_stream_in_flight_and_exits_0(stack: ProcessStack) -> None:
    """Last in the module: ft-b stays down (a later test's `stack` fixture would restart it)."""
    target = stack.service("ft-b").target
    channel = grpc.insecure_channel(target)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
    payloads: list[tuple[float, str]] = []
    first_text = threading.Event()

    def read_stream() -> None:
        body = chat_body("ft-b", LONG_PROMPT, max_tokens=64, stream=True)
        with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=120) as response:
            for data in sse_data(response.iter_lines()):
                payloads.append((time.monotonic(), data))
                if len(payloads) == 2:
                    first_text.set()

    try:
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        with ThreadPoolExecutor(1) as pool:
            reader = pool.submit(read_stream)
            assert first_text.wait(60), "the stream never started"
            stack.send("ft-b", signal.SIGTERM)
            terminated_at = time.monotonic()
            # The watch opened before SIGTERM is in flight, so it is still served: readiness flips first.
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()  # an open watch would hold the drain for the whole grace period
            # A new Check meets a server that refuses new calls; the code depends on timing: the
            # listener closed gives UNAVAILABLE, a call grpc accepted but never matched to a handler
            # is CANCELLED at shutdown (grpc/grpc#41785; the gateway reads both as 503). Never SERVING.
            assert stack.grpc_health("ft-b") in ("NOT_SERVING", "UNAVAILABLE", "CANCELLED")
            refused = chat(stack, chat_body("ft-b", "hi"))
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            served = chat(stack, chat_body("ft-a", "hi"))
            assert served.status_code == 200
            reader.result(timeout=120)
    finally:
        watch.cancel()
        channel.close()
    assert any(at > terminated_at for at, _ in payloads[:-2]), "no output after SIGTERM: nothing was drained"
    assert payloads[-1][1] == "[DONE]"
    last = json.loads(payloads[-2][1])
    assert "error" not in last and last["choices"][0]["finish_reason"] == "length"
    assert stack.wait_exit("ft-b", 60) == 0


# --- connection ageing --------------------------------------------------------------------------


def test_connection_ageing_never_cuts_a_stream_the_gateway_still_waits_for() -> None:
    """Servers age connections out; calls still open when the grace ends are cut with UNAVAILABLE
    ("max connection age"), so the grace must outlast the gateway's deadline for a Generate stream."""
    assert MAX_CONNECTION_AGE_GRACE_MS >= GatewaySettings.model_fields["request_timeout_s"].default * 1000
