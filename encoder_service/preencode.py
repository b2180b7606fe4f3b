"""Pre-encodes a dataset's images so later questions only fetch stored embeddings.

    python -m encoder_service.preencode --encoder 127.0.0.1:50051 --manifest out.jsonl \
        images/ extra.png https://example.com/cat.png @more.txt

A SOURCE is an image file, a folder (searched recursively for IMAGE_SUFFIXES, sorted),
an http(s) URL, or `@list.txt` (one path or URL per line; blank lines and `#` comments
skipped; relative paths are relative to the list file). The manifest gets one JSON line
per image, in input order:
    {"source", "key", "grid_thw": [t, h, w], "num_tokens", "cache_hit"}
or, when that image failed (the run goes on):
    {"source", "error": {"code", "message"}}
Exit status: 0 all encoded, 1 some failed (or the manifest's reader went away), 2 usage error
(no sources, unreadable list file, a bad option) or an encoder that does not answer before the
first image (the manifest is not touched), 130 interrupted (Ctrl-C: the manifest holds, in order,
the images finished before; a rerun finds them stored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import stat
import sys
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from shared.errors import ServiceError
from shared.grpc_limits import DEFAULT_GRPC_MAX_MESSAGE_BYTES
from shared.sdk import AsyncEncoderClient, ChannelConfig, EncodedMedia
from shared.sdk.calls import call_timeout

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif"})
URL_PREFIXES = ("http://", "https://")
# Not a service error code: the file never reached the encoder.
UNREADABLE_CODE = "unreadable_file"
# A file bigger than this cannot go in one Encode call (the SDK's message limit): it is not read.
MAX_FILE_BYTES = DEFAULT_GRPC_MAX_MESSAGE_BYTES - 1024
TOO_LARGE_CODE = "too_large"

WINDOW_PER_SLOT = 4
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Bad arguments; reported before any image is sent."""


@dataclass
class Progress:
    """The bar plus the counts shown beside it."""

    bar: tqdm
    cache_hits: int = 0
    failed: int = 0
    written: int = 0  # manifest lines, in input order

    def done(self, record: dict[str, Any]) -> None:
        if "error" in record:
            self.failed += 1
        elif record["cache_hit"]:
            self.cache_hits += 1
        self.bar.set_postfix(cache_hits=self.cache_hits, failed=self.failed, refresh=False)
        self.bar.update(1)


