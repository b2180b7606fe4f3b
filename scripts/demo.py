"""`make demo`'s scenario: a few images of the shapes task, each asked of every trained fine-tune
through the gateway with the official openai client, shown as a table beside what the image
holds, with the encoder's own count of the images it encoded (one per image, whatever the number
of models)."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path

from openai import OpenAI
from PIL import Image

from model_builders.shapes.task import TASKS, Scene, draw_examples
from shared.sdk import EncoderClient

DEMO_SEED = 2026  # not a training seed (model_builders/shapes/__main__.py): images the models never saw


@dataclass(frozen=True)
class Row:
    image_path: Path
    scene: Scene
    answers: dict[str, str]  # model -> its answer


@dataclass(frozen=True)
class DemoReport:
    rows: list[Row]
    images_encoded: int
    cache_hits: int


def png_data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def ask(client: OpenAI, model: str, image_url: str, question: str) -> str:
    reply = client.chat.completions.create(
        model=model,
        max_tokens=4,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": question}],
            }
        ],
    )
    return (reply.choices[0].message.content or "").strip()


def run_demo(base_url: str, encoder_target: str, models: list[str], image_dir: Path, n_images: int = 6) -> DemoReport:
    """Asks each model its own question about each image; saves the images to `image_dir`."""
    image_dir.mkdir(parents=True, exist_ok=True)
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    rows = []
    with EncoderClient(encoder_target) as encoder:
        before = encoder.stats()
        for index, (image, scene) in enumerate(draw_examples(DEMO_SEED, n_images), start=1):
            path = image_dir / f"{index:02d}-{scene.describe().replace(' ', '-')}.png"
            image.save(path)
            url = png_data_url(image)
            rows.append(Row(path, scene, {model: ask(client, model, url, TASKS[model][0]) for model in models}))
        after = encoder.stats()
    return DemoReport(rows, after.images_encoded - before.images_encoded, after.cache_hits - before.cache_hits)


def format_table(report: DemoReport, models: list[str]) -> str:
    """One line per image: what it holds, then each model's answer, marked when it is wrong."""
    header = ["image", "holds", *models]
    lines = [header]
    for row in report.rows:
        marks = [f"{row.answers[m]}{'' if row.answers[m] == row.scene.answer(m) else ' (wrong)'}" for m in models]
        lines.append([row.image_path.name, row.scene.describe(), *marks])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in lines)
