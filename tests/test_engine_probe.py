"""The hung-engine watch beyond requests (llm_service/server.py, shared/progress_watch.py): a probe
of the engine every LLM_ENGINE_PROBE_S catches an engine frozen while the service is idle, and
without LLM_STALL_S the stall limit is sized from a prefill timed at start-up.

Against real processes: one LLM service on vLLM (the tiny checkpoints, tests/process_stack.py's
VLLM_ENV) per test, started as `python -m llm_service`; the engine process is found as a child of
the service by pid and signalled by pid only. And the transformers engine's probe, on its own."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from llm_service.engines.base import EngineRequest, SamplingParams
from llm_service.engines.factory import vllm_available
from llm_service.engines.handoff import OWNER_LOCK, PREFIX
from llm_service.engines.transformers_engine import TransformersEngine
from shared.sdk import LLMClient, Message, Sampling
from tests.harness import RedisServer, free_port
from tests.metrics_text import metric_sum, scrape
from tests.process_stack import VLLM_ENV, ProcessStack
from tests.test_lifecycle import NOT_SERVING, SERVING, HealthWatch, alive

REPO = Path(__file__).resolve().parent.parent
STALL_S = 3.0
PROBE_S = 0.5
needs_vllm = pytest.mark.skipif(not vllm_available(), reason="the service's engine runs in vLLM's processes")


@dataclass
class Service:
    process: subprocess.Popen[bytes]
    target: str
    metrics_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, condition: Callable[[], object], timeout_s: float, what: str) -> None:
        started = time.monotonic()
        while not condition():
            assert time.monotonic() - started < timeout_s, f"{what} not within {timeout_s}s\n{self.log()[-2000:]}"
            time.sleep(0.05)


@contextmanager
def llm_service(checkpoint: Path, redis: RedisServer, log_path: Path, **env: str) -> Iterator[Service]:
    """An LLM service on vLLM as its own process, SERVING; killed at exit if still running."""
    port, metrics_port = free_port(), free_port()
    environment = {
        **os.environ, **VLLM_ENV, "LLM_CHECKPOINT": str(checkpoint), "LLM_MODEL_NAME": "ft-a",
        "LLM_HOST": "127.0.0.1", "LLM_PORT": str(port), "LLM_METRICS_PORT": str(metrics_port),
        "LLM_REDIS_URL": redis.url, "LLM_JSON_LOGS": "true", **env,
    }  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "llm_service"], cwd=REPO, env=environment, stdout=log, stderr=log
        )
    service = Service(process, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", log_path)
    handoff: list[Path] = []
    try:
        deadline = time.monotonic() + 240
        while "ready on port" not in service.log():
            assert process.poll() is None and time.monotonic() < deadline, service.log()[-3000:]
            time.sleep(0.5)
        handoff = handoff_directories(process.pid)
        yield service
    finally:
        if process.poll() is None:
            process.kill()  # its engine processes die with it (shared/process_tree.py)
        process.wait(timeout=30)
        for directory in handoff:  # a service that exits on a hung engine may leave its own behind
            shutil.rmtree(directory, ignore_errors=True)


def handoff_directories(pid: int) -> list[Path]:
    """The handed-off embeddings' directories (llm_service/engines/handoff.py) the process holds open."""
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = Path(os.readlink(fd))
        except OSError:  # closed meanwhile
            continue
        if target.name == OWNER_LOCK and target.parent.name.startswith(PREFIX):
            found.append(target.parent)
    return found


def engine_process(service: Service, title: str) -> int:
    """The pid of the vLLM process called `title`: EngineCore, a child of the service, or its Worker."""
    core = [pid for pid, command in ProcessStack.children_of(service.process.pid).items() if "EngineCore" in command]
    assert len(core) == 1, ProcessStack.children_of(service.process.pid)
    if title == "EngineCore":
        return core[0]
    workers = [pid for pid, command in ProcessStack.children_of(core[0]).items() if "Worker" in command]
    assert len(workers) == 1, ProcessStack.children_of(core[0])
    return workers[0]


