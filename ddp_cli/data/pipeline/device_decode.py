"""data.decode = "gpu": the rank decodes its batch's JPEGs on its own device and renders them there.

The loader processes do what they always did up to the pixels: read each file,
judge its header, apply the bad-image policy, and draw its crop, flip and
augmentation from the seeded stream (`TrainTransform.plan`); a JPEG the device
decodes then travels compressed with its plan (`Deferred`), any other image
(CMYK, PNG named .JPEG, truncated) is rendered in the loader as on the CPU path.
`collate` packs a batch's bytes end to end in one tensor (one shared-memory
segment, one pinned buffer) beside the rows already rendered.

On the rank, `DeferredBatch.to(device)` (what the trainer calls on a batch's
images) decodes the JPEGs in one batched call (torchvision.io.decode_jpeg: nvJPEG
on a GPU, libjpeg-turbo on a CPU), then crops, resizes and flips the batch's
images together (`batched_resize`: two batched matrix products in float, torch's
antialiased filters, rounded back to uint8 as the CPU path's), and replays the
augmentation steps through v2's tensor kernels (`augment.replay`), the images that
share a call together (`replay_grouped`): the launches a batch do not grow with
it (tests/unit/test_device_decode counts them at 64 and 256 images); the
normalisation is the batch's, as for every batch (`to_model_input`). Nothing is
read back to the host: the two places where torchvision's tensor kernels would
wait for the device (a tensor made from Python numbers on it, a boolean-mask
assignment) are rewritten by `queued` into queued equivalents (tests/gpu_rules,
tests/unit/test_device_decode). One wait is torchvision's own and stays: its
nvJPEG decoder works on a stream of its own (baseline JPEGs on the GPU's hardware
JPEG engines where it has them, A100 and later) and synchronises that stream
before returning, so the host waits for the batch's decode, not for the training
queued before it, which the GPU runs meanwhile (its output is taken from a stream
of ddp's own: nvJPEG's engine would otherwise write memory that training still
reads; `decode_jpegs`): the step keeps pace as long as the decode, the render's
launches and the step's take less host time than the step takes the GPU, which
`make gpu-check`'s input stage weighs. The render is batched for that: launched
image by image, its kernels alone cost the host about as much as the step.

An image the device's decoder refuses anyway is decoded on the rank's CPU
(`images.decode`, PIL judging it) and goes on through the same steps; one PIL
refuses too is a bad image: under "error" the run stops naming it, under "skip"
its row stays blank, with a warning naming it (the loader's header checks make
this rare: they catch what PIL calls truncated or unreadable).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torchvision
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map
from torchvision.io import ImageReadMode, decode_jpeg

from ddp_cli.data.pipeline.augment import replay
from ddp_cli.data.pipeline.batched_ops import BATCHED
from ddp_cli.data.pipeline.batched_resize import host_tensor, resize_crops
from ddp_cli.data.pipeline.images import BadImage, bad_image_message, decode_rgb
from ddp_cli.data.pipeline.transforms import Deferred, Plan, pixel_box
from ddp_cli.errors import DataError

log = logging.getLogger("ddp")
HOST_DATA = (torch.tensor, torch.as_tensor)
STAND_IN = "DDP_DECODE_STAND_IN"  # "1": CPU workers measure data.decode "auto" too (`decodes_on`)


@dataclass
class DeferredBatch:
    """A training batch whose JPEGs the rank decodes: `to(device)` makes its uint8 N x S x S x C images, or
    N x V x S x S x C where each image has V views (FixMatch's weak and strong), all from its one decode."""

    size: int  # S, the crop's side
    pixels: torch.Tensor  # R x (V x) S x S x 3 uint8: rows the loader rendered (CMYK, PNG, a bad one's blank)
    pixel_rows: list[int]  # their rows in the batch
    data: torch.Tensor  # the deferred rows' JPEG files, end to end (uint8)
    ends: list[int]  # where each file ends in `data`
    rows: list[int]  # the batch row of each deferred image
    items: list[Deferred]  # their plans (their `data` emptied: it is in `data`)
    views: int = 1  # V: the plans of each image (`Deferred.plans`)

    def __len__(self) -> int:
        return len(self.pixel_rows) + len(self.rows)

    def pin_memory(self) -> DeferredBatch:
        """Pinned, as the DataLoader pins a batch (so every copy to the GPU is asynchronous): the rows,
        the files and the augmentation's tensors (erasing's values)."""
        items = [replace(item, plan=_pinned_plan(item.plan), more=tuple(_pinned_plan(p) for p in item.more))
                 for item in self.items]
        return replace(self, pixels=self.pixels.pin_memory(), data=self.data.pin_memory(), items=items)

    def files(self) -> list[torch.Tensor]:
        starts = [0, *self.ends[:-1]]
        return [self.data[start:end] for start, end in zip(starts, self.ends, strict=True)]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> torch.Tensor:
        """The batch's uint8 N x (V x) S x S x C images on `device`, decoded and rendered there (queued:
        nothing waits for the device, whatever `non_blocking` says)."""
        device, views, side = torch.device(device), self.views, self.size
        out = torch.empty((len(self) * views, side, side, 3), dtype=torch.uint8, device=device)
        if self.pixel_rows:
            rendered = self.pixels.to(device, non_blocking=True).view(-1, side, side, 3)
            out.index_copy_(0, host_tensor([row * views + k for row in self.pixel_rows for k in range(views)],
                                           device), rendered)
        files = self.files()
        images = [Decoded(row, item, image if image is not None else on_cpu(data, item, device))
                  for row, item, data, image in zip(self.rows, self.items, files, decode_jpegs(files, device),
                                                    strict=True)]
        for blank in (image for image in images if image.chw is None):
            out[blank.row * views:(blank.row + 1) * views].zero_()
        render(out, [View(image.row * views + k, plan, image.item.interpolation, image.chw)
                     for image in images if image.chw is not None for k, plan in enumerate(image.item.plans)],
               device)
        return out if views == 1 else out.view(len(self), views, side, side, 3)


class Decoded(NamedTuple):
    row: int  # in the batch
    item: Deferred
    chw: torch.Tensor | None  # on the device; None: a bad image skipped


class View(NamedTuple):
    row: int  # in the rendered rows (an image's views side by side)
    plan: Plan
    interpolation: str
    chw: torch.Tensor  # its image, decoded on the device (the one decode its views share)


def render(out: torch.Tensor, views: list[View], device: torch.device) -> None:
    """The views' plans, into their rows of `out`: crops resized and flipped in batches (one per resize
    filter: `resize_crops`), then each view's augmentation steps replayed (`replay_grouped`), the steps on
    the image first, then those on the tensor (erasing, Cutout), each kind at positions of its own (a
    policy's op that calls nothing, as Identity, would otherwise move erasing to another position)."""
    for mode in sorted({view.interpolation for view in views}):
        these = [view for view in views if view.interpolation == mode]
        boxes = [pixel_box(view.plan.box, *view.chw.shape[1:]) for view in these]
        flips = [view.plan.flip for view in these]
        resized = resize_crops([view.chw for view in these], boxes, flips, out.shape[1], mode)
        out.index_copy_(0, host_tensor([view.row for view in these], device), resized)
    with queued(device):
        for kind in range(2):
            replay_grouped(out, [(view.row, view.plan.steps[kind]) for view in views if view.plan.steps],
                           device)


def replay_grouped(out: torch.Tensor, planned: list[tuple[int, list]], device: torch.device) -> None:
    """Each row's augmentation steps on `out` (N x S x S x C), a step position at a time, the rows whose
    step there is the same functional replayed together as one batch, each with its own magnitude
    (`batched_ops`: brightness, contrast, saturation, sharpness, posterize, solarize, the warps, a box of
    one colour); any other call (equalize, autocontrast, erasing's noise) with the rows whose call is the
    same (functional and arguments). So the launches are a few per functional the policy knows, not per
    image: RandAugment's 14 ops, at one magnitude or at FixMatch's random one, TrivialAugment's 14 at 31,
    colour jitter's continuous factors."""
    for position in range(max((len(steps) for _, steps in planned), default=0)):
        groups: dict[Any, tuple[Any, list[dict[str, Any]], list[int]]] = {}
        for row, steps in planned:
            if position < len(steps):
                functional, kwargs = steps[position]
                group = groups.setdefault(_group_key(functional, kwargs), (functional, [], []))
                group[1].append(kwargs)
                group[2].append(row)
        for functional, calls, rows in groups.values():
            index = host_tensor(rows, device)
            chw = out.index_select(0, index).permute(0, 3, 1, 2)
            batched = BATCHED.get(functional)
            if batched is not None and batched.takes(calls[0]):
                chw = batched.kernel(chw, calls)
            else:
                chw = replay(chw, [(functional, calls[0])], device)
            out.index_copy_(0, index, chw.permute(0, 2, 3, 1))


def _group_key(functional: Any, kwargs: dict[str, Any]) -> Any:
    """The calls replayed together: a functional `batched_ops` covers, whatever its per-image arguments;
    any other, the same functional with the same arguments (a tensor argument, as erasing's noise, by
    identity: each image's own)."""
    def frozen(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", id(value))
        if isinstance(value, list | tuple):
            return tuple(frozen(v) for v in value)
        return value
    batched = BATCHED.get(functional)
    shared = batched.per_image if batched is not None and batched.takes(kwargs) else ()
    return functional, shared, tuple(sorted((k, frozen(v)) for k, v in kwargs.items() if k not in shared))


def on_cpu(data: torch.Tensor, item: Deferred, device: torch.device) -> torch.Tensor | None:
    """An image the device's decoder refused, decoded on the CPU (PIL judges it) and put on `device` as CHW;
    None for a bad image under "skip" (its row stays blank), DataError under "error"."""
    try:
        pixels = decode_rgb(data.numpy().tobytes())
    except BadImage as e:
        if item.on_bad_image != "skip":
            raise DataError(bad_image_message(item.where, str(e))) from e
        log.warning("bad image %s: %s; its row of the batch is left blank", item.where, e)
        return None
    return _pinned(pixels, device).to(device, non_blocking=True).permute(2, 0, 1)


def decodes_on(device: str, env: Mapping[str, str] = os.environ) -> bool:
    """Whether workers on `device` (cuda | cpu) can decode their JPEGs there: on CUDA, with a torchvision
    built with it (its CUDA builds have nvJPEG). What data.decode "auto" resolves from: where they can,
    the workers measure both paths. CPU workers have no device to hand the work to (the rank would decode
    on the cores its loader processes use), so "auto" is "cpu" there without a measurement, unless
    STAND_IN is set to 1: then the CPU stand-in of the device path counts, and "auto" is measured (the
    tests of the measurement, and a look at it without a GPU)."""
    if device == "cpu":
        return env.get(STAND_IN) == "1"
    return device == "cuda" and torchvision.version.cuda is not None


def decode_jpegs(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """RGB CHW uint8 images on `device`, decoded there in one batched call; where the batch is refused,
    each image alone, None for those refused alone.

    On a GPU the decoder's output comes from memory no queued work can still read. torchvision takes it
    from the current stream's pool and nvJPEG writes it at once: its hardware engine (baseline JPEGs on
    A100 and later) does not wait for the work queued before it (pytorch/vision#9606). A block freed on
    the caller's stream by the training step still queued there would be overwritten under that step:
    its inputs silently corrupted, seen only later as a NaN loss (`make gpu-check`'s input stage). So the
    decode runs with a stream of its own current, whose pool holds only decoder outputs, each returned
    to it (`record_stream`) only once the caller's work using it has run; the caller's stream waits for
    the decode's on the device, and the host never waits for the training."""
    if device.type != "cuda":
        return _decoded(files, device)
    caller, own = torch.cuda.current_stream(device), decoder_stream(device)
    with torch.cuda.stream(own):
        decoded = _decoded(files, device)
    caller.wait_stream(own)
    for image in decoded:
        if image is not None:
            image.record_stream(caller)
    return decoded


@functools.cache
def decoder_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream `decode_jpegs` allocates the decoder's output on, one per GPU."""
    return torch.cuda.Stream(device)


def _decoded(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    try:
        return list(decode_jpeg(files, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        return [_decoded_alone(data, device) for data in files]


def _decoded_alone(data: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        return None


def collate_images(images: Sequence[torch.Tensor | Deferred]) -> DeferredBatch:
    """A batch of rendered rows and deferred JPEGs as one `DeferredBatch` (the loader process's collate):
    the files end to end in one tensor, the rendered rows in another (empty, as a rule)."""
    deferred = [(row, image) for row, image in enumerate(images) if isinstance(image, Deferred)]
    rendered = [(row, image) for row, image in enumerate(images) if not isinstance(image, Deferred)]
    size, views = deferred[0][1].plan.size, len(deferred[0][1].plans)
    row = (views, size, size, 3) if views > 1 else (size, size, 3)
    pixels = (torch.stack([image for _, image in rendered]) if rendered
              else torch.empty((0, *row), dtype=torch.uint8))
    files = [image.data for _, image in deferred]
    data = torch.frombuffer(bytearray(b"".join(files)), dtype=torch.uint8)
    ends = torch.tensor([len(f) for f in files]).cumsum(0).tolist()
    return DeferredBatch(size, pixels, [row for row, _ in rendered], data, ends, [row for row, _ in deferred],
                         [replace(image, data=b"") for _, image in deferred], views)


def _pinned_plan(plan: Plan) -> Plan:
    return replace(plan, steps=_pinned(plan.steps))


def _pinned(tree: Any, device: torch.device | None = None) -> Any:
    """`tree`'s tensors in pinned memory (where a GPU is: pinning needs one; `device` a CPU: as they are)."""
    if device is not None and device.type == "cpu":
        return tree
    return tree_map(lambda t: t.pin_memory() if isinstance(t, torch.Tensor) else t, tree)


class queued(TorchFunctionMode):  # noqa: N801 - a context manager, like torch's modes
    """The two waits for the device in torchvision's tensor kernels, rewritten into queued equivalents:
    `torch.tensor(numbers, device=D)` (an affine's matrix, a sharpness kernel), a blocking copy as
    written, made on the host, pinned and copied asynchronously; `x[mask] = number` with a boolean mask
    of x's shape (autocontrast's flat channels), which counts the mask on the host, as `masked_fill_`."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = kwargs.get("device")
        if func in HOST_DATA and target is not None and torch.device(target).type == self.device.type \
                and not any(isinstance(a, torch.Tensor) for a in tree_leaves(args)):  # Python numbers only
            host = func(*args, **{k: v for k, v in kwargs.items() if k != "device"})
            return _pinned(host, self.device).to(target, non_blocking=True)
        if func is torch.Tensor.__setitem__ and _mask_fill(*args):
            args[0].masked_fill_(args[1], args[2])
            return None
        return func(*args, **kwargs)


def _mask_fill(target: Any, index: Any = None, value: Any = None) -> bool:
    return (isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.shape == target.shape
            and isinstance(value, int | float))
