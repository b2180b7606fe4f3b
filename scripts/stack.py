"""Runs the whole stack as processes: `python scripts/stack.py serve|demo`.

serve: encoder, one LLM service per model, gateway; left running until Ctrl-C.
demo:  the same on free ports, the fan-out scenario through the openai client, then stop.
Checkpoints come from flags (a local dir or a hub id); without flags, the tiny
test checkpoints are built under ./checkpoints. A Redis is started when none
answers on --redis-url (a loopback URL) and stopped at exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.fanout import demo_image, run_fanout  # noqa: E402
from shared.checkpoints import build_all  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def launch(module: str, env: dict[str, str], stack: ExitStack) -> None:
    process = subprocess.Popen([sys.executable, "-m", module], env={**os.environ, **env}, cwd=REPO)
    stack.callback(_stop, process)


def wait_healthy(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"stack not healthy after {timeout_s}s")


def start(args: argparse.Namespace, stack: ExitStack, ports: dict[str, int]) -> str:
    ensure_redis(args.redis_url, stack)
    common = {"ENCODER_REDIS_URL": args.redis_url, "LLM_REDIS_URL": args.redis_url, "ENCODER_JSON_LOGS": "false",
              "LLM_JSON_LOGS": "false", "GATEWAY_JSON_LOGS": "false"}
    encoder_env = {"ENCODER_CHECKPOINT": args.encoder_checkpoint, "ENCODER_PORT": str(ports["encoder"]),
                   "ENCODER_METRICS_PORT": str(ports["metrics"])}
    launch("encoder_service", {**common, **encoder_env}, stack)
    routes = {}
    for index, (name, checkpoint) in enumerate(args.models.items()):
        port = ports["llm"] + index if ports["llm"] else free_port()
        metrics_port = ports["metrics"] + 1 + index if ports["metrics"] else 0
        llm_env = {"LLM_CHECKPOINT": checkpoint, "LLM_MODEL_NAME": name, "LLM_PORT": str(port), "LLM_METRICS_PORT": str(metrics_port)}
        launch("llm_service", {**common, **llm_env}, stack)
        routes[name] = [f"127.0.0.1:{port}"]
    gateway_env = {"GATEWAY_PORT": str(ports["gateway"]), "GATEWAY_ENCODER_TARGET": f"127.0.0.1:{ports['encoder']}",
                   "GATEWAY_MODELS": json.dumps(routes)}
    launch("gateway", gateway_env, stack)
    base_url = f"http://127.0.0.1:{ports['gateway']}"
    wait_healthy(base_url, args.start_timeout_s)
    return base_url


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["serve", "demo"])
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--encoder-checkpoint", default=os.environ.get("ENCODER_CHECKPOINT", ""))
    parser.add_argument("--models", default=os.environ.get("MODELS", ""), help="name=checkpoint,name=checkpoint")
    parser.add_argument("--checkpoints-dir", type=Path, default=REPO / "checkpoints")
    parser.add_argument("--start-timeout-s", type=float, default=300)
    args = parser.parse_args()
    if not args.encoder_checkpoint or not args.models:
        built = build_all(args.checkpoints_dir)
        args.encoder_checkpoint = args.encoder_checkpoint or str(built["base"])
        args.models = args.models or f"ft-a={built['ft-a']},ft-b={built['ft-b']}"
    args.models = dict(item.split("=", 1) for item in args.models.split(","))
    return args


def main() -> None:
    args = parse_args()
    with ExitStack() as stack:
        if args.command == "serve":
            ports = {"encoder": 50051, "llm": 50061, "gateway": int(os.environ.get("GATEWAY_PORT", "8000")), "metrics": 9090}
            base_url = start(args, stack, ports)
            print(f"serving: {base_url}/v1 (models: {', '.join(args.models)}); Ctrl-C stops", flush=True)
            # Blocked only now, so the children did not inherit the mask.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
            return
        ports = {"encoder": free_port(), "llm": 0, "gateway": free_port(), "metrics": 0}
        base_url = start(args, stack, ports)
        report = run_fanout(base_url, f"127.0.0.1:{ports['encoder']}", demo_image(), list(args.models))
        for answer in report.answers:
            print(f"[{answer.model}] {answer.question} -> {answer.text!r}")
        print(f"images encoded by the encoder: {report.images_encoded} (cache hits: {report.cache_hits})", flush=True)


if __name__ == "__main__":
    main()
