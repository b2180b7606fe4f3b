"""decode_blob's own safetensors reader and writer: zero-copy views, the layout checks safetensors
makes, and bytes that safetensors itself reads and writes (blobs stored before the codec left torch
still decode)."""

from __future__ import annotations

import json
import struct
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load as torch_load
from safetensors.torch import save as torch_save

from encoder_service.blob_arrays import blob_from_tensors
from llm_service.blob_tensors import embeds_tensor, grid_tensor
from shared.blob import BlobRules, EmbeddingBlob, decode_blob, encode_blob, serialize_unvalidated
from shared.errors import InvalidEmbedding

RULES = BlobRules(merge_size=2, hidden_size=8, accepted_encoder_ids=frozenset({"enc-a"}))
METADATA = {"schema": "1", "encoder_id": "enc-a", "modality": "image", "dtype": "float32"}
GRID = np.array([[1, 4, 6]])  # int64
ARANGE = np.arange(48, dtype=np.float32).reshape(6, 8)
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _randn(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape, dtype=np.float32)


def _blob_arrays(tensor: torch.Tensor) -> np.ndarray:
    """A tensor as a blob holds it: bfloat16 as its bits."""
    return tensor.view(torch.int16).numpy().view(np.uint16) if tensor.dtype == torch.bfloat16 else tensor.numpy()


def _raw(tensors: dict[str, dict], payload: bytes, metadata: dict | None = None, pad: int = 0) -> bytes:
    """safetensors bytes written by hand, so that they can break its rules."""
    header = json.dumps({"__metadata__": metadata or METADATA, **tensors}).encode() + b" " * pad
    return struct.pack("<Q", len(header)) + header + payload


def _good_parts() -> tuple[dict[str, dict], bytes]:
    tensors = {
        "image_embeds": {"dtype": "F32", "shape": [6, 8], "data_offsets": [0, 192]},
        "image_grid_thw": {"dtype": "I64", "shape": [1, 3], "data_offsets": [192, 216]},
    }
    return tensors, ARANGE.tobytes() + GRID.tobytes()


def test_decoded_arrays_are_read_only_views_of_the_fetched_bytes() -> None:
    data = encode_blob(EmbeddingBlob(_randn(6, 8), GRID, "enc-a"), RULES)
    base = np.frombuffer(data, np.uint8).ctypes.data
    blob = decode_blob(data, RULES)
    for array in (blob.embeds, blob.grid_thw):
        assert base <= array.ctypes.data < base + len(data) and not array.flags.writeable


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_blobs_written_by_safetensors_torch_decode_to_the_same_values(dtype: str) -> None:
    """Blobs stored before the codec left torch were written by safetensors.torch.save."""
    embeds, grid = torch.randn(12, 8).to(TORCH_DTYPES[dtype]), torch.tensor([[2, 4, 6]])
    metadata = {**METADATA, "modality": "video", "dtype": dtype}
    blob = decode_blob(torch_save({"video_embeds": embeds, "video_grid_thw": grid}, metadata=metadata), RULES)
    assert (blob.dtype, blob.modality, blob.encoder_id) == (dtype, "video", "enc-a")
    assert np.array_equal(blob.embeds, _blob_arrays(embeds)) and np.array_equal(blob.grid_thw, grid.numpy())


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_written_blobs_are_what_safetensors_torch_writes_and_reads(dtype: str) -> None:
    embeds, grid = torch.randn(6, 8).to(TORCH_DTYPES[dtype]), torch.tensor([[1, 4, 6]])
    ours = encode_blob(EmbeddingBlob(_blob_arrays(embeds), grid.numpy(), "enc-a", dtype=dtype), RULES)
    loaded = torch_load(ours)
    assert loaded.keys() == {"image_embeds", "image_grid_thw"}
    assert loaded["image_embeds"].dtype == embeds.dtype and torch.equal(loaded["image_embeds"], embeds)
    assert loaded["image_grid_thw"].dtype == torch.int64 and torch.equal(loaded["image_grid_thw"], grid)
    # Byte for byte what safetensors writes, but for the order of the metadata (safetensors'
    # own order varies from call to call; ours is fixed).
    theirs = torch_save({"image_embeds": embeds, "image_grid_thw": grid}, metadata={**METADATA, "dtype": dtype})
    header_length = struct.unpack("<Q", ours[:8])[0]
    assert theirs[:8] == ours[:8] and theirs[8 + header_length :] == ours[8 + header_length :]
    assert json.loads(theirs[8 : 8 + header_length]) == json.loads(ours[8 : 8 + header_length])


def test_hand_written_blob_decodes_even_when_its_data_is_misaligned() -> None:
    tensors, payload = _good_parts()
    for pad in (0, 1, 3):  # pad 1 and 3 put the float32 data at an odd address: copied, not viewed
        blob = decode_blob(_raw(tensors, payload, pad=pad), RULES)
        assert np.array_equal(blob.embeds, ARANGE) and blob.embeds.ctypes.data % 4 == 0
        assert blob.grid_thw.tolist() == [[1, 4, 6]]


