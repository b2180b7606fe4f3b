"""Handing embeddings to vLLM as files (llm_service/engines/handoff.py): what exists when, on a real
filesystem. The engine side (vLLM loading them, a missing one) is in test_vllm_engine.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llm_service.engines.handoff import OWNER_LOCK, PREFIX, TENSOR_NAME, HandoffFiles, handoff_path

ROWS = torch.arange(4 * 8, dtype=torch.float32).reshape(4, 8)


def _size(parent: Path) -> int:
    """Bytes one ROWS file takes in bfloat16."""
    probe = HandoffFiles(torch.bfloat16, 1 << 20, parent=parent)
    probe.hold("probe", ROWS)
    size = handoff_path(probe.directory, "probe").stat().st_size
    probe.close()
    return size


@pytest.fixture
def parent(tmp_path: Path) -> Path:
    return tmp_path


def test_a_held_item_is_a_file_in_the_model_dtype_named_by_its_uuid_hash(parent: Path) -> None:
    files = HandoffFiles(torch.bfloat16, 1 << 20, parent=parent)
    assert files.hold("emb:v1:x:1/../weird", ROWS)
    path = handoff_path(files.directory, "emb:v1:x:1/../weird")
    assert path.parent == files.directory and len(path.stem) == 64
    stored = load_file(path)[TENSOR_NAME]
    assert stored.dtype == torch.bfloat16 and torch.equal(stored, ROWS.to(torch.bfloat16))
    assert sorted(p.name for p in files.directory.iterdir()) == sorted([OWNER_LOCK, path.name])  # no partial file
    files.close()
    assert not files.directory.exists()


def test_a_file_stays_while_held_and_for_its_grace_then_goes_when_room_is_needed(parent: Path) -> None:
    size = _size(parent)
    files = HandoffFiles(torch.bfloat16, 2 * size, parent=parent, grace_s=0.0)
    assert files.hold("a", ROWS) and files.hold("b", ROWS)
    assert not files.hold("c", ROWS)  # both held: no room, so "c" goes inline
    assert not handoff_path(files.directory, "c").exists()
    files.release("a")
    assert files.hold("c", ROWS)  # "a" is idle past its (zero) grace: it makes room
    assert not handoff_path(files.directory, "a").exists()
    assert handoff_path(files.directory, "b").exists() and handoff_path(files.directory, "c").exists()
    assert files.hold("b", ROWS)  # held twice: one release leaves it held
    files.release("b")
    assert not files.hold("d", ROWS) and handoff_path(files.directory, "b").exists()
    files.close()


def test_a_request_ending_after_close_releases_quietly(parent: Path) -> None:
    files = HandoffFiles(torch.bfloat16, 1 << 20, parent=parent)
    assert files.hold("a", ROWS)
    files.close()  # the engine shut down with the request still open
    files.release("a")
    assert not files.has("a") and not files.directory.exists()


def test_a_forgotten_item_is_written_again_by_the_next_hold(parent: Path) -> None:
    files = HandoffFiles(torch.bfloat16, 1 << 20, parent=parent)
    assert files.hold("a", ROWS)
    handoff_path(files.directory, "a").unlink()  # deleted behind our back; the engine said so
    files.forget("a")
    files.release("a")
    assert files.hold("a", ROWS) and handoff_path(files.directory, "a").is_file()
    files.close()


def test_other_rows_under_a_held_uuid_go_inline(parent: Path) -> None:
    files = HandoffFiles(torch.bfloat16, 1 << 20, parent=parent)
    assert files.hold("a", ROWS)
    assert not files.hold("a", ROWS[:2])  # the file holds 4 rows: it cannot answer for 2
    assert files.hold("a", ROWS.clone())
    files.close()


def test_an_idle_file_within_its_grace_is_kept(parent: Path) -> None:
    size = _size(parent)
    files = HandoffFiles(torch.bfloat16, size, parent=parent, grace_s=3600.0)
    assert files.hold("a", ROWS)
    files.release("a")  # an abort may still be on its way to the engine
    assert not files.hold("b", ROWS)
    assert handoff_path(files.directory, "a").exists()
    files.close()


def test_a_directory_that_cannot_be_written_sends_items_inline(parent: Path) -> None:
    files = HandoffFiles(torch.bfloat16, 1 << 20, parent=parent)
    shutil.rmtree(files.directory)  # e.g. a tmpfs that is full or was unmounted
    assert not files.hold("a", ROWS)
    files.directory.mkdir()
    assert files.hold("a", ROWS)  # nothing was recorded for the failed write
    files.close()


def test_a_killed_services_directory_is_removed_by_the_next(parent: Path) -> None:
    living = HandoffFiles(torch.bfloat16, 1 << 20, parent=parent)
    assert living.hold("a", ROWS)
    orphan = parent / f"{PREFIX}killed"  # its owner lock is held by nobody
    orphan.mkdir()
    (orphan / OWNER_LOCK).touch()
    (orphan / "x.safetensors").write_bytes(b"left behind")
    files = HandoffFiles(torch.bfloat16, 1 << 20, parent=parent)
    assert not orphan.exists()
    assert handoff_path(living.directory, "a").is_file()  # a live one stays, whatever its pid namespace
    files.close()
    living.close()
    assert list(parent.iterdir()) == []
