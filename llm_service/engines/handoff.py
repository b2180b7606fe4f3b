"""Embeddings handed to vLLM's engine as files in shared memory instead of inside each request.

Inline, every request carries its images' rows (0.8 MB for a 448x448 image at hidden 1536,
bfloat16) from this process to vLLM's EngineCore and on to its worker: two serialisations and
copies per request, even when the worker's encoder cache already holds the item (vLLM's
processor cache, which spares such repeats, skips embedding inputs). Handed off, the service
writes each item once, as `<dir>/<sha256 of its uuid>.safetensors` in the model's dtype, and
sends only the grid; vLLM's scheduler asks our connector (handoff_connector.py) whether the file
exists and, only when the worker's encoder cache misses, the worker loads it.

The one rule that keeps the engine alive: a file exists while any request naming it is live,
and for GRACE_S after (an abort reaches EngineCore a step late). Files beyond that are deleted
least recently used first once the directory holds more than its budget; a new item that would
not fit is sent inline instead, as is an item without a uuid or one the disk refused. The
directory goes when the engine closes; one left by a killed service is removed by the next to start.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save

logger = logging.getLogger(__name__)

TENSOR_NAME = "embeds"
# An abort is sent to EngineCore without waiting; a step already scheduled may still load the file.
GRACE_S = 60.0
SHARED_MEMORY = Path("/dev/shm")
PREFIX = "llm-handoff-"
OWNER_LOCK = ".owner"  # flock'd while the directory's service lives (across pid namespaces too)


def handoff_path(directory: Path, identifier: str) -> Path:
    """The file for one item: named by a hash, since a uuid may hold any character."""
    return directory / f"{hashlib.sha256(identifier.encode()).hexdigest()}.safetensors"


@dataclass
class _File:
    size: int
    rows: torch.Size
    holders: int = 0
    released_at: float = 0.0


class HandoffFiles:
    """The handed-off items of one engine; one event loop uses it (no locking)."""

    def __init__(
        self, dtype: torch.dtype, max_bytes: int, parent: Path | None = None, grace_s: float = GRACE_S
    ) -> None:
        if parent is None:
            parent = SHARED_MEMORY if SHARED_MEMORY.is_dir() else Path(tempfile.gettempdir())
        _remove_orphans(parent)
        # Locked under a name the sweep ignores, then renamed: never seen unlocked.
        making = Path(tempfile.mkdtemp(prefix=f".{PREFIX}", dir=parent))
        self._owner = open(making / OWNER_LOCK, "wb")  # noqa: SIM115 (held open for the directory's life)
        fcntl.flock(self._owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.directory = making.with_name(making.name[1:])
        making.rename(self.directory)
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.grace_s = grace_s
        self._files: OrderedDict[str, _File] = OrderedDict()  # uuid -> file, least recently used first
        self._bytes = 0

    def hold(self, uuid: str, rows: torch.Tensor) -> bool:
        """Makes the item's file exist and keeps it until release(uuid); False where it could not
        (over budget, a write error): the caller sends that item inline."""
        file = self._files.get(uuid)
        if file is None:
            file = self._write(uuid, rows)
            if file is None:
                return False
        elif file.rows != rows.shape:  # one uuid, other rows (a rewritten blob): not the file's to answer
            return False
        file.holders += 1
        self._files.move_to_end(uuid)
        return True

    def has(self, uuid: str) -> bool:
        return uuid in self._files

    def release(self, uuid: str) -> None:
        file = self._files.get(uuid)
        if file is None:  # closed meanwhile: a request ending after its engine shut down
            return
        file.holders -= 1
        file.released_at = time.monotonic()

    def forget(self, uuid: str) -> None:
        """The engine found no file for this item (deleted behind our back): the next hold writes
        it again, instead of every later request naming a file that is gone."""
        file = self._files.pop(uuid, None)
        if file is not None:
            self._bytes -= file.size
            handoff_path(self.directory, uuid).unlink(missing_ok=True)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        self._owner.close()
        self._files.clear()
        self._bytes = 0

    def _write(self, uuid: str, rows: torch.Tensor) -> _File | None:
        data = save({TENSOR_NAME: rows.detach().to("cpu", self.dtype).contiguous()})
        if not self._make_room(len(data)):
            return None
        part: str | None = None
        try:  # written whole under another name, then renamed: the engine never sees half a file
            descriptor, part = tempfile.mkstemp(dir=self.directory, suffix=".part")
            with os.fdopen(descriptor, "wb") as out:
                out.write(data)
            os.replace(part, handoff_path(self.directory, uuid))
        except OSError as error:  # a full or missing tmpfs: inline still works
            logger.warning("handing embeddings off to vLLM as a file failed (%s); sending them inline", error)
            if part is not None:
                Path(part).unlink(missing_ok=True)
            return None
        file = self._files[uuid] = _File(len(data), rows.shape)
        self._bytes += file.size
        return file

    def _make_room(self, size: int) -> bool:
        """Deletes idle files past their grace, oldest use first, until `size` more bytes fit."""
        now = time.monotonic()
        for uuid, file in list(self._files.items()):
            if self._bytes + size <= self.max_bytes:
                break
            if file.holders == 0 and now - file.released_at >= self.grace_s:
                handoff_path(self.directory, uuid).unlink(missing_ok=True)
                del self._files[uuid]
                self._bytes -= file.size
        return self._bytes + size <= self.max_bytes


def _remove_orphans(parent: Path) -> None:
    """Directories of services that died without closing their engine (SIGKILL, OOM killer): a
    lock nobody holds."""
    for directory in parent.glob(f"{PREFIX}*"):
        try:
            with open(directory / OWNER_LOCK, "rb") as owner:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its service is alive
            continue
        except OSError:  # gone meanwhile, or not ours to open
            continue
        shutil.rmtree(directory, ignore_errors=True)
