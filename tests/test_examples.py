"""The SDK and openai examples in examples/ run as real processes against the stack."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.sdk import EncoderClient
from tests.harness import Stack
from tests.images import png_bytes

REPO = Path(__file__).resolve().parent.parent


def run_sync_example(stack: Stack, model: str, image_file: Path) -> subprocess.CompletedProcess[str]:
    targets = ("--encoder", stack.encoder_target, "--llm", stack.llm_target("ft-a"))
    return run_example("sdk_sync.py", *targets, "--model", model, str(image_file))


def run_example(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, f"examples/{name}", *args], cwd=REPO, capture_output=True, text=True, timeout=180
    )


@pytest.fixture(scope="module")
def image_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("examples") / "picture.png"
    path.write_bytes(png_bytes(9201))
    return path


@pytest.fixture(scope="module")
def image_key(stack: Stack, image_file: Path) -> str:
    with EncoderClient(stack.encoder_target) as encoder:
        return encoder.encode(image_bytes=image_file.read_bytes()).key


def test_sdk_sync_encodes_streams_an_answer_and_prints_stats(stack: Stack, image_file: Path, image_key: str) -> None:
    run = run_sync_example(stack, "ft-a", image_file)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"encoded: {image_key} grid_thw=[" in run.stdout
    # Answers are free text (tiny random models may emit newlines): read them between markers.
    assert re.search(r"^\[ft-a\] (.+?)\nfinish: ", run.stdout, flags=re.M | re.S)
    assert re.search(r"^finish: (length|stop) \(prompt \d+, completion [1-9]\d* tokens\)$", run.stdout, flags=re.M)
    assert re.search(r"^encoder stats: media_encoded=[1-9]\d* cache_hits=[1-9]", run.stdout, flags=re.M)


def test_sdk_sync_encodes_frames_as_one_video(stack: Stack, tmp_path: Path) -> None:
    frames = []
    for index in range(4):
        frames.append(tmp_path / f"frame{index}.png")
        frames[-1].write_bytes(png_bytes(9300 + index))
    targets = ("--encoder", stack.encoder_target, "--llm", stack.llm_target("ft-a"))
    run = run_example("sdk_sync.py", *targets, "--model", "ft-a", "--video", *map(str, frames))
    assert run.returncode == 0, run.stderr[-2000:]
    # Four frames of one size: two temporal patches.
    assert re.search(r"^encoded: emb:v1:\S+ grid_thw=\[2, \d+, \d+\]", run.stdout, flags=re.M)
    assert re.search(r"^finish: (length|stop) \(prompt \d+, completion [1-9]\d* tokens\)$", run.stdout, flags=re.M)


def test_sdk_sync_exits_non_zero_for_an_unknown_model(stack: Stack, image_file: Path) -> None:
    run = run_sync_example(stack, "nope", image_file)
    assert run.returncode == 1 and "model_not_found" in run.stderr


def test_sdk_async_asks_two_models_about_one_stored_image(stack: Stack, image_file: Path, image_key: str) -> None:
    models = [arg for name in ("ft-a", "ft-b") for arg in ("--model", f"{name}={stack.llm_target(name)}")]
    run = run_example("sdk_async.py", "--encoder", stack.encoder_target, *models, str(image_file))
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"encoded: {image_key} grid_thw=[" in run.stdout and "cache_hit=True" in run.stdout
    answers = re.search(
        r"^\[ft-a\] (.+?)\n\[ft-b\] (.+?)\nencoder stats: media_encoded=", run.stdout, flags=re.M | re.S
    )
    assert answers and all(text.strip() for text in answers.groups()), run.stdout


def test_openai_example_streamed_answer_equals_the_plain_one(stack: Stack, image_file: Path) -> None:
    run = run_example("openai_client.py", "--base-url", f"{stack.base_url}/v1", "--model", "ft-b", str(image_file))
    assert run.returncode == 0, run.stderr[-2000:]
    plain = re.search(
        r"^\[ft-b\] (.+?) \(finish: (length|stop), usage: (\d+) tokens\)\n", run.stdout, flags=re.M | re.S
    )
    streamed = re.search(r"^\[ft-b, streamed\] (.+?)\nstream usage: ", run.stdout, flags=re.M | re.S)
    assert plain and streamed, run.stdout
    assert streamed.group(1) == plain.group(1)  # greedy: the same tokens either way
    assert f"stream usage: {plain.group(3)} tokens" in run.stdout
    assert "models: ft-a, ft-b" in run.stdout
