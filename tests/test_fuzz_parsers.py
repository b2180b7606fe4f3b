"""Fuzzing the two parsers that read client or store bytes: the gateway's inline-embeddings parser
(base64 of .npy or safetensors) and the blob decoder every LLM service runs on what Redis returns.

For any input, only the domain errors of shared/errors.py may escape (a MemoryError, ValueError or
struct.error would be a 500), and memory stays bounded: the traced allocation peak of one parse is
a small multiple of the input, whatever its header claims. Inputs are random bytes, random
headers, and mutations (bit flips, truncations, header edits) of valid payloads. Derandomized, so
a CI run is reproducible.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import tracemalloc
from collections.abc import Callable

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.inline_embeds import inline_blob
from shared.blob import BlobRules, EmbeddingBlob, decode_blob, encode_blob
from shared.errors import ServiceError

HIDDEN = 8
ENCODER_ID = "qwen2vl-fuzz"
RULES = BlobRules(merge_size=2, hidden_size=HIDDEN, accepted_encoder_ids=frozenset({ENCODER_ID}))
FUZZ = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
# One parse may allocate a few copies of its input, plus fixed overhead; never what a header claims.
MEMORY_SLACK = 8 * 1024 * 1024


def _valid_blob() -> bytes:
    embeds = np.random.default_rng(0).standard_normal((4, HIDDEN), dtype=np.float32)
    blob = EmbeddingBlob(embeds, np.array([[1, 4, 4]]), ENCODER_ID)
    return encode_blob(blob, RULES)


def _valid_npy() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.random.default_rng(0).standard_normal((4, HIDDEN)).astype(np.float32))
    return buffer.getvalue()


def _npy_with_header(header: str, data: bytes) -> bytes:
    encoded = header.encode("latin1", errors="replace")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(encoded)) + encoded + data


def _safetensors_with_header(header: object, data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


def _mutated(valid: bytes) -> st.SearchStrategy[bytes]:
    """`valid` with some bytes overwritten, then maybe cut short or extended."""

    def mutate(edits: list[tuple[int, int]], cut: int | None, tail: bytes) -> bytes:
        data = bytearray(valid)
        for position, value in edits:
            data[position % len(data)] = value
        return bytes(data[:cut]) + tail if cut is not None else bytes(data) + tail

    return st.builds(
        mutate,
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8),
        st.none() | st.integers(0, len(valid)),
        st.binary(max_size=16),
    )


DIMENSION = st.integers(0, 2**40) | st.integers(0, 64)
NPY_HEADERS = st.builds(
    lambda descr, fortran, shape: f"{{'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {tuple(shape)!r}, }}",
    st.sampled_from(["<f4", "<f2", ">f4", "<f8", "|O", "<i8", "|u1", "V8", "<c8", "bogus"]),
    st.booleans(),
    st.lists(DIMENSION, max_size=4),
)
SAFETENSORS_ENTRY = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "F64", "U8", "XX"]),
    "shape": st.lists(DIMENSION, max_size=4),
    "data_offsets": st.lists(st.integers(0, 2**45) | st.integers(0, 4096), min_size=0, max_size=3),
})  # fmt: skip
SAFETENSORS_HEADERS = st.dictionaries(
    st.sampled_from(["image_embeds", "image_grid_thw", "video_embeds", "other", "__metadata__"]),
    SAFETENSORS_ENTRY | st.dictionaries(st.text(max_size=8), st.text(max_size=8)),
    max_size=4,
)

PAYLOADS = st.one_of(
    st.binary(max_size=4096),
    _mutated(_valid_npy()),
    _mutated(_valid_blob()),
    st.builds(_npy_with_header, NPY_HEADERS, st.binary(max_size=2048)),
    st.builds(_safetensors_with_header, SAFETENSORS_HEADERS, st.binary(max_size=2048)),
)


def _assert_only_domain_errors_and_bounded_memory(parse: Callable[[bytes], object], data: bytes) -> None:
    tracemalloc.start()
    try:
        parse(data)
    except ServiceError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 4 * len(data) + MEMORY_SLACK, f"{peak} bytes allocated for a {len(data)}-byte input"


# Found before: a .npy header claiming ~95 GiB made numpy allocate it (500).
NPY_CLAIMING_95_GIB = _npy_with_header(
    "{'descr': '<f4', 'fortran_order': False, 'shape': (100000000, 256), }", b"\0" * 64
)
# Found before: a safetensors header that is not UTF-8 raised AttributeError in the decoder (500).
NON_UTF8_HEADER = _valid_blob()[:8] + b"\x80" + _valid_blob()[9:]


@FUZZ
@example(NPY_CLAIMING_95_GIB, [1, 4, 4], "image")
@given(PAYLOADS, st.lists(st.integers(1, 64), min_size=3, max_size=3), st.sampled_from(["image", "video"]))
def test_inline_embeddings_parser_raises_only_domain_errors(payload: bytes, grid: list[int], modality: str) -> None:
    encoded = base64.b64encode(payload).decode()

    def parse(_: bytes) -> object:
        return inline_blob(encoded, grid, ENCODER_ID, "messages[0].content[0]", modality)  # type: ignore[arg-type]

    _assert_only_domain_errors_and_bounded_memory(parse, payload)


@FUZZ
@example(NON_UTF8_HEADER)
@example(NPY_CLAIMING_95_GIB)
@given(PAYLOADS)
def test_blob_decoder_raises_only_domain_errors(payload: bytes) -> None:
    _assert_only_domain_errors_and_bounded_memory(lambda data: decode_blob(data, RULES, "fuzzed"), payload)


def test_the_fuzz_inputs_include_valid_payloads() -> None:
    """The strategies reach the parsers' success paths too (a fuzz that only ever fails proves less)."""
    assert decode_blob(_valid_blob(), RULES).num_tokens == 4
    assert inline_blob(base64.b64encode(_valid_npy()).decode(), [1, 4, 4], ENCODER_ID, "p")
