"""Video: a list of frames becomes a t > 1 grid through the same encode-once path, and answers
equal transformers' own Qwen2-VL given the video's pixels (float32, greedy), on both engines."""

from __future__ import annotations

import base64
import io
import itertools
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI
from PIL import Image
from transformers import AutoConfig, AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from encoder_service.video import checkpoint_frame_bounds, preprocess_video
from llm_service.chat_request import MediaInput, PromptMessage
from llm_service.engines.base import EngineRequest, EngineShape, MediaItem
from llm_service.engines.transformers_engine import expand_pads
from llm_service.prompt import PromptBuilder
from shared.blob import BlobRules, Modality, decode_blob
from shared.errors import ServiceError
from shared.keys import embedding_key, video_key
from shared.sdk import EncoderClient, ImageKey, LLMClient, Message, Sampling, VideoKey
from tests.harness import Stack
from tests.images import data_url
from tests.model_fixtures import make_image
from tests.reference import reference_video_greedy_tokens

MAX_TOKENS = 10
# Over the tiny checkpoint's 50,176 pixels: AutoProcessor, and the encoder, resize the frames.
FRAME_SIZE = (300, 200)


def _frames(seed: int, count: int = 4) -> list[Image.Image]:
    return [make_image(seed * 100 + i, *FRAME_SIZE) for i in range(count)]


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _video_part(frames: list[Image.Image]) -> dict:
    return {"type": "video", "video": [data_url(_png(frame)) for frame in frames]}


def _ask(client: OpenAI, model: str, part: dict, question: str) -> str:
    reply = client.chat.completions.create(
        model=model,
        max_tokens=MAX_TOKENS,
        temperature=0,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": question}]}],
    )
    return reply.choices[0].message.content or ""


def _decode(checkpoint: Path, tokens: list[int]) -> str:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# --- preprocessing and keys (pure) ----------------------------------------------------------


def test_video_pixels_equal_transformers_video_processor() -> None:
    pytest.importorskip("torchvision")
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    frames = [make_image(seed, 84, 56) for seed in range(5)]  # odd count: the last frame is repeated
    pixels, grid = preprocess_video(Qwen2VLImageProcessorPil(), frames, 56 * 56, 28 * 28 * 100)
    video = torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1) for f in frames])
    expected = Qwen2VLVideoProcessor()(videos=[video], do_resize=False, do_sample_frames=False, return_tensors="pt")
    assert grid.tolist() == expected["video_grid_thw"].tolist() == [[3, 4, 6]]
    torch.testing.assert_close(pixels, expected["pixel_values_videos"], rtol=0, atol=1e-6)


def test_two_identical_frames_are_exactly_that_image() -> None:
    processor, frame = Qwen2VLImageProcessorPil(), make_image(3, 84, 56)
    image = processor(images=[frame], size={"shortest_edge": 3136, "longest_edge": 78400}, return_tensors="pt")
    pixels, grid = preprocess_video(processor, [frame, frame], 3136, 78400)
    assert torch.equal(pixels, image["pixel_values"]) and torch.equal(grid, image["image_grid_thw"])


def test_video_keys_depend_on_every_frame_and_their_order() -> None:
    a, b = _png(make_image(1, 28, 28)), _png(make_image(2, 28, 28))
    keys = {
        video_key("enc", [a, b], 1, 2, dtype="float32"),
        video_key("enc", [b, a], 1, 2, dtype="float32"),
        video_key("enc", [a + b], 1, 2, dtype="float32"),
        video_key("enc", [a, b], 1, 3, dtype="float32"),
        video_key("enc", [a], 1, 2, dtype="float32"),
        embedding_key("enc", a, 1, 2, dtype="float32"),
        video_key("enc", [a, b], 1, 2, dtype="bfloat16"),
    }
    assert len(keys) == 7


