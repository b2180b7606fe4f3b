"""The device under test: synchronising before a clock is read, and what to record about it."""

from __future__ import annotations

from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work: a GPU clock read without it times the launch, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_info(device: torch.device) -> dict[str, Any]:
    """Name, memory, CUDA and cuDNN versions, and the float32 settings the golden check runs under
    (TF32 would change float32 results on a GPU)."""
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    if device.type != "cuda":
        return info
    props = torch.cuda.get_device_properties(device)
    return {
        **info,
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory torch allocated on the device in this process since the last reset; 0 off a GPU."""
    if device.type != "cuda":
        return 0.0
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
