"""Logs as data: the gateway's JSON lines carry the request id as a field, one summary line per
request says what it asked and what it cost (model, keys, tokens in/out, TTFT, total, status),
and vLLM's own loggers, in the LLM service and in the engine processes vLLM spawns, write the
same JSON lines as the service."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.summary import RequestSummary, log_summary
from shared.logging_setup import JsonFormatter, configure_logging
from tests.harness import RedisServer, Stack, free_port
from tests.images import data_url, png_bytes

REPO = Path(__file__).resolve().parent.parent
# A line in vLLM's own logging format: "(EngineCore pid=12) INFO 12-02 02:09:15 [core.py:93] ...".
VLLM_TEXT_LINE = re.compile(r"^(\(\S+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d ")


def _parsed(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@contextmanager
def gateway_lines(*awaited: str) -> Iterator[list[dict[str, Any]]]:
    """The JSON lines the gateway's loggers write meanwhile, as the service's handler writes them.
    The gateway writes a request's summary after the response has gone out, so the client can
    return first: on exit this waits (up to 10 s) for the summary of each request id in `awaited`."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("gateway"))
    logger = logging.getLogger("gateway")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    lines: list[dict[str, Any]] = []
    try:
        yield lines
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(summaries(_parsed(stream), rid) for rid in awaited):
            time.sleep(0.02)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        lines.extend(_parsed(stream))


