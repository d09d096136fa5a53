"""Decoding: every file becomes 3-channel RGB, or a `BadImage` saying why not.

Real ImageNet has CMYK JPEGs, grayscale JPEGs and a PNG named `.JPEG`; PIL
sniffs the content, not the name, and `convert("RGB")` normalises the modes.
Decoding is lazy: `open_image` reads only the header, so the transform can ask
for a reduced-size DCT decode (`draft`) once it knows the output size.
"""

from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

Image.MAX_IMAGE_PIXELS = 200_000_000  # the largest ImageNet image is ~30 MP; beyond this is a bomb


class BadImage(Exception):
    """An image that cannot be used; the message is the reason."""


def open_image(data: bytes) -> Image.Image:
    """Parse the header only; pixels are decoded by `finish`."""
    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError as e:
        raise BadImage("not an image") from e
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise BadImage("truncated" if "runcated" in str(e) else f"unreadable ({e})") from e


def shrink_on_decode(img: Image.Image, width: int, height: int) -> float:
    """Let a JPEG decode at 1/2, 1/4 or 1/8 scale while staying >= (width, height).

    Returns the scale factor applied to the image's coordinates (1.0 if none).
    """
    if img.format != "JPEG":
        return 1.0
    full = img.size[0]
    img.draft(None, (max(1, width), max(1, height)))
    return img.size[0] / full


def finish(img: Image.Image) -> Image.Image:
    """Decode the pixels and return RGB, raising `BadImage` for truncated data."""
    try:
        img.load()
        return img if img.mode == "RGB" else img.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:
        reason = "truncated" if "runcated" in str(e) else f"corrupt ({e})"
        raise BadImage(reason) from e


def decode_rgb(data: bytes) -> Image.Image:
    """Full-size RGB decode (used by `datasets check`)."""
    return finish(open_image(data))
