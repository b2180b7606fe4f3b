"""Layers that do not lean on each other, checked in fresh interpreters: the SDK depends on
contracts only (no server runtime, no model code), the gateway loads no model code, and the
servers never load the builder of test checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Starts processes of its own (see the tiers in tests/conftest.py).
pytestmark = pytest.mark.integration


def _loaded(module: str, candidates: tuple[str, ...]) -> list[str]:
    """Which of `candidates` a fresh interpreter has loaded after importing `module`."""
    probe = f"import json, sys, {module}; print(json.dumps([m for m in {candidates!r} if m in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(result.stdout)


def test_importing_the_sdk_loads_no_server_runtime() -> None:
    runtime_or_models = ("redis", "prometheus_client", "pydantic_settings", "torch", "transformers", "fastapi")
    assert _loaded("shared.sdk", runtime_or_models) == []


def test_the_gateway_and_the_blob_codec_load_no_model_code() -> None:
    """The gateway only checks and forwards blobs: it works on bytes and numpy (shared/blob.py)."""
    for module in ("gateway.app", "shared.blob", "gateway.inline_embeds"):
        assert _loaded(module, ("torch", "transformers", "safetensors")) == [], module


def test_servers_do_not_load_the_test_checkpoint_builder() -> None:
    for server in ("encoder_service.server", "llm_service.server"):
        assert _loaded(server, ("model_builders.tiny", "model_builders.bench")) == [], server
