"""One encoder service as a real process (`python -m encoder_service`) with settings of a test's
own, for tests that watch the process itself (its memory) or stop and start it under a client."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scripts.ports import free_port

REPO = Path(__file__).resolve().parent.parent


class EncoderProcess:
    """`python -m encoder_service` on a free port; `env` adds ENCODER_* settings."""

    def __init__(
        self, checkpoint: Path, redis_url: str, log_path: Path, tls_root_certs: bytes | None = None, **env: str
    ) -> None:
        self.port = free_port()
        self.tls_root_certs = tls_root_certs  # set when env has it serve TLS: health is asked over TLS
        self.log_path = log_path
        self.env = {
            **os.environ,
            "ENCODER_CHECKPOINT": str(checkpoint),
            "ENCODER_REDIS_URL": redis_url,
            "ENCODER_HOST": "127.0.0.1",
            "ENCODER_PORT": str(self.port),
            "ENCODER_METRICS_PORT": "0",
            "ENCODER_WARMUP_PIXELS": "0",
            "ENCODER_JSON_LOGS": "false",
            **env,
        }
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180) -> None:
        """Starts the process and waits for SERVING. A process that exits while starting is
        started again on another port (another process may have taken the free port meanwhile)."""
        for _ in range(3):
            with self.log_path.open("ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "encoder_service"], cwd=REPO, env=self.env, stdout=log, stderr=log
                )
            deadline = time.monotonic() + timeout_s
            while self.process.poll() is None and time.monotonic() < deadline:
                if self.health() == "SERVING":
                    return
                time.sleep(0.2)
            if self.process.poll() is None:  # neither serving nor gone: a real failure
                break
            self.port = free_port()
            self.env["ENCODER_PORT"] = str(self.port)
        self.kill()
        raise RuntimeError(f"encoder did not start:\n{self.log_path.read_text()[-3000:]}")

    def health(self) -> str:
        if self.tls_root_certs is None:
            channel = grpc.insecure_channel(self.target)
        else:
            channel = grpc.secure_channel(self.target, grpc.ssl_channel_credentials(self.tls_root_certs))
        with channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.RpcError as error:
                return error.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def status_kib(self, field: str) -> int:
        """A `VmHWM` / `VmRSS` line of /proc/<pid>/status, in KiB."""
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
        raise KeyError(field)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


@contextmanager
def running_encoder(checkpoint: Path, redis_url: str, log_path: Path) -> Iterator[EncoderProcess]:
    """An encoder process with default settings, started for the block and killed after it."""
    process = EncoderProcess(checkpoint, redis_url, log_path)
    process.start()
    try:
        yield process
    finally:
        process.kill()
