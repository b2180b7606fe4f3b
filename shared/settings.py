"""Settings pieces shared by the services. Each service has one settings class
(its own env prefix) built from these; nothing else reads the environment."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings

from shared.grpc_limits import DEFAULT_GRPC_MAX_MESSAGE_BYTES
from shared.grpc_server import ServerSecurity
from shared.store import StoreConfig


class StoreSettings(BaseSettings):
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="Redis URL (redis:// or rediss://, password in the URL)."
    )
    embedding_ttl_s: int = Field(24 * 3600, gt=0, description="TTL of every stored embedding, refreshed on each hit.")
    redis_timeout_s: float = Field(1.0, gt=0, description="Budget for one Redis operation, retries included.")
    redis_retries: int = Field(1, ge=0, description="Retries of a Redis operation on a connection error.")

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            url=self.redis_url,
            ttl_s=self.embedding_ttl_s,
            socket_timeout_s=self.redis_timeout_s / 2,
            op_timeout_s=self.redis_timeout_s,
            retries=self.redis_retries,
        )


class GrpcServerSettings(BaseSettings):
    host: str = Field("0.0.0.0", description="Address the gRPC server binds.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    grace_s: float = Field(10.0, ge=0, description="Seconds in-flight RPCs get to finish on SIGTERM.")
    stall_s: float = Field(
        600.0,
        ge=0,
        description="Seconds the service's compute (the encoder's forward pass, the LLM's engine) may go without "
        "progress while it has work before it counts as hung: the service then exits non-zero to be restarted "
        "(shared/progress_watch.py); 0 turns the watch off.",
    )
    grpc_max_message_bytes: int = Field(
        DEFAULT_GRPC_MAX_MESSAGE_BYTES, gt=0, description="Largest gRPC message accepted or sent."
    )
    log_level: str = Field("INFO", description="Python logging level.")
    json_logs: bool = Field(True, description="Structured JSON log lines (with the request id) instead of plain text.")
    metrics_port: int = Field(9090, ge=0, le=65535, description="HTTP port of Prometheus /metrics; 0 turns it off.")
    grpc_token: str | None = Field(
        None, description="Shared token callers must send as `authorization: Bearer`; unset = open."
    )
    grpc_tls_cert_file: str | None = Field(
        None, description="PEM certificate: serve gRPC over TLS (with grpc_tls_key_file)."
    )
    grpc_tls_key_file: str | None = Field(None, description="PEM private key of grpc_tls_cert_file.")

    def server_security(self) -> ServerSecurity:
        return ServerSecurity.from_files(self.grpc_token, self.grpc_tls_cert_file, self.grpc_tls_key_file)
