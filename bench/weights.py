"""Weight bytes of a checkpoint's vision tower and language model, at a given runtime dtype.

Read from safetensors headers (shapes only), so it costs nothing to report next to peak RSS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from shared.encoder_id import VISION_PREFIXES

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class WeightCounts:
    vision_params: int
    language_params: int

    def vision_bytes(self, dtype: str) -> int:
        return self.vision_params * DTYPE_BYTES[dtype]

    def language_bytes(self, dtype: str) -> int:
        return self.language_params * DTYPE_BYTES[dtype]

    def total_bytes(self, dtype: str) -> int:
        return self.vision_bytes(dtype) + self.language_bytes(dtype)


def count_weights(checkpoint: Path) -> WeightCounts:
    vision = language = 0
    for shard in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                numel = math.prod(f.get_slice(key).get_shape())
                if key.startswith(VISION_PREFIXES):
                    vision += numel
                else:
                    language += numel
    return WeightCounts(vision, language)
