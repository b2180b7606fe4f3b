"""The trained tiny family's architecture, tokenizer and on-disk layout.

Real Qwen2-VL architecture and chat template, small sizes. The vision tower is wider and deeper
than the random test checkpoints' (it has to learn counting and shapes) and the text model keeps
the dims both engines accept on CPU. Word embeddings are tied, as in Qwen2-VL-2B, to keep each
language model small.

Layout: the tower is stored once, `<root>/tower/visual.safetensors`, and every checkpoint links
to it (`visual.safetensors -> ../tower/visual.safetensors`) beside its own
`language.safetensors`, with an index naming both. The fine-tunes therefore share the tower byte
for byte (one encoder id), and the repository holds it once.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from model_builders.shapes.task import TASKS
from model_builders.tiny import CORPUS, build_tokenizer, save_checkpoint, tiny_config
from shared.encoder_id import is_vision_key

TOWER_DIR = "tower"
TOWER_FILE = "visual.safetensors"
LANGUAGE_FILE = "language.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHIPPED_DTYPE = torch.bfloat16  # halves the repository's share; both engines widen it on load

VISION = dict(depth=4, embed_dim=192, num_heads=3, mlp_ratio=4)  # head dim 64, as the tiny tower's
INIT_STD = 0.02  # transformers' usual: trained weights, not the random checkpoints' large scale


def task_corpus() -> str:
    """The tiny corpus plus the task's questions and answers, so each answer word is a token."""
    lines = [question for question, _ in TASKS.values()]
    # Each word alone on a line: an answer follows "assistant\n", so its first token has no space.
    lines += [word for _, words in TASKS.values() for word in words] * 20
    return CORPUS + "\n".join(lines) + "\n"


def build_family_tokenizer() -> Qwen2Tokenizer:
    return build_tokenizer(task_corpus())


def family_config(tokenizer: Qwen2Tokenizer) -> Qwen2VLConfig:
    config = tiny_config(tokenizer)
    for name, value in VISION.items():
        setattr(config.vision_config, name, value)
    config.vision_config.initializer_range = INIT_STD
    config.text_config.initializer_range = INIT_STD
    config.tie_word_embeddings = True
    config.text_config.tie_word_embeddings = True
    return config


def save_member(
    model: Qwen2VLForConditionalGeneration, tokenizer: Qwen2Tokenizer, preprocessor: dict, root: Path, name: str
) -> Path:
    """Write checkpoint `root/name` (config, tokenizer and processor files, its language model in
    the shipped dtype) linked to the shared tower; the first member written stores the tower, later
    ones must carry the very same tower bytes."""
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors*"):
        stale.unlink()
    # config.json keeps float32 so that engines loading with dtype "auto" compute in float32.
    save_checkpoint(model, tokenizer, preprocessor, out)
    saved = out / "model.safetensors"
    tower: dict[str, torch.Tensor] = {}
    language: dict[str, torch.Tensor] = {}
    with safe_open(saved, framework="pt") as f:
        for key in f.keys():
            tensor = f.get_tensor(key).to(SHIPPED_DTYPE).contiguous()
            (tower if is_vision_key(key) else language)[key] = tensor
    saved.unlink()
    _store_tower(tower, root / TOWER_DIR / TOWER_FILE)
    save_file(language, str(out / LANGUAGE_FILE), metadata={"format": "pt"})
    (out / TOWER_FILE).symlink_to(Path("..") / TOWER_DIR / TOWER_FILE)
    weight_map = {key: LANGUAGE_FILE for key in language} | {key: TOWER_FILE for key in tower}
    size = sum(t.numel() * t.element_size() for t in [*tower.values(), *language.values()])
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out


def _store_tower(tower: dict[str, torch.Tensor], path: Path) -> None:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tower, str(path), metadata={"format": "pt"})
        return
    with safe_open(path, framework="pt") as f:
        stored = {key: f.get_tensor(key) for key in f.keys()}
    if stored.keys() != tower.keys() or any(not torch.equal(stored[k], tower[k]) for k in tower):
        raise ValueError(f"{path} holds another tower: a fine-tune must keep the base's tower")
