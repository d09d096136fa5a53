"""Decoding: every file becomes 3-channel RGB (a uint8 HWC tensor), or a `BadImage` saying why not.

The fast path is libjpeg-turbo through simplejpeg, straight into numpy, for
the JPEGs that are almost all of ImageNet (YCbCr or grayscale), at 1/2, 1/4 or
1/8 scale (DCT scaling) when the crop will be shrunk that much anyway. Only
power-of-two scales: libjpeg-turbo's n/8 scales are slower than a full decode.
Everything else goes through PIL, which sniffs the content, not the name: the
CMYK JPEGs, the PNG named `.JPEG`, and any JPEG libjpeg-turbo complains about.
PIL is the judge of what is bad: it accepts harmless warnings ("extraneous
bytes before marker", found in real ImageNet files) and refuses truncated data.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import simplejpeg
import torch
from PIL import Image, UnidentifiedImageError

Image.MAX_IMAGE_PIXELS = 200_000_000  # the largest ImageNet image is ~30 MP; beyond this is a bomb
JPEG_MAGIC = b"\xff\xd8"
JPEG_END = b"\xff\xd9"  # EOI: the last marker of a whole JPEG
FAST_COLORSPACES = ("YCbCr", "Gray")  # what libjpeg-turbo turns into RGB exactly as PIL does
SCALES = (8, 4, 2)  # DCT scaling that pays: 1/8, 1/4, 1/2


class BadImage(Exception):
    """An image that cannot be used; the message is the reason."""


def bad_image_message(where: str, reason: str) -> str:
    """What stops a run under data.on_bad_image = "error"."""
    return f'bad image {where}: {reason} (set data.on_bad_image = "skip" to skip it)'


@dataclass(frozen=True)
class EncodedImage:
    """An image file whose header has been read: its size, and how it will be decoded."""

    data: bytes
    width: int
    height: int
    fast: bool  # a JPEG libjpeg-turbo decodes to RGB itself

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height


def open_image(data: bytes) -> EncodedImage:
    """Read the header only; `decode` produces the pixels."""
    if data[:2] == JPEG_MAGIC:
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            return EncodedImage(data, width, height, colorspace in FAST_COLORSPACES)
        except ValueError:
            pass  # let PIL name the problem
    img = _pil_open(data)
    return EncodedImage(data, img.width, img.height, fast=False)


def decode(img: EncodedImage, min_width: int = 0, min_height: int = 0) -> tuple[torch.Tensor, float]:
    """RGB pixels (H, W, 3 uint8) at the smallest 1/k scale still >= (min_width, min_height).

    Returns the pixels and the scale applied to the image's coordinates.
    """
    k = next((k for k in SCALES if math.ceil(img.width / k) >= min_width
              and math.ceil(img.height / k) >= min_height), 1)
    if img.fast:
        try:
            pixels = simplejpeg.decode_jpeg(img.data, "RGB", min_width=math.ceil(img.width / k),
                                            min_height=math.ceil(img.height / k))
            return torch.from_numpy(pixels), pixels.shape[1] / img.width
        except ValueError:
            pass  # a warning in strict mode; PIL decides whether it matters
    pil = _pil_open(img.data)
    if pil.format == "JPEG" and k > 1:  # PIL takes 1/k for k up to side // asked: ask side // k, not ceil
        pil.draft(None, (max(1, img.width // k), max(1, img.height // k)))
    try:
        pil.load()
        rgb = pil if pil.mode == "RGB" else pil.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:
        raise BadImage("truncated" if "runcated" in str(e) else f"corrupt ({e})") from e
    return torch.from_numpy(np.array(rgb, dtype=np.uint8)), rgb.width / img.width


def device_decodable(img: EncodedImage) -> bool:
    """A JPEG nvJPEG decodes as libjpeg-turbo does (YCbCr or grayscale), whole (ending in its EOI
    marker): the rest (CMYK, PNG named .JPEG, truncated) is decoded on the CPU, where PIL judges it."""
    return img.fast and img.data.endswith(JPEG_END)


def decode_rgb(data: bytes) -> torch.Tensor:
    """Full-size RGB pixels (H, W, 3 uint8)."""
    return decode(open_image(data), 1 << 30, 1 << 30)[0]


def _pil_open(data: bytes) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError as e:
        raise BadImage("not an image") from e
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise BadImage("truncated" if "runcated" in str(e) else f"unreadable ({e})") from e
