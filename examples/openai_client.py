"""The official openai client against the gateway: a chat completion about an image
(sent as a data URL), the same question streamed, and the list of models.

Against `make serve` (gateway on :8000):

    .venv/bin/python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --model ft-a cat.png
"""

from __future__ import annotations

import argparse
import base64
import mimetypes
import sys
from pathlib import Path

from openai import OpenAI, OpenAIError


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the gateway's /v1 URL")
    parser.add_argument("--api-key", default="unused", help="one of GATEWAY_API_KEYS, when the gateway sets any")
    parser.add_argument("--model", default="ft-a")
    parser.add_argument("--question", default="What is in this image?")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("image", type=Path, help="image file (png, jpeg, webp, ...)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    mime = mimetypes.guess_type(args.image.name)[0] or "image/png"
    url = f"data:{mime};base64,{base64.b64encode(args.image.read_bytes()).decode()}"
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": args.question}]
    messages = [{"role": "user", "content": content}]
    request = {"model": args.model, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0}

    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    print(
        f"[{args.model}] {choice.message.content} (finish: {choice.finish_reason}, usage: {reply.usage.total_tokens} tokens)"
    )

    print(f"[{args.model}, streamed] ", end="", flush=True)
    # The second request costs no vision encode: the gateway's encode is a cache hit.
    for chunk in client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\nstream usage: {chunk.usage.total_tokens} tokens")

    print("models:", ", ".join(model.id for model in client.models.list()))


if __name__ == "__main__":
    try:
        main()
    except (OpenAIError, OSError) as error:
        sys.exit(f"error: {error}")
