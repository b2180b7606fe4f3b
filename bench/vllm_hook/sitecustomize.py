"""Benchmark-only hook: counts and times the images vLLM's Qwen2-VL runs through its vision tower.

Plain vLLM reports no encoder counter, and "encodes performed" is the number scenario 1 is
about; scenario 4 compares the seconds its tower takes per image with ours. Python imports this
module at start-up in every process the benchmark launches with PYTHONPATH pointing here (vLLM's
engine and worker processes inherit it). When vLLM's Qwen2-VL module is imported,
`_process_image_input` is wrapped: each call with pixel input adds its number of images to a
per-process file `<pid>.count` in BENCH_ENCODE_COUNT_DIR, and appends one line "<images>
<seconds>" to `<pid>.times` (the tower's forward pass and the split of its output: no HTTP,
preprocessing or prefill; on CPU the call returns when the work is done). Without that variable
it does nothing. Never part of the product.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time
from typing import Any

_TARGET = "vllm.model_executor.models.qwen2_vl"
_counted = 0
_times: list[str] = []


def _record(images: int, seconds: float) -> None:
    global _counted
    _counted += images
    _times.append(f"{images} {seconds:.6f}\n")
    base = os.path.join(os.environ["BENCH_ENCODE_COUNT_DIR"], str(os.getpid()))
    _write(base + ".count", str(_counted))
    _write(base + ".times", "".join(_times))


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as out:
        out.write(text)
    os.replace(path + ".tmp", path)  # a reader never sees a half-written file


def _patch(module: Any) -> None:
    model = module.Qwen2VLForConditionalGeneration
    original = model._process_image_input

    def counted(self: Any, image_input: Any) -> Any:
        if image_input["type"] == "image_embeds":
            return original(self, image_input)
        start = time.perf_counter()
        result = original(self, image_input)
        _record(len(image_input["image_grid_thw"]), time.perf_counter() - start)
        return result

    model._process_image_input = counted


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if os.environ.get("BENCH_ENCODE_COUNT_DIR"):
    sys.meta_path.insert(0, _PatchOnImport())
