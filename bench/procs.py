"""Service processes for the benchmarks: start with a log file, wait until ready, read the peak
resident memory of the whole process tree, stop.

Peak memory is VmHWM from /proc/<pid>/status, read just before SIGTERM: after exit it is gone.
vLLM serves from three processes (API server, engine core, worker), so a service's peak is the
sum over its tree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.outcome import MemoryRecord

REPO = Path(__file__).resolve().parent.parent


class ServiceFailed(RuntimeError):
    pass


@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    weight_bytes: int
    weights: str  # what the weight bytes are, e.g. "vision tower, bfloat16"


def start_service(
    name: str, argv: list[str], env: dict[str, str], log_dir: Path, weight_bytes: int = 0, weights: str = "none"
) -> Service:
    """Starts argv (a list; `-m module` for ours) from the repository root, output to log_dir/name.log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, env={**os.environ, **env}, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return Service(name, process, log_path, weight_bytes, weights)


def python_module(module: str, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", module]


def log_tail(service: Service, lines: int = 30) -> str:
    try:
        return "\n".join(service.log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_until(service: Service, ready: Callable[[], bool], timeout_s: float) -> None:
    """Polls `ready` until it is true; fails early, with the log's tail, if the process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if service.process.poll() is not None:
            raise ServiceFailed(f"{service.name} exited with {service.process.returncode}:\n{log_tail(service)}")
        if ready():
            return
        time.sleep(0.5)
    raise ServiceFailed(f"{service.name} not ready after {timeout_s:.0f}s:\n{log_tail(service)}")


def http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    return check


def grpc_serving(target: str) -> Callable[[], bool]:
    def check() -> bool:
        with grpc.insecure_channel(target) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    return check


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc/<pid>/task/*/children)."""
    pids, pending = [], [pid]
    while pending:
        current = pending.pop()
        pids.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                pending.extend(int(child) for child in (task / "children").read_text().split())
            except OSError:
                continue
    return pids


def peak_rss_bytes(pid: int) -> int:
    """VmHWM of one process, in bytes; 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def memory_of(service: Service) -> MemoryRecord:
    pids = process_tree(service.process.pid)
    return MemoryRecord(
        service.name, sum(peak_rss_bytes(p) for p in pids), service.weight_bytes, service.weights, len(pids)
    )


def stop_all(services: list[Service], timeout_s: float = 30) -> None:
    """SIGTERM to every service at once (each vLLM takes seconds to shut down), then SIGKILL for
    any service, or child of one, still there after timeout_s: vLLM's engine processes must not
    keep gigabytes after the benchmark moves on."""
    running = [(s, process_tree(s.process.pid)[1:]) for s in services if s.process.poll() is None]
    for service, _ in running:
        service.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for service, children in running:
        try:
            service.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            service.process.kill()
            service.process.wait()
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue


@dataclass
class ServiceGroup:
    """Services of one system under test; closing records each one's memory, then stops them all."""

    log_dir: Path
    services: list[Service] = field(default_factory=list)
    memory: list[MemoryRecord] = field(default_factory=list)

    def start(
        self, name: str, argv: list[str], env: dict[str, str], weight_bytes: int = 0, weights: str = "none"
    ) -> Service:
        service = start_service(name, argv, env, self.log_dir, weight_bytes, weights)
        self.services.append(service)
        return service

    def close(self) -> list[MemoryRecord]:
        self.memory = [memory_of(s) for s in self.services if s.process.poll() is None]
        stop_all(self.services)
        return self.memory

    def __enter__(self) -> ServiceGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
