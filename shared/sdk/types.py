"""Typed inputs and results of the SDK; each converts itself to or from its proto."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import grpc

from shared.errors import clip
from shared.grpc_limits import DEFAULT_GRPC_MAX_MESSAGE_BYTES
from shared.pb.encoder.v1 import encoder_pb2
from shared.pb.llm.v1 import llm_pb2

_FINISH_NAMES = {llm_pb2.FINISH_REASON_STOP: "stop", llm_pb2.FINISH_REASON_LENGTH: "length"}
# Idempotent RPCs are retried by gRPC itself on UNAVAILABLE; Generate never is
# (a retried stream could repeat tokens the caller already saw).
RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [
                    {"service": "encoder.v1.EncoderService"},
                    {"service": "llm.v1.LLMService", "method": "ListModels"},
                ],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

RECONNECT_INITIAL_BACKOFF_MS = 500
RECONNECT_MAX_BACKOFF_MS = 2_000
MIN_CONNECT_TIMEOUT_MS = 5_000
KEEPALIVE_TIME_MS = 15_000  # a server must accept pings this often (see shared.grpc_server)
KEEPALIVE_TIMEOUT_MS = 5_000


@dataclass(frozen=True)
class ChannelConfig:
    """How a client reaches a service: message size cap, shared token, TLS roots (PEM), and
    interceptors of the async clients' calls (e.g. shared.tracing's, which sends the trace context).
    `call_metadata` gives what those interceptors add, for the calls no interceptor sees: those
    multiplexed over one stream (shared/sdk/generate_mux.py)."""

    max_message_bytes: int = DEFAULT_GRPC_MAX_MESSAGE_BYTES
    token: str | None = None
    tls_root_certs: bytes | None = None
    aio_interceptors: tuple[grpc.aio.ClientInterceptor, ...] = ()
    call_metadata: Callable[[], dict[str, str]] | None = None

    def open(self, target: str, *, aio: bool) -> grpc.Channel | grpc.aio.Channel:
        options = channel_options(self.max_message_bytes)
        credentials = (
            None if self.tls_root_certs is None else grpc.ssl_channel_credentials(root_certificates=self.tls_root_certs)
        )
        if aio:
            interceptors = list(self.aio_interceptors) or None
            if credentials is None:
                return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
            return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)
        if credentials is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, credentials, options=options)


def channel_options(max_message_bytes: int) -> list[tuple[str, object]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 1),
        # A dns:/// target naming a headless Service resolves to every pod; spread calls over them.
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.service_config", RETRY_SERVICE_CONFIG),
        # Reconnect within ~2 s of a service coming back: by default the backoff grows to 120 s,
        # and calls fail fast (UNAVAILABLE) during it although the service is SERVING again.
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_BACKOFF_MS),
        # The least time one connection attempt is given (gRPC's min_connect_timeout, 20 s by
        # default): long enough for a TLS handshake on a busy node, short enough for a black hole.
        ("grpc.min_reconnect_backoff_ms", MIN_CONNECT_TIMEOUT_MS),
        # Pings notice a pod that vanished without closing its connections (node lost, network
        # cut) in seconds, not at the TCP timeout; servers allow them (shared.grpc_server.grpc_options).
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # What the transport waits for a ping's ack before it drops the connection. gRPC 1.85 times
        # a keepalive ping by this (default 60 s), not by keepalive_timeout_ms: calls to a frozen
        # service (SIGSTOP, a hung node) hung 70 s, not ~20 s (tests/test_grpc_keepalive.py).
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


@dataclass(frozen=True)
class EncodedMedia:
    """An image or a video the encoder stored: the key to reference it by, and what it occupies."""

    key: str
    grid_thw: list[int]  # [t, h, w]; t > 1 for a video of more than two frames
    num_tokens: int
    cache_hit: bool
    encoder_id: str

    @classmethod
    def from_pb(cls, reply: encoder_pb2.EncodeReply) -> EncodedMedia:
        return cls(reply.key, list(reply.grid_thw), reply.num_tokens, reply.cache_hit, reply.encoder_id)


EncodedImage = EncodedMedia  # the name before videos; kept for existing callers


@dataclass(frozen=True)
class EncoderStats:
    encoder_id: str
    media_encoded: int  # images and videos run through the vision tower
    cache_hits: int
    coalesced: int
    forward_passes: int

    @property
    def images_encoded(self) -> int:
        """The name before videos (it counted them too); kept for existing callers."""
        return self.media_encoded

    @classmethod
    def from_pb(cls, reply: encoder_pb2.EncoderStats) -> EncoderStats:
        return cls(reply.encoder_id, reply.media_encoded, reply.cache_hits, reply.coalesced, reply.forward_passes)


def encode_request(
    image_bytes: bytes | None, image_url: str | None, min_pixels: int, max_pixels: int
) -> encoder_pb2.EncodeRequest:
    if (image_bytes is None) == (image_url is None):
        raise ValueError("pass exactly one of image_bytes or image_url")
    if image_bytes is not None:
        return encoder_pb2.EncodeRequest(image_bytes=image_bytes, min_pixels=min_pixels, max_pixels=max_pixels)
    return encoder_pb2.EncodeRequest(image_url=image_url, min_pixels=min_pixels, max_pixels=max_pixels)


def encode_video_request(frames: list[bytes | str], min_pixels: int, max_pixels: int) -> encoder_pb2.EncodeVideoRequest:
    """Each frame is an image file's bytes, or a data:/http(s) URL (str)."""
    if isinstance(frames, str | bytes):  # iterable, and one frame per character or byte
        raise TypeError(f"frames is a list of frames (image bytes or URLs), not one {type(frames).__name__}")
    request = encoder_pb2.EncodeVideoRequest(min_pixels=min_pixels, max_pixels=max_pixels)
    for frame in frames:
        if isinstance(frame, bytes):
            request.frames.append(encoder_pb2.Frame(image_bytes=frame))
        elif isinstance(frame, str):
            request.frames.append(encoder_pb2.Frame(image_url=frame))
        else:
            raise TypeError(f"a frame is image bytes or a URL string, not {type(frame).__name__}")
    return request


