"""Decoding every real-world ImageNet oddity to RGB, the transforms, the bad-image policy."""

from __future__ import annotations

import io

import fsspec
import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from torchvision.transforms import CenterCrop, RandomResizedCrop, Resize

from ddp_cli.data.images import BadImage, decode_rgb, open_image, shrink_on_decode
from ddp_cli.data.loaders import ImageDataset
from ddp_cli.data.transforms import MEAN, STD, TrainTransform, ValTransform, to_model_input


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
    assert img.mode == "RGB"
    pixels = np.asarray(img).reshape(-1, 3).astype(int)
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
    table = pd.DataFrame({"path": ["n0/x.JPEG"], "label": [4]})
    dataset = ImageDataset(fsspec.filesystem("file"), str(tmp_path), table, ValTransform(8, 10))
    image, label, skipped, error = dataset[0]
    assert (error, label, skipped) == ("", 4, 0)
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


@pytest.mark.parametrize("data", [b"hello, not an image\n" * 10, b"", b"\x00" * 64])
def test_non_image_is_reported_as_not_an_image(data):
    with pytest.raises(BadImage, match="^not an image$"):
        decode_rgb(data)


def test_val_transform_with_draft_matches_full_decode():
    data = encode(gradient(400, 300), "JPEG", quality=95)
    size, resize = 64, 73
    probe = open_image(data)
    assert shrink_on_decode(probe, 98, 73) == pytest.approx(0.25)  # the draft path is really taken
    ours = ValTransform(size, resize)(open_image(data)).numpy().astype(float)
    reference = CenterCrop(size)(Resize(resize)(decode_rgb(data)))
    diff = np.abs(ours - np.asarray(reference, dtype=float))
    assert ours.shape == (size, size, 3)
    assert diff.mean() < 8, diff.mean()


def test_train_transform_with_draft_crops_the_same_region():
    data = encode(gradient(800, 600), "JPEG", quality=95)
    full = decode_rgb(data)
    for seed in range(5):
        torch.manual_seed(seed)
        ours = TrainTransform(32, min_scale=0.5, hflip=False)(open_image(data)).numpy().astype(float)
        torch.manual_seed(seed)
        top, left, h, w = RandomResizedCrop.get_params(full, [0.5, 1.0], [3 / 4, 4 / 3])
        reference = full.resize((32, 32), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        diff = np.abs(ours - np.asarray(reference, dtype=float))
        assert diff.mean() < 4, (seed, diff.mean())  # a 20-pixel misplacement gives ~12


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
    table = pd.DataFrame({"path": ["a.JPEG", "bad.JPEG", "c.JPEG", "gone.JPEG"], "label": [0, 1, 2, 3]})
    return tmp_path, table


def test_skip_policy_replaces_a_bad_file_and_counts_it(mixed_folder):
    root, table = mixed_folder
    dataset = ImageDataset(fsspec.filesystem("file"), str(root), table, ValTransform(16, 18),
                           on_bad_image="skip", out_size=16)
    for index in (1, 3):  # a corrupt file, a missing file
        image, label, skipped, error = dataset[index]
        assert error == ""
        assert skipped > 0
        assert tuple(image.shape) == (16, 16, 3)
        assert image[..., 0].float().mean() > 150  # a real (red) image, not the blank
        replacement = (index + skipped * 7919) % len(table)
        assert label == table["label"][replacement]
    assert dataset[0][2] == 0


def test_error_policy_returns_the_message_naming_the_file(mixed_folder):
    root, table = mixed_folder
    dataset = ImageDataset(fsspec.filesystem("file"), str(root), table, ValTransform(16, 18),
                           on_bad_image="error", out_size=16)
    image, label, skipped, error = dataset[1]
    assert error == f"{root}/bad.JPEG: not an image"
    assert label == 1
    assert skipped == 0
    assert tuple(image.shape) == (16, 16, 3)
    assert dataset[3][3] == f"{root}/gone.JPEG: missing file"
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
