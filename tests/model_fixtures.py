"""Tiny checkpoints and deterministic images for tests (see model_builders/tiny.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from model_builders.tiny import build_all


def build_test_checkpoints(root: Path) -> dict[str, Path]:
    """{"base", "ft-a", "ft-b"} -> checkpoint dir; ft-a/ft-b share base's vision tower."""
    return build_all(Path(root))


def make_image(seed: int, width: int = 100, height: int = 80) -> Image.Image:
    """Deterministic RGB noise; different seeds give images the tiny model tells apart."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), mode="RGB")
