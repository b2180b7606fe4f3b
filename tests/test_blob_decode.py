"""decode_blob's own safetensors reader: zero-copy views, and the layout checks safetensors makes."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from shared.blob import BlobRules, EmbeddingBlob, decode_blob, encode_blob, serialize_unvalidated
from shared.errors import InvalidEmbedding

RULES = BlobRules(merge_size=2, hidden_size=8, accepted_encoder_ids=frozenset({"enc-a"}))
METADATA = {"schema": "1", "encoder_id": "enc-a", "modality": "image", "dtype": "float32"}


def _raw(tensors: dict[str, dict], payload: bytes, metadata: dict | None = None, pad: int = 0) -> bytes:
    """safetensors bytes written by hand, so that they can break its rules."""
    header = json.dumps({"__metadata__": metadata or METADATA, **tensors}).encode() + b" " * pad
    return struct.pack("<Q", len(header)) + header + payload


def _good_parts() -> tuple[dict[str, dict], bytes]:
    embeds, grid = torch.arange(48, dtype=torch.float32).reshape(6, 8), torch.tensor([[1, 4, 6]])
    tensors = {
        "image_embeds": {"dtype": "F32", "shape": [6, 8], "data_offsets": [0, 192]},
        "image_grid_thw": {"dtype": "I64", "shape": [1, 3], "data_offsets": [192, 216]},
    }
    return tensors, embeds.numpy().tobytes() + grid.numpy().tobytes()


def test_decoded_tensors_are_views_of_the_fetched_bytes() -> None:
    data = encode_blob(EmbeddingBlob(torch.randn(6, 8), torch.tensor([[1, 4, 6]]), "enc-a"), RULES)
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    blob = decode_blob(data, RULES)
    for tensor in (blob.embeds, blob.grid_thw):
        assert base <= tensor.data_ptr() < base + len(data)


def test_hand_written_blob_decodes_even_when_its_data_is_misaligned() -> None:
    tensors, payload = _good_parts()
    for pad in (0, 1, 3):  # pad 1 and 3 put the float32 data at an odd address: copied, not viewed
        blob = decode_blob(_raw(tensors, payload, pad=pad), RULES)
        assert torch.equal(blob.embeds, torch.arange(48, dtype=torch.float32).reshape(6, 8))
        assert blob.grid_thw.tolist() == [[1, 4, 6]]


def test_video_blobs_decode_as_video() -> None:
    embeds, grid = torch.randn(12, 8), torch.tensor([[2, 4, 6]])
    blob = decode_blob(serialize_unvalidated(EmbeddingBlob(embeds, grid, "enc-a", "video")), RULES)
    assert blob.modality == "video" and torch.equal(blob.embeds, embeds) and torch.equal(blob.grid_thw, grid)


def _broken(change: str) -> bytes:
    tensors, payload = _good_parts()
    embeds, grid = tensors["image_embeds"], tensors["image_grid_thw"]
    if change == "overlap":
        grid["data_offsets"] = [188, 212]
        payload = payload[:212]
    elif change == "gap":
        grid["data_offsets"] = [196, 220]
        payload += b"\0" * 4
    elif change == "trailing bytes":
        payload += b"\0" * 8
    elif change == "short data":
        payload = payload[:-8]
    elif change == "shape":
        embeds["shape"] = [6, 7]
    elif change == "dtype":
        embeds["dtype"] = "F33"
    elif change == "bool in shape":
        embeds["shape"] = [6, True]
    elif change == "no offsets":
        del grid["data_offsets"]
    elif change == "metadata":
        return _raw(tensors, payload, {**METADATA, "extra": 1})
    return _raw(tensors, payload)


@pytest.mark.parametrize(
    "change",
    ["overlap", "gap", "trailing bytes", "short data", "shape", "dtype", "bool in shape", "no offsets", "metadata"],
)
def test_blobs_that_break_the_safetensors_layout_are_refused(change: str) -> None:
    with pytest.raises(InvalidEmbedding, match="not a valid safetensors blob"):
        decode_blob(_broken(change), RULES)


def test_an_int32_grid_is_refused_on_read_with_the_write_message() -> None:
    tensors, payload = _good_parts()
    tensors["image_grid_thw"] = {"dtype": "I32", "shape": [1, 3], "data_offsets": [192, 204]}
    data = _raw(tensors, payload[:192] + torch.tensor([[1, 4, 6]], dtype=torch.int32).numpy().tobytes())
    with pytest.raises(InvalidEmbedding, match=r"must be int64 \[n, 3\], got torch.int32"):
        decode_blob(data, RULES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_non_finite_value_is_refused_on_read_and_huge_finite_values_are_not(dtype: torch.dtype) -> None:
    grid = torch.tensor([[1, 4, 6]])
    huge = torch.full((6, 8), torch.finfo(dtype).max, dtype=dtype)  # sums overflow; values are finite
    assert decode_blob(serialize_unvalidated(EmbeddingBlob(huge, grid, "enc-a")), RULES).num_tokens == 6
    for bad in (float("nan"), float("inf"), float("-inf")):
        embeds = torch.randn(6, 8).to(dtype)
        embeds[5, 7] = bad
        with pytest.raises(InvalidEmbedding, match="NaN or infinite"):
            decode_blob(serialize_unvalidated(EmbeddingBlob(embeds, grid, "enc-a")), RULES)


def test_blobs_sharing_a_header_each_decode_their_own_values() -> None:
    # Blobs of one shape share their header byte for byte, and decode_blob parses a header once.
    tensors, payload = _good_parts()
    first = decode_blob(_raw(tensors, payload), RULES)
    other_values = torch.full((6, 8), -2.5).numpy().tobytes() + payload[192:]
    second = decode_blob(_raw(tensors, other_values), RULES)
    assert torch.equal(first.embeds, torch.arange(48, dtype=torch.float32).reshape(6, 8))
    assert torch.equal(second.embeds, torch.full((6, 8), -2.5))
    # The same header over data of another length is checked again, not taken from the cache.
    with pytest.raises(InvalidEmbedding, match="tensors cover 216 bytes of 220"):
        decode_blob(_raw(tensors, payload + b"\0" * 4), RULES)
    # And a header too large to keep is still parsed and checked.
    with pytest.raises(InvalidEmbedding, match="tensors cover 216 bytes of 220"):
        decode_blob(_raw(tensors, payload + b"\0" * 4, pad=8192), RULES)
    assert torch.equal(decode_blob(_raw(tensors, payload, pad=8192), RULES).embeds, first.embeds)