def test_prompt_pads_images_and_videos_in_order_and_expands_each_to_its_rows(checkpoints: dict[str, Path]) -> None:
    builder = PromptBuilder(AutoTokenizer.from_pretrained(checkpoints["base"]))
    order: list[Modality] = ["video", "image", "video"]
    ids = builder.build(
        [PromptMessage("user", [MediaInput(order[0]), "then", MediaInput(order[1]), MediaInput(order[2])])]
    )
    pads = {builder.image_token_id: "image", builder.video_token_id: "video"}
    assert [pads[token] for token in ids if token in pads] == order  # one pad per item
    shape = EngineShape.of(AutoConfig.from_pretrained(checkpoints["base"]))
    media = [
        MediaItem(m, torch.zeros(rows, shape.hidden_size), torch.tensor([[1, 1, 1]]))
        for m, rows in zip(order, (6, 2, 4), strict=True)
    ]
    expanded = expand_pads(EngineRequest("x", ids, media), shape)
    runs = [(pads[token], len(list(group))) for token, group in itertools.groupby(expanded) if token in pads]
    assert runs == [("video", 6), ("image", 2), ("video", 4)]


# --- through the services -------------------------------------------------------------------


@pytest.mark.parametrize("model", ["ft-a", "ft-b"])
def test_gateway_video_answers_equal_transformers_given_pixels(
    stack: Stack, openai_client: OpenAI, checkpoints: dict[str, Path], model: str
) -> None:
    outputs = set()
    for seed, question in ((1, "What happens in this video?"), (2, "What happens in this video?"), (1, "Why?")):
        frames = _frames(seed)
        text = _ask(openai_client, model, _video_part(frames), question)
        expected = reference_video_greedy_tokens(checkpoints[model], frames, question, MAX_TOKENS)
        assert text == _decode(checkpoints[model], expected)
        outputs.add(text)
    assert len(outputs) == 3, "videos and questions should lead to different answers, else this test proves little"


def test_sdk_encodes_a_video_once_with_t_above_one(stack: Stack, checkpoints: dict[str, Path]) -> None:
    frames = _frames(7, count=6)
    with EncoderClient(stack.encoder_target) as encoder:
        before = encoder.stats().images_encoded
        first = encoder.encode_video([_png(f) for f in frames])
        again = encoder.encode_video([data_url(_png(f)) for f in frames])  # same bytes, other form
        assert encoder.stats().images_encoded == before + 1
        blob = decode_blob(encoder.get_embedding(first.key), BlobRules(2, 256, frozenset({first.encoder_id})))
    assert first.grid_thw == [3, 12, 18] and first.num_tokens == 3 * 12 * 18 // 4  # AutoProcessor's grid
    assert (again.key, again.cache_hit, first.cache_hit) == (first.key, True, False)
    assert blob.modality == "video" and blob.grid_thw.tolist() == [[3, 12, 18]]
    question = "Describe the video."
    with LLMClient(stack.llm_target("ft-b")) as llm:
        chunks = list(llm.generate("ft-b", [Message("user", [VideoKey(first.key), question])], Sampling(max_tokens=8)))
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    assert tokens == reference_video_greedy_tokens(checkpoints["ft-b"], frames, question, 8)


def test_video_and_image_keys_are_not_interchangeable(stack: Stack) -> None:
    with EncoderClient(stack.encoder_target) as encoder:
        video = encoder.encode_video([_png(f) for f in _frames(8, count=2)])
        image = encoder.encode(image_bytes=_png(make_image(9, 84, 56)))
    for model in ("ft-a", "ft-b"):
        with LLMClient(stack.llm_target(model)) as llm:
            with pytest.raises(ServiceError, match="holds video embeddings; send them in a part of type video_embeds"):
                list(llm.generate(model, [Message("user", [ImageKey(video.key), "hi"])], Sampling(max_tokens=2)))
            with pytest.raises(ServiceError, match="holds image embeddings; send them in a part of type image_embeds"):
                list(llm.generate(model, [Message("user", [VideoKey(image.key), "hi"])], Sampling(max_tokens=2)))
            # The service still answers a good request afterwards.
            good = list(llm.generate(model, [Message("user", [VideoKey(video.key), "hi"])], Sampling(max_tokens=2)))
            assert good[-1].finish_reason is not None


def test_bad_videos_get_clear_errors(stack: Stack) -> None:
    frames = _frames(10, count=2)
    cases = [
        ([_png(frames[0]), _png(make_image(4, 84, 56))], "frames must all have one size", "frames[1]"),
        ([_png(frames[0]), b"not an image"], "not a recognized image format", "frames[1]"),
        ([], "at least one frame", "frames"),
    ]
    with EncoderClient(stack.encoder_target) as encoder:
        for video, message, param in cases:
            with pytest.raises(ServiceError, match=message) as caught:
                encoder.encode_video(video)
            assert caught.value.param == param
        with pytest.raises(ServiceError, match="frames; the limit is"):
            encoder.encode_video([_png(frames[0])] * 65)


