"""The README documents every setting each service reads."""

from __future__ import annotations

from pathlib import Path

from encoder_service.settings import EncoderSettings
from gateway.settings import GatewaySettings
from llm_service.settings import LLMSettings

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _documented(prefix: str, name: str) -> bool:
    if name in ("host", "port"):
        return f"`{prefix}HOST` / `{prefix}PORT`" in README
    return any(f"`{p}{name.upper()}`" in README for p in (prefix, "*_"))


def test_readme_names_every_setting() -> None:
    services = ((EncoderSettings, "ENCODER_"), (LLMSettings, "LLM_"), (GatewaySettings, "GATEWAY_"))
    missing = [
        f"{prefix}{name.upper()}"
        for cls, prefix in services
        for name in cls.model_fields
        if not _documented(prefix, name)
    ]
    assert not missing, f"README lacks {missing}"
