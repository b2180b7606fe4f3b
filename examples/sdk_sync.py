"""Encode an image (or a video's frames) once with the blocking gRPC SDK, then stream a model's answer about it.

Against `make serve` (encoder on :50051, model ft-a on :50061):

    .venv/bin/python examples/sdk_sync.py --encoder 127.0.0.1:50051 --llm 127.0.0.1:50061 --model ft-a cat.png
    .venv/bin/python examples/sdk_sync.py --video frame0.jpg frame1.jpg frame2.jpg frame3.jpg
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.errors import ServiceError
from shared.sdk import EncoderClient, ImageKey, LLMClient, Message, Sampling, VideoKey


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder", default="127.0.0.1:50051", help="encoder service host:port")
    parser.add_argument("--llm", default="127.0.0.1:50061", help="LLM service host:port")
    parser.add_argument("--model", default="ft-a", help="model name that LLM service serves")
    parser.add_argument("--question", default="What is in this image?")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--video", action="store_true", help="the files are the frames of one video, in order")
    parser.add_argument("images", type=Path, nargs="+", help="image file(s) (png, jpeg, webp, ...)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with EncoderClient(args.encoder) as encoder, LLMClient(args.llm) as llm:
        if args.video:
            image = encoder.encode_video([path.read_bytes() for path in args.images])
            part: ImageKey | VideoKey = VideoKey(image.key)
        else:
            image = encoder.encode(image_bytes=args.images[0].read_bytes())
            part = ImageKey(image.key)
        print(f"encoded: {image.key} grid_thw={image.grid_thw} tokens={image.num_tokens} cache_hit={image.cache_hit}")
        # The key stands in for the image: the LLM service reads the embeddings from Redis.
        messages = [Message("user", [part, args.question])]
        print(f"[{args.model}] ", end="", flush=True)
        for chunk in llm.generate(args.model, messages, Sampling(max_tokens=args.max_tokens, temperature=0)):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                print(
                    f"\nfinish: {chunk.finish_reason} (prompt {chunk.prompt_tokens}, completion {chunk.completion_tokens} tokens)"
                )
        stats = encoder.stats()
        print(
            f"encoder stats: media_encoded={stats.media_encoded} cache_hits={stats.cache_hits} passes={stats.forward_passes}"
        )


if __name__ == "__main__":
    try:
        main()
    except ServiceError as error:
        sys.exit(f"error ({error.code}): {error.message}")
    except OSError as error:
        sys.exit(f"error: {error}")