@needs_vllm
@pytest.mark.parametrize("title", ["EngineCore", "Worker"])
def test_an_engine_process_frozen_while_the_service_is_idle_turns_it_not_serving_and_it_exits(
    title: str, checkpoints: dict[str, Path], redis_server: RedisServer, tmp_path: Path
) -> None:
    """Before the probe the watch owed nothing while no request was in the engine: a frozen idle
    engine left health SERVING for good, and the next request waited out the whole limit. The
    Worker's case is why the probe goes on to the workers: vLLM's EngineCore, asked alone
    (`is_sleeping`), answers while its worker is frozen."""
    env = {"LLM_STALL_S": str(STALL_S), "LLM_ENGINE_PROBE_S": str(PROBE_S)}
    with llm_service(checkpoints["ft-a"], redis_server, tmp_path / "llm.log", **env) as service:
        frozen = engine_process(service, title)
        watch = HealthWatch(service.target)
        try:
            service.wait_for(lambda: watch.first(SERVING) is not None, 10, "SERVING on the watch")
            # Probed every PROBE_S, a stream and then idleness, 2 x STALL_S in all, are no hung engine.
            with LLMClient(service.target, timeout_s=60) as client:
                started = time.monotonic()
                chunks = list(client.generate("ft-a", [Message("user", ["talk"])], Sampling(max_tokens=1500)))
                time.sleep(max(0.0, 2 * STALL_S - (time.monotonic() - started)))
            assert chunks[-1].finish_reason is not None
            assert watch.first(NOT_SERVING) is None and service.process.poll() is None
            os.kill(frozen, signal.SIGSTOP)
            frozen_at = time.monotonic()
            service.wait_for(
                lambda: watch.first(NOT_SERVING) is not None, STALL_S + 10, f"NOT_SERVING after {title} froze"
            )
            not_serving_after = watch.first(NOT_SERVING) - frozen_at  # type: ignore[operator]
            print(
                f"NOT_SERVING {not_serving_after:.1f}s after {title} froze (limit {STALL_S}s, probe every {PROBE_S}s)"
            )
            assert not_serving_after > STALL_S - PROBE_S, "an engine frozen for less than the limit is no hung engine"
            assert service.process.wait(timeout=30) == 1, "a service whose engine hangs must exit 1, to be restarted"
            assert "the engine made no progress" in service.log()
        finally:
            watch.close()
            if alive(frozen):
                os.kill(frozen, signal.SIGKILL)


@needs_vllm
def test_without_llm_stall_s_the_limit_is_sized_from_a_prefill_timed_at_start_up(
    checkpoints: dict[str, Path], redis_server: RedisServer, tmp_path: Path
) -> None:
    """Before, the limit was 600 s on every machine, whatever its steps took."""
    with llm_service(checkpoints["ft-a"], redis_server, tmp_path / "llm.log") as service:
        exported = metric_sum(scrape(service.metrics_url), "llm_stall_limit_seconds")
        lines = [json.loads(line) for line in service.log().splitlines() if line.startswith("{")]
    (sized,) = [line for line in lines if "stall_limit_s" in line]
    print(sized["message"])
    limit, per_token_s, tokens = sized["stall_limit_s"], sized["prefill_s_per_token"], sized["longest_step_tokens"]
    # The documented rule (README, shared/progress_watch.stall_limit): 10 times the longest step, at least 60 s.
    assert exported == limit >= 60
    assert limit == pytest.approx(max(60, 10 * per_token_s * tokens))
    assert 0 < per_token_s < 1 and tokens >= 256, sized  # vLLM's token budget of one step, on the tiny model


def test_the_transformers_engines_probe_waits_for_a_hung_generation_and_not_for_its_reader(
    checkpoints: dict[str, Path],
) -> None:
    """In-process, the transformers engine answers its probe from its generation thread's next
    token: at once while it generates nothing, never while a generation hangs on its device (a
    stand-in here: a forward pass held on an event), and without waiting for a generation whose
    client reads nothing (its tokens still come)."""
    engine = TransformersEngine.load(str(checkpoints["ft-b"]))
    held, passes = threading.Event(), 0
    forward = engine.model.forward

    def hanging_forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal passes
        passes += 1
        if passes == 3:  # the third token's pass hangs until released
            held.wait()
        return forward(*args, **kwargs)

    engine.model.forward = hanging_forward  # type: ignore[method-assign]

    async def check() -> None:
        await asyncio.wait_for(engine.probe(), 1)  # idle
        prompt = engine.tokenizer.encode("Tell me a long story.")
        request = EngineRequest("hangs", prompt, sampling=SamplingParams(max_tokens=50))
        stream = engine.generate(request)
        await anext(stream)  # a token out; then nobody reads for a while
        for _ in range(500):
            if passes >= 3:
                break
            await asyncio.sleep(0.01)
        assert passes >= 3, "the generation ended before its third token"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(engine.probe(), 1)  # the generation hangs: no answer
        probing = asyncio.ensure_future(engine.probe())
        held.set()
        await asyncio.wait_for(probing, 5)  # its next token answers, unread
        await stream.aclose()

    try:
        asyncio.run(check())
    finally:
        held.set()
        engine.close()
