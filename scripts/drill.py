"""The fault drill: `python scripts/drill.py` (`make drill`).

The whole stack runs as processes (scripts/stack.py, both models on vLLM, as in production) with
its own Redis. Streaming clients (scripts/drill_client.py) send chat completions for the whole run
while faults land one after another:
  1. Redis restarts (data lost: images are encoded again);
  2. one LLM service is killed (-9) and relaunched by the launcher;
  3. Redis restarts again;
  4. the other LLM service's vLLM EngineCore is killed (-9), as the OOM killer would; the service
     notices, exits, and the launcher relaunches it;
and some clients hang up on purpose, before the response head or mid-stream. The report counts
every outcome (`lost` must be 0), the time from each fault's end to the first success after it,
and whether every service is healthy at the end with no manual restart. Loopback only; bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import httpx
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from model_builders.tiny import build_all  # noqa: E402
from scripts.drill_client import OUTCOMES, Tally, Workload, client_loop  # noqa: E402
from scripts.fanout import image_data_url  # noqa: E402
from scripts.redis_process import RedisServer  # noqa: E402
from scripts.stack import Ports, RunningStack, StackConfig, redis_answers, start  # noqa: E402

MODELS = ("ft-a", "ft-b")
# Tiny checkpoints on vLLM: a small KV cache and eager mode (a relaunch starts in seconds, not a minute).
STACK_ENV = {"LLM_ENGINE": "vllm", "LLM_KV_CACHE_GIB": "1", "LLM_MAX_MODEL_LEN": "2048",
             "LLM_ENFORCE_EAGER": "true", "LLM_GRACE_S": "5", "ENCODER_GRACE_S": "5"}  # fmt: skip
RECOVERY_CAP_S = 240.0  # longest the drill waits for a fault to heal, or for success after it


@dataclass
class FaultRecord:
    name: str
    began_s: float  # since the drill started
    ended_s: float | None = None  # when the fault was over (Redis answering, service SERVING again)
    first_success_after_s: float | None = None


@dataclass
class DrillReport:
    clients: int
    duration_s: float
    requests: int
    outcomes: dict[str, int]
    faults: list[FaultRecord]
    healthy_at_end: bool
    processes_alive_at_end: bool
    lost_samples: list[str] = field(default_factory=list)

    def table(self) -> str:
        lines = [f"clients {self.clients}, {self.duration_s:.0f} s, {self.requests} requests", "",
                 "| outcome | count |", "|---|---|"]  # fmt: skip
        lines += [f"| {name} | {self.outcomes.get(name, 0)} |" for name in OUTCOMES]
        lines += ["", "| fault | began (s) | ended (s) | end -> first success (s) |", "|---|---|---|---|"]
        for fault in self.faults:
            ended = f"{fault.ended_s:.1f}" if fault.ended_s is not None else "never"
            first = f"{fault.first_success_after_s:.2f}" if fault.first_success_after_s is not None else "none"
            lines.append(f"| {fault.name} | {fault.began_s:.1f} | {ended} | {first} |")
        lines += ["", f"healthy at the end (GET /health 200): {self.healthy_at_end}",
                  f"every process alive at the end: {self.processes_alive_at_end}"]  # fmt: skip
        lines += ["", "lost (first 20):", *(f"- {sample}" for sample in self.lost_samples)] if self.lost_samples else []
        return "\n".join(lines)


def serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def engine_core_pid(service_pid: int) -> int:
    """The pid of the vLLM EngineCore process under an LLM service (it renames itself)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        if parent == service_pid and b"EngineCore" in cmdline + stat.encode():
            return int(entry.name)
    raise RuntimeError(f"no EngineCore process under pid {service_pid}")


