"""Decoding engines behind one protocol (see base.py)."""

from llm_service.engines.base import Engine, EngineRequest, GenerationDelta, MediaItem, SamplingParams

__all__ = ["Engine", "EngineRequest", "GenerationDelta", "MediaItem", "SamplingParams"]
