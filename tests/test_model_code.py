"""Model-facing code against transformers' own full-model path, on tiny random checkpoints."""

from __future__ import annotations

import asyncio
import itertools
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

from encoder_service.vision import VisionEncoder
from llm_service.chat_request import MediaInput, PromptMessage
from llm_service.engines.base import EngineRequest, GenerationDelta, MediaItem, SamplingParams
from llm_service.engines.transformers_engine import TransformersEngine, expand_pads
from llm_service.prompt import PromptBuilder
from shared.encoder_id import compute_encoder_id
from shared.errors import InvalidInput
from tests.model_fixtures import build_test_checkpoints, make_image
from tests.reference import reference_greedy_tokens

QUESTIONS = ["What is in this picture?", "Describe the room."]
MAX_NEW = 12


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_test_checkpoints(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="module")
def encoder(ckpts: dict[str, Path]) -> VisionEncoder:
    return VisionEncoder.load(str(ckpts["base"]))


@pytest.fixture(scope="module")
def engines(ckpts: dict[str, Path]) -> dict[str, TransformersEngine]:
    return {name: TransformersEngine.load(str(ckpts[name])) for name in ("ft-a", "ft-b")}


@pytest.fixture(scope="module")
def images() -> list:
    return [make_image(1), make_image(2, width=140, height=60)]


