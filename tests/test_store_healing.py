"""A bad value under an embedding key heals: the next encode of that image re-encodes it and
overwrites the value, whatever the value is (a list or hash, a video blob, another encoder's
blob, a blob whose dtype is not the encoder's); and read by key, a key holding no string holds no
blob (404 / NOT_FOUND, as Redis's MGET answers nil for it), not a store outage (503).

Against the whole stack (real Redis, encoder, LLM services and gateway); each test corrupts the
value under the key that the encode API returned for an image of its own. At the end, unit tests
of the codec's rule that a blob's metadata dtype is its tensor's."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable

import grpc
import httpx
import numpy as np
import pytest
import redis

from gateway.inline_embeds import inline_blob
from shared.blob import SCHEMA_VERSION, BlobRules, EmbeddingBlob, decode_blob, serialize_unvalidated, write_safetensors
from shared.errors import EmbeddingNotFound, InvalidEmbedding
from shared.pb.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from shared.sdk import EncoderClient, ImageKey, LLMClient, Message
from tests.harness import Stack
from tests.images import data_url, png_bytes


def _encode(stack: Stack, seed: int) -> dict:
    response = httpx.post(
        f"{stack.base_url}/v1/images/encode", json={"image_url": data_url(png_bytes(seed))}, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()


def _chat(stack: Stack, part: dict) -> httpx.Response:
    content = [part, {"type": "text", "text": "What?"}]
    body = {"model": "ft-b", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)


def _image_url(seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(png_bytes(seed))}}


def _images_encoded(stack: Stack) -> int:
    with EncoderClient(stack.encoder_target) as encoder:
        return encoder.stats().images_encoded


def _stored_blob(stack: Stack, key: str) -> EmbeddingBlob:
    """The value under `key`, which must be exactly what the encoder writes for an image."""
    client = stack.redis.client()
    assert client.type(key) == b"string"
    core = stack.encoder.core
    data = client.get(key)
    assert isinstance(data, bytes)
    blob = decode_blob(data, core.rules)
    assert (blob.modality, blob.dtype, blob.encoder_id) == ("image", "float32", core.encoder_id)
    return blob


def _as_video(blob: EmbeddingBlob) -> bytes:
    return serialize_unvalidated(EmbeddingBlob(blob.embeds, blob.grid_thw, blob.encoder_id, "video", blob.dtype))


def _of_another_encoder(blob: EmbeddingBlob) -> bytes:
    return serialize_unvalidated(EmbeddingBlob(blob.embeds, blob.grid_thw, "qwen2vl-other", "image", blob.dtype))


def _as_float16(blob: EmbeddingBlob) -> bytes:
    """A well-formed float16 blob, under the key of a float32 encoder."""
    embeds = blob.embeds.astype(np.float16)
    return serialize_unvalidated(EmbeddingBlob(embeds, blob.grid_thw, blob.encoder_id, "image", "float16"))


def _float16_labelled_float32(blob: EmbeddingBlob) -> bytes:
    """F16 data whose metadata says float32: the metadata lies about what the array holds."""
    tensors = {"image_embeds": ("F16", blob.embeds.astype("<f2")), "image_grid_thw": ("I64", blob.grid_thw)}
    metadata = {"schema": SCHEMA_VERSION, "encoder_id": blob.encoder_id, "modality": "image", "dtype": "float32"}
    return write_safetensors(tensors, metadata)


CORRUPT_BLOBS: dict[str, Callable[[EmbeddingBlob], bytes]] = {
    "video blob": _as_video,
    "another encoder's blob": _of_another_encoder,
    "float16 blob": _as_float16,
    "float16 data labelled float32": _float16_labelled_float32,
}


def _store_non_string(client: redis.Redis, key: str, kind: str) -> None:
    """What `redis-cli del K; rpush K x` (or hset) does to a key."""
    client.delete(key)
    if kind == "list":
        client.rpush(key, b"x")
    else:
        client.hset(key, "field", b"x")
    assert client.type(key) == kind.encode()


@pytest.mark.parametrize(("kind", "seed"), [("list", 8801), ("hash", 8802)])
def test_a_list_or_hash_under_a_key_is_replaced_by_the_next_encode(stack: Stack, kind: str, seed: int) -> None:
    first = _encode(stack, seed)
    original = _stored_blob(stack, first["key"])
    _store_non_string(stack.redis.client(), first["key"], kind)
    before = _images_encoded(stack)
    again = _encode(stack, seed)
    assert again["key"] == first["key"] and again["cache_hit"] is False
    assert _images_encoded(stack) - before == 1
    assert np.array_equal(_stored_blob(stack, first["key"]).embeds, original.embeds)


def test_an_image_url_chat_heals_a_list_under_its_images_key(stack: Stack) -> None:
    key = _encode(stack, 8803)["key"]
    _store_non_string(stack.redis.client(), key, "list")
    before = _images_encoded(stack)
    response = _chat(stack, _image_url(8803))
    assert response.status_code == 200, response.text
    assert _images_encoded(stack) - before == 1
    _stored_blob(stack, key)


def test_a_key_holding_a_list_is_not_found_when_read_by_key(stack: Stack) -> None:
    key = _encode(stack, 8804)["key"]
    client = stack.redis.client()
    _store_non_string(client, key, "list")
    try:
        response = _chat(stack, {"type": "image_embeds", "image_embeds": None, "uuid": key})
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "embedding_not_found"
        with LLMClient(stack.llm_target("ft-b")) as llm, pytest.raises(EmbeddingNotFound) as caught:
            list(llm.generate("ft-b", [Message("user", [ImageKey(key), "hi"])]))
        assert caught.value.keys == [key]
        with grpc.insecure_channel(stack.encoder_target) as channel, pytest.raises(grpc.RpcError) as raised:
            encoder_pb2_grpc.EncoderServiceStub(channel).GetEmbedding(
                encoder_pb2.GetEmbeddingRequest(key=key), timeout=30
            )
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND, raised.value.details()
    finally:
        client.delete(key)


@pytest.mark.parametrize(("corruption", "seed"), list(zip(CORRUPT_BLOBS, range(8811, 8815), strict=True)))
def test_a_stored_blob_this_encoder_would_not_write_is_re_encoded(stack: Stack, corruption: str, seed: int) -> None:
    first = _encode(stack, seed)
    original = _stored_blob(stack, first["key"])
    stack.redis.client().set(first["key"], CORRUPT_BLOBS[corruption](original), ex=600)
    before = _images_encoded(stack)
    again = _encode(stack, seed)
    assert again["key"] == first["key"] and again["cache_hit"] is False
    assert _images_encoded(stack) - before == 1
    assert np.array_equal(_stored_blob(stack, first["key"]).embeds, original.embeds)


@pytest.mark.parametrize(("corruption", "seed"), [("video blob", 8821), ("another encoder's blob", 8822)])
def test_an_image_url_chat_heals_a_blob_this_encoder_would_not_write(stack: Stack, corruption: str, seed: int) -> None:
    key = _encode(stack, seed)["key"]
    stack.redis.client().set(key, CORRUPT_BLOBS[corruption](_stored_blob(stack, key)), ex=600)
    response = _chat(stack, _image_url(seed))
    assert response.status_code == 200, response.text
    _stored_blob(stack, key)


# --- the codec: the metadata's dtype is the tensor's (unit) ------------------------------------

UNIT_RULES = BlobRules(merge_size=2, hidden_size=8, accepted_encoder_ids=frozenset({"enc-a"}))
UNIT_BLOB = EmbeddingBlob(np.arange(48, dtype=np.float32).reshape(6, 8), np.array([[1, 4, 6]]), "enc-a")


def test_a_blob_whose_metadata_names_another_dtype_than_its_tensor_is_invalid() -> None:
    with pytest.raises(InvalidEmbedding, match="metadata says dtype float32, but its tensor holds float16"):
        decode_blob(_float16_labelled_float32(UNIT_BLOB), UNIT_RULES)


def test_client_blobs_with_a_consistent_dtype_or_none_stay_accepted() -> None:
    half = UNIT_BLOB.embeds.astype("<f2")
    buffer = io.BytesIO()
    np.save(buffer, half)
    inline = inline_blob(base64.b64encode(buffer.getvalue()).decode(), [1, 4, 6], "enc-a", "image_embeds")
    assert decode_blob(inline, UNIT_RULES).dtype == "float16"
    tensors = {"image_embeds": ("F16", half), "image_grid_thw": ("I64", UNIT_BLOB.grid_thw)}
    undeclared = write_safetensors(tensors, {"schema": SCHEMA_VERSION, "encoder_id": "enc-a"})
    assert decode_blob(undeclared, UNIT_RULES).dtype == "float16"
