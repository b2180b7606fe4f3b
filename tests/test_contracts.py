"""Unit tests of the contracts in shared/: blob codec and invariants, keys, error mapping, stubs."""

from __future__ import annotations

import filecmp
import pickle
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from shared.blob import BlobRules, EmbeddingBlob, decode_blob, encode_blob
from shared.errors import (
    EmbeddingNotFound,
    IncompatibleEncoder,
    InvalidEmbedding,
    InvalidInput,
    ModelNotFound,
    NotFound,
    Unavailable,
    error_class_for,
)
from shared.keys import embedding_key, encoder_id_of_key

RULES = BlobRules(merge_size=2, hidden_size=8, accepted_encoder_ids=frozenset({"enc-a"}))
REPO = Path(__file__).resolve().parent.parent
GRID = np.array([[1, 4, 6]])  # int64


def _randn(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape, dtype=np.float32)


def _blob(
    rows: int = 6, hidden: int = 8, grid: list[list[int]] | None = None, encoder_id: str = "enc-a"
) -> EmbeddingBlob:
    return EmbeddingBlob(_randn(rows, hidden), np.array(grid or [[1, 4, 6]], dtype=np.int64), encoder_id)


def test_blob_round_trip_keeps_tensors_and_metadata() -> None:
    blob = _blob()
    decoded = decode_blob(encode_blob(blob, RULES), RULES)
    assert np.array_equal(decoded.embeds, blob.embeds) and decoded.dtype == "float32"
    assert np.array_equal(decoded.grid_thw, blob.grid_thw) and decoded.grid_thw.dtype == np.int64
    assert (decoded.encoder_id, decoded.modality, decoded.num_tokens) == ("enc-a", "image", 6)


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (EmbeddingBlob(_randn(1, 6, 8), GRID, "enc-a"), "2-D"),
        (_blob(rows=5), "implies 6"),
        (_blob(hidden=16), "hidden size is 16"),
        (_blob(grid=[[1, 3, 3]], rows=2), "divisible"),
        (_blob(grid=[[0, 4, 6]]), "positive"),
        (EmbeddingBlob(np.full((6, 8), np.nan, np.float32), GRID, "enc-a"), "NaN"),
        (EmbeddingBlob(_randn(6, 8), GRID.astype(np.int32), "enc-a"), "int64"),
        (EmbeddingBlob(_randn(6, 8).astype(np.float64), GRID, "enc-a", dtype="float64"), "is not one of"),
        (EmbeddingBlob(_randn(6, 8).astype(np.float16), GRID, "enc-a"), "the array is float16"),
    ],
)
def test_invariants_reject_bad_blobs_on_write(blob: EmbeddingBlob, message: str) -> None:
    with pytest.raises(InvalidEmbedding, match=message):
        encode_blob(blob, RULES)


def test_blob_from_another_encoder_is_incompatible() -> None:
    data = encode_blob(_blob(encoder_id="enc-b"), BlobRules(2, 8, frozenset({"enc-b"})))
    with pytest.raises(IncompatibleEncoder, match="enc-b"):
        decode_blob(data, RULES)


def test_invariants_are_checked_on_read_too() -> None:
    lenient = BlobRules(2, 16, frozenset({"enc-a"}))
    data = encode_blob(_blob(hidden=16), lenient)
    with pytest.raises(InvalidEmbedding, match="hidden size"):
        decode_blob(data, RULES)


@pytest.mark.parametrize("data", [b"", b"short", b"\xff" * 64, pickle.dumps({"image_embeds": [1, 2]})])
def test_garbage_and_pickle_are_refused_without_unpickling(data: bytes) -> None:
    with pytest.raises(InvalidEmbedding, match="safetensors"):
        decode_blob(data, RULES)


def test_keys_depend_on_bytes_pixel_options_and_dtype() -> None:
    base = embedding_key("enc-a", b"image", 100, 200, dtype="float32")
    assert base == embedding_key("enc-a", b"image", 100, 200, dtype="float32")
    assert (
        len(
            {
                base,
                embedding_key("enc-a", b"image2", 100, 200, dtype="float32"),
                embedding_key("enc-a", b"image", 100, 300, dtype="float32"),
                embedding_key("enc-b", b"image", 100, 200, dtype="float32"),
                embedding_key("enc-a", b"image", 100, 200, dtype="bfloat16"),
            }
        )
        == 5
    )
    assert base.startswith("emb:v1:enc-a:")
    assert encoder_id_of_key(base) == "enc-a"


@pytest.mark.parametrize("key", ["", "emb:v1:enc-a", "emb:v2:enc-a:" + "0" * 64, "x" * 5000])
def test_malformed_keys_are_invalid_input_and_not_echoed_in_full(key: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        encoder_id_of_key(key)
    assert len(caught.value.message) < 300


def test_status_codes_map_back_to_the_raised_class() -> None:
    assert error_class_for(grpc.StatusCode.NOT_FOUND, "model_not_found") is ModelNotFound
    assert error_class_for(grpc.StatusCode.NOT_FOUND, "embedding_not_found") is EmbeddingNotFound
    assert error_class_for(grpc.StatusCode.NOT_FOUND, None) is NotFound
    assert error_class_for(grpc.StatusCode.INVALID_ARGUMENT, "invalid_embedding") is InvalidEmbedding
    assert error_class_for(grpc.StatusCode.UNAVAILABLE, None) is Unavailable
    assert (ModelNotFound.kind.http_status, IncompatibleEncoder.kind.http_status, Unavailable.kind.http_status) == (
        404,
        409,
        503,
    )


@pytest.mark.integration  # runs grpc_tools' protoc in a subprocess
def test_generated_stubs_are_up_to_date(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(REPO / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True)
    comparison = filecmp.dircmp(tmp_path, REPO / "shared" / "pb")
    stale: list[str] = []

    def walk(cmp: filecmp.dircmp, prefix: str) -> None:
        _, mismatch, errors = filecmp.cmpfiles(cmp.left, cmp.right, cmp.common_files, shallow=False)
        stale.extend(prefix + name for name in mismatch + errors + cmp.left_only)
        for name, sub in cmp.subdirs.items():
            walk(sub, f"{prefix}{name}/")

    walk(comparison, "")
    stale = [name for name in stale if "__pycache__" not in name]
    assert not stale, f"stubs are stale, run `python scripts/gen_protos.py`: {stale}"


def test_large_finite_values_whose_sum_overflows_are_still_accepted() -> None:
    embeds = np.full((6, 8), 60000.0, dtype=np.float16)  # the float16 sum overflows to inf
    with np.errstate(over="ignore"):
        assert not np.isfinite(embeds.sum())
    decoded = decode_blob(encode_blob(EmbeddingBlob(embeds, GRID, "enc-a", dtype="float16"), RULES), RULES)
    assert np.array_equal(decoded.embeds, embeds) and decoded.dtype == "float16"
    embeds[3, 2] = np.inf
    with pytest.raises(InvalidEmbedding, match="infinite"):
        encode_blob(EmbeddingBlob(embeds, GRID, "enc-a", dtype="float16"), RULES)
