"""Decoding every real-world ImageNet oddity to RGB, the transforms, the bad-image policy."""

from __future__ import annotations

import dataclasses
import io
import math

import fsspec
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image
from torchvision.transforms import CenterCrop, RandomResizedCrop, Resize

from ddp_cli.data.pipeline.images import BadImage, decode, decode_rgb, open_image
from ddp_cli.data.pipeline.loaders import ImageDataset, collate, requested, skipped_files
from ddp_cli.data.pipeline.transforms import (
    MEAN,
    STD,
    TrainTransform,
    ValTransform,
    random_resized_crop,
    to_model_input,
)
from ddp_cli.data.sources.packed import Split


def encode(img: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, fmt, **options)
    return buffer.getvalue()


def gradient(width: int = 400, height: int = 300) -> Image.Image:
    """Smooth in both directions, with a slow wave so misplaced crops show."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    r = x * 255 / (width - 1)
    g = y * 255 / (height - 1)
    b = 128 + 100 * np.sin(x / 23) * np.cos(y / 17)
    return Image.fromarray(np.stack([r, g, b], -1).round().astype(np.uint8), "RGB")


def pil_rgb(data: bytes) -> Image.Image:
    """The reference decoder: plain PIL, full size."""
    return Image.open(io.BytesIO(data)).convert("RGB")


ADAPTIVE = Image.Palette.ADAPTIVE  # exact colours, no dithering to the web palette

# name -> (encoded bytes, the RGB colour every pixel should decode to)
ODDITIES = {
    "cmyk-jpeg": (encode(Image.new("CMYK", (60, 45), (0, 255, 255, 0)), "JPEG", quality=95), (255, 0, 0)),
    "gray-jpeg": (encode(Image.new("L", (45, 60), 128), "JPEG", quality=95), (128, 128, 128)),
    "rgba-png": (encode(Image.new("RGBA", (50, 50), (0, 0, 255, 40)), "PNG"), (0, 0, 255)),
    "palette-png": (encode(Image.new("RGB", (40, 30), (0, 200, 0)).convert("P", palette=ADAPTIVE), "PNG"),
                    (0, 200, 0)),
}


@pytest.mark.parametrize("name", ODDITIES)
def test_oddities_decode_to_rgb(name):
    data, colour = ODDITIES[name]
    img = decode_rgb(data)
    assert img.dtype == torch.uint8 and img.shape[-1] == 3
    pixels = img.numpy().reshape(-1, 3).astype(int)
    assert np.abs(pixels - colour).max() <= 3, pixels[:3]


@pytest.mark.parametrize("name", ODDITIES)
def test_oddities_through_both_transforms(name):
    data, colour = ODDITIES[name]
    torch.manual_seed(0)
    for transform, size in ((TrainTransform(24), 24), (ValTransform(16, 20), 16)):
        out = transform(open_image(data))
        assert out.dtype == torch.uint8
        assert tuple(out.shape) == (size, size, 3)
        assert (out.int() - torch.tensor(colour)).abs().max() <= 3


def test_png_named_jpeg_loads_through_the_dataset(tmp_path):
    (tmp_path / "n0").mkdir()
    Image.new("RGB", (30, 30), (10, 20, 200)).save(tmp_path / "n0" / "x.JPEG", format="PNG")
    assert (tmp_path / "n0" / "x.JPEG").read_bytes()[:4] == b"\x89PNG"
    table = Split.of(["n0/x.JPEG"], [4])
    dataset = ImageDataset(fsspec.filesystem("file"), str(tmp_path), table, ValTransform(8, 10))
    image, label, skipped, error = dataset[0]
    assert (error, label, skipped) == ("", 4, "")
    assert type(label) is int  # not a numpy uint8: a batch of labels collates to int64
    assert tuple(image.shape) == (8, 8, 3)
    assert (image[..., 2] > 190).all()


def test_truncated_jpeg_is_reported_as_truncated():
    data = encode(gradient(200, 160), "JPEG", quality=90)
    cut = data[: len(data) // 2]
    with pytest.raises(BadImage, match="^truncated$"):
        decode_rgb(cut)
    with pytest.raises(BadImage, match="^truncated$"):
        ValTransform(32, 36)(open_image(cut))
    with pytest.raises(BadImage, match="^truncated$"):
        TrainTransform(32)(open_image(cut))


@pytest.mark.parametrize(("name", "fast"), [("cmyk-jpeg", False), ("gray-jpeg", True), ("rgba-png", False)])
def test_fast_decoder_only_for_jpegs_it_turns_into_rgb_itself(name, fast):
    assert open_image(ODDITIES[name][0]).fast is fast


def test_colour_jpeg_takes_the_fast_path_and_matches_pil():
    data = encode(gradient(300, 200), "JPEG", quality=90)
    img = open_image(data)
    assert img.fast and img.size == (300, 200)
    ours = decode_rgb(data).numpy().astype(int)
    assert np.abs(ours - np.asarray(pil_rgb(data), dtype=int)).max() <= 2


def test_progressive_jpeg_decodes_and_scales():
    data = encode(gradient(320, 240), "JPEG", quality=90, progressive=True)
    pixels, k = decode(open_image(data), 80, 60)
    assert k == pytest.approx(0.25) and tuple(pixels.shape) == (60, 80, 3)


def test_harmless_libjpeg_warning_falls_back_to_pil_instead_of_failing():
    """Real ImageNet has JPEGs with "extraneous bytes before marker": PIL reads them fine."""
    good = encode(gradient(64, 48), "JPEG", quality=90)
    odd = good[:-2] + b"\x00" * 10 + good[-2:]
    assert torch.equal(decode_rgb(odd), torch.from_numpy(np.asarray(pil_rgb(good)).copy()))


@pytest.mark.parametrize("data", [b"hello, not an image\n" * 10, b"", b"\x00" * 64])
def test_non_image_is_reported_as_not_an_image(data):
    with pytest.raises(BadImage, match="^not an image$"):
        decode_rgb(data)


def test_val_transform_with_draft_matches_full_decode():
    data = encode(gradient(400, 300), "JPEG", quality=95)
    size, resize = 64, 73
    pixels, k = decode(open_image(data), 98, 73)
    assert k == pytest.approx(0.25) and tuple(pixels.shape) == (75, 100, 3)  # DCT scaling is really used
    ours = ValTransform(size, resize)(open_image(data)).numpy().astype(float)
    reference = CenterCrop(size)(Resize(resize)(pil_rgb(data)))
    diff = np.abs(ours - np.asarray(reference, dtype=float))
    assert ours.shape == (size, size, 3)
    assert diff.mean() < 8, diff.mean()


def test_train_transform_with_draft_crops_the_same_region():
    data = encode(gradient(800, 600), "JPEG", quality=95)
    full = pil_rgb(data)
    for seed in range(5):
        torch.manual_seed(seed)
        ours = TrainTransform(32, min_scale=0.5, hflip=False)(open_image(data)).numpy().astype(float)
        torch.manual_seed(seed)
        top, left, h, w = random_resized_crop(800, 600, (0.5, 1.0), (3 / 4, 4 / 3))
        assert max(w, h) > 400  # so the decoder really shrinks the image (1/2 scale)
        reference = full.resize((32, 32), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        diff = np.abs(ours - np.asarray(reference, dtype=float))
        assert diff.mean() < 4, (seed, diff.mean())  # a 20-pixel misplacement gives ~12


@pytest.mark.parametrize(("width", "height"), [(500, 375), (300, 500), (60, 2000)])
def test_random_resized_crop_draws_like_torchvision(width, height):
    """Same distribution of crops as torchvision's get_params (means over many draws)."""
    def stats(draw) -> np.ndarray:
        torch.manual_seed(0)
        boxes = np.array([draw() for _ in range(3000)], dtype=float)  # top, left, h, w
        assert (boxes[:, 2] >= 1).all() and (boxes[:, 0] + boxes[:, 2] <= height).all()
        assert (boxes[:, 3] >= 1).all() and (boxes[:, 1] + boxes[:, 3] <= width).all()
        return np.array([boxes[:, 2].mean(), boxes[:, 3].mean(), boxes[:, 0].mean(), boxes[:, 1].mean(),
                         (boxes[:, 2] * boxes[:, 3]).mean() / (width * height)])

    shape = torch.empty(1, 1, 1).expand(1, height, width)
    theirs = stats(lambda: RandomResizedCrop.get_params(shape, [0.08, 1.0], [3 / 4, 4 / 3]))
    ours = stats(lambda: random_resized_crop(width, height, (0.08, 1.0), (3 / 4, 4 / 3)))
    np.testing.assert_allclose(ours, theirs, rtol=0.05)