class Drill:
    def __init__(self, running: RunningStack, redis: RedisServer, clients: int, duration_s: float) -> None:
        self.running, self.redis = running, redis
        self.clients, self.duration_s = clients, duration_s
        self.tally = Tally()
        self.faults: list[tuple[FaultRecord, str | None, float]] = []  # record, model it hits, monotonic end
        self.started = time.monotonic()

    def _now(self) -> float:
        return time.monotonic() - self.started

    async def _wait_until(self, check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + RECOVERY_CAP_S
        while not await asyncio.to_thread(check):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not happen within {RECOVERY_CAP_S}s")
            await asyncio.sleep(0.1)

    async def _fault(
        self, name: str, model: str | None, inflict: Callable[[], None], healed: Callable[[], bool]
    ) -> None:
        record = FaultRecord(name, self._now())
        print(f"[{record.began_s:6.1f}s] fault: {name}", flush=True)
        await asyncio.to_thread(inflict)
        try:
            await self._wait_until(healed, f"recovery from {name}")
        except TimeoutError as error:
            print(f"  {error}", flush=True)
            self.faults.append((record, model, float("inf")))
            return
        record.ended_s = self._now()
        self.faults.append((record, model, time.monotonic()))
        print(f"[{record.ended_s:6.1f}s] over: {name}", flush=True)

    def _restart_redis(self) -> None:
        self.redis.stop()
        time.sleep(3.0)
        self.redis.start()

    def _relaunched(self, model: str) -> Callable[[], bool]:
        """A check that passes once the launcher has replaced the model's process (asked now, before
        the fault) and the new one reports SERVING. A health check alone could pass before the
        fault has even been noticed, or time out under load and look like one."""
        service = self.running.llms[model]
        before = service.process.pid  # type: ignore[union-attr]
        return lambda: service.process is not None and service.process.pid != before and serving(service.target)

    def _kill_service(self, model: str) -> None:
        os.kill(self.running.llms[model].process.pid, signal.SIGKILL)  # type: ignore[union-attr]

    def _kill_engine_core(self, model: str) -> None:
        # The service notices, reports NOT_SERVING, drains and exits 1; the launcher relaunches it.
        os.kill(engine_core_pid(self.running.llms[model].process.pid), signal.SIGKILL)  # type: ignore[union-attr]

    async def faults_in_turn(self) -> None:
        def redis_up() -> bool:
            return redis_answers(self.redis.url)

        plan = [
            (0.10, "Redis restart 1", None, self._restart_redis, redis_up),
            (0.30, "LLM service ft-b killed (-9)", "ft-b", lambda: self._kill_service("ft-b"), self._relaunched("ft-b")),
            (0.50, "Redis restart 2", None, self._restart_redis, redis_up),
            (0.65, "vLLM EngineCore of ft-a killed (-9)", "ft-a", lambda: self._kill_engine_core("ft-a"),
             self._relaunched("ft-a")),
        ]  # fmt: skip
        for at, name, model, inflict, healed in plan:
            await asyncio.sleep(max(0.0, at * self.duration_s - self._now()))
            await self._fault(name, model, inflict, healed)

    def _all_faults_followed_by_success(self) -> bool:
        return all(self.tally.first_success_after(end, model) is not None for _, model, end in self.faults)

    async def run(self) -> None:
        urls = tuple(image_data_url(_png(seed)) for seed in range(4))
        workload = Workload(self.running.base_url, MODELS, urls)
        stop = asyncio.Event()
        loops = [asyncio.create_task(client_loop(i, workload, self.tally, stop)) for i in range(self.clients)]
        await self.faults_in_turn()
        # Clients run for the whole duration, and on until each fault has been followed by a success.
        cap = time.monotonic() + RECOVERY_CAP_S
        while self._now() < self.duration_s or not self._all_faults_followed_by_success():
            if time.monotonic() > cap:
                break
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*loops)

    def report(self) -> DrillReport:
        for record, model, end in self.faults:
            record.first_success_after_s = self.tally.first_success_after(end, model)
        healthy = httpx.get(f"{self.running.base_url}/health", timeout=5).status_code == 200
        alive = all(s.process is not None and s.process.poll() is None for s in self.running.services.values())
        counts = dict(self.tally.counts)
        return DrillReport(self.clients, self._now(), sum(counts.values()), counts,
                           [record for record, _, _ in self.faults], healthy, alive, self.tally.lost_samples)  # fmt: skip


def _png(seed: int) -> bytes:
    """A random-noise PNG: each seed a different image (and key)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def run_drill(checkpoints: dict[str, Path], workdir: Path, clients: int, duration_s: float) -> DrillReport:
    """Starts the stack in `workdir`, runs the drill, stops everything, returns the report."""
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (workdir / "redis").mkdir(exist_ok=True)
    redis = RedisServer(workdir / "redis")
    redis.start()
    config = StackConfig(
        redis_url=redis.url, encoder_checkpoint=str(checkpoints["base"]),
        models={name: str(checkpoints[name]) for name in MODELS}, ports=Ports(metrics=0), start_timeout_s=300,
        env=STACK_ENV, log_dir=logs, tied_to_parent=True,
    )  # fmt: skip
    try:
        with ExitStack() as stack:
            drill = Drill(start(config, stack), redis, clients, duration_s)
            asyncio.run(drill.run())
            # Healthy "at the end": give a service relaunched late its start-up time, nothing more.
            deadline = time.monotonic() + RECOVERY_CAP_S
            while httpx.get(f"{drill.running.base_url}/health", timeout=5).status_code != 200:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            return drill.report()
    finally:
        if redis.process is not None:
            redis.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--checkpoints-dir", type=Path, default=REPO / "checkpoints")
    parser.add_argument("--json", type=Path, help="also write the report here as JSON")
    parser.add_argument("--logs", type=Path, help="keep each service's log here (default: dropped with the run)")
    args = parser.parse_args()
    checkpoints = build_all(args.checkpoints_dir)
    with tempfile.TemporaryDirectory(prefix="drill-") as workdir:
        report = run_drill(checkpoints, Path(workdir), args.clients, args.duration_s)
        if args.logs:
            shutil.copytree(Path(workdir) / "logs", args.logs, dirs_exist_ok=True)
    print(report.table())
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    lost = report.outcomes.get("lost", 0)
    sys.exit(0 if lost == 0 and report.healthy_at_end and report.processes_alive_at_end else 1)


if __name__ == "__main__":
    main()
