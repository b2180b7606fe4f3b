"""Prints the entries of a hash-locked requirements file whose package the image does not have.

The GPU LLM image starts from vLLM's image, whose Python already holds vLLM's pinned stack
(torch, transformers, numpy, ...). Installing our lock over it would move those pins; instead
the image's own versions stay, and only what it lacks comes from our lock, hashes and all:

    python3 lock_beyond_image.py requirements/llm.txt image-pins.txt > missing.txt

image-pins.txt is `pip list --format=freeze` of the image. Standard library only: it runs in
whatever Python the base image has.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def entries(lock: str) -> list[str]:
    """The lock's entries, each one requirement with its continuation lines (hashes), comments dropped."""
    joined = re.sub(r"\\\n", " ", lock)
    return [line.split(" #")[0].strip() for line in joined.splitlines() if NAME.match(line)]


def beyond(lock: str, pins: str) -> list[str]:
    have = {canonical(m[1]) for line in pins.splitlines() if (m := NAME.match(line))}
    return [entry for entry in entries(lock) if canonical(NAME.match(entry)[1]) not in have]  # type: ignore[index]


if __name__ == "__main__":
    lock_path, pins_path = sys.argv[1:3]
    print("\n".join(beyond(Path(lock_path).read_text(), Path(pins_path).read_text())))
