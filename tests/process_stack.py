"""The whole stack as real processes, for fault and load tests: our own redis-server (stopped and
restarted on the same port), the encoder, one LLM service per model and the gateway, launched by
`scripts/stack.py`'s `start()` on free ports, each with its own /metrics port and log file.
Tests signal, kill and restart single services; everything is killed when the context ends.
The launcher relaunches a service that fails on its own (scripts/stack.py, Supervisor); `restart`
and the teardown go through the same Service methods, under its lock, so the two never fight."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scripts.stack import Ports, RunningStack, Service, StackConfig, start, wait_healthy
from tests.harness import RedisServer
from tests.metrics_text import GENERATE_LABELS, metric_sum, scrape

GENERATE = GENERATE_LABELS["grpc_method"]
# Settings every process-stack test wants: the reference engine, plain-text logs, and a drain long
# enough that a SIGTERM test sees a stream finish before the grace period ends.
TEST_ENV = {"LLM_ENGINE": "transformers", "GATEWAY_JSON_LOGS": "false", "LLM_GRACE_S": "60"}
# The LLM services on vLLM, as in production, sized for the tiny checkpoints: a small KV cache, and
# eager mode so that a (re)launch starts in seconds.
VLLM_ENV = {"LLM_ENGINE": "vllm", "LLM_KV_CACHE_GIB": "1", "LLM_MAX_MODEL_LEN": "2048", "LLM_ENFORCE_EAGER": "true"}


@dataclass
class ProcessStack:
    running: RunningStack
    redis: RedisServer
    log_dir: Path
    # The process each service had when a test last signalled it: the launcher may have replaced
    # it by a relaunch since, and `wait_exit` is about the one signalled.
    signalled: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return self.running.base_url

    def service(self, name: str) -> Service:
        """The service called "encoder", "gateway" or a model name."""
        return self.running.services[name]

    def pid(self, name: str) -> int:
        process = self.service(name).process
        assert process is not None
        return process.pid

    def pids(self) -> dict[str, int]:
        return {name: self.pid(name) for name in self.running.services}

    def alive(self, name: str) -> bool:
        process = self.service(name).process
        return process is not None and process.poll() is None

    def send(self, name: str, sig: signal.Signals) -> None:
        process = self.service(name).process
        assert process is not None
        self.signalled[name] = process
        os.kill(process.pid, sig)

    def wait_exit(self, name: str, timeout_s: float) -> int:
        """The exit code of the process last signalled (else the current one)."""
        process = self.signalled.get(name) or self.service(name).process
        assert process is not None
        return process.wait(timeout=timeout_s)

    def restart(self, name: str, timeout_s: float = 180) -> None:
        """Starts the service again on its ports (killing it first if it still runs, even when the
        launcher has just relaunched it); waits until the gateway reports every backend SERVING."""
        self.service(name).restart()
        self.wait_healthy(timeout_s)

    def ensure_running(self) -> None:
        """Brings back whatever an earlier test stopped, and waits for any relaunch to be SERVING."""
        if self.redis.process is None:
            self.redis.start()
        for name in self.running.services:
            if not self.alive(name):
                self.restart(name)
        self.wait_healthy()

    def children(self, name: str) -> dict[int, str]:
        """The service's child processes now: pid -> command line ("VLLM::EngineCore": vLLM
        retitles its processes)."""
        return self.children_of(self.pid(name))

    @staticmethod
    def children_of(pid: int) -> dict[int, str]:
        """pid -> command line of each child process of `pid` now."""
        found = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                parent = int(stat.read_text().rpartition(")")[2].split()[1])
                command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone meanwhile
                continue
            if parent == pid:
                found[int(stat.parent.name)] = command
        return found

    def engine_core_pid(self, name: str) -> int:
        """The pid of the vLLM EngineCore under an LLM service on the vllm engine."""
        cores = [pid for pid, command in self.children(name).items() if "EngineCore" in command]
        assert len(cores) == 1, f"{name} has no single EngineCore child: {self.children(name)}"
        return cores[0]

    def wait_healthy(self, timeout_s: float = 180) -> None:
        try:
            wait_healthy(self.base_url, timeout_s)
        except SystemExit as unhealthy:
            raise AssertionError(f"{unhealthy}\n{self.log_tails()}") from None

    def grpc_health(self, name: str, health_service: str = "") -> str:
        """SERVING / NOT_SERVING as the service itself reports it (readiness; "liveness" for the
        liveness probes' service), or the RPC error's code name."""
        with grpc.insecure_channel(self.service(name).target) as channel:
            request = health_pb2.HealthCheckRequest(service=health_service)
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=2)
            except grpc.RpcError as error:
                return error.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def metrics_url(self, name: str) -> str:
        service = self.service(name)
        port = service.metrics_port or service.port  # the gateway serves /metrics on its HTTP port
        return f"http://127.0.0.1:{port}/metrics"

    def metric(self, name: str, sample: str, **labels: str) -> float:
        """Sum of the samples called `sample` whose labels include `labels`, from the service's /metrics."""
        return metric_sum(scrape(self.metrics_url(name)), sample, **labels)

    def rss_bytes(self, name: str) -> int:
        """Resident memory of the service process now (VmRSS)."""
        for line in Path(f"/proc/{self.pid(name)}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no VmRSS for {name}")

    def cpu_seconds(self, name: str) -> float:
        """CPU time the service process has used so far (user + system)."""
        fields = Path(f"/proc/{self.pid(name)}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.service(name).log_path
        text = path.read_text(errors="replace") if path and path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def log_tails(self, lines: int = 15) -> str:
        return log_tails(self.log_dir, lines)

    def wait_for(self, condition: Callable[[], object], timeout_s: float, what: str) -> float:
        """Seconds until `condition()` held; fails after `timeout_s`, naming `what`, with the logs' tails."""
        started = time.monotonic()
        while not condition():
            assert time.monotonic() - started < timeout_s, f"{what} not within {timeout_s}s\n{self.log_tails()}"
            time.sleep(0.05)
        return time.monotonic() - started


def log_tails(log_dir: Path, lines: int = 15) -> str:
    """The last lines of every service's log, for failure messages."""
    return "\n".join(
        f"--- {path.stem} ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        for path in sorted(log_dir.glob("*.log"))
    )


@contextmanager
def process_stack(
    checkpoints: dict[str, Path],
    workdir: Path,
    env: dict[str, str] | None = None,
    models: tuple[str, ...] = ("ft-a", "ft-b"),
) -> Iterator[ProcessStack]:
    """Redis, the encoder (on checkpoints["base"]), one LLM service per name in `models` and the
    gateway as processes; all killed at exit."""
    (workdir / "redis").mkdir(parents=True, exist_ok=True)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    redis_server = RedisServer(workdir / "redis")
    redis_server.start()
    config = StackConfig(
        redis_url=redis_server.url,
        encoder_checkpoint=str(checkpoints["base"]),
        models={name: str(checkpoints[name]) for name in models},
        ports=Ports(metrics=0),
        start_timeout_s=240,
        env={**TEST_ENV, **(env or {})},
        log_dir=logs,
        tied_to_parent=True,
    )
    try:
        with ExitStack() as stack:
            try:
                running = start(config, stack)
            except SystemExit as error:  # start() speaks to a terminal; a test wants the logs
                raise RuntimeError(f"{error}\n{log_tails(logs)}") from None
            processes = ProcessStack(running, redis_server, logs)
            try:
                yield processes
            finally:  # no drain at teardown: kill, so a stuck test cannot hold the run
                running.supervisor.stop()
                for service in running.services.values():
                    service.kill()
    finally:
        if redis_server.process is not None:
            redis_server.stop()
