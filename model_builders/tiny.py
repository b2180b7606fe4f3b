"""Tiny random-weight Qwen2-VL checkpoints for tests and demos.

No model hub is reachable, so a checkpoint is built on the spot: a byte-level BPE tokenizer
trained on a built-in corpus, the real Qwen2-VL chat template, an image processor config with
small pixel bounds, and random weights. "Fine-tunes" copy the base and change only the language
model, so they share the vision tower and therefore the encoder id.

CLI: ``python -m model_builders.tiny --out DIR`` builds DIR/base, DIR/ft-a and DIR/ft-b.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

from shared.encoder_id import is_vision_key

WEIGHTS_FILE = "model.safetensors"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    WEIGHTS_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "chat_template.jinja",
)

# Qwen2-VL's special tokens, in the order the real vocabulary has them (ids follow the BPE vocab).
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip

# Verbatim from Qwen/Qwen2-VL-*-Instruct chat_template.json.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = """\
You are a helpful assistant. Describe the image in one short sentence.
What is in this picture? There is a red square on a white background.
What color is the circle? The circle is blue and it sits near the top left corner.
How many objects can you see? I can see three objects: a cat, a dog and a small bird.
Is there a person in the photo? Yes, a woman is standing next to a green car.
Where was this photo taken? It looks like a busy street in a large city at night.
What is the man holding? He is holding a yellow umbrella because it is raining.
Read the text on the sign. The sign says stop, and it is written in white letters.
What time of day is it? The sky is orange, so it is probably early in the evening.
Compare the two images. The first image is brighter than the second one.
Which animal is larger? The elephant is much larger than the mouse beside it.
Count the apples on the table. There are five apples and two oranges on the table.
What is the weather like? It is sunny and warm, with a few white clouds in the sky.
Describe the room. The room has a wooden floor, a brown sofa and a tall lamp.
What game are they playing? The children are playing football in the park.
Is the door open or closed? The door is open and light comes in from outside.
What shape is the window? The window is round, like a circle in a ship.
Tell me about the chart. The chart shows sales growing every month this year.
Please answer the question about the picture with a single word if you can.
The quick brown fox jumps over the lazy dog while the birds sing in the trees.
A horse runs across the field, and a farmer watches from the old red barn.
The train leaves the station at nine, and the passengers wave from the windows.
Mountains rise behind the lake, and snow covers their highest peaks all year.
A plate of pasta with tomato sauce, cheese and fresh basil sits on the kitchen table.
Two boats float on the calm water, one white and one with a striped blue sail.
The little girl draws a house, a tree and a bright sun with her colored pencils.
Numbers: one two three four five six seven eight nine ten 0 1 2 3 4 5 6 7 8 9.
Is the bottle empty? No, the glass bottle on the shelf is half full of water.
What is written on the board? The teacher wrote a long math problem in chalk.
Describe the street. Tall buildings, parked bicycles and a market with fruit stalls.
What are the players wearing? One team wears striped shirts, the other plain black.
Where is the bird sitting? The bird sits on a thin branch above the frozen river.
How old is the building? The stone walls and narrow windows suggest it is very old.
Which way is the road turning? The road bends to the right after the bridge.
What is unusual about this picture? A giraffe is standing inside a telephone box.
Summarize the document. It explains how to plant tomatoes, potatoes and carrots.
The scientist checks the microscope, writes notes, and smiles at the results.
Please list every vehicle: a truck, a bus, three taxis, a motorcycle and a scooter.
Quiet forests, noisy highways, sandy beaches, and deep valleys fill the atlas.
"""

TOKENIZER_VOCAB_SIZE = 1024
# Init scales chosen (see tests) so that greedy output of a random model depends on the image
# and on the question: at the usual 0.02 the residual stream is dominated by the last token's
# embedding and every prompt yields the same repeated token.
TEXT_INIT_STD = 0.15
VISION_INIT_STD = 0.15
FINETUNE_NOISE = 0.6
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 64  # at most 64 merged tokens per image, keeps CPU tests fast
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def build_tokenizer(corpus: str = CORPUS) -> Qwen2Tokenizer:
    """Train a byte-level BPE on `corpus` with Qwen2's pre-tokenizer and add Qwen2-VL's special tokens."""
    raw = Tokenizer(models.BPE())
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(corpus.splitlines(), trainer)
    trained = json.loads(raw.to_str())["model"]
    vocab: dict[str, int] = dict(trained["vocab"])
    for token in SPECIAL_TOKENS:  # in the vocab before Qwen2Tokenizer sees them, so ids stay in order
        vocab.setdefault(token, len(vocab))
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[tuple(m) for m in trained["merges"]],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        extra_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(tokenizer: Qwen2Tokenizer) -> Qwen2VLConfig:
    """The dims DESIGN.md fixes for the tiny model; token ids taken from the tokenizer."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tokenizer),  # no unmapped ids: a random model may emit any id
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [8, 12, 12]},
        initializer_range=TEXT_INIT_STD,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=2,
        embed_dim=128,
        hidden_size=256,
        num_heads=2,
        mlp_ratio=4,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        initializer_range=VISION_INIT_STD,
    )
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def preprocessor_config() -> dict:
    """Hub-style Qwen2VLImageProcessor config; `size` mirrors min/max pixels for transformers 5."""
    return {
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    }


