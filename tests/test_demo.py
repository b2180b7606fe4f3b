"""`make demo` as a test: real processes (encoder, two LLM services, gateway), the
official openai client, and the encoder's own count of images encoded."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.harness import RedisServer

REPO = Path(__file__).resolve().parent.parent


def test_demo_asks_six_questions_and_encodes_the_image_once(
    checkpoints: dict[str, Path], redis_server: RedisServer
) -> None:
    completed = subprocess.run(
        [
            sys.executable,
            "scripts/stack.py",
            "demo",
            "--redis-url",
            redis_server.url,
            "--checkpoints-dir",
            str(checkpoints["base"].parent),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    answers = re.findall(r"^\[(ft-a|ft-b)\] (.+?) -> (.+)$", completed.stdout, flags=re.M)
    assert len(answers) == 6 and {model for model, _, _ in answers} == {"ft-a", "ft-b"}
    assert "images encoded by the encoder: 1 (cache hits: 5)" in completed.stdout
