"""Crops of differently sized images resized to one size in a few batched kernels (the GPU decode's render).

torch's antialiased resize (`F.interpolate(..., antialias=True)`, PIL's filters) is separable and linear:
each output row is a weighted sum of the crop's rows, with weights that depend only on the crop's length and
the output's, and likewise for columns. So a crop resized is `Wy @ crop @ Wx^T`, and a batch of crops,
zero-padded to the largest, is two batched matrix products, with every image's weights built at once from
its crop's lengths (and a flip is `Wx` read backwards). Rendered image by image, the same work was some ten
kernels an image, launched from Python, enough host time a batch to rival the GPU step it has to hide
behind. Here it is one gather of every crop from the images' memory (`padded_crops`) and a dozen
kernels a batch, whatever its size. The weights are torch's own (`upsample_*_aa`:
the filter widened by the downscale, cut at the crop's edges and normalised), so the pixels are
`crop_resize(..., in_float=True)`'s up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import torch

Box = tuple[int, int, int, int]  # top, left, height, width, in whole pixels of the image
BUDGET = 1 << 26  # floats of one padded chunk (256 MiB): a batch of huge crops is resized a chunk at a time


def triangle(x: torch.Tensor) -> torch.Tensor:
    return (1 - x.abs()).clamp_(min=0)


def cubic(x: torch.Tensor) -> torch.Tensor:
    """Keys' cubic convolution with a = -0.5, as torch's and PIL's antialiased bicubic."""
    x, a = x.abs(), -0.5
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


FILTERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"bilinear": triangle, "bicubic": cubic}


def resize_weights(lengths: torch.Tensor, size: int, span: int, mode: str) -> torch.Tensor:
    """N x size x span: row i of image n weighs the crop's `span` (padded) pixels for output pixel i, as
    torch's antialiased kernels do: centre (i + 0.5) * scale, the filter stretched by the scale when it
    shrinks."""
    length = lengths.to(torch.float32).view(-1, 1, 1)
    scale = length / size
    centre = scale * (torch.arange(size, device=lengths.device, dtype=torch.float32).view(1, -1, 1) + 0.5)
    source = torch.arange(span, device=lengths.device, dtype=torch.float32).view(1, 1, -1)
    weights = FILTERS[mode]((source + 0.5 - centre) / scale.clamp(min=1.0)) * (source < length)
    return weights / weights.sum(-1, keepdim=True)


def resize_crops(images: Sequence[torch.Tensor], boxes: Sequence[Box], flips: Sequence[bool], size: int,
                 mode: str) -> torch.Tensor:
    """N x size x size x 3 uint8: each CHW uint8 image's box resized to size x size (antialiased, in float,
    rounded), flipped left-right where asked. Chunks of crops padded to at most `BUDGET` floats each."""
    device = images[0].device
    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=device)
    for rows in chunks([(h, w) for _, _, h, w in boxes]):
        resized = _resized([images[i] for i in rows], [boxes[i] for i in rows], [flips[i] for i in rows],
                           size, mode)
        out.index_copy_(0, host_tensor(rows, device), resized)
    return out.permute(0, 2, 3, 1)


def chunks(sizes: list[tuple[int, int]]) -> list[list[int]]:
    """The crops' indices in groups whose padded batch holds at most `BUDGET` floats (one crop alone if it is
    larger), largest crops first so that a group pads to sizes close to its own."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i][0] * sizes[i][1], reverse=True)
    groups: list[list[int]] = []
    height = width = 0
    for i in order:
        h, w = max(height, sizes[i][0]), max(width, sizes[i][1])
        if groups and (len(groups[-1]) + 1) * 3 * h * w <= BUDGET:
            groups[-1].append(i)
            height, width = h, w
        else:
            groups.append([i])
            height, width = sizes[i]
    return groups


def _resized(images: list[torch.Tensor], boxes: list[Box], flips: list[bool], size: int,
             mode: str) -> torch.Tensor:
    device = images[0].device
    height, width = max(h for _, _, h, _ in boxes), max(w for _, _, _, w in boxes)
    crops = padded_crops(images, boxes, height, width)
    lengths = host_tensor([[h, w] for _, _, h, w in boxes], device)
    across = resize_weights(lengths[:, 1], size, width, mode)
    across = torch.where(host_tensor(flips, device).view(-1, 1, 1), across.flip(1), across)
    rows = torch.matmul(resize_weights(lengths[:, 0], size, height, mode).unsqueeze(1), crops)
    out = torch.matmul(rows, across.transpose(1, 2).unsqueeze(1))
    return out.round_().clamp_(0, 255).to(torch.uint8)


def padded_crops(images: list[torch.Tensor], boxes: list[Box], height: int, width: int) -> torch.Tensor:
    """N x 3 x height x width float: each CHW uint8 image's box at the top left, zeros around it. One
    gather for the batch: the images' memory end to end (one cat of views: a decoder's CHW or HWC
    layout, whichever it wrote, is read as it lies), and every output pixel's source position computed
    on the device from each image's sizes, layout and box (one copy of 8 numbers an image), so the
    launches do not grow with the batch."""
    device = images[0].device
    flat = torch.cat([_memory(image) for image in images])
    starts = accumulate([image.numel() for image in images[:-1]], initial=0)
    table = host_tensor([[start, *_steps(image), *box]
                         for start, image, box in zip(starts, images, boxes, strict=True)], device)
    start, channel_step, row_step, column_step, top, left, h, w = (table[:, k].view(-1, 1, 1, 1)
                                                                    for k in range(8))
    y = torch.arange(height, device=device).view(1, 1, -1, 1)
    x = torch.arange(width, device=device).view(1, 1, 1, -1)
    channel = torch.arange(3, device=device).view(1, -1, 1, 1)
    source = (start + channel * channel_step + (top + y.minimum(h - 1)) * row_step
              + (left + x.minimum(w - 1)) * column_step)
    return flat.take(source).to(torch.float32).mul_((y < h) & (x < w))


def _memory(image: torch.Tensor) -> torch.Tensor:
    """A CHW image's memory as one flat view where it is CHW- or HWC-contiguous (decoders write either),
    else a copy."""
    if image.permute(1, 2, 0).is_contiguous():
        return image.permute(1, 2, 0).reshape(-1)
    return image.reshape(-1)


def _steps(image: torch.Tensor) -> tuple[int, int, int]:
    """(channel, row, column) strides of `image` in `_memory`'s flat view."""
    _, height, width = image.shape
    if image.permute(1, 2, 0).is_contiguous():
        return 1, 3 * width, 3
    return height * width, width, 1


def host_tensor(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Python numbers on `device` without the host waiting: made on the host, pinned where a GPU is, copied
    asynchronously (`torch.tensor(..., device=cuda)` would be a blocking copy from pageable memory)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, pinned and copied asynchronously where that is a GPU."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
