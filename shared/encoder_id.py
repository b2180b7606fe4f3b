"""The encoder id: which vision tower (weights and image preprocessing) made an embedding.

Fine-tunes that share the tower share the id, so one stored blob serves all of them; an LLM
service accepts blobs of the ids it knows (DESIGN.md, Contracts). Both servers derive it from a
checkpoint here, apart from the test-checkpoint builder (model_builders/tiny.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

# transformers 5.x save_pretrained writes the hub layout (`visual.`); in-memory 5.x names use
# `model.visual.`. Both name the vision tower.
VISION_PREFIXES = ("model.visual.", "visual.")
# Changes whenever the encoder makes other embeddings from the same bytes and weights (other
# pixels, other tower numerics), so that blobs made before get another id and are never taken for
# the new ones (keys hash the bytes, not the pixels or the code).
# 2: EXIF orientation applied (encoder_service/images.py).
# 3: bfloat16/float16 towers keep transformers' float32 rotary frequencies (encoder_service/vision.py);
#    float32 embeddings are unchanged, but the id cannot tell the dtypes apart.
EMBEDDING_REVISION = 3


def compute_encoder_id(checkpoint_dir: Path) -> str:
    """`qwen2vl-<16 hex>` over the vision-tower tensors, the image preprocessing config and the
    encoder's embedding revision.

    Tensor names are hashed without their layout prefix (`visual.` or `model.visual.`), so one
    tower saved by two transformers versions gets one id.
    """
    checkpoint_dir = Path(checkpoint_dir)
    digest = hashlib.sha256()
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for key in sorted(k for k in f.keys() if is_vision_key(k)):
                tensor = f.get_tensor(key).contiguous()
                header = f"{vision_name(key)}|{tensor.dtype}|{list(tensor.shape)}|"
                digest.update(header.encode())
                digest.update(tensor.view(torch.uint8).numpy())  # hashed in place: no copy of the weights
    preprocessor = json.loads((checkpoint_dir / "preprocessor_config.json").read_text())
    vision_config = json.loads((checkpoint_dir / "config.json").read_text())["vision_config"]
    for volatile in ("dtype", "torch_dtype", "transformers_version", "_name_or_path"):
        vision_config.pop(volatile, None)
    digest.update(_canonical_json(preprocessor).encode())
    digest.update(_canonical_json(vision_config).encode())
    digest.update(f"pixels:{EMBEDDING_REVISION}".encode())
    return f"qwen2vl-{digest.hexdigest()[:16]}"


def is_vision_key(key: str) -> bool:
    return key.startswith(VISION_PREFIXES)


def vision_name(key: str) -> str:
    """A vision weight's name inside the tower ("blocks.0.attn.qkv.weight"), whichever prefix the checkpoint uses."""
    for prefix in VISION_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
