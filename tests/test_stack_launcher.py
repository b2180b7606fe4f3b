"""scripts/stack.py's launcher and port picker: a child tied to its parent dies with it, starting
one never runs Python in a forked copy of the (multi-threaded) parent, and the ports picked for
services are ones no outgoing connection can take."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from scripts.ports import ephemeral_start, free_port
from scripts.stack import Service, Supervisor
from tests.harness import RedisServer

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


def test_a_service_the_supervisor_relaunched_drains_when_the_stack_stops(tmp_path: Path) -> None:
    """A tied child dies with the thread that started it: one the supervisor's thread relaunched was
    SIGKILLed as that thread ended, at the stack's stop, skipping its drain (a vLLM service left its
    /dev/shm handoff directory behind). It gets SIGTERM, as every other service does."""
    drained = tmp_path / "drained"
    (tmp_path / "drains.py").write_text(
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path(sys.argv[0]).with_name('drained').touch(), sys.exit(0)))\n"
        "time.sleep(120)\n"
    )
    service = Service("drains", "drains", {"PYTHONPATH": str(tmp_path)}, port=0, tied_to_parent=True)
    service.launch()
    first = service.process
    assert first is not None
    supervisor = Supervisor([service]).start()
    try:
        first.kill()  # a failure: relaunched after the first pause
        deadline = time.monotonic() + 20
        while service.process is first and time.monotonic() < deadline:
            time.sleep(0.1)
        relaunched = service.process
        assert relaunched is not first and relaunched is not None, "the supervisor did not relaunch the service"
        time.sleep(1)  # its SIGTERM handler installed
    finally:
        supervisor.stop()
        service.stop()
    assert relaunched.wait(timeout=30) == 0, "the relaunched service was killed, not drained"
    assert drained.exists()


def test_an_untied_launch_uses_plain_python_dash_m() -> None:
    service = Service("version", "platform", {}, port=0)
    service.launch()
    assert service.process is not None
    assert service.process.wait(timeout=30) == 0
    assert service.process.args[1:] == ["-m", "platform"]


def test_free_ports_never_come_from_the_ephemeral_range_outgoing_connections_use() -> None:
    """A port picked by binding port 0 is ephemeral: an outgoing connection could take it before
    the service binds it (the demo lost a service that way). Every pick, on the real kernel, is
    below the range and bindable on every address, and a port is handed out once."""
    start = ephemeral_start()
    picks = [free_port() for _ in range(200)]
    assert max(picks) < start and len(set(picks)) == len(picks)
    with socket.socket() as sock:
        sock.bind(("", picks[-1]))


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    found: list[int] = []
    for task in tasks.iterdir() if tasks.exists() else []:
        children = task / "children"
        if children.exists():
            found += [int(child) for child in children.read_text().split()]
    return found


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_during_start_up_stops_every_service_started(
    stop: signal.Signals, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Minutes pass before the stack is ready on a CPU; a person's Ctrl-C, or a supervisor's
    SIGTERM, in that time must stop the services too, not only the launcher. SIGINT is ignored
    in a process a non-interactive shell starts in the background: the launcher is started here
    with it ignored, as such a shell would."""
    launcher = subprocess.Popen(
        [sys.executable, "scripts/stack.py", "demo", "--tiny", "--redis-url", redis_server.url,
         "--checkpoints-dir", str(tmp_path / "checkpoints"), "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(services := _children(launcher.pid)) < 4:  # encoder, ft-a, ft-b, gateway
            assert launcher.poll() is None and time.monotonic() < deadline, "the stack never started its services"
            time.sleep(0.2)
        launcher.send_signal(stop)
        output, _ = launcher.communicate(timeout=90)
    finally:
        launcher.kill()
    assert "stack ready" not in output, "the stop came too late to test a stop during start-up"
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in services) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in services if _alive(pid)], f"services outlived their launcher:\n{output[-2000:]}"
