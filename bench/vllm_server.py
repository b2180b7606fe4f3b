"""Plain vLLM OpenAI servers: the baselines users run today, started as vLLM documents them.

Every vLLM process the benchmark starts (these and our LLM services' engines) gets a 1 GiB KV
cache (VLLM_CPU_KVCACHE_SPACE) so several fit in RAM at once, and the encode-counting hook
(bench/vllm_hook) on its PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

from bench.procs import REPO, Service, ServiceFailed, ServiceGroup, http_ok, log_tail, python_module, wait_until

HOOK_DIR = REPO / "bench" / "vllm_hook"
KV_CACHE_GIB = "1"
MAX_MODEL_LEN = 2048
RENDER_TIMEOUT_S = "3600"


def vllm_env(encode_count_dir: Path) -> dict[str, str]:
    """Environment for any process that runs a vLLM engine."""
    encode_count_dir.mkdir(parents=True, exist_ok=True)
    pythonpath = os.pathsep.join(p for p in (str(HOOK_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
        # vLLM fails a request whose chat template has not rendered within 30 s. Under 96 requests
        # at once on 2 cores, renders queue behind the engine's own work for longer than that (the
        # EPD encoder of 2026-12-03 failed 41 of 96 so): a benchmark's peer must do the work, not
        # give up on it. Our services render on their own clock and have no such limit.
        "VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT": RENDER_TIMEOUT_S,
        "PYTHONPATH": pythonpath,
        "BENCH_ENCODE_COUNT_DIR": str(encode_count_dir),
    }


def all_cores() -> str:
    """VLLM_CPU_OMP_THREADS_BIND for every core this process may use. vLLM on CPU binds a worker's
    OpenMP threads to all cores but one, kept for its scheduler (on 2 cores: threads on core 0), so
    by default a vLLM running a vision tower would encode on one core where our encoder uses every
    core. Such an instance (EPD's encoder, scenario 4's tower) gets them all, as ours has; decoding
    instances keep the default, as our LLM services' engines do."""
    return ",".join(str(core) for core in sorted(os.sched_getaffinity(0)))


def encodes_counted(encode_count_dir: Path) -> int:
    """Images run through a vision tower by the processes that write to this directory."""
    total = 0
    for path in encode_count_dir.glob("*.count"):
        try:
            total += int(path.read_text() or 0)
        except (OSError, ValueError):
            continue
    return total


def start_vllm_server(
    group: ServiceGroup,
    name: str,
    served_name: str,
    checkpoint: Path,
    port: int,
    dtype: str,
    *,
    embeds_only: bool,
    weight_bytes: int,
    weights: str,
    python: str | None = None,
    eager: bool = False,
    cache_reset: bool = False,
    every_core: bool = False,
) -> Service:
    """`python -m vllm.entrypoints.openai.api_server` for one checkpoint, served as `served_name`;
    `name` names the service in logs and the memory table.

    embeds_only: accept inline `image_embeds` and skip the vision tower (images limited to 0,
    as our LLM service's engine does); otherwise a stock server that encodes `image_url` itself.
    eager: `--enforce-eager`, as our services get LLM_ENFORCE_EAGER (quick runs: no torch.compile).
    cache_reset: vLLM's development endpoints (VLLM_SERVER_DEV_MODE), for reset_prefix_cache().
    every_core: its worker's threads on every core (all_cores), not vLLM's default of all but one.
    """
    argv = [
        *python_module("vllm.entrypoints.openai.api_server", python),
        "--model", str(checkpoint), "--served-model-name", served_name, "--dtype", dtype,
        "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port),
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    if embeds_only:
        argv += ["--enable-mm-embeds", "--limit-mm-per-prompt", json.dumps({"image": 0, "video": 0})]
    if eager:
        argv.append("--enforce-eager")
    env = vllm_env(group.log_dir / f"{name}.encodes")
    if cache_reset:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if every_core:
        env["VLLM_CPU_OMP_THREADS_BIND"] = all_cores()
    return group.start(name, argv, env, weight_bytes, weights)


# What a vLLM API server logs when its engine died: the server itself stays up, answering /health
# with 503, so without this a dead engine would be waited on until the timeout.
ENGINE_DEAD = ("EngineDeadError", "Engine core initialization failed")


def wait_vllm_ready(service: Service, port: int, timeout_s: float) -> None:
    health = http_ok(f"http://127.0.0.1:{port}/health")

    def ready() -> bool:
        if any(marker in log_tail(service, 200) for marker in ENGINE_DEAD):
            raise ServiceFailed(f"{service.name}: its vLLM engine died while starting:\n{log_tail(service)}")
        return health()

    wait_until(service, ready, timeout_s)


def reset_prefix_cache(port: int) -> None:
    """Drops the server's cached KV blocks (prefix cache); its encoder cache keeps the images'
    vision-tower outputs. Needs a server started with cache_reset=True."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        if not json.loads(response.read()).get("success"):
            raise RuntimeError(f"vLLM on port {port} refused to reset its prefix cache")
