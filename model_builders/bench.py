"""Benchmark checkpoint: the real Qwen2-VL-2B vision tower shape with a small language model.

Encoding must cost what it costs in life (DESIGN.md, Models), so the tower keeps Qwen2-VL-2B's
shape (depth 32, embed 1280, 16 heads, merger out 1536, ~665M parameters); the language model is
small (2 layers, hidden 1536 = the merger's output) because the benchmarks compare serving paths,
not decoding quality. Weights are random and stored in bfloat16: the tower is ~1.3 GB on disk
instead of ~2.7 GB, and every loader casts to the dtype it is asked for.

Fine-tunes redraw every language-model tensor from their own seed and draw the vision tensors
from the base's seed, so the tower is byte-identical and the encoder id is shared.

CLI: ``python -m model_builders.bench --out DIR`` builds DIR/base, DIR/ft-1 .. DIR/ft-N.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

from model_builders.tiny import (
    SPECIAL_TOKENS,
    build_tokenizer,
    is_complete,
    preprocessor_config,
    save_checkpoint,
    staging,
    tiny_config,
)
from shared.encoder_id import is_vision_key

STORED_DTYPE = torch.bfloat16
BENCH_MIN_PIXELS = 56 * 56
BENCH_MAX_PIXELS = 448 * 448  # a 448x448 image: 32x32 patches, 256 merged tokens
# Qwen2-VL-2B's vision tower, verbatim from its config.json.
BENCH_VISION = dict(
    depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4,
    patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
)  # fmt: skip
# hidden_size must equal the merger's output; head_dim = 1536 / 12 = 128 = 2 * sum(mrope_section).
BENCH_TEXT = dict(
    hidden_size=1536, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=12,
    num_key_value_heads=2, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]},
)  # fmt: skip


def bench_config() -> Qwen2VLConfig:
    """The tiny config's token ids and conventions with the benchmark's dimensions."""
    tiny = tiny_config(build_tokenizer())
    return Qwen2VLConfig(
        text_config={**tiny.text_config.to_dict(), **BENCH_TEXT},
        vision_config={**tiny.vision_config.to_dict(), **BENCH_VISION},
        image_token_id=tiny.image_token_id,
        video_token_id=tiny.video_token_id,
        vision_start_token_id=tiny.vision_start_token_id,
        vision_end_token_id=tiny.vision_end_token_id,
        tie_word_embeddings=False,
    )


def bench_preprocessor_config() -> dict:
    config = preprocessor_config()
    config.update(
        min_pixels=BENCH_MIN_PIXELS,
        max_pixels=BENCH_MAX_PIXELS,
        size={"shortest_edge": BENCH_MIN_PIXELS, "longest_edge": BENCH_MAX_PIXELS},
    )
    return config


def _tensor_seed(seed: int, name: str) -> int:
    # Per-tensor seeds: a tensor's values depend only on (seed, name), never on build order,
    # which is what keeps the tower byte-identical across the base and its fine-tunes.
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _randomize(
    model: Qwen2VLForConditionalGeneration, vision_seed: int, text_seed: int, special_ids: list[int]
) -> None:
    """Every matrix drawn with std 1/sqrt(fan_in), so activations stay O(1) through 32 blocks
    (the tiny model's 0.15 would overflow here); 1-D params keep transformers' init."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim < 2:
                continue
            seed = vision_seed if is_vision_key(name) else text_seed
            gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
            fan_in = param[0].numel()
            param.copy_(torch.randn(param.shape, generator=gen) / fan_in**0.5)
        # A zero logit row is (almost surely) never the argmax of ~1000 random logits: no request
        # stops early on <|im_end|>, so every system decodes exactly max_tokens per request.
        model.lm_head.weight[special_ids] = 0


def _build(out_dir: Path, vision_seed: int, text_seed: int) -> Path:
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        return out_dir
    with staging(out_dir) as tmp:
        tokenizer = build_tokenizer()
        config = bench_config()
        model = Qwen2VLForConditionalGeneration._from_config(config, dtype=STORED_DTYPE)
        _randomize(model, vision_seed, text_seed, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)))
        save_checkpoint(model, tokenizer, bench_preprocessor_config(), tmp)
    return out_dir


def build_bench_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """Builds the base benchmark checkpoint into out_dir (skipped when complete); returns out_dir."""
    return _build(out_dir, vision_seed=seed, text_seed=seed)


def build_bench_finetunes(base: Path, root: Path, n: int = 3, seed: int = 0) -> list[Path]:
    """root/ft-1 .. root/ft-n: the base's tower (same seed, same bytes), each its own language model.

    `base` must have been built with `seed`; it is taken to name the shared tower, and checked.
    """
    if not is_complete(Path(base)):
        raise FileNotFoundError(f"build the base benchmark checkpoint first: {base} is incomplete")
    return [_build(Path(root) / f"ft-{i}", vision_seed=seed, text_seed=seed + i) for i in range(1, n + 1)]


def build_bench_all(root: Path, n_finetunes: int = 3, seed: int = 0) -> dict[str, Path]:
    """root/base plus n fine-tunes, as {"base": ..., "ft-1": ..., ...}."""
    base = build_bench_checkpoint(Path(root) / "base", seed)
    finetunes = build_bench_finetunes(base, root, n_finetunes, seed)
    return {"base": base, **{path.name: path for path in finetunes}}


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the benchmark Qwen2-VL checkpoints (random weights).")
    parser.add_argument("--out", type=Path, required=True, help="directory to build base/ft-1..ft-N in")
    parser.add_argument("--finetunes", type=int, default=3)
    args = parser.parse_args()
    for name, path in build_bench_all(args.out, args.finetunes).items():
        print(f"{name}\t{path.resolve()}")


if __name__ == "__main__":
    main()
