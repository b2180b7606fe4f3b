"""gRPC security: a shared token (health stays open) and TLS, on a real LLM server."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llm_service.server import LLMServer, start_llm_server
from llm_service.settings import LLMSettings
from shared.errors import Unauthenticated, Unavailable
from shared.pb.llm.v1 import llm_pb2, llm_pb2_grpc
from shared.sdk import ChannelConfig, LLMClient, Message, Sampling
from tests.harness import BackgroundLoop, Stack


@contextmanager
def _serve(stack: Stack, background_loop: BackgroundLoop, **security: str) -> Iterator[LLMServer]:
    """A second LLM server sharing ft-a's loaded model, with the given security settings."""
    settings = LLMSettings(checkpoint="unused", model_name="ft-a", host="127.0.0.1", port=0, **security)
    server = background_loop.run(start_llm_server(settings, core=stack.llms["ft-a"].core))
    yield server
    background_loop.run(server.running.server.stop(0))


@pytest.fixture(scope="module")
def token_server(stack: Stack, background_loop: BackgroundLoop) -> Iterator[LLMServer]:
    with _serve(stack, background_loop, grpc_token="s3cret-token") as server:
        yield server


def _ask(target: str, config: ChannelConfig | None = None) -> str:
    with LLMClient(target, timeout_s=30, config=config) as llm:
        return "".join(c.text for c in llm.generate("ft-a", [Message("user", ["hi"])], Sampling(max_tokens=2)))


def test_calls_without_the_token_are_refused_but_health_is_open(token_server: LLMServer) -> None:
    target = f"127.0.0.1:{token_server.port}"
    with pytest.raises(Unauthenticated):
        _ask(target)
    with pytest.raises(Unauthenticated):
        _ask(target, ChannelConfig(token="wrong"))
    assert isinstance(_ask(target, ChannelConfig(token="s3cret-token")), str)
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_bearer_scheme_is_read_in_any_case_and_the_token_exactly(token_server: LLMServer) -> None:
    """HTTP reads an auth scheme in any case (RFC 9110): `bearer <token>` was refused."""
    request = llm_pb2.GenerateRequest(
        model="ft-a", messages=[llm_pb2.ChatMessage(role="user", content=[llm_pb2.ContentPart(text="hi")])]
    )
    request.sampling.max_tokens = 1
    with grpc.insecure_channel(f"127.0.0.1:{token_server.port}") as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        for header in ("bearer s3cret-token", "BEARER s3cret-token", "Bearer s3cret-token"):
            assert list(stub.Generate(request, metadata=(("authorization", header),), timeout=30))
        for header in ("Bearer S3CRET-TOKEN", "Bearer  s3cret-token", "s3cret-token", "Basic s3cret-token"):
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request, metadata=(("authorization", header),), timeout=30))
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, header


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tls_serves_clients_that_trust_the_certificate(
    stack: Stack, background_loop: BackgroundLoop, tls_files: tuple[Path, Path]
) -> None:
    cert, key = tls_files
    with _serve(stack, background_loop, grpc_tls_cert_file=str(cert), grpc_tls_key_file=str(key)) as server:
        target = f"localhost:{server.port}"
        assert isinstance(_ask(target, ChannelConfig(tls_root_certs=cert.read_bytes())), str)
        with pytest.raises(Unavailable):
            _ask(target)  # plaintext client against a TLS server
