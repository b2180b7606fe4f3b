"""Gateway settings; every field reads from GATEWAY_<NAME>."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.grpc_limits import DEFAULT_GRPC_MAX_MESSAGE_BYTES
from shared.sdk import ChannelConfig

ENV_PREFIX = "GATEWAY_"


class GatewaySettings(BaseSettings):
    # populate_by_name: code still sets an aliased field by its name (max_media_per_request=4).
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", populate_by_name=True)

    host: str = Field("0.0.0.0", description="HTTP bind address.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port.")
    encoder_target: str = Field("127.0.0.1:50051", description="host:port of the encoder service.")
    models: dict[str, list[str]] = Field(
        default_factory=dict,
        description='Routing, as JSON: model name -> LLM service targets, e.g. {"ft-a": ["127.0.0.1:50061"]}.',
    )
    request_timeout_s: float = Field(300.0, gt=0, description="Deadline of one backend call.")
    max_media_per_request: int = Field(
        16,
        gt=0,
        description="Most images and videos in one chat request.",
        # An alias replaces the env prefix, so both names are spelled out; the second is the name
        # before videos, still read so existing deployments keep their limit.
        validation_alias=AliasChoices(f"{ENV_PREFIX}MAX_MEDIA_PER_REQUEST", f"{ENV_PREFIX}MAX_IMAGES_PER_REQUEST"),
    )
    keep_alive_s: float = Field(
        75.0, gt=0, description="HTTP keep-alive; longer than load balancers' idle timeouts, so they close first."
    )
    max_body_bytes: int = Field(48 * 1024 * 1024, gt=0, description="Largest request body accepted.")
    max_header_bytes: int = Field(
        64 * 1024, gt=0, description="Largest request line plus headers of one request; past it 431, connection closed."
    )
    request_read_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a request begun (head or body unfinished) may go without a byte arriving; then 408, "
        "connection closed.",
    )
    grpc_max_message_bytes: int = Field(
        DEFAULT_GRPC_MAX_MESSAGE_BYTES, gt=0, description="Largest gRPC message to backends."
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description="Accepted `Authorization: Bearer` keys (JSON list); empty = no authentication.",
    )
    allow_inline_embeds: bool = Field(
        False, description="Accept inline image_embeds tensors (stored keys are always accepted)."
    )
    max_concurrent_requests: int = Field(
        256, gt=0, description="Chat completions and encodes in flight before new ones get 429."
    )
    generate_streams: int = Field(
        8,
        ge=0,
        description="GenerateMany streams per LLM service target that carry its generations (less CPU per "
        "request on both sides); at least the replicas a target may resolve to. 0: one Generate call each.",
    )
    grpc_token: str | None = Field(None, description="Shared token sent to the gRPC services (their *_GRPC_TOKEN).")
    grpc_tls_ca_file: str | None = Field(
        None, description="PEM roots to verify the services' TLS certificates; unset = plaintext gRPC."
    )
    json_logs: bool = Field(True, description="Structured JSON log lines (with the request id) instead of plain text.")
    log_level: str = Field("INFO", description="Python logging level.")

    def channel_config(
        self,
        aio_interceptors: tuple[grpc.aio.ClientInterceptor, ...] = (),
        call_metadata: Callable[[], dict[str, str]] | None = None,
    ) -> ChannelConfig:
        roots = Path(self.grpc_tls_ca_file).read_bytes() if self.grpc_tls_ca_file else None
        return ChannelConfig(self.grpc_max_message_bytes, self.grpc_token, roots, aio_interceptors, call_metadata)