@dataclass(frozen=True)
class ImageKey:
    """An image stored by the encoder service."""

    key: str


@dataclass(frozen=True)
class VideoKey:
    """A video stored by the encoder service (EncodeVideo)."""

    key: str


@dataclass(frozen=True)
class InlineEmbedding:
    """An embedding blob (safetensors bytes) sent with the request; its modality says which part it fills."""

    blob: bytes
    modality: Literal["image", "video"] = "image"

    def __post_init__(self) -> None:
        if self.modality not in ("image", "video"):
            raise ValueError(f"InlineEmbedding.modality is 'image' or 'video', not {self.modality!r}")


@dataclass(frozen=True)
class Message:
    role: str
    content: list[str | ImageKey | VideoKey | InlineEmbedding]

    def to_pb(self) -> llm_pb2.ChatMessage:
        if isinstance(self.content, str):  # iterable: one text part per character
            raise TypeError(f"Message.content is a list of parts, e.g. [{clip(self.content, 20)!r}], not a str")
        return llm_pb2.ChatMessage(role=self.role, content=[_part_pb(part) for part in self.content])


def _part_pb(part: str | ImageKey | VideoKey | InlineEmbedding) -> llm_pb2.ContentPart:
    if isinstance(part, str):
        return llm_pb2.ContentPart(text=part)
    if isinstance(part, ImageKey):
        return llm_pb2.ContentPart(image=llm_pb2.ImageRef(key=part.key))
    if isinstance(part, VideoKey):
        return llm_pb2.ContentPart(video=llm_pb2.VideoRef(key=part.key))
    if isinstance(part, InlineEmbedding):
        if part.modality == "video":
            return llm_pb2.ContentPart(video=llm_pb2.VideoRef(embedding_blob=part.blob))
        return llm_pb2.ContentPart(image=llm_pb2.ImageRef(embedding_blob=part.blob))
    raise TypeError(f"a content part is a str, ImageKey, VideoKey or InlineEmbedding, not {type(part).__name__}")


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 0  # 0 = the service's default
    temperature: float | None = None  # None or 0 = greedy
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False  # return each generated token's logprob
    top_logprobs: int = 0  # alternatives per token, 0..20; needs logprobs
    presence_penalty: float = 0.0  # -2..2; 0 = off
    frequency_penalty: float = 0.0  # -2..2; 0 = off

    def to_pb(self) -> llm_pb2.SamplingParams:
        params = llm_pb2.SamplingParams(
            max_tokens=self.max_tokens,
            stop=self.stop,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )
        if self.temperature is not None:
            params.temperature = self.temperature
        if self.top_p is not None:
            params.top_p = self.top_p
        if self.seed is not None:
            params.seed = self.seed
        return params


def generate_request(
    model: str, messages: list[Message], sampling: Sampling, request_id: str, single_chunk: bool = False
) -> llm_pb2.GenerateRequest:
    for message in messages:
        if not isinstance(message, Message):
            raise TypeError(f"messages is a list of Message, not of {type(message).__name__}")
    return llm_pb2.GenerateRequest(
        model=model, messages=[m.to_pb() for m in messages], sampling=sampling.to_pb(), request_id=request_id,
        single_chunk=single_chunk,
    )  # fmt: skip


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: bytes  # the token's exact UTF-8 bytes (token shows U+FFFD for a partial character)
    token_id: int


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float  # from the raw logits: before penalties, temperature and top_p
    bytes: bytes
    top_logprobs: list[TopLogprob]  # most likely first

    @classmethod
    def from_pb(cls, entry: llm_pb2.TokenLogprob) -> TokenLogprob:
        top = [TopLogprob(t.token, t.logprob, t.bytes, t.token_id) for t in entry.top_logprobs]
        return cls(entry.token, entry.logprob, entry.bytes, top)


@dataclass(frozen=True)
class GenerationChunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" on the last chunk
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when requested

    @classmethod
    def from_pb(cls, chunk: llm_pb2.GenerateChunk) -> GenerationChunk:
        finish = _FINISH_NAMES.get(chunk.finish_reason)
        logprobs = [TokenLogprob.from_pb(entry) for entry in chunk.logprobs]
        usage = chunk.usage
        return cls(chunk.text, list(chunk.token_ids), finish, usage.prompt_tokens, usage.completion_tokens, logprobs)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    accepted_encoder_ids: list[str]
    hidden_size: int
    engine: str

    @classmethod
    def from_pb(cls, info: llm_pb2.ModelInfo) -> ModelInfo:
        return cls(info.name, list(info.accepted_encoder_ids), info.hidden_size, info.engine)
