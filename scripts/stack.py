"""Runs the whole stack as processes: `python scripts/stack.py serve|demo`.

serve: encoder, one LLM service per model, gateway; left running until Ctrl-C.
demo:  the same on free ports, a few shapes images asked of each model through the openai
       client (scripts/demo.py), a table of the answers, then stop.
Checkpoints come from flags (a local dir or a hub id); without flags, the trained shapes family
(models/shapes: color, count, shape); `--tiny` builds the random test checkpoints under
./checkpoints instead (answers are gibberish). Services log to files under run/logs/. A Redis
is started when none answers on --redis-url (a loopback URL) and stopped at exit.

`start()` is the one way to launch the stack as processes; the process tests
(tests/process_stack.py) use it too, and signal or restart its services.

The launcher supervises like Kubernetes: a service that exits on its own with a failure (killed,
crashed, or an LLM service whose engine died) is started again on the same ports after a short,
growing pause. One that exits 0 (it drained after SIGTERM: someone meant to stop it) stays down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from model_builders.shapes import trained_family  # noqa: E402
from model_builders.tiny import build_all  # noqa: E402
from scripts.demo import format_table, run_demo  # noqa: E402
from scripts.fanout import demo_image, run_fanout  # noqa: E402
from scripts.ports import free_port  # noqa: E402

RUN_DIR = REPO / "run"


def redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def ensure_redis(url: str, stack: ExitStack) -> None:
    if redis_answers(url):
        return
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost") or shutil.which("redis-server") is None:
        raise SystemExit(f"Redis does not answer at {url} and cannot be started here")
    print(f"starting redis-server on port {parts.port or 6379}", flush=True)
    process = subprocess.Popen(
        ["redis-server", "--port", str(parts.port or 6379), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    stack.callback(_stop, process)
    deadline = time.monotonic() + 10
    while not redis_answers(url):
        if time.monotonic() > deadline:
            raise SystemExit("redis-server did not start")
        time.sleep(0.1)


def _stop(process: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# Starts `python -m <module>` after asking Linux to SIGKILL this process when the thread that
# started it ends (shared/process_tree.py). It runs after exec, in the child's own interpreter: a
# preexec_fn would run in the forked copy of a multi-threaded parent (gRPC, torch and vLLM threads
# in a test run), where dlopen or any lock another thread held at fork time can deadlock the child
# before it execs. argv: module, the launcher's pid.
_TIED_TO_PARENT_BOOT = (
    "import runpy, sys; "
    "from shared.process_tree import die_with_parent; "
    "module, parent = sys.argv.pop(1), int(sys.argv.pop(1)); "
    "die_with_parent(parent); "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)"
)
# Pause before relaunching a service that failed: doubled after each failure that came soon after
# its launch, back to the first value once it has run for a while.
RELAUNCH_PAUSE_S = (1.0, 16.0)
RAN_FOR_A_WHILE_S = 60.0


@dataclass
class Service:
    """One process of the stack, and what it takes to start it again on the same ports."""

    name: str
    module: str
    env: dict[str, str]
    port: int
    metrics_port: int = 0  # 0: no /metrics of its own (the gateway serves it on `port`)
    log_path: Path | None = None  # None: output goes to this terminal
    tied_to_parent: bool = False
    process: subprocess.Popen[bytes] | None = None
    # Up: launched and not stopped on purpose since, so a failed exit is relaunched (Supervisor).
    up: bool = False
    launched_at: float = 0.0
    # Held while a process is started or stopped, so a relaunch and a test's restart never overlap.
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def launch(self) -> subprocess.Popen[bytes]:
        with self.lock:
            log = open(self.log_path, "ab") if self.log_path else None  # the child keeps its own copy
            try:
                command = (
                    [sys.executable, "-c", _TIED_TO_PARENT_BOOT, self.module, str(os.getpid())]
                    if self.tied_to_parent
                    else [sys.executable, "-m", self.module]
                )
                self.process = subprocess.Popen(
                    command, env={**os.environ, **self.env}, cwd=REPO, stdout=log,
                    stderr=subprocess.STDOUT if log else None,
                )  # fmt: skip
            finally:
                if log:
                    log.close()
            self.up, self.launched_at = True, time.monotonic()
            return self.process

    def stop(self, timeout_s: float = 20) -> None:
        """SIGTERM (the service drains), SIGKILL after `timeout_s`; not relaunched."""
        with self.lock:
            self.up = False
            process = self.process
        if process is not None:
            _stop(process, timeout_s)

    def kill(self) -> None:
        """SIGKILL, no drain; not relaunched."""
        with self.lock:
            self.up = False
            if self.process is not None and self.process.poll() is None:
                self.process.kill()
                self.process.wait()

    def restart(self) -> None:
        """Kills the process if it runs, and launches it again on the same ports."""
        with self.lock:
            self.kill()
            self.launch()

    def failed(self) -> int | None:
        """The exit code when the service should run but its process exited with a failure."""
        with self.lock:
            code = self.process.poll() if self.up and self.process is not None else None
            return code if code else None


class Supervisor:
    """Relaunches services that fail, as Kubernetes restarts a container: after a pause that
    grows while relaunches keep failing. It runs on its own thread, which lives until `stop`:
    a child tied to its parent dies with the thread that started it (shared/process_tree.py)."""

    def __init__(self, services: list[Service]) -> None:
        self._services = services
        self._pause_s = {service.name: RELAUNCH_PAUSE_S[0] for service in services}
        self._due: dict[str, float] = {}
        self._relaunched: list[subprocess.Popen[bytes]] = []  # started by this thread, so tied to it
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        """No more relaunches; returns once the services this thread relaunched have drained (each
        stop is bounded: SIGKILL after its timeout)."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping.wait(0.2):
            for service in self._services:
                self._check(service)
        # A process tied to its parent dies with the thread that started it: one relaunched here
        # would be SIGKILLed as this thread ends, skipping its drain and its clean-up at exit (a
        # vLLM service's /dev/shm handoff directory was left behind). It is stopped as the stack
        # stops every service, first.
        for service in self._services:
            if service.tied_to_parent and service.process in self._relaunched:
                service.stop()

    def _check(self, service: Service) -> None:
        code = service.failed()
        if code is None:
            self._due.pop(service.name, None)
            return
        now = time.monotonic()
        if service.name not in self._due:
            if now - service.launched_at > RAN_FOR_A_WHILE_S:
                self._pause_s[service.name] = RELAUNCH_PAUSE_S[0]
            pause = self._pause_s[service.name]
            print(f"{service.name} exited with code {code}; relaunching in {pause:.0f}s", file=sys.stderr, flush=True)
            self._due[service.name] = now + pause
            self._pause_s[service.name] = min(pause * 2, RELAUNCH_PAUSE_S[1])
            return
        if now >= self._due[service.name]:
            with service.lock:
                if service.failed() is not None and not self._stopping.is_set():  # nobody relaunched it meanwhile
                    self._relaunched.append(service.launch())
            del self._due[service.name]


