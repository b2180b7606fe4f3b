"""The synthetic visual task the trained tiny family answers (issue 13), drawn exactly as specified.

An image: white background, 72-224 px on each side, holding 1-3 filled shapes of one kind and one
colour, each 16-48 px across, fully inside, at least 4 px apart. Three fine-tunes each answer one
question with one word. Training, the demo and the accuracy tests all draw images here, so what the
models learned and what they are tested on can never drift apart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

BACKGROUND = (255, 255, 255)
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
}
KINDS = ("circle", "square", "triangle")
COUNTS = (1, 2, 3)
MIN_SIDE, MAX_SIDE = 72, 224
MIN_SHAPE, MAX_SHAPE = 16, 48
MIN_GAP = 4

# model name -> (its question, the words it may answer).
TASKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "color": ("What color are the shapes?", tuple(COLORS)),
    "count": ("How many shapes are there?", tuple(str(n) for n in COUNTS)),
    "shape": ("What shape are they?", KINDS),
}
# Supersampling factor of the anti-aliased rendering: other clients' drawing code may smooth edges.
SUPERSAMPLE = 4

Box = tuple[int, int, int, int]  # left, top, right, bottom (exclusive), in pixels


@dataclass(frozen=True)
class Scene:
    """What an image shows, and therefore every model's right answer."""

    kind: str
    color: str
    boxes: tuple[Box, ...]
    width: int
    height: int

    @property
    def count(self) -> int:
        return len(self.boxes)

    def answer(self, model: str) -> str:
        return {"color": self.color, "count": str(self.count), "shape": self.kind}[model]

    def describe(self) -> str:
        """A person's caption, e.g. "2 blue squares"."""
        noun = self.kind if self.count == 1 else f"{self.kind}s"
        return f"{self.count} {self.color} {noun}"


def random_scene(rng: random.Random) -> Scene:
    """A scene within the specification; the number, kind and colour are uniform."""
    kind, color, count = rng.choice(KINDS), rng.choice(tuple(COLORS)), rng.choice(COUNTS)
    while True:
        width, height = rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE)
        boxes = _place(rng, count, width, height)
        if boxes is not None:
            return Scene(kind, color, boxes, width, height)


def _place(rng: random.Random, count: int, width: int, height: int) -> tuple[Box, ...] | None:
    """`count` square boxes inside the image, pairwise at least MIN_GAP apart; None if the
    rejection sampler gives up (a small image with three large shapes), so the caller redraws."""
    boxes: list[Box] = []
    for _ in range(200):
        if len(boxes) == count:
            break
        size = rng.randint(MIN_SHAPE, min(MAX_SHAPE, width, height))
        left, top = rng.randint(0, width - size), rng.randint(0, height - size)
        box = (left, top, left + size, top + size)
        if all(_apart(box, other) for other in boxes):
            boxes.append(box)
    return tuple(boxes) if len(boxes) == count else None


def _apart(a: Box, b: Box) -> bool:
    return a[2] + MIN_GAP <= b[0] or b[2] + MIN_GAP <= a[0] or a[3] + MIN_GAP <= b[1] or b[3] + MIN_GAP <= a[1]


def render(scene: Scene, antialias: bool = False) -> Image.Image:
    """The RGB image of `scene`; `antialias` draws at SUPERSAMPLE times the size and downsamples,
    as a client using a smoothing renderer would."""
    scale = SUPERSAMPLE if antialias else 1
    image = Image.new("RGB", (scene.width * scale, scene.height * scale), BACKGROUND)
    draw = ImageDraw.Draw(image)
    fill = COLORS[scene.color]
    for left, top, right, bottom in scene.boxes:
        # PIL's boxes are inclusive of their last pixel.
        x0, y0, x1, y1 = left * scale, top * scale, right * scale - 1, bottom * scale - 1
        if scene.kind == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif scene.kind == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:  # apex at the top centre of the box, base along its bottom
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    if antialias:
        image = image.resize((scene.width, scene.height), Image.Resampling.LANCZOS)
    return image


def draw_examples(seed: int, n: int, antialias_share: float = 0.0) -> list[tuple[Image.Image, Scene]]:
    """`n` images with their scenes from `seed`; the same seed always gives the same images."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        scene = random_scene(rng)
        examples.append((render(scene, antialias=rng.random() < antialias_share), scene))
    return examples
