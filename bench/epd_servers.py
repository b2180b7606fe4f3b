"""vLLM's own encoder disaggregation (EPD), started as vLLM documents it: one encoder-only
instance of the base checkpoint (`ec_role: ec_producer`) serving every fine-tune's name, and one
vLLM per fine-tune (`ec_role: ec_consumer`), all on one ECExampleConnector directory.

The producer-only role turns on vLLM's encoder-only mode (language-model weights not loaded,
prefix cache off); the consumer role turns on mm-embeds, so metadata-only image parts are
accepted. Each item's encoder output is one `<dir>/<uuid>/encoder_cache.safetensors` file,
written by the producer and read by consumers. Every process gets the benchmark's vLLM
environment (1 GiB KV cache, the encode-counting hook), as the other baselines do.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from bench.epd_proxy import EpdRoutes
from bench.procs import Service, ServiceGroup, python_module
from bench.vllm_server import MAX_MODEL_LEN, all_cores, vllm_env, wait_vllm_ready
from bench.weights import count_weights
from scripts.ports import free_port

ENCODER = "epd-encoder"
CACHE_FILE = "encoder_cache.safetensors"
# Start-up only. A compiled vLLM runs its vision tower at start on the largest batch of items it may
# get (memory profiling), and an EC producer once more per modality to measure the encoder's output
# width, by default on a video of the whole context (8,192 patches): with the 2B-shaped tower (bf16), four
# single-threaded instances on two cores had not finished after seven minutes. Every instance skips
# the profiling (`--skip-mm-profiling`, vLLM's documented shortcut: a CPU engine takes its memory
# from VLLM_CPU_KVCACHE_SPACE anyway), and the producer is told what the workload sends, one image
# per request and no video, so it measures the width on one image: a 448x448 one, the workload's
# size, so that is the encoder instance's warm-up, as our encoder encodes one such image before it
# serves.
START_UP = ["--skip-mm-profiling"]
PRODUCER_LIMITS = ["--limit-mm-per-prompt", json.dumps({"image": 1, "video": 0})]


@dataclass
class EpdDeployment:
    routes: EpdRoutes
    storage: Path  # the connector's shared_storage_path
    services: dict[str, tuple[Service, int]]  # service name -> (service, port)
    count_dirs: dict[str, Path]  # service name -> where its vision-tower runs are counted


def consumer_name(model: str) -> str:
    return f"epd-decode-{model}"


def ec_transfer_config(role: str, storage: Path) -> str:
    return json.dumps({
        "ec_connector": "ECExampleConnector",
        "ec_role": role,
        "ec_connector_extra_config": {"shared_storage_path": str(storage)},
    })  # fmt: skip


def stored_items(storage: Path) -> int:
    """Encoder outputs on disk. Files, not folders: a consumer's lookup creates the folder even on a miss."""
    return sum(1 for _ in storage.glob(f"*/{CACHE_FILE}"))


def clear_storage(storage: Path) -> None:
    """The connector never deletes a file; a run starts from an empty directory."""
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)


def _start(
    group: ServiceGroup, name: str, checkpoint: Path, served: list[str], role: str, storage: Path, dtype: str,
    eager: bool, weight_bytes: int, weights: str,
) -> tuple[Service, int]:  # fmt: skip
    port = free_port()
    argv = [
        *python_module("vllm.entrypoints.openai.api_server"),
        "--model", str(checkpoint), "--served-model-name", *served, "--dtype", dtype,
        "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port),
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
        "--ec-transfer-config", ec_transfer_config(role, storage),
        *START_UP, *(PRODUCER_LIMITS if role == "ec_producer" else []),
    ]  # fmt: skip
    if eager:
        argv.append("--enforce-eager")
    env = vllm_env(group.log_dir / f"{name}.encodes")
    if role == "ec_producer":
        env["VLLM_CPU_OMP_THREADS_BIND"] = all_cores()
    return group.start(name, argv, env, weight_bytes, weights), port


def start_epd(
    group: ServiceGroup,
    base: Path,
    finetunes: dict[str, Path],
    storage: Path,
    dtype: str,
    *,
    eager: bool,
    start_timeout_s: float,
) -> EpdDeployment:
    """Starts the encoder instance and one consumer per fine-tune on an emptied `storage`; waits for all."""
    clear_storage(storage)
    vision = count_weights(base).vision_bytes(dtype)
    # One instance at a time, each ready before the next starts. Started together, the four loading
    # and compiling the 2B-shaped float32 checkpoints at once sit near this host's 23.5 GiB (a
    # consumer's engine died while starting in one run), and on two cores starting them together
    # saves no time anyway.
    services = {ENCODER: _start(group, ENCODER, base, ["base", *finetunes], "ec_producer", storage, dtype, eager,
                                vision, f"vision tower (encoder-only mode), {dtype}")}  # fmt: skip
    wait_vllm_ready(*services[ENCODER], start_timeout_s)
    for model, checkpoint in finetunes.items():
        name = consumer_name(model)
        weights = count_weights(checkpoint).total_bytes(dtype)
        services[name] = _start(group, name, checkpoint, [model], "ec_consumer", storage, dtype, eager,
                                weights, f"vision tower + language model, {dtype}")  # fmt: skip
        wait_vllm_ready(*services[name], start_timeout_s)
    url = "http://127.0.0.1:{}/v1/chat/completions".format
    routes = EpdRoutes(url(services[ENCODER][1]), {m: url(services[consumer_name(m)][1]) for m in finetunes})
    count_dirs = {name: group.log_dir / f"{name}.encodes" for name in services}
    return EpdDeployment(routes, storage, services, count_dirs)