def test_train_transform_flips_when_asked():
    data = encode(gradient(120, 120), "JPEG", quality=95)
    flips = []
    for seed in range(8):
        torch.manual_seed(seed)
        plain = TrainTransform(16, min_scale=1.0, hflip=False)(open_image(data))
        torch.manual_seed(seed)
        maybe = TrainTransform(16, min_scale=1.0, hflip=True)(open_image(data))
        flips.append(torch.equal(maybe, plain.flip(1)))
        assert flips[-1] or torch.equal(maybe, plain)
    assert any(flips) and not all(flips)


def write_files(root, names_and_bytes):
    for name, data in names_and_bytes.items():
        (root / name).write_bytes(data)


@pytest.fixture
def mixed_folder(tmp_path):
    good = encode(Image.new("RGB", (40, 40), (200, 30, 30)), "JPEG", quality=95)
    write_files(tmp_path, {"a.JPEG": good, "bad.JPEG": b"garbage, not a jpeg", "c.JPEG": good})
    table = Split.of(["a.JPEG", "bad.JPEG", "c.JPEG", "gone.JPEG"], [0, 1, 2, 3])
    return tmp_path, table


def test_skip_policy_replaces_a_bad_file_and_counts_it(mixed_folder):
    root, table = mixed_folder
    dataset = ImageDataset(fsspec.filesystem("file"), str(root), table, ValTransform(16, 18),
                           on_bad_image="skip", out_size=16)
    for index, name in ((1, "bad.JPEG"), (3, "gone.JPEG")):  # a corrupt file, a missing file
        image, label, skipped, error = dataset[index]
        assert error == ""
        assert skipped == f"{root}/{name}"  # names the file it stands in for
        assert tuple(image.shape) == (16, 16, 3)
        assert image[..., 0].float().mean() > 150  # a real (red) image, not the blank
        replacement = (index + 7919) % len(table)
        assert label == table.labels[replacement]
    assert dataset[0][2] == ""


