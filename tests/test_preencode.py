"""`python -m encoder_service.preencode` as a real process against the real encoder."""

from __future__ import annotations

import functools
import http.server
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.sdk import EncoderClient
from tests.harness import Stack
from tests.http_server import QuietHandler, serving
from tests.images import png_bytes

# Starts processes of its own (see the tiers in tests/conftest.py).
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
# Seeds no other test encodes, so the first run here is a real encode, not a cache hit.
SEEDS = {"a.png": 9101, "b.png": 9102, "nested/deeper/c.png": 9103}


def preencode(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "encoder_service.preencode", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )


def manifest_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 PNGs (one in a nested folder), a corrupt PNG, and a file that is not an image."""
    root = tmp_path_factory.mktemp("dataset")
    for name, seed in SEEDS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(png_bytes(seed))
    (root / "broken.png").write_bytes(png_bytes(9104)[:150])
    (root / "notes.txt").write_text("skipped: not an image suffix")
    return root


@pytest.fixture(scope="module")
def file_server(dataset: Path) -> Iterator[str]:
    class Handler(http.server.SimpleHTTPRequestHandler, QuietHandler):
        pass

    with serving(functools.partial(Handler, directory=str(dataset))) as base_url:
        yield base_url


def test_folder_run_writes_ordered_manifest_and_fails_on_corrupt_file(
    stack: Stack, dataset: Path, tmp_path: Path
) -> None:
    manifest = tmp_path / "out.jsonl"
    missing = str(dataset / "missing.png")
    first = preencode(
        "--encoder", stack.encoder_target, "--concurrency", "1", "--manifest", str(manifest), str(dataset), missing
    )
    assert first.returncode == 1, first.stderr[-2000:]
    assert first.stdout == ""
    records = manifest_lines(manifest.read_text())
    expected_order = ["a.png", "b.png", "broken.png", "nested/deeper/c.png"]
    assert [r["source"] for r in records] == [str(dataset / name) for name in expected_order] + [missing]
    assert records[2]["error"]["code"] == "invalid_value" and "corrupt" in records[2]["error"]["message"]
    assert records[4]["error"]["code"] == "unreadable_file"
    good = [records[i] for i in (0, 1, 3)]
    assert all(not r["cache_hit"] for r in good)
    assert all(r["num_tokens"] * 4 == r["grid_thw"][0] * r["grid_thw"][1] * r["grid_thw"][2] for r in good)
    with EncoderClient(stack.encoder_target) as encoder:
        sdk_keys = [encoder.encode(image_bytes=(dataset / name).read_bytes()).key for name in SEEDS]
    assert [r["key"] for r in good] == sdk_keys
    assert "5 images: 0 cache hits, 2 failed" in first.stderr

    second = preencode("--encoder", stack.encoder_target, str(dataset))  # manifest on stdout
    assert second.returncode == 1
    again = manifest_lines(second.stdout)
    assert [r["key"] for r in again if "key" in r] == sdk_keys
    assert all(r["cache_hit"] for r in again if "key" in r)
    assert "4/4" in second.stderr and "cache_hits=3" in second.stderr


def test_list_file_with_comments_relative_paths_and_urls(
    stack: Stack, dataset: Path, file_server: str, tmp_path: Path
) -> None:
    list_file = dataset / "list.txt"
    list_file.write_text(f"# images for the VQA set\n\na.png\n   \n{dataset / 'nested'}\n{file_server}/b.png\n")
    run = preencode("--encoder", stack.encoder_target, f"@{list_file}")
    assert run.returncode == 0, run.stderr[-2000:]
    records = manifest_lines(run.stdout)
    assert [r["source"] for r in records] == [
        str(dataset / "a.png"),
        str(dataset / "nested/deeper/c.png"),
        f"{file_server}/b.png",
    ]
    with EncoderClient(stack.encoder_target) as encoder:
        assert records[2]["key"] == encoder.encode(image_bytes=png_bytes(SEEDS["b.png"])).key


@pytest.mark.parametrize(
    "args",
    [[], ["{empty}"], ["@/nonexistent/list.txt"], ["--concurrency", "0", "x.png"]],
    ids=["none", "empty-folder", "no-list", "bad-flag"],
)
def test_usage_errors_exit_2_without_contacting_the_encoder(args: list[str], tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    run = preencode("--encoder", "127.0.0.1:1", *(arg.format(empty=tmp_path / "empty") for arg in args))
    assert run.returncode == 2 and run.stdout == ""