def summaries(lines: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    return [line for line in lines if line["logger"] == "gateway.requests" and line.get("request_id") == request_id]


def test_a_chat_writes_one_summary_line_and_every_line_names_the_request(stack: Stack) -> None:
    image = data_url(png_bytes(8101))
    key = httpx.post(f"{stack.base_url}/v1/images/encode", json={"image_url": image}, timeout=60).json()["key"]
    body = {
        "model": "ft-b", "max_tokens": 3, "temperature": 0, "not_an_openai_field": 1,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "hi"}]}],
    }  # fmt: skip
    with gateway_lines("logs-chat-1") as lines:
        response = httpx.post(
            f"{stack.base_url}/v1/chat/completions", json=body, headers={"x-request-id": "logs-chat-1"}, timeout=120
        )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    ignoring = [line for line in lines if line["message"].startswith("ignoring unknown fields")]
    assert [line["request_id"] for line in ignoring] == ["logs-chat-1"]
    assert "logs-chat-1" not in ignoring[0]["message"]  # a field now, not part of the text
    (summary,) = summaries(lines, "logs-chat-1")
    assert {name: summary[name] for name in ("method", "route", "status", "model", "keys")} == {
        "method": "POST", "route": "/v1/chat/completions", "status": 200, "model": "ft-b", "keys": [key],
    }  # fmt: skip
    assert (summary["tokens_in"], summary["tokens_out"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert summary["ttft_s"] is None  # not streamed: its client sees no first token


def test_a_streamed_chat_and_a_failed_one_are_summarised_once_each(stack: Stack) -> None:
    body = {"model": "ft-a", "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip
    with gateway_lines("logs-stream-1", "logs-404") as lines:
        with httpx.stream(
            "POST", f"{stack.base_url}/v1/chat/completions", json=body, headers={"x-request-id": "logs-stream-1"},
            timeout=120,
        ) as response:  # fmt: skip
            events = [line for line in response.iter_lines() if line.startswith("data: {")]
        unknown = {**body, "model": "no-such-model", "stream": False, "stream_options": None}
        missing = httpx.post(
            f"{stack.base_url}/v1/chat/completions", json=unknown, headers={"x-request-id": "logs-404"}, timeout=60
        )
    assert missing.status_code == 404
    usage = json.loads(events[-1].removeprefix("data: "))["usage"]
    (streamed,) = summaries(lines, "logs-stream-1")
    assert (streamed["status"], streamed["model"], streamed["keys"]) == (200, "ft-a", [])
    assert streamed["tokens_out"] == usage["completion_tokens"] > 0
    assert 0 < streamed["ttft_s"] <= streamed["total_s"]
    (failed,) = summaries(lines, "logs-404")
    assert (failed["status"], failed["model"], failed["tokens_out"], failed["ttft_s"]) == (
        404,
        "no-such-model",
        0,
        None,
    )
    assert failed["error"].startswith("model_not_found: model 'no-such-model' does not exist"), failed
    assert streamed["error"] is None
    assert f"error={failed['error']}" in failed["message"]


def test_a_full_store_is_named_in_the_summary_and_in_redis_own_words(stack: Stack, live_redis: RedisServer) -> None:
    """Redis at its memory limit refuses writes: the client gets a 503, and the logs say why
    (before, no line anywhere said more than the status)."""
    store_lines = io.StringIO()
    handler = logging.StreamHandler(store_lines)
    logging.getLogger("shared.store").addHandler(handler)
    client = live_redis.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)  # any write is over it
    try:
        with gateway_lines("logs-full-store") as lines:
            response = httpx.post(
                f"{stack.base_url}/v1/images/encode", json={"image_url": data_url(png_bytes(8133))},
                headers={"x-request-id": "logs-full-store"}, timeout=60,
            )  # fmt: skip
    finally:
        client.config_set("maxmemory", 0)
        logging.getLogger("shared.store").removeHandler(handler)
    assert response.status_code == 503, response.text
    (summary,) = summaries(lines, "logs-full-store")
    assert summary["error"] == "unavailable: embedding store (Redis) is unavailable: OutOfMemoryError", summary
    assert (
        "Redis SET failed: OutOfMemoryError: command not allowed when used memory > 'maxmemory'"
        in store_lines.getvalue()
    )


def test_the_summary_reads_as_text_too() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("gateway.requests")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        summary = RequestSummary(started=time.perf_counter() - 0.5, model="ft-a", keys=["emb:v1:x:y"])
        summary.note_first_token()
        summary.note_usage(12, 7)
        log_summary(summary, "POST", "/v1/chat/completions", 200)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    text = stream.getvalue()
    assert text.startswith("POST /v1/chat/completions 200 model=ft-a keys=1 tokens=12/7 ttft=0.5"), text


def test_configured_logging_writes_json_lines_with_the_lines_own_fields(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("gateway", "INFO", True)
        logging.getLogger("gateway.anything").info("from gateway", extra={"fields": {"tokens_in": 3, "level": "nope"}})
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
    # Services of the session stack may log meanwhile, from their threads: only this line counts.
    (line,) = [json.loads(text) for text in capsys.readouterr().err.splitlines() if "gateway.anything" in text]
    assert (line["service"], line["message"], line["tokens_in"]) == ("gateway", "from gateway", 3)
    assert line["level"] == "INFO"  # a line's own fields never replace the standard ones


@pytest.mark.integration
def test_vllm_loggers_write_the_services_json_in_every_engine_process(
    checkpoints: dict[str, Path], redis_server: RedisServer, tmp_path: Path
) -> None:
    pytest.importorskip("vllm")
    env = {
        **os.environ, "LLM_ENGINE": "vllm", "LLM_CHECKPOINT": str(checkpoints["ft-a"]), "LLM_MODEL_NAME": "ft-a",
        "LLM_PORT": str(free_port()), "LLM_METRICS_PORT": "0", "LLM_REDIS_URL": redis_server.url,
        "LLM_KV_CACHE_GIB": "1", "LLM_MAX_MODEL_LEN": "2048", "LLM_ENFORCE_EAGER": "true", "LLM_JSON_LOGS": "true",
    }  # fmt: skip
    log_path = tmp_path / "llm.log"
    with log_path.open("wb") as log:
        service = subprocess.Popen([sys.executable, "-m", "llm_service"], cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 240
        while "ready on port" not in log_path.read_text(errors="replace"):
            assert service.poll() is None and time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(timeout=60)
    lines = log_path.read_text(errors="replace").splitlines()
    # What is not JSON is not a logger's: print()s, warnings, C++ and progress-bar output.
    assert not [line for line in lines if VLLM_TEXT_LINE.match(line)], "vLLM's own text format is back"
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert {record["service"] for record in records} == {"llm"}
    loggers = {record["logger"] for record in records}
    # The service's process (vllm.config), EngineCore and its worker, both spawned by vLLM.
    assert {"vllm.config.model", "vllm.v1.engine.core"} <= loggers, sorted(loggers)
    assert any(name.startswith("vllm.v1.worker.") for name in loggers), sorted(loggers)
