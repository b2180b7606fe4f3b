"""A real redis-server we own on a free loopback port, so a test or the fault drill can stop and
restart it (the same port each time)."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from scripts.ports import free_port


@dataclass
class RedisServer:
    """A real redis-server we own, so tests can stop and restart it."""

    workdir: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)