def test_video_blobs_decode_as_video() -> None:
    embeds, grid = _randn(12, 8), np.array([[2, 4, 6]])
    blob = decode_blob(serialize_unvalidated(EmbeddingBlob(embeds, grid, "enc-a", "video")), RULES)
    assert blob.modality == "video" and np.array_equal(blob.embeds, embeds) and np.array_equal(blob.grid_thw, grid)


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_engines_get_the_stored_tensors_without_a_copy(dtype: str) -> None:
    embeds, grid = torch.randn(6, 8).to(TORCH_DTYPES[dtype]), torch.tensor([[1, 4, 6]])
    data = torch_save({"image_embeds": embeds, "image_grid_thw": grid}, metadata={**METADATA, "dtype": dtype})
    blob = decode_blob(data, RULES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's read-only warning is absorbed where tensors are made
        rows, grid_thw = embeds_tensor(blob), grid_tensor(blob)
    assert rows.dtype == embeds.dtype and torch.equal(rows, embeds) and torch.equal(grid_thw, grid)
    base = np.frombuffer(data, np.uint8).ctypes.data
    assert base <= rows.data_ptr() < base + len(data)


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_the_encoders_tensors_reach_an_engine_bit_for_bit(dtype: str) -> None:
    """Tower output -> blob (encoder) -> bytes -> blob -> engine tensors (LLM service)."""
    embeds, grid = torch.randn(6, 8).to(TORCH_DTYPES[dtype]), torch.tensor([[1, 4, 6]])
    blob = blob_from_tensors(embeds, grid, "enc-a", "image")
    assert blob.dtype == dtype
    decoded = decode_blob(encode_blob(blob, RULES), RULES)
    rows = embeds_tensor(decoded)
    assert rows.dtype == embeds.dtype and torch.equal(rows.view(torch.int16), embeds.view(torch.int16))
    assert torch.equal(grid_tensor(decoded), grid)


def test_uint16_embeddings_are_not_taken_for_bfloat16_bits() -> None:
    tensors, payload = _good_parts()
    tensors["image_embeds"] = {"dtype": "U16", "shape": [6, 8], "data_offsets": [0, 96]}
    tensors["image_grid_thw"]["data_offsets"] = [96, 120]
    with pytest.raises(InvalidEmbedding, match="dtype uint16 is not one of"):
        decode_blob(_raw(tensors, payload[:96] + payload[192:]), RULES)


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
    data = _raw(tensors, payload[:192] + GRID.astype(np.int32).tobytes())
    with pytest.raises(InvalidEmbedding, match=r"must be int64 \[n, 3\], got int32"):
        decode_blob(data, RULES)


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_one_non_finite_value_is_refused_on_read_and_huge_finite_values_are_not(dtype: str) -> None:
    torch_dtype = TORCH_DTYPES[dtype]
    huge = torch.full((6, 8), torch.finfo(torch_dtype).max, dtype=torch_dtype)  # sums overflow; values are finite
    data = serialize_unvalidated(EmbeddingBlob(_blob_arrays(huge), GRID, "enc-a", dtype=dtype))
    assert decode_blob(data, RULES).num_tokens == 6
    for bad in (float("nan"), float("inf"), float("-inf")):
        embeds = torch.randn(6, 8).to(torch_dtype)
        embeds[5, 7] = bad
        with pytest.raises(InvalidEmbedding, match="NaN or infinite"):
            decode_blob(serialize_unvalidated(EmbeddingBlob(_blob_arrays(embeds), GRID, "enc-a", dtype=dtype)), RULES)


def test_blobs_sharing_a_header_each_decode_their_own_values() -> None:
    # Blobs of one shape share their header byte for byte, and decode_blob parses a header once.
    tensors, payload = _good_parts()
    first = decode_blob(_raw(tensors, payload), RULES)
    other_values = np.full((6, 8), -2.5, np.float32).tobytes() + payload[192:]
    second = decode_blob(_raw(tensors, other_values), RULES)
    assert np.array_equal(first.embeds, ARANGE)
    assert np.array_equal(second.embeds, np.full((6, 8), -2.5, np.float32))
    # The same header over data of another length is checked again, not taken from the cache.
    with pytest.raises(InvalidEmbedding, match="tensors cover 216 bytes of 220"):
        decode_blob(_raw(tensors, payload + b"\0" * 4), RULES)
    # And a header too large to keep is still parsed and checked.
    with pytest.raises(InvalidEmbedding, match="tensors cover 216 bytes of 220"):
        decode_blob(_raw(tensors, payload + b"\0" * 4, pad=8192), RULES)
    assert np.array_equal(decode_blob(_raw(tensors, payload, pad=8192), RULES).embeds, first.embeds)
