"""The layers of STYLE.md hold in the sources: a lower layer never imports a higher one.

    contracts  errors, keys, blob format, sampling limits, the gRPC error mapping, generated stubs
    runtime    gRPC server and interceptors, store, settings, logging, readiness
    sdk        the gRPC client SDK: contracts only
    services   encoder_service, llm_service, gateway: never each other
    builders   model_builders: test, benchmark and trained checkpoints; no service imports them
               (they may use the encoder's preprocessing: the shapes family trains on exactly the
               pixels the encoder serves)

Read from the source (every import statement, at any depth), so a lazy import counts too. A new
module of `shared/` must be given a layer here, or this test fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONTRACTS = {
    "shared", "shared.errors", "shared.keys", "shared.blob", "shared.sampling_limits", "shared.grpc_limits",
    "shared.grpc_errors", "shared.grpc_auth", "shared.grpc_wrap", "shared.pb",
}  # fmt: skip
RUNTIME = {
    "shared.grpc_server", "shared.grpc_metrics", "shared.store", "shared.redis_urls", "shared.settings",
    "shared.readiness", "shared.request_context", "shared.logging_setup", "shared.process_tree",
    "shared.model_paths", "shared.encoder_id", "shared.service_server", "shared.event_loop", "shared.tracing",
    "shared.gc_heap", "shared.progress_watch", "shared.grpc_subcalls",
}  # fmt: skip
SERVICES = ("encoder_service", "llm_service", "gateway")
# What each layer may import, besides itself.
ALLOWED = {
    "contracts": {"contracts"},
    "runtime": {"contracts", "runtime"},
    "sdk": {"contracts", "sdk"},
    "builders": {"contracts", "runtime", "builders", "encoder_service"},
}
# Third-party packages a layer must not load (the SDK and the gateway must not bring them).
HEAVY = {"torch", "transformers", "vllm", "redis", "fastapi", "prometheus_client", "pydantic_settings"}


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] in SERVICES:
        return parts[0]
    if parts[0] == "model_builders":
        return "builders"
    if parts[:2] == ["shared", "sdk"]:
        return "sdk"
    unit = ".".join(parts[:2])
    if unit in CONTRACTS:
        return "contracts"
    if unit in RUNTIME:
        return "runtime"
    raise AssertionError(f"{module} has no layer: add it to CONTRACTS or RUNTIME in tests/test_layers.py")


def _modules() -> dict[str, Path]:
    found = {}
    for top in ("shared", *SERVICES, "model_builders"):
        for path in (REPO / top).rglob("*.py"):
            if "pb" in path.relative_to(REPO).parts[:2]:
                continue
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from shared import readiness` imports the module shared.readiness.
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(MODULES)
            names |= submodules or {node.module}
    return names


MODULES = _modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_higher_layer(module: str) -> None:
    layer = _layer(module)
    wrong = []
    for name in _imports(MODULES[module]):
        top = name.split(".")[0]
        if top in ("shared", *SERVICES, "model_builders") and name != "shared":
            target = _layer(name)
            allowed = ALLOWED.get(layer, {"contracts", "runtime", "sdk", layer})
            if target not in allowed:
                wrong.append(f"{name} ({target})")
        elif top in HEAVY and layer in ("contracts", "sdk"):
            wrong.append(f"{name} (third-party server stack)")
    assert wrong == [], f"{module} ({layer}) imports {', '.join(sorted(wrong))}"
