"""Service lifecycle against real processes (tests/process_stack.py, both models on vLLM as in
production): an EngineCore killed as the OOM killer would, an LLM service killed with its engine
processes, readiness that follows Redis, and a drain that ends when the last stream does.
One stack for the module; each test starts with every process up and SERVING."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from shared.errors import ServiceError
from shared.sdk import LLMClient, Message, Sampling
from tests.images import data_url
from tests.process_stack import VLLM_ENV, ProcessStack, process_stack

# The tiny checkpoints on vLLM (VLLM_ENV). An engine step of these takes milliseconds: 6 s without
# a token means a hung engine. The encoder's passes over the images here take milliseconds too; its
# limit is low enough for a long video to pass it (test_an_encoder_pass_past_its_stall_limit...).
STALL_S = 6.0
ENCODER_STALL_S = 1.0
# Video frames up to qwen-vl-utils' 768x28x28 pixels, not the tiny checkpoint's 50,176: that long
# video's pass then takes seconds.
STALL_ENV = {**VLLM_ENV, "LLM_STALL_S": str(STALL_S), "ENCODER_STALL_S": str(ENCODER_STALL_S),
             "ENCODER_VIDEO_MAX_PIXELS": str(768 * 28 * 28)}  # fmt: skip
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def processes(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessStack]:
    with process_stack(checkpoints, tmp_path_factory.mktemp("lifecycle"), env=STALL_ENV) as running:
        yield running


@pytest.fixture
def stack(processes: ProcessStack) -> ProcessStack:
    processes.ensure_running()
    return processes


def chat(stack: ProcessStack, model: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)


def alive(pid: int) -> bool:
    """Running, not a zombie (a killed orphan stays one until init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


class HealthWatch:
    """A health Watch on a service, read on a thread: the statuses it reported, with their times."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target)
        self._call = health_pb2_grpc.HealthStub(self._channel).Watch(health_pb2.HealthCheckRequest(), timeout=300)
        self.seen: list[tuple[float, int]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for reply in self._call:
                self.seen.append((time.monotonic(), reply.status))
        except grpc.RpcError:  # cancelled, or the server went away
            pass

    def first(self, status: int) -> float | None:
        return next((at for at, seen in self.seen if seen == status), None)

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


def test_a_killed_engine_core_turns_the_service_not_serving_503s_exits_and_is_relaunched(stack: ProcessStack) -> None:
    service = stack.service("ft-a")
    old = service.process
    assert old is not None
    watch = HealthWatch(service.target)
    try:
        stack.wait_for(lambda: watch.first(SERVING) is not None, 10, "the watch's first SERVING")
        os.kill(stack.engine_core_pid("ft-a"), signal.SIGKILL)  # as the OOM killer would
        killed_at = time.monotonic()
        down = chat(stack, "ft-a")
        assert down.status_code == 503, down.text  # was 500 (EngineDeadError) forever
        assert down.headers["retry-after"] == "1" and down.json()["error"]["code"] == "unavailable"
        stack.wait_for(lambda: watch.first(NOT_SERVING) is not None, 5, "NOT_SERVING on the watch")
        not_serving_after = watch.first(NOT_SERVING) - killed_at  # type: ignore[operator]
        assert not_serving_after < 1.5, f"NOT_SERVING {not_serving_after:.2f}s after the engine died"
    finally:
        watch.close()
    assert old.wait(timeout=15) == 1, "a service whose engine died must exit non-zero, to be restarted"
    stack.wait_for(lambda: service.process is not old and stack.alive("ft-a"), 30, "the relaunch")
    stack.wait_healthy()
    again = chat(stack, "ft-a")
    assert again.status_code == 200, again.text


def test_a_frozen_engine_core_turns_the_service_not_serving_fails_its_requests_exits_and_is_relaunched(
    stack: ProcessStack,
) -> None:
    """A hung GPU leaves EngineCore alive and silent; SIGSTOP makes it so here. Before the progress
    watch (shared/progress_watch.py) the service stayed SERVING and every request waited forever."""
    service = stack.service("ft-a")
    old = service.process
    assert old is not None
    core = stack.engine_core_pid("ft-a")
    watch = HealthWatch(service.target)
    try:
        stack.wait_for(lambda: watch.first(SERVING) is not None, 10, "the watch's first SERVING")
        os.kill(core, signal.SIGSTOP)
        frozen_at = time.monotonic()
        waiting = chat(stack, "ft-a")  # reaches the frozen engine and waits for a token
        answered_after = time.monotonic() - frozen_at
        assert waiting.status_code == 503, waiting.text
        print(f"503 {answered_after:.1f}s after the freeze: {waiting.json()['error']['message']}")
        assert answered_after < STALL_S + 10, f"the request waited {answered_after:.1f}s"
        stack.wait_for(lambda: watch.first(NOT_SERVING) is not None, 5, "NOT_SERVING on the watch")
        assert old.wait(timeout=30) == 1, "a service whose engine hangs must exit non-zero, to be restarted"
        assert "the engine made no progress" in (stack.log_dir / "ft-a.log").read_text()
        stack.wait_for(lambda: not alive(core), 5, "the end of the frozen EngineCore")  # no stopped orphan
    finally:
        watch.close()
        if alive(core):
            os.kill(core, signal.SIGKILL)
    stack.wait_for(lambda: service.process is not old and stack.alive("ft-a"), 30, "the relaunch")
    stack.wait_healthy()
    again = chat(stack, "ft-a")
    assert again.status_code == 200, again.text


def test_a_frozen_engine_is_caught_though_every_client_gives_up_before_the_limit(stack: ProcessStack) -> None:
    """Clients whose deadline is shorter than STALL_S (the gateway's 300 s against the default
    600 s) leave a hung engine before the limit. Their waits add up: before, each new request
    started the count afresh and a hung engine behind such traffic was never caught."""
    service = stack.service("ft-b")
    old = service.process
    assert old is not None
    core = stack.engine_core_pid("ft-b")
    try:
        os.kill(core, signal.SIGSTOP)
        # gRPC calls with a 2.5 s deadline, which the service cancels on time: waits each well
        # under STALL_S, with idle gaps between them.
        with LLMClient(service.target, timeout_s=2.5) as client:
            for _ in range(6):
                with pytest.raises(ServiceError):
                    list(client.generate("ft-b", [Message("user", ["hi"])], Sampling(max_tokens=4)))
                if old.poll() is not None:
                    break
                time.sleep(1)
        assert old.wait(timeout=30) == 1, "the hung engine went unnoticed"
    finally:
        if alive(core):
            os.kill(core, signal.SIGKILL)
    stack.wait_for(lambda: service.process is not old and stack.alive("ft-b"), 30, "the relaunch")
    stack.wait_healthy()
    assert chat(stack, "ft-b").status_code == 200


def _solid_png(side: int, color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_client_that_stops_reading_is_no_hung_engine(stack: ProcessStack) -> None:
    """A stream whose client stops reading blocks the service's writes (gRPC flow control) while
    the engine has long finished its part. Counted as the engine's wait, that looked like a hung
    engine after STALL_S: any caller could restart the service by not reading."""
    service = stack.service("ft-a")
    process = service.process
    sampling = Sampling(max_tokens=1500, temperature=1.0, seed=3, logprobs=True, top_logprobs=20)
    with LLMClient(service.target, timeout_s=120) as client:
        chunks = client.generate("ft-a", [Message("user", ["talk"])], sampling)
        first = next(chunks)
        time.sleep(STALL_S + 4)  # reading nothing; ~0.5 KB a token fills the stream's window
        assert service.process is process and process is not None and process.poll() is None
        assert stack.grpc_health("ft-a") == "SERVING"
        rest = list(chunks)
    assert rest[-1].finish_reason is not None and 1 + len(rest) > 100, (first, len(rest))


def test_an_encoder_pass_past_its_stall_limit_makes_the_encoder_exit_and_be_relaunched(stack: ProcessStack) -> None:
    """A hung GPU leaves the tower's pass running forever, which no CPU does on demand; a 64-frame
    video, a pass of 3-5 s on 2 cores, stands in for it against the 1 s limit. Before the
    progress watch the encoder stayed SERVING whatever its tower did.

    The encoder then drains its calls for 2 s before it exits (shared/grpc_server.py): a hung
    pass never ends, so its call fails (503); this stand-in ends, and on a fast machine (AMX:
    a pass of about 3 s) inside the drain, so its call may also be answered."""
    service = stack.service("encoder")
    old = service.process
    assert old is not None
    frames = [data_url(_solid_png(840, (index * 3, 40, 90))) for index in range(64)]
    started = time.monotonic()
    reply = httpx.post(f"{stack.base_url}/v1/videos/encode", json={"frames": frames}, timeout=60)
    assert reply.status_code in (200, 503), reply.text
    if reply.status_code == 503:
        assert reply.json()["error"]["code"] == "unavailable"
    print(f"{reply.status_code} {time.monotonic() - started:.1f}s after the request: {reply.text[:200]}")
    assert old.wait(timeout=30) == 1, "an encoder whose tower hangs must exit non-zero, to be restarted"
    assert "the vision tower made no progress" in (stack.log_dir / "encoder.log").read_text()
    stack.wait_for(lambda: service.process is not old and stack.alive("encoder"), 30, "the relaunch")
    stack.wait_healthy()
    small = httpx.post(f"{stack.base_url}/v1/images/encode", json={"image_url": frames[0]}, timeout=60)
    assert small.status_code == 200, small.text


def test_a_killed_llm_service_takes_its_engine_processes_with_it(stack: ProcessStack) -> None:
    children = stack.children("ft-b")
    core = stack.engine_core_pid("ft-b")
    workers = list(stack.children_of(core))
    assert workers, "vLLM's EngineCore runs its model in a worker process on CPU"
    tree = [*children, *workers]
    stack.send("ft-b", signal.SIGKILL)
    gone_after = stack.wait_for(lambda: not any(alive(pid) for pid in tree), 5, f"the end of ft-b's children {tree}")
    print(f"engine processes gone {gone_after:.2f}s after the service was killed")


def test_a_service_stopped_while_its_engine_starts_leaves_no_engine_process(stack: ProcessStack) -> None:
    """A SIGTERM can come at any time, also in the seconds an engine takes to start. vLLM's
    EngineCore, spawned first, then waits for a start-up handshake with the service, and without
    the service it waited forever, holding its memory."""
    service = stack.service("ft-b")
    service.restart()  # the launcher's own relaunch; no wait for SERVING

    def spawned() -> list[int]:  # EngineCore, before and after vLLM retitles it
        children = stack.children("ft-b").items()
        return [pid for pid, command in children if "spawn_main" in command or "EngineCore" in command]

    stack.wait_for(spawned, 60, "ft-b's EngineCore")
    (core,) = spawned()
    stack.send("ft-b", signal.SIGTERM)
    stack.wait_exit("ft-b", 30)
    gone_after = stack.wait_for(lambda: not alive(core), 30, f"the end of ft-b's EngineCore {core}")
    print(f"EngineCore gone {gone_after:.2f}s after its service")


def test_a_redis_that_stalls_for_a_moment_leaves_readiness_alone(stack: ProcessStack) -> None:
    """Redis answering late once or twice (a busy node) is no outage: single failed PINGs used to
    turn a service NOT_SERVING, and with the encoder the gateway's /readyz, on a loaded box."""
    watches = {name: HealthWatch(stack.service(name).target) for name in ("encoder", "ft-a")}
    try:
        for name, watch in watches.items():
            stack.wait_for(lambda watch=watch: watch.first(SERVING) is not None, 10, f"{name}'s first SERVING")
        with redis.Redis.from_url(stack.redis.url) as client:
            for _ in range(2):
                # Every client's commands wait 1.2 s: longer than the services' 0.5 s socket timeout
                # and the 1 s a readiness check gets, so one or two checks in a row fail.
                client.execute_command("CLIENT", "PAUSE", 1200, "ALL")
                time.sleep(4)
        for name, watch in watches.items():
            assert watch.first(NOT_SERVING) is None, f"{name} went NOT_SERVING for a 1.2 s stall of Redis"
    finally:
        for watch in watches.values():
            watch.close()


def test_readiness_follows_redis_and_a_service_starts_while_redis_is_down(stack: ProcessStack) -> None:
    services = ("encoder", "ft-a")
    stack.redis.stop()
    try:
        for name in services:  # three failed checks a second apart (shared/readiness.py DOWN_AFTER)
            stack.wait_for(lambda name=name: stack.grpc_health(name) == "NOT_SERVING", 8, f"{name} NOT_SERVING")
        stack.service("encoder").restart()  # down at start: it must start all the same, NOT_SERVING
        stack.wait_for(lambda: stack.grpc_health("encoder") == "NOT_SERVING", 120, "the encoder up, NOT_SERVING")
        time.sleep(2)  # and stays so while Redis is down
        assert stack.grpc_health("encoder") == "NOT_SERVING" and stack.grpc_health("ft-a") == "NOT_SERVING"
        # Liveness stays SERVING: Kubernetes must not restart pods for an outage of Redis.
        assert all(stack.grpc_health(name, "liveness") == "SERVING" for name in services)
    finally:
        stack.redis.start()
    for name in services:
        back = stack.wait_for(lambda name=name: stack.grpc_health(name) == "SERVING", 5, f"{name} SERVING again")
        print(f"{name} SERVING {back:.2f}s after Redis returned")
    assert chat(stack, "ft-a").status_code == 200


def test_sigterm_exits_as_soon_as_the_last_stream_ends_not_after_the_grace(stack: ProcessStack) -> None:
    """LLM_GRACE_S is 60 (tests/process_stack.py); a health Watch stays open throughout, as a
    client-side health checker keeps one: grpc's own stop(grace) waited the whole 60 s for it."""
    service = stack.service("ft-b")
    process = service.process
    assert process is not None
    watch = HealthWatch(service.target)
    payloads: list[tuple[float, str]] = []
    first_text = threading.Event()

    def read_stream() -> None:
        body = {"model": "ft-b", "max_tokens": 800, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
        with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    payloads.append((time.monotonic(), line.removeprefix("data: ")))
                    if len(payloads) == 2:
                        first_text.set()

    try:
        with ThreadPoolExecutor(1) as pool:
            reader = pool.submit(read_stream)
            assert first_text.wait(60), "the stream never started"
            process.send_signal(signal.SIGTERM)
            terminated_at = time.monotonic()
            reader.result(timeout=120)
        ended_at = payloads[-1][0]
        assert process.wait(timeout=60) == 0
        exited_at = time.monotonic()
    finally:
        watch.close()
    last = json.loads(payloads[-2][1])
    assert payloads[-1][1] == "[DONE]" and "error" not in last, last
    assert last["choices"][0]["finish_reason"] == "length", "the stream was cut, not drained"
    assert ended_at > terminated_at, "the stream ended before SIGTERM: nothing was drained"
    print(f"stream ended {ended_at - terminated_at:.2f}s after SIGTERM; exit {exited_at - ended_at:.2f}s after that")
    # gRPC is done ~1 s after the stream; vLLM's own engine shutdown then takes up to ~5 s (its
    # EngineCore exit timeout, then SIGKILL) on these loaded 2 cores. Before: the whole 60 s grace.
    assert exited_at - ended_at < 12, f"exited {exited_at - ended_at:.1f}s after its last stream ended"
    time.sleep(2)  # exit 0 is a stop someone asked for: the launcher leaves it down
    assert service.process is process


def _loaded_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_every_service_runs_on_uvloop_and_the_gateway_parses_http_with_httptools(stack: ProcessStack) -> None:
    """The services share their cores with the engines: their loop's CPU per message is taken from
    decoding (shared/event_loop.py). asyncio.run, or uvicorn's silent fallback where uvloop or
    httptools is missing, would not load these libraries."""
    assert chat(stack, "ft-a", max_tokens=2).status_code == 200
    for name, pid in stack.pids().items():
        assert "uvloop/loop.cpython" in _loaded_libraries(pid), f"{name} does not run on uvloop"
    assert "httptools/parser/parser.cpython" in _loaded_libraries(stack.pid("gateway"))


def test_every_service_keeps_its_start_up_heap_out_of_full_collections(stack: ProcessStack) -> None:
    """A full collection over what start-up made stalls the loop: ~200 ms in an LLM service on
    these cores (shared/gc_heap.py). Each running service froze those objects once it was ready,
    and so did the vLLM worker under each LLM service, where one took 0.3-0.9 s with no token for
    any request (llm_service/engines/vllm_worker.py): vLLM's CPU worker does not freeze its own."""
    assert chat(stack, "ft-a", max_tokens=2).status_code == 200
    frozen = {name: stack.metric(name, "python_gc_frozen_objects") for name in stack.pids()}
    assert all(count > 50_000 for count in frozen.values()), frozen
    assert frozen["ft-a"] > 300_000, frozen  # torch, transformers and vLLM: the big heap
    workers = {name: stack.metric(name, "llm_engine_gc_frozen_objects") for name in ("ft-a", "ft-b")}
    assert all(count > 300_000 for count in workers.values()), workers  # torch, vLLM and the model


def test_the_gateway_process_logs_one_line_per_request_and_none_per_probe(stack: ProcessStack) -> None:
    """The running gateway (`python -m gateway`) writes its summary line per API request and
    nothing per probe. uvicorn's own access log wrote a second, thinner line for each request and
    one for every probe a kubelet sends, which the summary deliberately leaves out."""
    log = stack.log_dir / "gateway.log"
    seen = len(log.read_text().splitlines())
    assert httpx.get(f"{stack.base_url}/livez", timeout=10).status_code == 200
    assert chat(stack, "ft-a", max_tokens=2).status_code == 200

    def written() -> list[str]:
        return log.read_text().splitlines()[seen:]

    stack.wait_for(lambda: any("gateway.requests" in line for line in written()), 10, "the summary line")
    time.sleep(0.5)  # anything else about the two requests would be written by now
    summaries = [line for line in written() if "gateway.requests" in line]
    assert len(summaries) == 1 and "POST /v1/chat/completions 200" in summaries[0], written()
    assert not [line for line in written() if "uvicorn.access" in line or "/livez" in line], written()
