"""The trained shapes family (models/shapes) through the whole disaggregated path, on both engines.

Real processes: Redis, the encoder on the shared tower, one LLM service per fine-tune (color,
count, shape) and the gateway, asked with the official openai client and the gRPC SDK. The images
come from a seed no training stage used, so right answers mean the visual information survived
encoder -> Redis -> LLM service with the right M-RoPE positions. The sensitivity tests are tests
of these tests: wrong embeddings must drop accuracy to about chance, or a broken path could pass.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from openai import OpenAI
from PIL import Image
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from model_builders.shapes import FINETUNES, trained_family
from model_builders.shapes.task import TASKS, Scene, draw_examples
from shared.sdk import EncoderClient, ImageKey, LLMClient, Message, Sampling
from tests.process_stack import VLLM_ENV, ProcessStack, process_stack

pytestmark = pytest.mark.e2e
TEST_SEED = 20261202  # training used seeds 0-10 and 10001, 10008-10010 (model_builders/shapes/__main__.py)
ACCURACY_IMAGES = 120
# Issue 13's target for every fine-tune on both engines (measured: color 1.000, count 0.983,
# shape 0.983), far above chance (0.25 colour, 0.33 count and shape): a broken path falls below.
TARGET_ACCURACY = 0.95
# Inline embeddings let the sensitivity test hand the models rows of its choosing.
ENGINE_ENV = {
    engine: {**env, "GATEWAY_ALLOW_INLINE_EMBEDS": "true"}
    for engine, env in {"transformers": {"LLM_ENGINE": "transformers"}, "vllm": VLLM_ENV}.items()
}


@pytest.fixture(scope="module", params=["transformers", "vllm"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessStack]:
    if request.param == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (make VLLM=none)")
    workdir = tmp_path_factory.mktemp(f"shapes-{request.param}")
    with process_stack(trained_family(), workdir, ENGINE_ENV[request.param], models=FINETUNES) as running:
        yield running


@pytest.fixture(scope="module")
def examples() -> list[tuple[Image.Image, Scene]]:
    # A quarter anti-aliased: other clients draw with smoothing renderers.
    return draw_examples(TEST_SEED, ACCURACY_IMAGES, antialias_share=0.25)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_url_part(image: Image.Image) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(image)).decode()}}


def ask(client: OpenAI, model: str, part: dict[str, Any], question: str) -> str:
    reply = client.chat.completions.create(
        model=model,
        max_tokens=4,
        temperature=0,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": question}]}],
    )
    return (reply.choices[0].message.content or "").strip()


def ask_all(family: ProcessStack, jobs: list[tuple[str, dict[str, Any], str]]) -> list[str]:
    """Answers to (model, image part, question) jobs, eight at a time, in order."""
    client = OpenAI(base_url=f"{family.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda job: ask(client, *job), jobs))


def accuracy(answers: list[str], truths: list[str]) -> float:
    return sum(a == t for a, t in zip(answers, truths, strict=True)) / len(truths)


def encoded_keys(family: ProcessStack, images: list[Image.Image]) -> list[str]:
    with EncoderClient(family.service("encoder").target) as encoder:
        return [encoder.encode(image_bytes=png(image)).key for image in images]


@pytest.fixture(scope="module")
def own_answers(family: ProcessStack, examples: list[tuple[Image.Image, Scene]]) -> dict[str, list[str]]:
    """Each fine-tune's answers to its own question about every image, asked by image_url."""
    parts = [image_url_part(image) for image, _ in examples]
    return {model: ask_all(family, [(model, part, TASKS[model][0]) for part in parts]) for model in FINETUNES}


def own_accuracy(model: str, own_answers: dict[str, list[str]], examples: list[tuple[Image.Image, Scene]]) -> float:
    return accuracy(own_answers[model], [scene.answer(model) for _, scene in examples])


