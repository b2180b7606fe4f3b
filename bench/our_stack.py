"""Our system as processes, the way scripts/stack.py runs it: encoder (optional), one LLM service
per fine-tune, gateway; each with its weights recorded for the memory table."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.procs import Service, ServiceGroup, grpc_serving, http_ok, python_module, wait_until
from bench.vllm_server import KV_CACHE_GIB, MAX_MODEL_LEN, vllm_env
from bench.weights import count_weights
from scripts.ports import free_port


@dataclass(frozen=True)
class StackOptions:
    redis_url: str
    engine: str  # LLM_ENGINE: "vllm" or "transformers"
    dtype: str  # dtype of the vision tower and the language models
    eager: bool = False  # vLLM without torch.compile (LLM_ENFORCE_EAGER; --quick), baselines alike
    start_timeout_s: float = 900


@dataclass
class OurStack:
    base_url: str  # gateway, http://127.0.0.1:<port>
    encoder_target: str | None  # host:port, None when started without an encoder
    encode_count_dir: Path  # where the LLM services' vLLM engines would count vision-tower runs
    metrics_urls: list[str]  # the gateway's and each LLM service's /metrics


def start_our_stack(
    group: ServiceGroup, options: StackOptions, models: dict[str, Path], encoder_checkpoint: Path | None
) -> OurStack:
    """Starts everything, waits until each part is ready; services belong to `group`."""
    count_dir = group.log_dir / "ours.encodes"
    waits: list[tuple[Service, Callable[[], bool]]] = []
    encoder_target = None
    if encoder_checkpoint is not None:
        port = free_port()
        encoder_target = f"127.0.0.1:{port}"
        env = {"ENCODER_CHECKPOINT": str(encoder_checkpoint), "ENCODER_PORT": str(port), "ENCODER_DTYPE": options.dtype,
               "ENCODER_REDIS_URL": options.redis_url, "ENCODER_LOG_LEVEL": "INFO", "ENCODER_METRICS_PORT": "0"}  # fmt: skip
        weights = count_weights(encoder_checkpoint).vision_bytes(options.dtype)
        service = group.start(
            "ours-encoder", python_module("encoder_service"), env, weights, f"vision tower, {options.dtype}"
        )
        waits.append((service, grpc_serving(encoder_target)))
    routes = {}
    metrics_urls = []
    for name, checkpoint in models.items():
        port, metrics_port = free_port(), free_port()
        metrics_urls.append(f"http://127.0.0.1:{metrics_port}/metrics")
        routes[name] = [f"127.0.0.1:{port}"]
        env = {
            "LLM_CHECKPOINT": str(checkpoint), "LLM_MODEL_NAME": name, "LLM_PORT": str(port),
            "LLM_ENGINE": options.engine, "LLM_DTYPE": options.dtype, "LLM_REDIS_URL": options.redis_url,
            # The same context and KV cache as the plain vLLM servers they are compared with.
            "LLM_MAX_MODEL_LEN": str(MAX_MODEL_LEN), "LLM_KV_CACHE_GIB": KV_CACHE_GIB,
            "LLM_ENFORCE_EAGER": str(options.eager).lower(), "LLM_LOG_LEVEL": "WARNING", "LLM_METRICS_PORT": str(metrics_port),
            **vllm_env(count_dir),
        }  # fmt: skip
        weights = count_weights(checkpoint).language_bytes(options.dtype)
        service = group.start(
            f"ours-llm-{name}", python_module("llm_service"), env, weights, f"language model, {options.dtype}"
        )
        waits.append((service, grpc_serving(routes[name][0])))
    gateway_port = free_port()
    env = {"GATEWAY_PORT": str(gateway_port), "GATEWAY_HOST": "127.0.0.1", "GATEWAY_MODELS": json.dumps(routes),
           "GATEWAY_ENCODER_TARGET": encoder_target or "127.0.0.1:9", "GATEWAY_LOG_LEVEL": "WARNING"}  # fmt: skip
    base_url = f"http://127.0.0.1:{gateway_port}"
    # /v1/models, not /health: /health also asks the encoder, which scenario 2 runs without.
    waits.append((group.start("ours-gateway", python_module("gateway"), env), http_ok(f"{base_url}/v1/models")))
    for service, ready in waits:
        wait_until(service, ready, options.start_timeout_s)
    return OurStack(base_url, encoder_target, count_dir, [f"{base_url}/metrics", *metrics_urls])
