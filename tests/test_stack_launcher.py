"""scripts/stack.py's launcher: a child tied to its parent dies with it, and starting one never
runs Python in a forked copy of the (multi-threaded) parent."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# Starts processes of its own (see the tiers in tests/conftest.py).
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of an exited parent is reaped by init; until then it is a zombie.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_tied_child_runs_its_module_and_dies_with_its_parent(tmp_path: Path) -> None:
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(120)\n")
    parent = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from scripts.stack import Service
        service = Service("sleeper", "sleeper", {{"PYTHONPATH": {str(tmp_path)!r}}}, port=0, tied_to_parent=True)
        service.launch()
        time.sleep(2)
        print(service.process.pid, service.process.poll(), flush=True)
        """
    )
    run = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    child, status = run.stdout.split()
    assert status == "None", "the child should have been running its module when the parent ended"
    child = int(child)
    deadline = time.monotonic() + 20
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the tied child outlived its parent"


def test_an_untied_launch_uses_plain_python_dash_m() -> None:
    from scripts.stack import Service

    service = Service("version", "platform", {}, port=0)
    service.launch()
    assert service.process is not None
    assert service.process.wait(timeout=30) == 0
    assert service.process.args[1:] == ["-m", "platform"]