def _rewrite_weights(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    with safe_open(src / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(edit(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _collect(engine: TransformersEngine, request: EngineRequest) -> list[GenerationDelta]:
    async def run() -> list[GenerationDelta]:
        return [d async for d in engine.generate(request)]

    return asyncio.run(run())


def _request(
    engine: TransformersEngine, encoder: VisionEncoder, images: list, question: str, **sampling: object
) -> EngineRequest:
    items = [encoder.preprocess(image) for image in images]
    embeds = encoder.encode_batch(items)
    ids = PromptBuilder(engine.tokenizer).build(
        [PromptMessage("user", [MediaInput("image") for _ in images] + [question])]
    )
    media = [MediaItem("image", rows, grid) for rows, (_, grid) in zip(embeds, items, strict=True)]
    return EngineRequest("test", ids, media, SamplingParams(**sampling))


def _tokens(deltas: list[GenerationDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def _text(deltas: list[GenerationDelta]) -> str:
    return "".join(d.text for d in deltas)


# --- encoder id ---------------------------------------------------------------------------


def test_encoder_id_shared_by_finetunes_and_layouts(ckpts: dict[str, Path], tmp_path: Path) -> None:
    ids = {name: compute_encoder_id(path) for name, path in ckpts.items()}
    assert len(set(ids.values())) == 1 and ids["base"].startswith("qwen2vl-") and len(ids["base"]) == 24
    renamed = _rewrite_weights(
        ckpts["base"], tmp_path / "layout",
        lambda t: {("model." + k if k.startswith("visual.") else k): v for k, v in t.items()},
    )  # fmt: skip
    assert compute_encoder_id(renamed) == ids["base"]


def test_encoder_id_changes_with_vision_weights_or_preprocessing(ckpts: dict[str, Path], tmp_path: Path) -> None:
    base_id = compute_encoder_id(ckpts["base"])

    def nudge(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors["visual.merger.mlp.2.bias"] = tensors["visual.merger.mlp.2.bias"] + 1e-3
        return tensors

    assert compute_encoder_id(_rewrite_weights(ckpts["base"], tmp_path / "w", nudge)) != base_id
    other = shutil.copytree(ckpts["base"], tmp_path / "p")
    config = other / "preprocessor_config.json"
    config.write_text(config.read_text().replace('"max_pixels": 50176', '"max_pixels": 50177'))
    assert compute_encoder_id(other) != base_id


# --- vision encoder (batching: test_encoder_batching.py) ----------------------------------


def test_preprocess_respects_pixel_bounds(encoder: VisionEncoder) -> None:
    _, grid = encoder.preprocess(make_image(3, 1000, 1000))
    assert int(grid.prod()) // 4 <= 64
    _, small = encoder.preprocess(make_image(3, 1000, 1000), max_pixels=28 * 28 * 4)
    assert small.tolist() == [[1, 4, 4]]
    with pytest.raises(ValueError):
        encoder.preprocess(make_image(3), min_pixels=100, max_pixels=10)


# --- prompt -------------------------------------------------------------------------------


def test_prompt_has_one_pad_per_image_and_the_engine_expands_each_to_its_rows(engines) -> None:
    engine = engines["ft-a"]
    builder = PromptBuilder(engine.tokenizer)
    ids = builder.build([PromptMessage("user", [MediaInput("image"), "left or right?", MediaInput("image")])])
    pad = builder.image_token_id
    assert ids.count(pad) == 2
    text = engine.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|vision_end|><|im_end|>\n<|im_start|>assistant\n")
    assert "<|vision_start|><|image_pad|><|vision_end|>left or right?" in text
    hidden, grid = engine.hidden_size, torch.tensor([[1, 2, 2]])
    media = [MediaItem("image", torch.zeros(rows, hidden), grid) for rows in (3, 5)]
    request = EngineRequest("x", ids, media)
    expanded = expand_pads(request, engine.shape)
    runs = [len(list(group)) for token, group in itertools.groupby(expanded) if token == pad]
    assert runs == [3, 5] and request.prompt_tokens == len(expanded) == len(ids) + 6
    assert [t for t in expanded if t != pad] == [t for t in ids if t != pad]


def test_prompt_refuses_pad_tokens_in_text(ckpts: dict[str, Path]) -> None:
    builder = PromptBuilder(AutoTokenizer.from_pretrained(ckpts["base"]))
    for sneaky, pad in (("sneaky <|image_pad|>", "<|image_pad|>"), ("<|video_pad|>", "<|video_pad|>")):
        with pytest.raises(InvalidInput, match=re.escape(f"text may not contain {pad}")) as caught:
            builder.build([PromptMessage("user", ["fine"]), PromptMessage("user", ["fine", sneaky])])
        assert caught.value.param == "messages[1].content[1].text"


# --- transformers engine ------------------------------------------------------------------


def test_engine_greedy_matches_reference_and_varies(engines, encoder: VisionEncoder, ckpts, images) -> None:
    outputs: dict[tuple[str, int, str], list[int]] = {}
    for name, engine in engines.items():
        for index, image in enumerate(images):
            for question in QUESTIONS:
                deltas = _collect(engine, _request(engine, encoder, [image], question, max_tokens=MAX_NEW))
                expected = reference_greedy_tokens(ckpts[name], image, question, MAX_NEW)
                assert _tokens(deltas) == expected, (name, index, question)
                outputs[(name, index, question)] = expected
    # The comparison above proves little unless the cases disagree with each other.
    assert len({tuple(v) for v in outputs.values()}) == len(outputs)
    assert outputs[("ft-a", 0, QUESTIONS[0])][:4] != outputs[("ft-a", 1, QUESTIONS[0])][:4]


def test_engine_multi_image_and_text_only_match_full_model(engines, encoder: VisionEncoder, ckpts, images) -> None:
    engine = engines["ft-b"]
    assert engine.model.model.visual is None, "the LLM service must not hold a vision tower"
    full_model = Qwen2VLForConditionalGeneration.from_pretrained(ckpts["ft-b"]).eval()
    for pictures in (images, []):
        request = _request(engine, encoder, pictures, "Compare the two images.", max_tokens=MAX_NEW)
        ids = torch.tensor([expand_pads(request, engine.shape)])  # as the processor renders it
        extra = {}
        if pictures:
            items = [encoder.preprocess(image) for image in pictures]
            grid = torch.cat([g for _, g in items])
            extra = dict(
                pixel_values=torch.cat([p for p, _ in items]), image_grid_thw=grid,
                mm_token_type_ids=(ids == engine.shape.image_token_id).long(),
            )  # fmt: skip
        with torch.inference_mode():
            out = full_model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW, **extra
            )
        assert _tokens(_collect(engine, request)) == out[0, ids.shape[1] :].tolist()


def test_engine_deltas_text_and_usage(engines, encoder: VisionEncoder, images) -> None:
    engine = engines["ft-a"]
    request = _request(engine, encoder, images[:1], QUESTIONS[0], max_tokens=MAX_NEW)
    deltas = _collect(engine, request)
    assert [d.finish_reason for d in deltas] == [None] * (MAX_NEW - 1) + ["length"]
    # Usage counts the prompt as the model reads it: each image's pad as its rows.
    assert deltas[-1].completion_tokens == MAX_NEW
    assert deltas[-1].prompt_tokens == len(expand_pads(request, engine.shape)) > len(request.prompt_token_ids)
    tokens = _tokens(deltas)
    expected = engine.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert _text(deltas) == expected


def test_engine_stop_string_truncates_and_halts(engines, encoder: VisionEncoder, images) -> None:
    engine = engines["ft-a"]
    full = _text(_collect(engine, _request(engine, encoder, images[:1], QUESTIONS[0], max_tokens=MAX_NEW)))
    words = [w for w in full.split() if w.isascii() and w.isalpha() and len(w) >= 3 and full.index(w) > 0]
    assert words, f"no usable stop word in {full!r}"
    stop = words[0]
    deltas = _collect(engine, _request(engine, encoder, images[:1], QUESTIONS[0], max_tokens=MAX_NEW, stop=[stop]))
    assert _text(deltas) == full[: full.index(stop)]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].completion_tokens < MAX_NEW


def test_engine_eos_finishes_with_stop(engines, encoder: VisionEncoder, images) -> None:
    engine = engines["ft-b"]
    request = _request(engine, encoder, images[:1], QUESTIONS[1], max_tokens=MAX_NEW)
    greedy = _tokens(_collect(engine, request))
    saved = engine.eos_ids
    engine.eos_ids = saved | {greedy[2]}  # as if the checkpoint declared that token an eos
    try:
        deltas = _collect(engine, request)
    finally:
        engine.eos_ids = saved
    assert _tokens(deltas) == greedy[:3] and deltas[-1].finish_reason == "stop"
    prefix = engine.tokenizer.decode(greedy[:2], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert _text(deltas) == prefix


def test_engine_seeded_sampling_is_reproducible(engines, encoder: VisionEncoder, images) -> None:
    engine = engines["ft-a"]

    def sample(seed: int) -> list[int]:
        request = _request(engine, encoder, images[:1], QUESTIONS[0], max_tokens=MAX_NEW, temperature=1.0, seed=seed)
        return _tokens(_collect(engine, request))

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_engine_closing_stream_stops_generation(engines, encoder: VisionEncoder, images) -> None:
    engine = engines["ft-a"]
    calls = 0

    def count_forward(*_: object) -> None:
        nonlocal calls
        calls += 1

    async def scenario() -> tuple[int, int]:
        long_request = _request(engine, encoder, images[:1], QUESTIONS[0], max_tokens=500)
        stream = engine.generate(long_request)
        await stream.__anext__()
        await stream.aclose()
        short = _request(engine, encoder, images[:1], QUESTIONS[1], max_tokens=2)
        deltas = [d async for d in engine.generate(short)]  # runs only after the first worker job ends
        return calls, len(deltas)

    hook = engine.model.register_forward_hook(count_forward)
    try:
        total_calls, short_deltas = asyncio.run(scenario())
    finally:
        hook.remove()
    assert short_deltas == 2
    assert total_calls - 2 < 50  # the 500-token generation was cut short


def test_engine_rejects_inconsistent_request(engines, encoder: VisionEncoder, images) -> None:
    engine = engines["ft-a"]
    good = _request(engine, encoder, images[:1], QUESTIONS[0])
    (item,) = good.media
    for match, media in (
        ("embeddings", [replace(item, embeds=item.embeds[:-1])]),  # rows the grid does not imply
        ("embeddings", [replace(item, embeds=item.embeds[:, :-1])]),  # not the model's hidden size
        ("grid_thw", [replace(item, grid_thw=torch.zeros((0, 3), dtype=torch.int64))]),
        ("pad tokens", [replace(item, modality="video")]),  # the prompt holds an image pad
        ("pad tokens", [item, item]),
        ("pad tokens", []),
    ):
        with pytest.raises(ValueError, match=match):
            _collect(engine, replace(good, media=media))
