"""The README documents every setting each service reads, every HTTP endpoint the gateway
serves and every command-line entry point the package installs or runs with `python -m`."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from fastapi.routing import APIRoute

from encoder_service.settings import EncoderSettings
from gateway.app import create_app
from gateway.settings import GatewaySettings
from llm_service.settings import LLMSettings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


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


def _as_documented(path: str) -> str:
    """A path parameter's converter ("{model:path}") is how it matches, not how a reader writes it."""
    return re.sub(r":\w+}", "}", path)


def test_readme_names_every_gateway_endpoint() -> None:
    """Each route as `METHOD /path`; FastAPI's own pages (/docs, /openapi.json, ...) aside."""
    app = create_app(GatewaySettings())
    own = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
    routes = [route for route in app.routes if isinstance(route, APIRoute) and route.path not in own]
    endpoints = {f"{method} {_as_documented(route.path)}" for route in routes for method in route.methods - {"HEAD"}}
    assert {"POST /v1/chat/completions", "GET /readyz"} <= endpoints
    missing = sorted(endpoint for endpoint in endpoints if f"`{endpoint}`" not in README)
    assert not missing, f"README lacks {missing}"


def _runnable_modules() -> list[str]:
    """Modules of the installed packages that run with `python -m`: a package's __main__.py, or a
    module with an `if __name__ == "__main__":` block."""
    packages = [name.rstrip("*") for name in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
    found = []
    for package in sorted(set(packages)):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            if path.name == "__main__.py":
                found.append(module.removesuffix(".__main__"))
            elif any(_is_main_guard(node) for node in ast.parse(path.read_text()).body):
                found.append(module)
    return found


def _is_main_guard(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)
    )


def test_readme_names_every_command_line_entry_point() -> None:
    modules = _runnable_modules()
    assert {"gateway", "encoder_service", "llm_service", "encoder_service.preencode"} <= set(modules)
    scripts = PYPROJECT["project"]["scripts"]
    missing = [f"python -m {m}" for m in modules if f"`python -m {m}" not in README]
    missing += [name for name in scripts if f"`{name}`" not in README]
    assert not missing, f"README lacks {missing}"
