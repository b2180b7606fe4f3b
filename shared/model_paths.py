"""Where a checkpoint's files are: a local directory as given, or a hub id resolved
through the local Hugging Face cache (downloaded there first when the hub is reachable)."""

from __future__ import annotations

from pathlib import Path


def resolve_checkpoint(name_or_path: str) -> Path:
    """A local directory holding config.json, the weights, tokenizer and processor config."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or name_or_path.startswith("."):
        raise FileNotFoundError(f"checkpoint directory {name_or_path} does not exist")
    from huggingface_hub import snapshot_download  # a hub id like "Qwen/Qwen2-VL-2B-Instruct"

    return Path(snapshot_download(name_or_path))
