"""A benchmark target is judged only when every compared system did the work: the full run of
2026-12-03 reported "wall ours / EPD 0.565x, met" while EPD had failed 41 of its 96 requests."""

from __future__ import annotations

from pathlib import Path

from bench.outcome import ScenarioResult, Target
from bench.report import _scenario_markdown
from bench.vllm_server import vllm_env

COLUMNS = ["requests", "errors", "wall s"]


def _result(peer_errors: int) -> ScenarioResult:
    rows = {"peer": {"requests": 96, "errors": peer_errors, "wall s": 80.0},
            "ours": {"requests": 96, "errors": 0, "wall s": 45.0}}  # fmt: skip
    return ScenarioResult("5", "fan-out", COLUMNS, rows, targets=[Target("wall ours / peer", 0.5625, "<=", 1.0, "x")])


def test_a_target_against_a_system_that_failed_requests_is_not_judged() -> None:
    result = _result(peer_errors=41)
    (target,) = result.to_json()["targets"]
    assert target["met"] is False and target["verdict"] == "not judged: peer failed 41 requests"
    assert "| **not judged: peer failed 41 requests** |" in "\n".join(_scenario_markdown(result))


def test_a_target_is_judged_when_every_system_did_the_work() -> None:
    result = _result(peer_errors=0)
    (target,) = result.to_json()["targets"]
    assert target["met"] is True and target["verdict"] == "met"
    assert "| met |" in "\n".join(_scenario_markdown(result))


def test_every_benchmark_vllm_waits_for_its_chat_template_past_vllms_30_s(tmp_path: Path) -> None:
    """vLLM's default VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT (30 s) failed those 41 requests."""
    assert float(vllm_env(tmp_path)["VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT"]) >= 600