@dataclass(frozen=True)
class Ports:
    """Where the stack listens; 0 picks a free port. LLM services take `llm`, `llm`+1, ...
    `metrics`: the encoder's /metrics port, LLM services follow; 0 picks free ones, None turns them off."""

    encoder: int = 0
    llm: int = 0
    gateway: int = 0
    metrics: int | None = None

    def metrics_port(self, index: int) -> int:
        if self.metrics is None:
            return 0
        return self.metrics + index if self.metrics else free_port()


@dataclass(frozen=True)
class StackConfig:
    redis_url: str
    encoder_checkpoint: str
    models: dict[str, str]  # model name -> checkpoint
    ports: Ports = Ports()
    start_timeout_s: float = 300
    env: dict[str, str] = field(default_factory=dict)  # more settings, for every service (each reads its prefix)
    log_dir: Path | None = None  # each service's output to <log_dir>/<name>.log
    tied_to_parent: bool = False  # children die with this process, so a killed test run leaks none
    progress: bool = False  # print a line every 10 s while waiting for the stack (a person watches)


@dataclass
class RunningStack:
    base_url: str
    encoder: Service
    llms: dict[str, Service]  # by model name
    gateway: Service
    supervisor: Supervisor

    @property
    def services(self) -> dict[str, Service]:
        return {"encoder": self.encoder, **self.llms, "gateway": self.gateway}


