"""Benchmark-only hook: counts the images vLLM's Qwen2-VL runs through its vision tower.

Plain vLLM reports no encoder counter, and "encodes performed" is the number scenario 1 is
about. Python imports this module at start-up in every process the benchmark launches with
PYTHONPATH pointing here (vLLM's engine and worker processes inherit it). When vLLM's Qwen2-VL
module is imported, `_process_image_input` is wrapped: each call with pixel input adds its number
of images to a per-process file in BENCH_ENCODE_COUNT_DIR. Without that variable it does nothing.
Never part of the product.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

_TARGET = "vllm.model_executor.models.qwen2_vl"
_counted = 0


def _record(images: int) -> None:
    global _counted
    _counted += images
    directory = os.environ["BENCH_ENCODE_COUNT_DIR"]
    path = os.path.join(directory, f"{os.getpid()}.count")
    with open(path + ".tmp", "w") as out:
        out.write(str(_counted))
    os.replace(path + ".tmp", path)  # a reader never sees a half-written number


def _patch(module: Any) -> None:
    model = module.Qwen2VLForConditionalGeneration
    original = model._process_image_input

    def counted(self: Any, image_input: Any) -> Any:
        if image_input["type"] != "image_embeds":
            _record(len(image_input["image_grid_thw"]))
        return original(self, image_input)

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
