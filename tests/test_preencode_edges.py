"""`python -m encoder_service.preencode` in bad moments, as a real process against a real encoder
process: options no call could meet, an encoder that does not answer, paths that are not files,
a reader that goes away, Ctrl-C. Each ends with its exit status and one line that says what
happened, never a traceback, and a manifest whose every line is whole."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tqdm import tqdm

from encoder_service.preencode import Progress, encode_all
from encoder_service.preencode import parse_args as preencode_args
from shared.sdk import AsyncEncoderClient
from tests.encoder_process import EncoderProcess
from tests.harness import RedisServer
from tests.images import png_bytes

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "encoder_service.preencode"]


@pytest.fixture(scope="module")
def many_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 images no other test encodes: at one call at a time, seconds of work."""
    folder = tmp_path_factory.mktemp("many")
    for index in range(300):
        (folder / f"img{index:03d}.png").write_bytes(png_bytes(96_000 + index, (448, 448)))
    return folder


def preencode(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize("timeout", ["0", "-1", "nan"])
def test_a_timeout_no_call_could_meet_is_a_usage_error(timeout: str, tmp_path: Path) -> None:
    """It was taken: every image failed "Deadline Exceeded", exit 1, as if the encoder were slow."""
    image = tmp_path / "a.png"
    image.write_bytes(png_bytes(1))
    run = preencode("--encoder", "127.0.0.1:1", "--timeout", timeout, str(image))
    assert (run.returncode, run.stdout) == (2, "")
    assert "argument --timeout: must be a positive number of seconds" in run.stderr


def test_an_encoder_that_does_not_answer_is_a_usage_error_and_leaves_the_manifest(tmp_path: Path) -> None:
    """A wrong --encoder reported every image failed (exit 1) and overwrote the last manifest."""
    image, manifest = tmp_path / "a.png", tmp_path / "out.jsonl"
    image.write_bytes(png_bytes(1))
    manifest.write_text("the last run's manifest\n")
    run = preencode("--encoder", "127.0.0.1:1", "--manifest", str(manifest), str(image))
    assert (run.returncode, run.stdout) == (2, "")
    assert "preencode: error: cannot use the encoder: encoder at 127.0.0.1:1 is unavailable" in run.stderr
    assert manifest.read_text() == "the last run's manifest\n"


def test_paths_that_are_not_files_fail_without_being_read(lone_encoder: EncoderProcess, tmp_path: Path) -> None:
    """A FIFO blocked the run forever, and a huge file was read whole before the SDK refused to send
    it (/dev/zero, not tried here, was read until the kernel killed the process at 16 GB)."""
    fifo, huge, good = tmp_path / "pipe.png", tmp_path / "huge.png", tmp_path / "good.png"
    os.mkfifo(fifo)
    with huge.open("wb") as file:
        file.truncate(100_000_000)  # sparse: no disk used
    good.write_bytes(png_bytes(96_999))
    run = preencode("--encoder", lone_encoder.target, str(fifo), str(huge), str(good), timeout=60)
    assert run.returncode == 1, run.stderr[-2000:]
    records = lines(run.stdout)
    assert [r.get("error", {}).get("code") for r in records] == [
        "unreadable_file",
        "too_large",
        None,
    ]
    assert records[0]["error"]["message"] == "not a regular file"
    assert records[1]["error"]["message"].startswith("file is 100000000 bytes; one Encode call carries at most")
    assert records[2]["num_tokens"] > 0


def test_ctrl_c_reports_what_the_manifest_holds_and_exits_130(
    lone_encoder: EncoderProcess, many_images: Path, tmp_path: Path
) -> None:
    manifest = tmp_path / "out.jsonl"
    args = ["--encoder", lone_encoder.target, "--concurrency", "1", "--manifest", str(manifest), str(many_images)]
    # Ctrl-C as at a terminal, however the suite was started: a shell starts a background job
    # (`.ci/run &`) with SIGINT ignored, which its children inherit, and Python then keeps it ignored.
    process = subprocess.Popen(
        [*COMMAND, *args], cwd=REPO, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not manifest.exists() or len(manifest.read_text().splitlines()) < 3:
        assert process.poll() is None and time.monotonic() < deadline, "the run should still be under way"
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    records = lines(manifest.read_text())
    assert process.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    assert 3 <= len(records) < 300
    assert f"interrupted: {len(records)} of 300 images in the manifest, in input order" in stderr
    assert [r["source"] for r in records] == [str(many_images / f"img{i:03d}.png") for i in range(len(records))]


def test_a_reader_that_goes_away_stops_the_run_with_one_line(lone_encoder: EncoderProcess, many_images: Path) -> None:
    """`preencode ... | head -1`: a BrokenPipeError traceback. The folder five times: more lines
    than a pipe's buffer holds, so the run is still writing when the reader leaves."""
    process = subprocess.Popen(
        [*COMMAND, "--encoder", lone_encoder.target, *[str(many_images)] * 5],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stderr is not None
    json.loads(process.stdout.readline())
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=60) == 1
    assert "Traceback" not in stderr
    assert "preencode: the manifest's reader went away (broken pipe); stopped" in stderr


class _GoneReader(io.StringIO):
    """A manifest whose reader went away at once: its first line meets a broken pipe."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_stopped_run_leaves_no_call_behind(lone_encoder: EncoderProcess, many_images: Path) -> None:
    """The run that stops on a broken pipe (above) left its other calls running; once the client
    closed they failed, and asyncio printed each unread failure with its traceback after the one
    line (seen in a CI rehearsal, the test above failing). Stopped, the run cancels and awaits them."""
    sources = [str(path) for path in sorted(many_images.iterdir())[:40]]
    args = preencode_args(["--encoder", lone_encoder.target, "--concurrency", "8"])

    async def scenario() -> set[asyncio.Task[object]]:
        async with AsyncEncoderClient(lone_encoder.target) as client:
            progress = Progress(tqdm(total=len(sources), disable=True))
            with pytest.raises(BrokenPipeError):
                await encode_all(client, args, sources, _GoneReader(), progress)
            return asyncio.all_tasks() - {asyncio.current_task()}  # type: ignore[operator]

    assert asyncio.run(scenario()) == set()


@pytest.fixture(scope="module")
def secured_encoder(
    checkpoints: dict[str, Path], redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EncoderProcess, Path, Path]]:
    """An encoder as deploy/ runs one: a token (ENCODER_GRPC_TOKEN), and here TLS too."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    folder = tmp_path_factory.mktemp("secured")
    cert, key, token = folder / "cert.pem", folder / "key.pem", folder / "token"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    token.write_text("s3cret-token\n")  # as `echo s3cret-token > token` writes it
    env = {"ENCODER_GRPC_TOKEN": "s3cret-token", "ENCODER_GRPC_TLS_CERT_FILE": str(cert)}
    process = EncoderProcess(
        checkpoints["base"], redis_server.url, folder / "encoder.log", cert.read_bytes(),
        ENCODER_GRPC_TLS_KEY_FILE=str(key), **env,
    )  # fmt: skip
    process.start()
    yield process, token, cert
    process.kill()


def test_an_encoder_with_a_token_and_tls_is_reachable(
    secured_encoder: tuple[EncoderProcess, Path, Path], tmp_path: Path
) -> None:
    """Every deployment in deploy/ sets ENCODER_GRPC_TOKEN, and the CLI had no way to send one:
    each image failed unauthenticated."""
    encoder, token, cert = secured_encoder
    image = tmp_path / "a.png"
    image.write_bytes(png_bytes(97_001))
    run = preencode("--encoder", encoder.target, "--token-file", str(token), "--tls-ca", str(cert), str(image))
    assert run.returncode == 0, run.stderr[-2000:]
    assert lines(run.stdout)[0]["num_tokens"] > 0
    no_token = preencode("--encoder", encoder.target, "--tls-ca", str(cert), str(image))
    assert no_token.returncode == 2 and "missing or invalid gRPC token" in no_token.stderr
    unreadable = preencode("--encoder", encoder.target, "--token-file", str(tmp_path / "none"), str(image))
    assert unreadable.returncode == 2 and "argument --token-file: cannot read" in unreadable.stderr