def launch(name: str, module: str, env: dict[str, str], port: int, metrics_port: int, config: StackConfig,
           stack: ExitStack) -> Service:  # fmt: skip
    log_path = config.log_dir / f"{name}.log" if config.log_dir else None
    service = Service(name, module, {**env, **config.env}, port, metrics_port, log_path, config.tied_to_parent)
    service.launch()
    stack.callback(service.stop)
    return service


def wait_healthy(base_url: str, timeout_s: float, progress: bool = False) -> None:
    """Until the gateway's /health says every backend serves; with `progress`, a line every 30 s
    saying how many serve (a person watches it: vLLM engines take minutes to start on a CPU)."""
    started = time.monotonic()
    next_report = started + 30
    serving = "the gateway is not answering yet"
    while time.monotonic() < started + timeout_s:
        try:
            response = httpx.get(f"{base_url}/health", timeout=2)
            if response.status_code == 200:
                return
            backends = response.json().get("backends", {})
            serving = f"{sum(map(bool, backends.values()))} of {len(backends)} services serving"
        except (httpx.HTTPError, ValueError):
            pass
        if progress and time.monotonic() >= next_report:
            print(f"  still starting ({time.monotonic() - started:.0f} s): {serving}", flush=True)
            next_report += 30
        time.sleep(0.5)
    raise SystemExit(f"stack not healthy after {timeout_s}s")


def start(config: StackConfig, stack: ExitStack) -> RunningStack:
    """Starts Redis if needed, the encoder, one LLM service per model and the gateway, supervised;
    waits until the gateway reports every backend SERVING. Every process is stopped when `stack`
    closes."""
    ensure_redis(config.redis_url, stack)
    ports = config.ports
    common = {"ENCODER_REDIS_URL": config.redis_url, "LLM_REDIS_URL": config.redis_url, "ENCODER_JSON_LOGS": "false",
              "LLM_JSON_LOGS": "false", "GATEWAY_JSON_LOGS": "false"}  # fmt: skip
    encoder_port, metrics_port = ports.encoder or free_port(), ports.metrics_port(0)
    encoder_env = {"ENCODER_CHECKPOINT": config.encoder_checkpoint, "ENCODER_PORT": str(encoder_port),
                   "ENCODER_METRICS_PORT": str(metrics_port)}  # fmt: skip
    encoder = launch("encoder", "encoder_service", {**common, **encoder_env}, encoder_port, metrics_port, config, stack)
    llms = {}
    for index, (name, checkpoint) in enumerate(config.models.items()):
        port, metrics_port = ports.llm + index if ports.llm else free_port(), ports.metrics_port(1 + index)
        llm_env = {"LLM_CHECKPOINT": checkpoint, "LLM_MODEL_NAME": name, "LLM_PORT": str(port),
                   "LLM_METRICS_PORT": str(metrics_port)}  # fmt: skip
        llms[name] = launch(name, "llm_service", {**common, **llm_env}, port, metrics_port, config, stack)
    gateway_port = ports.gateway or free_port()
    gateway_env = {"GATEWAY_PORT": str(gateway_port), "GATEWAY_ENCODER_TARGET": encoder.target,
                   "GATEWAY_MODELS": json.dumps({name: [llm.target] for name, llm in llms.items()})}  # fmt: skip
    # The gateway gets only its own settings, as it always has (its logs stay JSON).
    gateway = launch("gateway", "gateway", gateway_env, gateway_port, 0, config, stack)
    # Registered last, so it stops first: nothing is relaunched while the stack stops.
    supervisor = Supervisor([encoder, *llms.values(), gateway]).start()
    stack.callback(supervisor.stop)
    base_url = f"http://127.0.0.1:{gateway_port}"
    wait_healthy(base_url, config.start_timeout_s, config.progress)
    return RunningStack(base_url, encoder, llms, gateway, supervisor)