def test_skipped_files_and_requested_mask_of_a_collated_batch(mixed_folder):
    root, table = mixed_folder
    dataset = ImageDataset(fsspec.filesystem("file"), str(root), table, ValTransform(16, 18),
                           on_bad_image="skip", out_size=16)
    batch = collate([dataset[i] for i in range(4)])
    assert skipped_files(batch.skipped) == [f"{root}/bad.JPEG", f"{root}/gone.JPEG"]
    assert requested(batch.skipped).tolist() == [True, False, True, False]
    assert list(batch.errors) == [""] * 4 and batch.images.shape == (4, 16, 16, 3)
    assert batch.labels.dtype == torch.int64


def test_error_policy_returns_the_message_naming_the_file(mixed_folder):
    root, table = mixed_folder
    dataset = ImageDataset(fsspec.filesystem("file"), str(root), table, ValTransform(16, 18),
                           on_bad_image="error", out_size=16)
    image, label, skipped, error = dataset[1]
    hint = '(set data.on_bad_image = "skip" to skip it)'
    assert error == f"bad image {root}/bad.JPEG: not an image {hint}"
    assert label == 1
    assert skipped == ""
    assert tuple(image.shape) == (16, 16, 3)
    assert dataset[3][3] == f"bad image {root}/gone.JPEG: missing file {hint}"
    assert dataset[0][3] == ""


def random_batch(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (2, 4, 5, 3), dtype=torch.uint8, generator=g)


def test_to_model_input_normalises_to_nchw():
    images = random_batch(1)
    out = to_model_input(images, torch.device("cpu"), channels_last=False)
    assert out.dtype == torch.float32
    assert tuple(out.shape) == (2, 3, 4, 5)
    assert out.is_contiguous()
    expected = (images.permute(0, 3, 1, 2).double() / 255 - torch.tensor(MEAN, dtype=torch.double)
                .view(1, 3, 1, 1)) / torch.tensor(STD, dtype=torch.double).view(1, 3, 1, 1)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
    assert out[0, 1, 2, 3].item() == pytest.approx((images[0, 2, 3, 1].item() / 255 - MEAN[1]) / STD[1],
                                                   abs=1e-5)


def test_to_model_input_channels_last():
    images = random_batch(2)
    plain = to_model_input(images, torch.device("cpu"), channels_last=False)
    nhwc = to_model_input(images, torch.device("cpu"), channels_last=True)
    assert tuple(nhwc.shape) == (2, 3, 4, 5)
    assert nhwc.is_contiguous(memory_format=torch.channels_last)
    assert not nhwc.is_contiguous()
    torch.testing.assert_close(nhwc, plain)


def test_dct_scaling_off_decodes_every_image_whole(monkeypatch):
    """`ddp bench data --full-decode`'s pipeline: the same crops, each from the whole image."""
    from ddp_cli.data.pipeline import transforms

    asked = []
    real = transforms.decode
    monkeypatch.setattr(transforms, "decode", lambda img, w, h: asked.append((w, h)) or real(img, w, h))
    img = open_image(encode(gradient(400, 300), "JPEG", quality=90))
    for scaling in (True, False):
        torch.manual_seed(0)
        TrainTransform(32, dct_scaling=scaling)(img)
    assert asked[0] < (400, 300) and asked[1] == (400, 300)