def _folder_images(folder: Path) -> list[str]:
    files = (p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    return sorted(str(p) for p in files)


def _read_list(list_file: Path) -> list[str]:
    try:
        lines = list_file.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read list file {list_file}: {error}") from None
    entries = []
    for line in lines:
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        is_relative = not entry.startswith(URL_PREFIXES) and not Path(entry).is_absolute()
        entries.append(str(list_file.parent / entry) if is_relative else entry)
    return entries


def _expand_path_or_url(source: str) -> list[str]:
    if not source.startswith(URL_PREFIXES) and Path(source).is_dir():
        return _folder_images(Path(source))
    # A missing path is kept: it becomes a failure line, like a corrupt file.
    return [source]


def expand_sources(sources: list[str]) -> list[str]:
    """Files and URLs, in argument order; folders and list files expand in place.

    Lines of a list file are taken literally (a list cannot include another)."""
    expanded: list[str] = []
    for source in sources:
        entries = _read_list(Path(source[1:])) if source.startswith("@") else [source]
        for entry in entries:
            expanded.extend(_expand_path_or_url(entry))
    return expanded


def _error_record(source: str, code: str, message: str) -> dict[str, Any]:
    return {"source": source, "error": {"code": code, "message": message}}


def _success_record(source: str, image: EncodedMedia) -> dict[str, Any]:
    fields = {
        "key": image.key,
        "grid_thw": image.grid_thw,
        "num_tokens": image.num_tokens,
        "cache_hit": image.cache_hit,
    }
    return {"source": source, **fields}


class FileRefused(Exception):
    """A path that is not read: not a regular file (a FIFO would block, /dev/zero never end), or
    too big for one Encode call (it would be read whole, only for the call to refuse it)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def read_image_file(path: Path) -> bytes:
    info = path.stat()
    if not stat.S_ISREG(info.st_mode):
        raise FileRefused(UNREADABLE_CODE, "not a regular file")
    if info.st_size > MAX_FILE_BYTES:
        raise FileRefused(
            TOO_LARGE_CODE, f"file is {info.st_size} bytes; one Encode call carries at most {MAX_FILE_BYTES}"
        )
    return path.read_bytes()


async def encode_one(client: AsyncEncoderClient, source: str, pixels: tuple[int, int]) -> dict[str, Any]:
    """One manifest record; every expected failure becomes an error record."""
    min_pixels, max_pixels = pixels
    try:
        if source.startswith(URL_PREFIXES):
            image = await client.encode(image_url=source, min_pixels=min_pixels, max_pixels=max_pixels)
        else:
            data = await asyncio.to_thread(read_image_file, Path(source))
            image = await client.encode(image_bytes=data, min_pixels=min_pixels, max_pixels=max_pixels)
    except OSError as error:
        return _error_record(source, UNREADABLE_CODE, f"{type(error).__name__}: {error.strerror or error}")
    except FileRefused as error:
        return _error_record(source, error.code, error.message)
    except ServiceError as error:
        return _error_record(source, error.code, error.message)
    return _success_record(source, image)


def _write(out: TextIO, record: dict[str, Any], progress: Progress) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()
    progress.written += 1


async def run(args: argparse.Namespace, sources: list[str]) -> int:
    """Encodes every source with at most `args.concurrency` requests in flight."""
    config = ChannelConfig(token=args.token, tls_root_certs=args.tls_ca)
    async with AsyncEncoderClient(args.encoder, timeout_s=args.timeout, config=config) as client:
        try:  # before the manifest is opened (truncated): a wrong --encoder leaves it as it was
            await client.stats()
        except ServiceError as error:
            raise UsageError(f"cannot use the encoder: {error.message}") from None
        manifest = nullcontext(sys.stdout) if args.manifest is None else _create(args.manifest)
        progress = Progress(tqdm(total=len(sources), unit="img", file=sys.stderr, dynamic_ncols=True))
        try:
            with manifest as out:
                await encode_all(client, args, sources, out, progress)
        except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels this task, then raises KeyboardInterrupt
            progress.bar.close()
            print(
                f"interrupted: {progress.written} of {len(sources)} images in the manifest, in input order; "
                "a rerun finds them stored (cache hits)",
                file=sys.stderr,
            )
            raise
    progress.bar.close()
    print(f"{len(sources)} images: {progress.cache_hits} cache hits, {progress.failed} failed", file=sys.stderr)
    return EXIT_FAILED if progress.failed else EXIT_OK


async def encode_all(
    client: AsyncEncoderClient, args: argparse.Namespace, sources: list[str], out: TextIO, progress: Progress
) -> None:
    gate = asyncio.Semaphore(args.concurrency)
    pixels = (args.min_pixels, args.max_pixels)

    async def bounded(source: str) -> dict[str, Any]:
        async with gate:
            record = await encode_one(client, source, pixels)
        progress.done(record)
        return record

    # Lines are written in input order as soon as all before them are done (the
    # manifest can be followed with `tail -f`); tasks are created at most WINDOW_PER_SLOT
    # per slot ahead of the oldest unwritten one, so a million-image list stays cheap.
    pending: deque[asyncio.Task[dict[str, Any]]] = deque()
    try:
        for source in sources:
            pending.append(asyncio.create_task(bounded(source)))
            if len(pending) >= args.concurrency * WINDOW_PER_SLOT:
                _write(out, await pending.popleft(), progress)
        while pending:
            _write(out, await pending.popleft(), progress)
    finally:
        # Stopped early (the manifest's reader went away, Ctrl-C): the calls still open are
        # cancelled and awaited here. Left behind, they failed once the client closed, and asyncio
        # printed each unread failure with its traceback after our one line.
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _seconds(text: str) -> float | None:
    """--timeout, as the SDK reads a timeout (shared.sdk.calls.call_timeout)."""
    try:
        return call_timeout(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (got {text!r})") from None


def _file_bytes(text: str) -> bytes:
    try:
        return Path(text).read_bytes()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {error.strerror or error}") from None


def _token(text: str) -> str:
    """The token in a file, without the line end an editor or `echo` leaves after it."""
    try:
        token = _file_bytes(text).decode().strip()
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{text} does not hold a text token") from None
    if not token:
        raise argparse.ArgumentTypeError(f"{text} is empty")
    return token


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}")
        return value

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m encoder_service.preencode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder", default="127.0.0.1:50051", help="host:port of the encoder service")
    parser.add_argument("--concurrency", type=_at_least(1), default=8, help="most Encode calls in flight")
    parser.add_argument("--manifest", type=Path, help="JSONL output file (default: stdout)")
    parser.add_argument("--min-pixels", type=_at_least(0), default=0, help="resize floor (0 = the encoder's default)")
    parser.add_argument("--max-pixels", type=_at_least(0), default=0, help="resize ceiling (0 = the encoder's default)")
    parser.add_argument("--timeout", type=_seconds, default=120.0, help="seconds per Encode call (inf: no limit)")
    parser.add_argument(
        "--token-file",
        type=_token,
        dest="token",
        metavar="PATH",
        help="file holding the encoder's gRPC token (ENCODER_GRPC_TOKEN)",
    )
    parser.add_argument(
        "--tls-ca", type=_file_bytes, metavar="PATH", help="PEM roots that sign the encoder's TLS certificate"
    )
    parser.add_argument("sources", nargs="*", metavar="SOURCE", help="image file, folder, http(s) URL or @list.txt")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sources = expand_sources(args.sources)
        if not sources:
            raise UsageError("no images to encode (give files, folders, URLs or @list.txt)")
        return asyncio.run(run(args, sources))
    except UsageError as error:
        print(f"preencode: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `preencode ... | head`: the reader has what it wanted
        # Python flushes stdout again at exit, into the same broken pipe; send that nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("preencode: the manifest's reader went away (broken pipe); stopped", file=sys.stderr)
        return EXIT_FAILED


def _create(path: Path) -> TextIO:
    try:
        return path.open("w")
    except OSError as error:
        raise UsageError(f"cannot write manifest {path}: {error.strerror or error}") from None


if __name__ == "__main__":
    sys.exit(main())