def _interrupt(number: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(number).name)


def stop_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt from here on, so a stop during the minutes of
    start-up unwinds it too, stopping (draining) every service started so far. Before, SIGTERM
    killed the launcher at once and its services ran on, and SIGINT was ignored where the shell
    that started the launcher in the background ignored it. Handled, not blocked: relaunched
    children would inherit a blocked mask and could not be stopped by SIGTERM any more."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)


def wait_for_stop_signal() -> None:
    """Returns on SIGINT or SIGTERM (stop_on_signals)."""
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            time.sleep(3600)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["serve", "demo"])
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--encoder-checkpoint", default=os.environ.get("ENCODER_CHECKPOINT", ""))
    parser.add_argument("--models", default=os.environ.get("MODELS", ""), help="name=checkpoint,name=checkpoint")
    parser.add_argument("--tiny", action="store_true", help="the random tiny checkpoints instead of the trained family")
    parser.add_argument("--checkpoints-dir", type=Path, default=REPO / "checkpoints", help="where --tiny builds")
    parser.add_argument("--log-dir", type=Path, default=RUN_DIR / "logs", help="one <service>.log each")
    parser.add_argument("--images-dir", type=Path, default=RUN_DIR / "demo-images", help="demo: images saved here")
    parser.add_argument("--start-timeout-s", type=float, default=300)
    args = parser.parse_args()
    args.env = {}
    if not args.encoder_checkpoint or not args.models:
        # Tiny models need a tiny vLLM KV cache: its default takes most of the machine's RAM.
        args.env = {"LLM_KV_CACHE_GIB": "1", "LLM_MAX_MODEL_LEN": "2048"}
        if args.tiny:
            built = build_all(args.checkpoints_dir)
            default_models = f"ft-a={built['ft-a']},ft-b={built['ft-b']}"
        else:
            built = trained_family()
            default_models = ",".join(f"{name}={built[name]}" for name in ("color", "count", "shape"))
        args.encoder_checkpoint = args.encoder_checkpoint or str(built["base"])
        args.models = args.models or default_models
    args.models = dict(item.split("=", 1) for item in args.models.split(","))
    return args


def main() -> None:
    stop_on_signals()
    args = parse_args()
    if args.command == "serve":
        ports = Ports(encoder=50051, llm=50061, gateway=int(os.environ.get("GATEWAY_PORT", "8000")), metrics=9090)
    else:
        ports = Ports()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    config = StackConfig(args.redis_url, args.encoder_checkpoint, args.models, ports, args.start_timeout_s, args.env,
                         log_dir=args.log_dir, progress=True)  # fmt: skip
    models = list(args.models)
    print(f"starting the encoder, {len(models)} LLM services ({', '.join(models)}) and the gateway", flush=True)
    print(f"service logs: {args.log_dir}/<service>.log", flush=True)
    with contextlib.suppress(KeyboardInterrupt), ExitStack() as stack:  # a stop before ready: services stopped
        started = time.monotonic()
        running = start(config, stack)
        print(f"stack ready in {time.monotonic() - started:.0f} s", flush=True)
        if args.command == "serve":
            print(f"serving: {running.base_url}/v1 (models: {', '.join(models)}); Ctrl-C stops", flush=True)
            wait_for_stop_signal()
            running.supervisor.stop()
        elif set(models) <= {"color", "count", "shape"}:
            report = run_demo(running.base_url, running.encoder.target, models, args.images_dir)
            print(format_table(report, models))
            print(f"images saved in {args.images_dir}")
            print(
                f"images encoded by the encoder: {report.images_encoded} (cache hits: {report.cache_hits})", flush=True
            )
        else:  # other checkpoints: generic questions about one drawn picture
            fanout = run_fanout(running.base_url, running.encoder.target, demo_image(), models)
            for answer in fanout.answers:
                print(f"[{answer.model}] {answer.question} -> {answer.text!r}")
            print(
                f"images encoded by the encoder: {fanout.images_encoded} (cache hits: {fanout.cache_hits})", flush=True
            )


if __name__ == "__main__":
    main()
