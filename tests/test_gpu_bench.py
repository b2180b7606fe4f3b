"""The GPU command's parts that can be checked without a GPU (bench/gpu/): its FLOP count, and that
everything it imports is on the GPU host or in the wheelhouse it carries there."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from bench.gpu.flops import tower_flops
from model_builders.tiny import build_tokenizer, tiny_config

REPO = Path(__file__).resolve().parent.parent
FIRST_PARTY = {"bench", "encoder_service", "llm_service", "shared", "model_builders", "scripts", "gateway", "tests"}
# What the GPU host has installed (DESIGN.md), besides what torch and transformers require.
HOST = {"torch", "transformers", "grpcio", "protobuf", "safetensors", "prometheus-client"}
# The processes the command starts: the measurements, and the encoder service they drive.
ENTRY_POINTS = ("bench/gpu/__main__.py", "encoder_service/__main__.py")


def test_flop_formula_equals_torch_flop_counter_on_the_tiny_tower() -> None:
    config = tiny_config(build_tokenizer()).vision_config
    # Eager attention: torch counts its matrix products on a CPU (the CPU SDPA kernel goes uncounted).
    tower = Qwen2VisionTransformerPretrainedModel._from_config(config, attn_implementation="eager").eval()
    grids = [(1, 8, 12), (1, 4, 4), (2, 4, 6)]  # the last: two frames, each attending to itself
    patches = sum(t * h * w for t, h, w in grids)
    pixel_values = torch.randn(patches, 3 * 2 * 14 * 14)
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        tower(pixel_values, grid_thw=torch.tensor(grids))
    assert tower_flops(config, grids) == counter.get_total_flops()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _plain_requirements(requirements: list[str] | None) -> set[str]:
    """Names of the requirements that apply without an extra."""
    names = set()
    for line in requirements or []:
        if "extra ==" not in line:
            names.add(_canonical(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0]))
    return names


def _module_file(name: str) -> Path | None:
    base = REPO.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _third_party_imports(entry_points: tuple[str, ...]) -> set[str]:
    """Top-level names of the non-stdlib, non-project modules imported by the entry points and by
    every project module they import, transitively."""
    found: set[str] = set()
    pending, seen = [REPO / path for path in entry_points], set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in FIRST_PARTY:
                    pending.extend(f for f in [_module_file(name)] if f is not None)
                elif top not in sys.stdlib_module_names:
                    found.add(top)
    return found


def test_what_the_gpu_command_imports_is_on_the_host_or_in_its_wheelhouse() -> None:
    requirements = (REPO / "bench/gpu/requirements.txt").read_text().splitlines()
    carried = _plain_requirements([line for line in requirements if line.strip() and not line.startswith("#")])
    host = {_canonical(name) for name in HOST}
    host |= _plain_requirements(metadata.requires("torch")) | _plain_requirements(metadata.requires("transformers"))
    distributions = metadata.packages_distributions()
    imported = _third_party_imports(ENTRY_POINTS)
    assert {"torch", "PIL", "redis", "grpc_health"} <= imported  # the walk reaches the service's modules
    missing = {}
    for module in sorted(imported):
        providers = {_canonical(d) for d in distributions.get(module, [module])}
        if not providers & (host | carried):
            missing[module] = sorted(providers)
    assert not missing, (
        f"imported by the GPU command, but neither on the host nor in bench/gpu/requirements.txt: {missing}"
    )