def test_video_embeds_inline_and_by_key_answer_like_frames(stack: Stack, strict_gateway: str) -> None:
    frames = _frames(11)
    headers = {"authorization": "Bearer test-key-1"}
    encoded = httpx.post(
        f"{strict_gateway}/v1/videos/encode",
        json={"frames": [data_url(_png(f)) for f in frames], "return_embeddings": True},
        headers=headers,
        timeout=120,
    ).json()
    assert encoded["grid_thw"][0] == 2
    blob = decode_blob(base64.b64decode(encoded["embeddings"]), BlobRules(2, 256, frozenset({encoded["encoder_id"]})))
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(blob.embeds))
    parts = [
        _video_part(frames),
        {"type": "video_embeds", "video_embeds": None, "uuid": encoded["key"]},
        {
            "type": "video_embeds",
            "video_embeds": base64.b64encode(buffer.getvalue()).decode(),
            "video_grid_thw": encoded["grid_thw"],
        },
    ]
    client = OpenAI(base_url=f"{strict_gateway}/v1", api_key="test-key-1", max_retries=0, timeout=120)
    answers = {_ask(client, "ft-a", part, "What is shown?") for part in parts}
    assert len(answers) == 1
    bad_grid = {**parts[2], "video_grid_thw": [3, 22, 24]}
    response = httpx.post(
        f"{strict_gateway}/v1/chat/completions",
        json={"model": "ft-a", "messages": [{"role": "user", "content": [bad_grid]}]},
        headers=headers,
        timeout=120,
    )
    assert response.status_code == 400 and "rows" in response.json()["error"]["message"]


def _video_processor_size(checkpoint: Path) -> tuple[int, int]:
    from transformers import AutoVideoProcessor

    size = AutoVideoProcessor.from_pretrained(checkpoint).size
    return size.shortest_edge, size.longest_edge


def test_default_frame_bounds_are_those_autoprocessor_takes_from_the_checkpoint(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """encoder_service.video finds a checkpoint's video frame bounds as transformers does (it cannot
    load the video processor, which needs torchvision): the image processor's config where there
    is no video one; a video one's `size`, or its min/max_pixels, where there is."""
    pytest.importorskip("torchvision")
    base = checkpoints["base"]
    assert checkpoint_frame_bounds(base) == _video_processor_size(base) == (3136, 50176)
    variants = {
        "size": {"size": {"shortest_edge": 6272, "longest_edge": 25088}},
        "pixels": {"min_pixels": 4704, "max_pixels": 31360, "size": {"shortest_edge": 1, "longest_edge": 2}},
        "neither": {},
    }
    for name, config in variants.items():
        checkpoint = tmp_path / name
        shutil.copytree(base, checkpoint, ignore=shutil.ignore_patterns("*.safetensors"))
        video_config = {"video_processor_type": "Qwen2VLVideoProcessor", **config}
        (checkpoint / "video_preprocessor_config.json").write_text(json.dumps(video_config))
        assert checkpoint_frame_bounds(checkpoint) == _video_processor_size(checkpoint), name
    assert checkpoint_frame_bounds(tmp_path / "neither") == (128 * 28 * 28, 768 * 28 * 28)  # the class's


def test_resized_video_pixels_equal_autoprocessors(checkpoints: dict[str, Path]) -> None:
    """Frames the checkpoint's bounds resize (down: 300x200, up: 40x30) get AutoProcessor's pixels."""
    pytest.importorskip("torchvision")
    from transformers import AutoVideoProcessor

    base = checkpoints["base"]
    processor = AutoVideoProcessor.from_pretrained(base)
    for width, height in ((300, 200), (40, 30)):
        frames = [make_image(seed, width, height) for seed in range(4)]
        pixels, grid = preprocess_video(
            Qwen2VLImageProcessorPil.from_pretrained(base), frames, *checkpoint_frame_bounds(base)
        )
        video = torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1) for f in frames])
        expected = processor(videos=[video], do_sample_frames=False, return_tensors="pt")
        assert grid.tolist() == expected["video_grid_thw"].tolist()
        torch.testing.assert_close(pixels, expected["pixel_values_videos"], rtol=0, atol=1e-5)
