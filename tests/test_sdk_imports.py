"""The SDK depends on contracts only: importing it loads no server runtime (Redis client,
Prometheus, settings machinery) and no model code. Checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

SERVER_OR_MODEL_MODULES = ("redis", "prometheus_client", "pydantic_settings", "torch", "transformers", "fastapi")


def test_importing_the_sdk_loads_no_server_runtime() -> None:
    probe = (
        f"import json, sys, shared.sdk; print(json.dumps([m for m in {SERVER_OR_MODEL_MODULES!r} if m in sys.modules]))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(loaded.stdout) == []
