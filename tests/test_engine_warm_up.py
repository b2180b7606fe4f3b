"""An LLM service compiles what vLLM compiles on first use before it reports SERVING
(llm_service/warm_up.py), against real processes: one vLLM service on a compile cache that starts
empty, as on a new pod.

Before, the first request asking for logprobs compiled vLLM's sampler rank kernel (and the
first batch of two compiled it again) while its client waited: seconds on CPU. With the test
stack's 6 s STALL_S the progress watch took that for a hung engine and restarted the service
(tests/test_lifecycle.py failed so, now and then, on a fresh machine)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shared.sdk import LLMClient, Message, Sampling
from tests.process_stack import VLLM_ENV, ProcessStack, process_stack

STALL_S = 3.0


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inductor-cache")


@pytest.fixture(scope="module")
def stack(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, fresh_cache: Path
) -> Iterator[ProcessStack]:
    env = {**VLLM_ENV, "LLM_STALL_S": str(STALL_S), "TORCHINDUCTOR_CACHE_DIR": str(fresh_cache)}
    with process_stack(checkpoints, tmp_path_factory.mktemp("warm-up"), env=env, models=("ft-a",)) as running:
        yield running


def _files(directory: Path) -> set[Path]:
    return {path for path in directory.rglob("*") if path.is_file()}


def test_the_first_logprobs_requests_compile_nothing_and_are_no_hung_engine(
    stack: ProcessStack, fresh_cache: Path
) -> None:
    compiled_at_start = _files(fresh_cache)
    assert compiled_at_start, "nothing was compiled before the service reported SERVING"
    service = stack.service("ft-a")
    process = service.process
    sampling = Sampling(max_tokens=8, temperature=1.0, seed=1, logprobs=True, top_logprobs=20)
    with LLMClient(service.target, timeout_s=60) as client:

        def ask(question: str) -> int:
            return len(list(client.generate("ft-a", [Message("user", [question])], sampling)))

        assert ask("alone") > 0
        with ThreadPoolExecutor(2) as pool:  # a batch of two: torch marks the batch size dynamic
            assert all(count > 0 for count in pool.map(ask, ["one of two", "two of two"]))
    assert service.process is process and process is not None and process.poll() is None
    assert stack.grpc_health("ft-a") == "SERVING"
    assert _files(fresh_cache) == compiled_at_start, "the first users' requests compiled code while they waited"
