"""VLLMEngine against the transformers engine and the independent reference, in float32.

One vLLM engine per checkpoint for the whole module: each takes tens of seconds to start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from encoder_service.video import preprocess_video  # noqa: E402
from encoder_service.vision import VisionEncoder  # noqa: E402
from llm_service.chat_request import MediaInput, PromptMessage  # noqa: E402
from llm_service.engines.base import EngineRequest, GenerationDelta, MediaItem, SamplingParams  # noqa: E402
from llm_service.engines.handoff import handoff_path  # noqa: E402
from llm_service.engines.transformers_engine import TransformersEngine, expand_pads  # noqa: E402
from llm_service.engines.vllm_engine import VLLMEngine, _concat_rows  # noqa: E402
from llm_service.prompt import PromptBuilder  # noqa: E402
from shared.errors import InvalidInput, Unavailable  # noqa: E402
from tests.model_fixtures import make_image  # noqa: E402
from tests.reference import reference_greedy_tokens  # noqa: E402

NAMES = ("ft-a", "base")
QUESTIONS = ["What is in this picture?", "Describe the room."]
MAX_NEW = 12
Engines = dict[str, tuple[VLLMEngine, TransformersEngine]]


@pytest.fixture(scope="module")
def engines(checkpoints: dict[str, Path]) -> Iterator[Engines]:
    loaded: Engines = {}
    try:
        for name in NAMES:
            fast = VLLMEngine.load(str(checkpoints[name]), max_model_len=1024, kv_cache_gib=1)
            loaded[name] = (fast, TransformersEngine.load(str(checkpoints[name])))
        yield loaded
    finally:
        for fast, slow in loaded.values():
            fast.close()
            slow.close()


@pytest.fixture(scope="module")
def encoder(checkpoints: dict[str, Path]) -> VisionEncoder:
    return VisionEncoder.load(str(checkpoints["base"]))


@pytest.fixture(scope="module")
def images() -> list:
    return [make_image(1), make_image(2, width=140, height=60)]


def _request(
    encoder: VisionEncoder, builder: PromptBuilder, images: list, question: str, **sampling: object
) -> EngineRequest:
    items = [encoder.preprocess(image) for image in images]
    embeds = encoder.encode_batch(items)
    ids = builder.build([PromptMessage("user", [MediaInput("image") for _ in images] + [question])])
    media = [
        MediaItem("image", rows, grid, f"emb:v1:test:{id(image)}")
        for image, rows, (_, grid) in zip(images, embeds, items, strict=True)
    ]
    return EngineRequest("test", ids, media, SamplingParams(**sampling))


async def _collect(engine: VLLMEngine | TransformersEngine, request: EngineRequest) -> list[GenerationDelta]:
    return [delta async for delta in engine.generate(request)]


def _tokens(deltas: list[GenerationDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def _text(deltas: list[GenerationDelta]) -> str:
    return "".join(d.text for d in deltas)


def _summary(deltas: list[GenerationDelta]) -> tuple:
    """What a client sees: tokens, text, finish reason and usage."""
    last = deltas[-1]
    return _tokens(deltas), _text(deltas), last.finish_reason, last.prompt_tokens, last.completion_tokens


async def test_greedy_matches_transformers_and_reference(engines: Engines, encoder, images, checkpoints) -> None:
    outputs: dict[tuple[str, int, str], list[int]] = {}
    for name, (fast, slow) in engines.items():
        builder = PromptBuilder(fast.tokenizer)
        for index, image in enumerate(images):
            for question in QUESTIONS:
                request = _request(encoder, builder, [image], question, max_tokens=MAX_NEW)
                got = await _collect(fast, request)
                assert _summary(got) == _summary(await _collect(slow, request)), (name, index, question)
                expected = reference_greedy_tokens(checkpoints[name], image, question, MAX_NEW)
                assert _tokens(got) == expected, (name, index, question)
                outputs[(name, index, question)] = expected
    # The comparisons above prove little unless the cases disagree with each other.
    assert len({tuple(v) for v in outputs.values()}) == len(outputs)
    assert outputs[("ft-a", 0, QUESTIONS[0])][:4] != outputs[("ft-a", 1, QUESTIONS[0])][:4]


async def test_two_images_and_text_only_match_transformers(engines: Engines, encoder, images) -> None:
    fast, slow = engines["base"]
    builder = PromptBuilder(fast.tokenizer)
    results = []
    for pictures in (images, images[::-1], []):
        request = _request(encoder, builder, pictures, "Compare the two images.", max_tokens=MAX_NEW)
        got = await _collect(fast, request)
        assert _summary(got) == _summary(await _collect(slow, request)), len(pictures)
        results.append(_tokens(got))
    assert len({tuple(r) for r in results}) == 3  # image order and presence both matter


async def test_videos_mixed_with_images_match_transformers(engines: Engines, encoder, images) -> None:
    """M-RoPE over a t > 1 grid, between images: both engines must place every row alike."""
    fast, slow = engines["base"]
    builder = PromptBuilder(fast.tokenizer)
    frames = [make_image(40 + i) for i in range(4)]
    video = preprocess_video(encoder.processor, frames, 3136, 28 * 28 * 64)
    (video_embeds,) = encoder.encode_batch([video])
    image_items = [encoder.preprocess(image) for image in images]
    image_embeds = encoder.encode_batch(image_items)
    results = []
    for order in (("image", "video", "image"), ("video", "image", "image")):
        ids = builder.build([PromptMessage("user", [MediaInput(m) for m in order] + ["What changes over time?"])])
        pictures = iter(
            MediaItem("image", rows, grid, f"emb:v1:test:i{index}")
            for index, (rows, (_, grid)) in enumerate(zip(image_embeds, image_items, strict=True))
        )
        film = MediaItem("video", video_embeds, video[1], "emb:v1:test:v0")
        media = [film if m == "video" else next(pictures) for m in order]
        request = EngineRequest("test", ids, media, SamplingParams(max_tokens=MAX_NEW))
        assert int(video[1][0, 0]) == 2
        got = await _collect(fast, request)
        assert _summary(got) == _summary(await _collect(slow, request)), order
        results.append(_tokens(got))
    assert results[0] != results[1]  # where the video sits matters


async def test_max_tokens_and_stop_string(engines: Engines, encoder, images) -> None:
    fast, slow = engines["ft-a"]
    request = _request(encoder, PromptBuilder(fast.tokenizer), images[:1], QUESTIONS[0], max_tokens=MAX_NEW)
    deltas = await _collect(fast, request)
    assert [d.finish_reason for d in deltas][-1] == "length" and deltas[-1].completion_tokens == MAX_NEW
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].prompt_tokens == len(expand_pads(request, fast.shape))  # the image counts its rows
    full = _text(deltas)
    words = [w for w in full.split() if w.isascii() and w.isalpha() and len(w) >= 3 and full.index(w) > 0]
    assert words, f"no usable stop word in {full!r}"
    stopped = replace(request, sampling=SamplingParams(max_tokens=MAX_NEW, stop=[words[0]]))
    got = await _collect(fast, stopped)
    assert _text(got) == full[: full.index(words[0])]
    assert got[-1].finish_reason == "stop" and got[-1].completion_tokens < MAX_NEW
    assert _summary(got) == _summary(await _collect(slow, stopped))


async def test_eos_reported_like_transformers(engines: Engines, encoder, images) -> None:
    fast, slow = engines["ft-a"]
    request = _request(encoder, PromptBuilder(fast.tokenizer), images[1:], QUESTIONS[1], max_tokens=MAX_NEW)
    greedy = _tokens(await _collect(fast, request))
    saved = (fast.eos_ids, slow.eos_ids)
    fast.eos_ids = slow.eos_ids = saved[0] | {greedy[2]}  # as if the checkpoint declared it an eos
    try:
        got, want = await _collect(fast, request), await _collect(slow, request)
    finally:
        fast.eos_ids, slow.eos_ids = saved
    assert _summary(got) == _summary(want)
    assert _tokens(got) == greedy[:3] and got[-1].finish_reason == "stop" and got[-1].completion_tokens == 3


async def test_seeded_sampling_is_reproducible(engines: Engines, encoder, images) -> None:
    fast, _ = engines["ft-a"]
    builder = PromptBuilder(fast.tokenizer)

    async def sample(seed: int) -> list[int]:
        request = _request(encoder, builder, images[:1], QUESTIONS[0], max_tokens=MAX_NEW, temperature=1.0, seed=seed)
        return _tokens(await _collect(fast, request))

    first = await sample(7)
    assert await sample(7) == first
    assert await sample(8) != first


async def test_closing_or_cancelling_aborts_the_request(engines: Engines, encoder, images) -> None:
    fast, _ = engines["ft-a"]
    request = _request(encoder, PromptBuilder(fast.tokenizer), images[:1], QUESTIONS[0], max_tokens=500)
    stream = fast.generate(request)
    await stream.__anext__()
    assert fast.num_unfinished_requests() == 1
    await stream.aclose()
    assert fast.num_unfinished_requests() == 0

    started = asyncio.Event()

    async def consume() -> None:
        async for _ in fast.generate(request):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fast.num_unfinished_requests() == 0
    short = replace(request, sampling=SamplingParams(max_tokens=2))
    assert len(_tokens(await _collect(fast, short))) == 2  # the engine still serves


async def test_reused_request_id_and_image_uuid(engines: Engines, encoder, images) -> None:
    fast, _ = engines["base"]
    builder = PromptBuilder(fast.tokenizer)
    # Long enough that the shared prefix (system prompt, image, context) spans whole KV blocks.
    context = "Here is a long description of the scene that both questions share. " * 12
    first, second = (
        _request(encoder, builder, images[:1], context + question, max_tokens=MAX_NEW) for question in QUESTIONS
    )
    same_id = await asyncio.gather(_collect(fast, first), _collect(fast, first))  # the client reused "test"
    assert _tokens(same_id[0]) == _tokens(same_id[1])

    async def cached_tokens(request: EngineRequest, request_id: str) -> tuple[int, list[int]]:
        params = fast.vllm_sampling_params(request.sampling)
        outputs = [out async for out in fast.engine.generate(fast.vllm_prompt(request), params, request_id)]
        return outputs[-1].num_cached_tokens or 0, [t for out in outputs for t in out.outputs[0].token_ids]

    # Positions in the prompt as the model reads it (vLLM expands the one pad into the rows).
    expanded = expand_pads(second, fast.shape)
    pads = [i for i, token in enumerate(expanded) if token == fast.shape.image_token_id]
    # Same uuid, new question: the cached prefix reaches past the image rows.
    cached, tokens = await cached_tokens(second, "same-uuid")
    assert cached > pads[-1]
    assert tokens == _tokens(await _collect(fast, second))
    # Same rows under another uuid: the cache may not serve the image (vLLM trusts the uuid).
    other = replace(second, media=[replace(second.media[0], uuid="emb:v1:test:other")])
    cached, _ = await cached_tokens(other, "other-uuid")
    assert cached <= pads[0]


async def test_rejects_inconsistent_request(engines: Engines, encoder, images) -> None:
    fast, _ = engines["ft-a"]
    good = _request(encoder, PromptBuilder(fast.tokenizer), images[:1], QUESTIONS[0])
    (item,) = good.media
    for match, media in (
        ("embeddings", [replace(item, embeds=item.embeds[:-1])]),
        ("embeddings", [replace(item, embeds=item.embeds[None])]),  # rank 3 crashed vLLM's engine process
        ("grid_thw", [replace(item, grid_thw=torch.zeros((0, 3), dtype=torch.int64))]),
        ("pad tokens", []),
        ("pad tokens", [item, item]),
    ):
        with pytest.raises(ValueError, match=match):
            await _collect(fast, replace(good, media=media))
    # A client fault vLLM detects is a domain error (the service checks length before the engine).
    with pytest.raises(InvalidInput, match="max_model_len|maximum|longer"):
        await _collect(fast, replace(good, prompt_token_ids=good.prompt_token_ids + [1] * 1024))
    assert fast.num_unfinished_requests() == 0


async def test_handed_off_items_reach_vllm_as_files_and_answer_as_inline_ones(
    engines: Engines, encoder, images
) -> None:
    fast, slow = engines["ft-a"]
    request = _request(encoder, PromptBuilder(fast.tokenizer), images, QUESTIONS[1], max_tokens=MAX_NEW)
    handed_off = _tokens(await _collect(fast, request))
    assert all(handoff_path(fast.handoff.directory, item.uuid).is_file() for item in request.media if item.uuid)
    sent = fast.vllm_prompt(request, {item.uuid for item in request.media if item.uuid})["multi_modal_data"]
    assert list(sent) == ["image"] and list(sent["image"]) == ["image_grid_thw"]  # no rows in the request
    assert torch.equal(sent["image"]["image_grid_thw"], torch.cat([item.grid_thw for item in request.media]))
    # Nothing fits the budget: the same rows under new uuids (no cache of vLLM's knows them) go inline.
    budget, fast.handoff.max_bytes = fast.handoff.max_bytes, 0
    try:
        inline = replace(request, media=[replace(item, uuid=f"{item.uuid}:inline") for item in request.media])
        inline_tokens = _tokens(await _collect(fast, inline))
        assert not any(handoff_path(fast.handoff.directory, item.uuid or "").exists() for item in inline.media)
    finally:
        fast.handoff.max_bytes = budget
    assert handed_off == inline_tokens == _tokens(await _collect(slow, request))


async def test_a_handed_off_file_gone_fails_its_request_and_the_engine_lives(engines: Engines, encoder, images) -> None:
    fast, _ = engines["ft-a"]
    request = _request(encoder, PromptBuilder(fast.tokenizer), images[:1], QUESTIONS[0], max_tokens=4)
    (item,) = request.media
    gone = replace(request, media=[replace(item, uuid="emb:v1:test:deleted-behind-our-back")])
    assert fast.handoff.hold("emb:v1:test:deleted-behind-our-back", item.embeds)
    handoff_path(fast.handoff.directory, "emb:v1:test:deleted-behind-our-back").unlink()
    # Sent with its grid only and no file: vLLM's consumer would die computing it; ours fails it.
    with pytest.raises(Unavailable, match="could not load"):
        await _collect(fast, gone)
    fast.handoff.release("emb:v1:test:deleted-behind-our-back")
    assert fast.failure() is None
    assert len(_tokens(await _collect(fast, request))) == 4
    assert len(_tokens(await _collect(fast, gone))) == 4  # the retry wrote the file again


async def test_a_uuid_reused_for_other_rows_answers_for_those_rows(engines: Engines, encoder, images) -> None:
    fast, slow = engines["ft-a"]
    builder = PromptBuilder(fast.tokenizer)
    first, other = (_request(encoder, builder, [image], QUESTIONS[0], max_tokens=MAX_NEW) for image in images)
    first, other = (replace(r, media=[replace(r.media[0], uuid="emb:v1:test:rewritten")]) for r in (first, other))
    assert first.media[0].embeds.shape != other.media[0].embeds.shape
    await _collect(fast, first)  # its rows are now the file under that uuid
    # A blob rewritten under its key: the engine must neither load the old file nor die of it.
    assert _tokens(await _collect(fast, other)) == _tokens(await _collect(slow, other))
    assert fast.failure() is None


def _logprobs(deltas: list[GenerationDelta]) -> list:
    return [entry for d in deltas for entry in d.logprobs]


async def test_logprobs_and_penalties_match_transformers(engines: Engines, encoder, images) -> None:
    fast, slow = engines["ft-a"]
    builder = PromptBuilder(fast.tokenizer)
    runs = {}
    for name, sampling in {
        "plain": {"logprobs": 5},
        # Negative: the tiny model's greedy text rarely repeats, so a bonus is what changes it.
        "penalized": {"logprobs": 5, "presence_penalty": -1.0, "frequency_penalty": -2.0},
    }.items():
        request = _request(encoder, builder, images[:1], QUESTIONS[0], max_tokens=MAX_NEW, **sampling)
        got, want = await _collect(fast, request), await _collect(slow, request)
        assert _summary(got) == _summary(want), name
        assert [e.token_id for e in _logprobs(got)] == _tokens(got) == [e.token_id for e in _logprobs(want)]
        for position, (a, b) in enumerate(zip(_logprobs(got), _logprobs(want), strict=True)):
            # Both raw logprobs (vLLM's default): with penalties, processed ones would differ after token 1.
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3), (name, position)
            assert len(a.top) == len(b.top) == 5 and {t for t, _ in a.top} == {t for t, _ in b.top}, (name, position)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-3), (name, position)
        runs[name] = got
    assert _tokens(runs["penalized"]) != _tokens(runs["plain"])
    # Greedy without penalties picks the raw argmax; with them it must sometimes pick another token.
    assert all(e.token_id == e.top[0][0] for e in _logprobs(runs["plain"]))
    assert any(e.token_id != e.top[0][0] for e in _logprobs(runs["penalized"]))


@pytest.mark.parametrize(
    "dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_embeddings_handed_to_vllm_are_a_copy_equal_to_torch_cat(dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    # vLLM gets a copy (made off torch's thread pool): the pod cache's tensors are never exposed.
    first, second = torch.randn(3, 8).to(dtypes[0]), torch.randn(5, 8).to(dtypes[1])
    joined = _concat_rows([first, second])
    assert joined.dtype == torch.cat([first, second]).dtype and torch.equal(joined, torch.cat([first, second]))
    joined.zero_()
    assert first.abs().sum() > 0 and second.abs().sum() > 0