def _randomize(model: Qwen2VLForConditionalGeneration, seed: int) -> None:
    """Redraw every matrix with our own scales; 1-D params keep transformers' init (norms 1, biases 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim < 2:
                continue
            std = VISION_INIT_STD if is_vision_key(name) else TEXT_INIT_STD
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def save_checkpoint(
    model: Qwen2VLForConditionalGeneration, tokenizer: Qwen2Tokenizer, preprocessor: dict, out_dir: Path
) -> None:
    """Weights, a generation config that ends on the chat's eos, the tokenizer and the image processor config."""
    text_config = model.config.text_config
    model.generation_config = GenerationConfig(
        bos_token_id=text_config.bos_token_id,
        eos_token_id=text_config.eos_token_id,
        pad_token_id=text_config.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    write_json(out_dir / "preprocessor_config.json", preprocessor)


def build_tiny_base(out_dir: Path, seed: int = 0) -> Path:
    """Build the base checkpoint into out_dir (skipped when already complete); returns out_dir."""
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        return out_dir
    with staging(out_dir) as tmp:
        tokenizer = build_tokenizer()
        config = tiny_config(tokenizer)
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
        _randomize(model, seed)
        save_checkpoint(model, tokenizer, preprocessor_config(), tmp)
    return out_dir


def build_finetune(base_dir: Path, out_dir: Path, seed: int) -> Path:
    """Copy base_dir, perturbing only language-model tensors; vision tensors stay byte-identical."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    if is_complete(out_dir):
        return out_dir
    with staging(out_dir) as tmp:
        for item in base_dir.iterdir():
            if item.is_file() and item.name != WEIGHTS_FILE:
                shutil.copy2(item, tmp / item.name)
        gen = torch.Generator().manual_seed(seed)
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(base_dir / WEIGHTS_FILE, framework="pt") as f:
            metadata = f.metadata()
            for key in sorted(f.keys()):
                tensor = f.get_tensor(key)
                if not is_vision_key(key) and tensor.ndim >= 2:
                    noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
                    tensor = (tensor.float() + noise * FINETUNE_NOISE * tensor.float().std()).to(tensor.dtype)
                tensors[key] = tensor.contiguous()
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata=metadata)
    return out_dir


def is_complete(checkpoint_dir: Path) -> bool:
    return all((Path(checkpoint_dir) / name).is_file() for name in REQUIRED_FILES)


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


@contextmanager
def staging(out_dir: Path) -> Iterator[Path]:
    """Build into a sibling temp dir and rename it into place, so a crash never leaves a
    half-written checkpoint that `is_complete` would accept."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield tmp
        # mkdtemp and safetensors create owner-only entries; readers may run as another user.
        os.chmod(tmp, 0o755)
        for item in tmp.iterdir():
            os.chmod(item, 0o644)
        if out_dir.exists() and not is_complete(out_dir):
            shutil.rmtree(out_dir)  # leftover of an interrupted build by an older version
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not is_complete(out_dir):  # a concurrent builder did not win either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_all(root: Path) -> dict[str, Path]:
    """The standard set: base plus two fine-tunes with different seeds."""
    root = Path(root)
    base = build_tiny_base(root / "base", seed=0)
    return {
        "base": base,
        "ft-a": build_finetune(base, root / "ft-a", seed=1),
        "ft-b": build_finetune(base, root / "ft-b", seed=2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Build tiny random Qwen2-VL checkpoints.")
    parser.add_argument("--out", type=Path, required=True, help="directory to build base/ft-a/ft-b in")
    args = parser.parse_args()
    for name, path in build_all(args.out).items():
        print(f"{name}\t{path.resolve()}")


if __name__ == "__main__":
    main()
