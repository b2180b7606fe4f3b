"""The fault drill (scripts/drill.py), shortened: streaming clients through two Redis restarts, a
killed LLM service and a killed vLLM EngineCore, with clients hanging up at random. Nothing may be
lost, every fault must be followed by a success, and the stack must be healthy at the end with no
manual restart. `make drill` runs the full 64 clients x 60 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_service.engines.factory import vllm_available
from scripts.drill import run_drill

pytestmark = pytest.mark.skipif(not vllm_available(), reason="the drill kills a vLLM EngineCore")


def test_fault_drill_loses_nothing_and_heals(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    report = run_drill(checkpoints, tmp_path, clients=16, duration_s=40)
    print(report.table())
    assert report.outcomes.get("lost", 0) == 0, report.lost_samples
    assert report.outcomes.get("completed", 0) > 0
    assert report.outcomes.get("client_4xx", 0) == 0
    assert len(report.faults) == 4
    for fault in report.faults:
        assert fault.ended_s is not None, f"{fault.name} never healed"
        assert fault.first_success_after_s is not None, f"no success after {fault.name}"
    assert report.healthy_at_end and report.processes_alive_at_end