@pytest.mark.parametrize("model", FINETUNES)
def test_each_finetune_answers_its_own_question_right_in_its_words(
    family: ProcessStack,
    examples: list[tuple[Image.Image, Scene]],
    own_answers: dict[str, list[str]],
    model: str,
    request: pytest.FixtureRequest,
) -> None:
    score = own_accuracy(model, own_answers, examples)
    engine = request.node.callspec.params["family"]
    print(f"{engine} {model}: accuracy {score:.3f} over {len(examples)} images (seed {TEST_SEED})")
    vocabulary = set(TASKS[model][1])
    assert set(own_answers[model]) <= vocabulary, f"{model} answered outside {vocabulary}"
    assert score >= TARGET_ACCURACY, f"{engine} {model}: accuracy {score:.3f}, below {TARGET_ACCURACY}"


def test_finetunes_never_answer_in_another_vocabulary(
    family: ProcessStack, examples: list[tuple[Image.Image, Scene]]
) -> None:
    parts = [image_url_part(image) for image, _ in examples[:30]]
    for model in FINETUNES:
        others = [TASKS[other][0] for other in FINETUNES if other != model]
        answers = ask_all(family, [(model, part, question) for part in parts for question in others])
        assert set(answers) <= set(TASKS[model][1]), f"{model} asked others' questions said {set(answers)}"


def test_image_url_stored_key_and_sdk_give_the_same_answer(
    family: ProcessStack, examples: list[tuple[Image.Image, Scene]]
) -> None:
    images = [image for image, _ in examples[:20]]
    keys = encoded_keys(family, images)
    for model in FINETUNES:
        question = TASKS[model][0]
        by_url = ask_all(family, [(model, image_url_part(image), question) for image in images])
        by_key = ask_all(family, [(model, {"type": "image_embeds", "uuid": key}, question) for key in keys])
        with LLMClient(family.service(model).target) as llm:
            by_sdk = [
                "".join(
                    chunk.text
                    for chunk in llm.generate(
                        model, [Message("user", [ImageKey(key), question])], Sampling(max_tokens=4, temperature=0)
                    )
                ).strip()
                for key in keys
            ]
        assert by_url == by_key == by_sdk, model


def inline_part(blob: bytes, grid_thw: list[int]) -> dict[str, Any]:
    """An image_embeds part carrying the rows of a stored blob inline, with the grid given."""
    rows = load_safetensors(blob)["image_embeds"]
    raw = save_safetensors({"image_embeds": rows.contiguous()})
    return {"type": "image_embeds", "image_embeds": base64.b64encode(raw).decode(), "image_grid_thw": grid_thw}


def stored_grid(blob: bytes) -> list[int]:
    grid: torch.Tensor = load_safetensors(blob)["image_grid_thw"]
    return [int(v) for v in grid[0]]


def test_another_images_embeddings_drop_accuracy_to_chance(
    family: ProcessStack, examples: list[tuple[Image.Image, Scene]]
) -> None:
    """A test of the tests: each image is asked about with the next image's embeddings. The answers
    must follow the donor image (the rows carry what the models read) and so match the asked
    image's own labels only about as often as chance (1/4 colour, 1/3 count and shape)."""
    sample = examples[:60]
    keys = encoded_keys(family, [image for image, _ in sample])
    with EncoderClient(family.service("encoder").target) as encoder:
        blobs = [encoder.get_embedding(key) for key in keys]
    donors = blobs[1:] + blobs[:1]
    donor_scenes = [scene for _, scene in sample[1:] + sample[:1]]
    for model in FINETUNES:
        question = TASKS[model][0]
        answers = ask_all(family, [(model, inline_part(blob, stored_grid(blob)), question) for blob in donors])
        own = accuracy(answers, [scene.answer(model) for _, scene in sample])
        donor = accuracy(answers, [scene.answer(model) for scene in donor_scenes])
        assert donor >= TARGET_ACCURACY - 0.05, f"{model} did not follow the rows it was given: {donor:.3f}"
        assert own <= 0.6, f"{model} still matched the asked image with another image's rows: {own:.3f}"
