"""Encode an image once with the asyncio gRPC SDK, then ask two models about it concurrently.

Against `make serve` (encoder on :50051, ft-a on :50061, ft-b on :50062):

    .venv/bin/python examples/sdk_async.py --encoder 127.0.0.1:50051 \
        --model ft-a=127.0.0.1:50061 --model ft-b=127.0.0.1:50062 cat.png
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from shared.errors import ServiceError
from shared.sdk import AsyncEncoderClient, AsyncLLMClient, ImageKey, Message, Sampling

DEFAULT_MODELS = [("ft-a", "127.0.0.1:50061"), ("ft-b", "127.0.0.1:50062")]


def model_spec(text: str) -> tuple[str, str]:
    name, _, target = text.partition("=")
    if not name or not target:
        raise argparse.ArgumentTypeError(f"expected NAME=HOST:PORT, got {text!r}")
    return name, target


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder", default="127.0.0.1:50051", help="encoder service host:port")
    parser.add_argument(
        "--model",
        type=model_spec,
        action="append",
        metavar="NAME=HOST:PORT",
        help="a model and its LLM service (repeat)",
    )
    parser.add_argument("--question", default="What is in this image?")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("image", type=Path, help="image file (png, jpeg, webp, ...)")
    return parser.parse_args()


async def ask(model: str, target: str, key: str, question: str, max_tokens: int) -> str:
    """The model's whole answer, gathered from the stream."""
    async with AsyncLLMClient(target) as llm:
        messages = [Message("user", [ImageKey(key), question])]
        return "".join(
            [
                chunk.text
                async for chunk in llm.generate(model, messages, Sampling(max_tokens=max_tokens, temperature=0))
            ]
        )


async def main() -> None:
    args = parse_args()
    models = dict(args.model or DEFAULT_MODELS)
    async with AsyncEncoderClient(args.encoder) as encoder:
        image = await encoder.encode(image_bytes=args.image.read_bytes())
        print(f"encoded: {image.key} grid_thw={image.grid_thw} tokens={image.num_tokens} cache_hit={image.cache_hit}")
        # One stored embedding serves every model; no model re-encodes the image.
        questions = (ask(name, target, image.key, args.question, args.max_tokens) for name, target in models.items())
        answers = await asyncio.gather(*questions)
        for name, answer in zip(models, answers, strict=True):
            print(f"[{name}] {answer}")
        stats = await encoder.stats()
        print(
            f"encoder stats: media_encoded={stats.media_encoded} cache_hits={stats.cache_hits} passes={stats.forward_passes}"
        )


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except ServiceError as error:
        sys.exit(f"error ({error.code}): {error.message}")
    except OSError as error:
        sys.exit(f"error: {error}")