@pytest.mark.parametrize(("width", "height", "k"), [(61, 45, 2), (125, 93, 4), (333, 251, 8)])
def test_pil_path_scales_jpegs_of_odd_sizes_as_libjpeg_turbo_does(width, height, k):
    """A JPEG PIL decodes (CMYK here) is DCT-scaled by the same 1/k as the fast path, odd sides included:
    PIL's draft asked for ceil(side / k) pixels took 375 // 188 = 1 for "1/2", and decoded whole."""
    data = encode(Image.new("CMYK", (width, height), (0, 255, 255, 0)), "JPEG", quality=95)
    img = open_image(data)
    assert not img.fast
    pixels, scale = decode(img, -(-width // k), -(-height // k))
    assert tuple(pixels.shape) == (-(-height // k), -(-width // k), 3)
    assert scale == pytest.approx(1 / k, rel=0.05)
    assert (pixels.int() - torch.tensor((255, 0, 0))).abs().max() <= 3


@pytest.mark.parametrize(("width", "height", "resize"), [(500, 375, 128), (500, 375, 47), (333, 251, 63),
                                                          (1001, 667, 167)])
def test_the_export_cards_pil_recipe_decodes_at_validations_scale(width, height, resize):
    """docs/evaluation.md's recipe (the card's `decode`) reproduces ValTransform's decode, at the sizes
    where asking PIL's draft for the resized size would decode a finer scale (all but the first)."""
    data = encode(gradient(width, height), "JPEG", quality=90)
    s = resize / min(width, height)
    ours, _ = decode(open_image(data), math.ceil(width * s), math.ceil(height * s))
    image = Image.open(io.BytesIO(data))
    k = next(k for k in (8, 4, 2, 1) if all(-(-n // k) >= math.ceil(n * s) for n in image.size))
    image.draft("RGB", (image.width // k, image.height // k))
    theirs = torch.from_numpy(np.asarray(image.convert("RGB")).copy())
    assert theirs.shape == ours.shape and (theirs.int() - ours.int()).abs().max() <= 1


DCT_SCALES = (8, 4, 2, 1)  # libjpeg's 1/k: what either decoder may hand back


@pytest.mark.parametrize("decoder", ["libjpeg-turbo", "pil-draft"])
@settings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(width=st.integers(1, 300), height=st.integers(1, 300), asked_width=st.integers(0, 320),
       asked_height=st.integers(0, 320))
@example(width=100, height=100, asked_width=26, asked_height=26).via("one pixel short at 1/4: 25 x 25")
@example(width=300, height=100, asked_width=20, asked_height=26).via("the short side one pixel short")
@example(width=64, height=48, asked_width=8, asked_height=6).via("exactly 1/8")
@example(width=64, height=48, asked_width=9, asked_height=6).via("one pixel over 1/8 on one side")
@example(width=7, height=300, asked_width=1, asked_height=300).via("asked all of the long side")
@example(width=200, height=150, asked_width=400, asked_height=10).via("asked more than there is")
def test_the_decode_is_the_coarsest_dct_scale_never_smaller_than_asked(decoder, width, height, asked_width,
                                                                       asked_height):
    """Either decoder (simplejpeg's libjpeg-turbo, or PIL's draft for the JPEGs it takes) hands back
    the image at the coarsest 1/k that is still at least the size asked on both sides (the whole
    image where it is smaller than that): a decode one step too coarse would be upsampled to the crop
    without a word."""
    img = open_image(encode(Image.new("RGB", (width, height), (200, 30, 90)), "JPEG", quality=75))
    assert img.fast
    if decoder == "pil-draft":
        img = dataclasses.replace(img, fast=False)
    pixels, scale = decode(img, asked_width, asked_height)
    got_height, got_width = pixels.shape[:2]
    assert got_width >= min(asked_width, width) and got_height >= min(asked_height, height)
    assert scale == got_width / width
    k = max(k for k in DCT_SCALES if (math.ceil(width / k), math.ceil(height / k)) == (got_width, got_height))
    coarser = 2 * k
    if decoder == "pil-draft" and min(width, height) < coarser:
        return  # PIL's draft cannot take 1/k of a side under k px (it divides by side // k): larger, not less
    assert k == 8 or math.ceil(width / coarser) < asked_width or math.ceil(height / coarser) < asked_height, \
        f"1/{coarser} ({math.ceil(width / coarser)} x {math.ceil(height / coarser)}) was large enough"
