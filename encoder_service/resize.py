"""What an image may be resized to: the rules of Qwen2-VL's `smart_resize`, and this server's limits.

transformers' `smart_resize` raises a bare ValueError for an image it cannot resize (an aspect
ratio over 200), which would surface as an internal error. The client's image is at fault, so it
is checked here, before transformers runs, and refused with a message naming the ratio and the
limit. `smart_resize` itself never fails on pixel bounds: it rounds each side to a multiple of
`factor` (patch_size * merge_size, 28) and at least one `factor`, so a max_pixels under
factor**2 could never be honoured; such a request is refused too rather than silently exceeded.

The pixel bounds a client asks for are capped by the operator's limit: they decide the patch
count, and so the cost of the forward pass, which grows faster than the pixel count.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import InvalidInput

# smart_resize refuses max(h, w) / min(h, w) > 200 (transformers hard-codes it; same test here).
MAX_ASPECT_RATIO = 200


def check_aspect_ratio(width: int, height: int, param: str) -> None:
    """InvalidInput when smart_resize would refuse the image's shape."""
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        raise InvalidInput(
            f"image is {width}x{height} pixels, an aspect ratio of {ratio:.1f}; "
            f"Qwen2-VL accepts at most {MAX_ASPECT_RATIO}",
            param=param,
        )


@dataclass(frozen=True)
class PixelPolicy:
    """The resized-pixel bounds a request may ask for (per image, or per video frame)."""

    default_min: int
    default_max: int
    limit: int  # the highest min_pixels or max_pixels a request may ask for
    factor: int  # patch_size * merge_size: each resized side is a multiple of it, and at least it

    def bounds(self, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        """The effective (min_pixels, max_pixels) of a request; 0 asks for the default."""
        for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
            if value < 0:
                raise InvalidInput(f"{name} must not be negative (got {value}; 0 asks for the default)", param=name)
        for name, value in (("max_pixels", max_pixels), ("min_pixels", min_pixels)):
            if value > self.limit:
                raise InvalidInput(f"{name} {value} exceeds this server's limit of {self.limit}", param=name)
        # An operator's limit under the default lowers the default with it.
        max_px = max_pixels or min(self.default_max, self.limit)
        # A caller who lowers only max_pixels gets a default minimum that fits under it.
        min_px = min_pixels or min(self.default_min, max_px)
        smallest = self.factor * self.factor
        if max_px < smallest:
            raise InvalidInput(
                f"max_pixels {max_px} is under {smallest}, one {self.factor}x{self.factor} block, "
                "the fewest pixels an image is resized to",
                param="max_pixels",
            )
        if min_px > max_px:
            raise InvalidInput(f"min_pixels {min_px} is greater than max_pixels {max_px}", param="min_pixels")
        return min_px, max_px
