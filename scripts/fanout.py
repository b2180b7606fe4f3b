"""The fan-out scenario: several questions about one image, to several models,
through the gateway with the official openai client. Used by `make demo` and the tests."""

from __future__ import annotations

import base64
from dataclasses import dataclass

from openai import OpenAI

from shared.sdk import EncoderClient

QUESTIONS = ("What is in this image?", "Which colors dominate the picture?", "Describe the shapes you see.")


@dataclass(frozen=True)
class Answer:
    model: str
    question: str
    text: str
    completion_tokens: int


@dataclass(frozen=True)
class FanoutReport:
    answers: list[Answer]
    images_encoded: int  # by the encoder during the scenario
    cache_hits: int


def image_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def run_fanout(
    base_url: str,
    encoder_target: str,
    png: bytes,
    models: list[str],
    questions: tuple[str, ...] = QUESTIONS,
    max_tokens: int = 16,
) -> FanoutReport:
    """Asks every question to every model about `png`; counts the encodes it caused."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    with EncoderClient(encoder_target) as encoder:
        before = encoder.stats()
        answers = []
        for model in models:
            for question in questions:
                reply = client.chat.completions.create(
                    model=model,
                    max_tokens=max_tokens,
                    temperature=0,
                    messages=[
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": image_data_url(png)}},
                                {"type": "text", "text": question},
                            ],
                        }
                    ],
                )
                usage = reply.usage.completion_tokens if reply.usage else 0
                answers.append(Answer(model, question, reply.choices[0].message.content or "", usage))
        after = encoder.stats()
    return FanoutReport(answers, after.images_encoded - before.images_encoded, after.cache_hits - before.cache_hits)


def demo_image() -> bytes:
    """A small picture with shapes and colors, drawn locally (no downloads)."""
    import io

    from PIL import Image, ImageDraw

    image = Image.new("RGB", (224, 168), (235, 225, 200))
    draw = ImageDraw.Draw(image)
    draw.ellipse((20, 20, 100, 100), fill=(200, 40, 40))
    draw.rectangle((120, 40, 200, 140), fill=(40, 90, 200))
    draw.polygon([(40, 150), (90, 110), (140, 150)], fill=(40, 160, 60))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
