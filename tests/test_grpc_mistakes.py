"""Request bytes that are not the method's message are the caller's mistake: INVALID_ARGUMENT
naming the message type, on every method of both services, and the server keeps answering.

Sent raw (no serializer) to the real gRPC servers of the test stack, as a client built from
another proto version, or a buggy one in another language, could send them. Before the error
mapping took parse failures in hand, grpc answered these UNKNOWN ("Unexpected DecodeError"), a
server fault to any client.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from shared.pb.llm.v1 import llm_pb2
from tests.harness import Stack

# The model field (1) of a GenerateRequest as a string of bytes that are not UTF-8 (a string field;
# the other methods' requests get the corrupt case only).
BAD_UTF8 = (
    llm_pb2.GenerateRequest(model="ft-a", request_id="r").SerializeToString().replace(b"ft-a", b"\xff\xfe\xfd\xfc")
)
CORRUPT = b"\x0a\xff"  # field 1, length-delimited, with a length past the end of the message

METHODS = [
    ("llm", "/llm.v1.LLMService/Generate", "stream", "llm.v1.GenerateRequest"),
    ("llm", "/llm.v1.LLMService/ListModels", "unary", "llm.v1.ListModelsRequest"),
    ("encoder", "/encoder.v1.EncoderService/Encode", "unary", "encoder.v1.EncodeRequest"),
    ("encoder", "/encoder.v1.EncoderService/EncodeVideo", "unary", "encoder.v1.EncodeVideoRequest"),
    ("encoder", "/encoder.v1.EncoderService/GetEmbedding", "unary", "encoder.v1.GetEmbeddingRequest"),
    ("encoder", "/encoder.v1.EncoderService/GetStats", "unary", "encoder.v1.GetStatsRequest"),
    ("encoder", "/grpc.health.v1.Health/Check", "unary", "grpc.health.v1.HealthCheckRequest"),
]


def _target(stack: Stack, server: str) -> str:
    return stack.llm_target("ft-a") if server == "llm" else stack.encoder_target


def _call(channel: grpc.Channel, method: str, kind: str, data: bytes) -> None:
    if kind == "stream":
        for _ in channel.unary_stream(method)(data, timeout=30):
            pass
    else:
        channel.unary_unary(method)(data, timeout=30)


CASES = [(*method, CORRUPT, "corrupt") for method in METHODS] + [(*METHODS[0], BAD_UTF8, "bad-utf8")]


@pytest.mark.parametrize(
    ("server", "method", "kind", "message_type", "data", "damage"), CASES, ids=[f"{c[1]}-{c[5]}" for c in CASES]
)
def test_request_bytes_that_do_not_parse_are_invalid_argument(
    stack: Stack, server: str, method: str, kind: str, message_type: str, data: bytes, damage: str
) -> None:
    with grpc.insecure_channel(_target(stack, server)) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            _call(channel, method, kind, data)
        error = raised.value
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        assert message_type in error.details() and "does not parse" in error.details()
        assert dict(error.trailing_metadata() or ())["error-code"] == "invalid_value"
        # The same server still answers a well-formed call on the same connection.
        request = health_pb2.HealthCheckRequest(service="liveness").SerializeToString()
        reply = channel.unary_unary("/grpc.health.v1.Health/Check")(request, timeout=10)
        assert health_pb2.HealthCheckResponse.FromString(reply).status == health_pb2.HealthCheckResponse.SERVING
