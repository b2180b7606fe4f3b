"""`make demo` as a test: real processes (encoder, the three trained fine-tunes, gateway), the
official openai client, and the encoder's own count of images encoded. Its terminal output is for
a person: progress, then the table; the services' logs go to files."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.harness import RedisServer

REPO = Path(__file__).resolve().parent.parent


def test_demo_shows_each_images_answers_and_encodes_each_image_once(redis_server: RedisServer, tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            sys.executable,
            "scripts/stack.py",
            "demo",
            "--redis-url",
            redis_server.url,
            "--log-dir",
            str(tmp_path / "logs"),
            "--images-dir",
            str(tmp_path / "images"),
            # Three vLLM engines start at once on the test machine's two cores.
            "--start-timeout-s",
            "450",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=580,  # under pytest's 600 s, so a hang reports its output
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    rows = re.findall(
        r"^(\d\d-\S+\.png)\s+(\d) (red|green|blue|yellow) (circle|square|triangle)s?\s+(.+)$", out, flags=re.M
    )
    assert len(rows) == 6, out
    for name, *_, answers in rows:
        assert (tmp_path / "images" / name).is_file()
        assert len(answers.split()) >= 3  # one answer per model (a wrong one is marked, not dropped)
    assert "images encoded by the encoder: 6 (cache hits: 12)" in out
    # The logs went to files, not to the person's terminal.
    assert {p.name for p in (tmp_path / "logs").glob("*.log")} >= {"encoder.log", "color.log", "gateway.log"}
    assert len(out.splitlines()) < 60 and "INFO" not in out, out
