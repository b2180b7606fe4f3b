"""`python -m bench.gpu`: the GPU measurements (bench/gpu/run.sh prepares the environment and runs
this; see bench/gpu/README.md). Parts run in this order, each written out as soon as it ends, and
a part that fails or would overrun --budget-s is recorded as such while the others go on:
golden check (tiny checkpoints) -> benchmark checkpoint built -> plain loop, then our encoder's
tower in-process on the same pixels (its bit-equality checks too) -> blob round trip (on the loop's
output) -> encoder service. `--device cpu --quick` rehearses all of it on a CPU.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import torch

from bench.gpu import report
from bench.gpu.device import device_info
from bench.gpu.golden import run_golden
from bench.gpu.roundtrip import run_roundtrip
from bench.gpu.service_load import ServiceSetup
from bench.gpu.throughput import Workload, measure_loop, measure_service, new_result
from bench.machine import machine_info
from bench.outcome import ScenarioResult
from model_builders.bench import build_bench_checkpoint
from scripts.redis_process import RedisServer

T = TypeVar("T")
MORE_PACKAGES = ("protobuf", "pydantic", "pydantic-settings", "pillow", "numpy", "tokenizers", "huggingface-hub")
# Seconds each part may take on the GPU host (measured on an H200: golden 4, checkpoint 26-33, loop
# 20-32 before the CUDA-graph rows, service 42-56); a part is skipped when less than this is left.
SKIPPABLE = {"golden", "roundtrip", "service"}  # the others feed later parts
NEEDS_S = {"golden": 30, "checkpoint": 60, "loop": 90, "roundtrip": 20, "service": 90}


def _csv(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="tower dtype")
    parser.add_argument("--out", type=Path, default=Path("bench/gpu/results"), help="where the JSON and Markdown go")
    parser.add_argument("--work", type=Path, help="checkpoints, Redis and logs (default: a temp dir)")
    parser.add_argument("--budget-s", type=float, default=540, help="parts that would end later are skipped")
    parser.add_argument("--images", type=int, default=256, help="images per row of the throughput table")
    parser.add_argument("--image-size", type=int, default=448, help="side of each image (a multiple of 28)")
    parser.add_argument("--per-call", type=_csv, default=(1, 8, 32), help="images per call of the plain loop")
    parser.add_argument("--concurrency", type=_csv, default=(1, 8, 32), help="calls in flight through the service")
    parser.add_argument("--max-batch-size", type=int, default=32, help="the service's ENCODER_MAX_BATCH_SIZE")
    parser.add_argument("--trips", type=int, default=100, help="timed blob round trips")
    parser.add_argument("--peak-tflops", type=float, default=790, help="the device's dense bf16 peak (H200: ~790)")
    parser.add_argument(
        "--skip",
        type=lambda text: set(text.split(",")),
        default=set(),
        help="parts not to run: golden, roundtrip, service (comma-separated)",
    )
    parser.add_argument("--quick", action="store_true", help="a rehearsal: 4 images of 56x56, concurrency 1 and 4")
    args = parser.parse_args(argv)
    if args.quick:  # the smallest image the processor keeps: a 2-core CPU runs the bf16 tower at ~10 GFLOP/s
        args.images, args.image_size, args.per_call, args.concurrency, args.trips = 4, 56, (1, 4), (1, 4), 10
    if args.skip - SKIPPABLE:
        parser.error(f"--skip takes {', '.join(sorted(SKIPPABLE))}, got {', '.join(sorted(args.skip - SKIPPABLE))}")
    if args.image_size % 28:
        parser.error("--image-size must be a multiple of 28 (the encoder would resize it)")
    return args


class Run:
    """The run's record: written out after every part (report.write)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.out, self.stem = args.out, device.type + ("-quick" if args.quick else "")
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s
        self.parts: list[ScenarioResult] = []
        self.skip: set[str] = args.skip
        self.record: dict[str, Any] = {
            "command": shlex.join(["python", "-m", "bench.gpu", *sys.argv[1:]]),
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": machine_info() | {"more_packages": _versions(MORE_PACKAGES)},
            "device": device_info(device),
            "part_seconds": {},
            "skipped": {},
            "errors": {},
        }

    def step(self, name: str, action: Callable[[], T]) -> T | None:
        """Runs `action` unless too little time is left; records a failure and goes on."""
        if name in self.skip:
            self.record["skipped"][name] = "--skip"
            return None
        left = self.deadline - time.monotonic()
        if left < NEEDS_S[name]:
            self.record["skipped"][name] = f"{left:.0f} s of the budget left, {NEEDS_S[name]} s needed"
            self.save()
            return None
        started = time.monotonic()
        try:
            return action()
        except Exception:  # recorded in the results; the other parts still run
            self.record["errors"][name] = traceback.format_exc()[-4000:]
            return None
        finally:
            self.record["part_seconds"][name] = round(time.monotonic() - started, 1)
            self.save()

    def save(self) -> None:
        self.record["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.record["parts"] = [part.to_json() for part in self.parts]
        report.write(self.record, self.out, self.stem)


def _versions(names: tuple[str, ...]) -> dict[str, str]:
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _keep(run: Run, part: ScenarioResult | None) -> None:
    if part is not None:
        run.parts.append(part)


def measure(args: argparse.Namespace, device: torch.device, work: Path, redis_url: str) -> Run:
    run = Run(args, device)
    dtype = getattr(torch, args.dtype)
    _keep(run, run.step("golden", lambda: run_golden(work / "tiny", device)))
    checkpoint = run.step("checkpoint", lambda: build_bench_checkpoint(work / "bench" / "base"))
    if checkpoint is None:
        return run
    load = Workload(args.images, args.image_size, args.per_call, args.concurrency, args.peak_tflops * 1e12)
    encoder = new_result(checkpoint, device, dtype, load)
    run.parts.append(encoder)
    measured = run.step("loop", lambda: measure_loop(encoder, checkpoint, device, dtype, load))
    if measured is not None:
        payload, invariance = measured
        run.parts.extend(invariance)
        _keep(run, run.step("roundtrip", lambda: run_roundtrip(*payload, redis_url, args.trips)))
        del payload, measured
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the loop's model is gone; the service gets the memory
    setup = ServiceSetup(checkpoint, str(device), args.dtype, redis_url, args.max_batch_size, work / "logs")
    run.step("service", lambda: measure_service(encoder, setup, load))
    return run


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # unwinds: services and Redis are stopped


def main() -> None:
    args = parse_args(sys.argv[1:])
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no GPU (torch.cuda.is_available() is False)")
    work = args.work or Path(tempfile.mkdtemp(prefix="vlm-gpu-bench."))
    (work / "redis").mkdir(parents=True, exist_ok=True)
    redis = RedisServer(work / "redis")
    redis.start()
    try:
        run = measure(args, device, work, redis.url)
    finally:
        redis.stop()
    path = report.write(run.record, run.out, run.stem)
    print(path.with_suffix(".md").read_text())
    # Correctness decides the exit status; the throughput's sanity check is only reported.
    checks = [t for p in run.record["parts"] if p["key"] != "encoder" for t in p["targets"]]
    sys.exit(1 if run.record["errors"] or any(not t["met"] for t in checks) else 0)


if __name__ == "__main__":
    main()
