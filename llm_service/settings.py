"""LLM service settings; every field reads from LLM_<NAME>."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict

from shared.sampling_limits import MAX_TOKENS_BOUND
from shared.settings import GrpcServerSettings, StoreSettings


class LLMSettings(StoreSettings, GrpcServerSettings):
    # validate_by_name: a field with an alias (max_media_per_request) is still set by its name.
    model_config = SettingsConfigDict(env_prefix="LLM_", extra="ignore", validate_by_name=True)

    checkpoint: str = Field(..., description="Qwen2-VL checkpoint dir (or hub id) of this fine-tune.")
    model_name: str = Field(..., description="Name clients use in `model`.")
    port: int = Field(50061, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    engine: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="Decoding engine: vllm, transformers (exact reference), or auto (vllm where it imports)."
    )
    max_model_len: int = Field(
        4096,
        gt=0,
        description="Most prompt + completion tokens per request, both engines (transformers: capped at the "
        "model's max_position_embeddings). A longer prompt is a 400; max_tokens is capped to the room left.",
    )
    kv_cache_gib: float | None = Field(None, gt=0, description="vLLM: KV cache size in GiB; unset = vLLM's default.")
    enforce_eager: bool = Field(
        False, description="vLLM: run the model eagerly, without torch.compile: starts faster, decodes slower."
    )
    device: str = Field("cpu", description="torch device (cpu, cuda, cuda:1).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Language model dtype.")
    accepted_encoder_ids: list[str] = Field(
        default_factory=list,
        description="Encoder ids whose blobs this model accepts (JSON list); empty = the id of this checkpoint's own vision tower.",
    )
    default_max_tokens: int = Field(256, gt=0, description="max_tokens when a request sets none.")
    max_tokens_limit: int = Field(
        4096, gt=0, le=MAX_TOKENS_BOUND, description="Highest max_tokens a request may ask for."
    )
    max_media_per_request: int = Field(
        16,
        gt=0,
        # An alias is read without the env prefix, so both names are spelled out; the second is
        # the name this setting had when it seemed to count images only.
        validation_alias=AliasChoices("LLM_MAX_MEDIA_PER_REQUEST", "LLM_MAX_IMAGES_PER_REQUEST"),
        description="Most images and videos together in one request (LLM_MAX_IMAGES_PER_REQUEST also sets it).",
    )
    handoff_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="vLLM: most bytes of embeddings handed to the engine as files in /dev/shm rather than inside "
        "each request (0: every request carries its embeddings).",
    )
    # Not GrpcServerSettings' fixed 600 s (the encoder's): unset, it is sized to the machine at start-up.
    stall_s: float | None = Field(  # type: ignore[assignment]
        None,
        ge=0,
        description="Seconds the engine may owe progress (a token, a probe's answer) before it counts as hung: the "
        "service then reports NOT_SERVING and exits 1 to be restarted (shared/progress_watch.py); 0 turns the watch "
        "off. Unset: sized at start-up from a timed prefill, 10x the engine's longest step and at least 60 s "
        "(llm_service/server.py).",
    )
    engine_probe_s: float = Field(
        5.0,
        ge=0,
        le=30,
        description="Seconds between probes of the engine, a round trip it answers between two steps, so that an "
        "engine frozen while idle counts as hung too; 0 turns them off. At most 30: a stall limit sized at "
        "start-up may be 60 s, and must outlast a probe's interval plus a step.",
    )
    blob_cache_bytes: int = Field(
        512 * 1024 * 1024, ge=0, description="Budget of the in-memory LRU of decoded blobs (0 disables it)."
    )
