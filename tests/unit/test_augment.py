"""Per-image augmentation: what each op does to the pixels, its determinism, and the plan's pipeline."""

from __future__ import annotations

import io
import math
import random

import fsspec
import numpy as np
import pytest
import torch
from PIL import Image
from synthetic import image
from torch.utils.data import DataLoader

from ddp_cli.cli.plan import augmentation as plan_augmentation
from ddp_cli.cli.plan import val_preprocessing
from ddp_cli.cli.render import print_mapping
from ddp_cli.config import AugmentConfig, DataConfig, RunConfig
from ddp_cli.data.pipeline.augment import MEAN_PIXEL, augmentation, op_names, train_transform
from ddp_cli.data.pipeline.images import EncodedImage, decode, open_image
from ddp_cli.data.pipeline.loaders import EpochItems, ImageDataset, eval_loader
from ddp_cli.data.pipeline.transforms import MEAN, STD, ValTransform, crop_resize, random_resized_crop
from ddp_cli.data.sources.packed import Split

SEEDS = range(60)


def photo(size: int = 48, seed: int = 0, low: int = 20, high: int = 235) -> torch.Tensor:
    """An HWC uint8 crop with structure (edges, gradients) and noise, inside [low, high]."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([x, y, (x > 0.5) ^ (y > 0.3)], -1) * 0.7 + 0.15 + rng.normal(0, 0.05, (size, size, 3))
    return torch.from_numpy((low + (high - low) * base.clip(0, 1)).round().astype(np.uint8))


def jpeg(pixels: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def augmented(cfg: AugmentConfig, pixels: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    ops = augmentation(cfg)
    out = ops.apply(pixels.clone(), ops.plan(pixels.shape[0]))
    assert out.dtype == torch.uint8 and out.shape == pixels.shape and out.is_contiguous()
    return out


def luminance(pixels: torch.Tensor) -> float:
    return float((pixels.double() @ torch.tensor([0.299, 0.587, 0.114], dtype=torch.float64)).mean())


def test_no_augmentation_by_default_and_none_at_zero_strength():
    assert augmentation(AugmentConfig()) is None
    assert augmentation(AugmentConfig(color_jitter=0.0, random_erase=0.0)) is None
    assert train_transform(DataConfig(), AugmentConfig()).augment is None
    only_policy = AugmentConfig(policy="trivialaugment", color_jitter=0.0, random_erase=0.0)
    assert op_names(only_policy) == ["TrivialAugmentWide(bilinear)"]


@pytest.mark.parametrize("strength", [0.2, 0.4])
def test_colour_jitter_scales_brightness_within_its_strength(strength):
    """Contrast and saturation keep the mean luminance, brightness multiplies it by a factor drawn from
    [1 - s, 1 + s]: so the ratio stays inside that range and, over many draws, spans most of it."""
    pixels = photo(low=60, high=170)  # no clipping even at 1.4x
    cfg = AugmentConfig(color_jitter=strength)
    ratios = np.array([luminance(augmented(cfg, pixels, seed)) / luminance(pixels) for seed in SEEDS])
    assert ratios.min() >= 1 - strength - 0.02 and ratios.max() <= 1 + strength + 0.02, ratios
    assert ratios.min() < 1 - strength / 2 and ratios.max() > 1 + strength / 2, ratios
    stds = [augmented(cfg, pixels, seed).double().std(dim=(0, 1)) for seed in SEEDS[:20]]
    assert any((s / pixels.double().std(dim=(0, 1)) - 1).abs().max() > strength / 4 for s in stds)  # contrast


def erased_box(before: torch.Tensor, after: torch.Tensor) -> tuple[int, int, int, int] | None:
    """The bounding box (top, left, h, w) of the pixels that changed, or None."""
    changed = (before != after).any(dim=2).nonzero()
    if not len(changed):
        return None
    (top, left), (bottom, right) = changed.min(0).values.tolist(), changed.max(0).values.tolist()
    return top, left, bottom - top + 1, right - left + 1


@pytest.mark.parametrize("value", [0.0, 77.0, "mean"])
def test_random_erasing_fills_one_rectangle_of_the_configured_area_and_value(value):
    pixels = torch.randint(1, 255, (64, 64, 3), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    fill = torch.tensor(MEAN_PIXEL if value == "mean" else (int(value),) * 3, dtype=torch.uint8)
    cfg = AugmentConfig(random_erase=1.0, random_erase_value=value)
    for seed in SEEDS:
        out = augmented(cfg, pixels, seed)
        top, left, h, w = erased_box(pixels, out)
        assert (out[top:top + h, left:left + w] == fill).all()  # one solid rectangle of the fill
        slack = 0.5 * (h + w) + 0.25  # h and w are rounded from the drawn area and ratio
        assert 0.02 * 64 * 64 - slack <= h * w <= 0.33 * 64 * 64 + slack, (h, w)  # v2's scale range
        assert 0.3 * 0.8 <= h / w <= 3.3 / 0.8  # and ratio range
    assert MEAN_PIXEL == (124, 116, 104)  # 0 after normalisation, as torchvision's recipes fill


def test_random_erasing_happens_with_its_probability():
    pixels = photo(32)
    cfg = AugmentConfig(random_erase=0.25, random_erase_value=255.0)
    hits = [erased_box(pixels, augmented(cfg, pixels, seed)) is not None for seed in range(400)]
    assert 0.18 <= np.mean(hits) <= 0.32, np.mean(hits)


def test_random_erasing_random_fill_is_normal_in_normalised_units():
    """"random" fills with N(mean, std) x 255 per channel (v2's N(0, 1) would cast to 0, 1 and 255)."""
    pixels = torch.full((128, 128, 3), 7, dtype=torch.uint8)
    cfg = AugmentConfig(random_erase=1.0, random_erase_value="random")
    outs = [augmented(cfg, pixels, seed) for seed in range(20)]
    noise = torch.cat([out[top:top + h, left:left + w].reshape(-1, 3)
                       for out in outs for top, left, h, w in [erased_box(pixels, out)]]).double()
    assert len(noise) > 20 * 0.02 * 128 * 128
    np.testing.assert_allclose(noise.mean(0), [255 * m for m in MEAN], atol=4)
    np.testing.assert_allclose(noise.std(0), [255 * s for s in STD], rtol=0.1)


@pytest.mark.parametrize(("policy", "changed_share"), [("trivialaugment", 0.75), ("randaugment", 0.8),
                                                       ("autoaugment", 0.6)])
def test_policies_change_most_images(policy, changed_share):
    pixels = photo()
    cfg = AugmentConfig(policy=policy)
    changed = [not torch.equal(augmented(cfg, pixels, seed), pixels) for seed in SEEDS]
    assert np.mean(changed) >= changed_share, np.mean(changed)
    outputs = {augmented(cfg, pixels, seed).numpy().tobytes() for seed in SEEDS}
    assert len(outputs) > len(SEEDS) // 2  # different draws, different images


def test_randaugment_changes_more_with_magnitude():
    pixels = photo()

    def change(magnitude: int) -> float:
        cfg = AugmentConfig(policy="randaugment", magnitude=magnitude)
        return float(np.mean([(augmented(cfg, pixels, seed).double() - pixels.double()).abs().mean()
                              for seed in SEEDS]))

    changes = [change(m) for m in (0, 10, 20, 30)]
    assert changes == sorted(changes) and changes[-1] > 2 * changes[0], changes


@pytest.mark.parametrize("policy", ["trivialaugment", "randaugment", "autoaugment"])
def test_policy_geometry_uses_the_configured_interpolation(policy):
    pixels = photo()
    outs = {mode: [augmented(AugmentConfig(policy=policy, interpolation=mode), pixels, seed)
                   for seed in SEEDS] for mode in ("bilinear", "bicubic")}
    assert any(not torch.equal(a, b) for a, b in zip(outs["bilinear"], outs["bicubic"], strict=True))


def checkerboard(size: int = 64, cell: int = 4) -> torch.Tensor:
    y, x = np.mgrid[0:size, 0:size] // cell
    board = ((x + y) % 2 * 255).astype(np.uint8)
    return torch.from_numpy(np.stack([board, 255 - board, board // 2], -1))


@pytest.mark.parametrize("size", [24, 100])
def test_bicubic_differs_from_bilinear_and_matches_pils_filter(size):
    """Down- and upsampling: bicubic's overshoot saturates in uint8 exactly as PIL's does."""
    pixels = checkerboard()
    box = (0.0, 0.0, 64.0, 64.0)
    bilinear, bicubic = (crop_resize(pixels, box, size, mode) for mode in ("bilinear", "bicubic"))
    assert bicubic.dtype == bilinear.dtype == torch.uint8 and not torch.equal(bicubic, bilinear)
    for out, resample in ((bilinear, Image.Resampling.BILINEAR), (bicubic, Image.Resampling.BICUBIC)):
        reference = np.asarray(Image.fromarray(pixels.numpy()).resize((size, size), resample)).astype(int)
        assert np.abs(out.numpy().astype(int) - reference).max() <= 1


def test_val_and_train_transforms_take_the_interpolation():
    data = open_image(jpeg(checkerboard(96, 3)))
    val = {mode: ValTransform(32, 40, mode)(data) for mode in ("bilinear", "bicubic")}
    assert not torch.equal(val["bilinear"], val["bicubic"])
    train = {}
    for mode in ("bilinear", "bicubic"):
        torch.manual_seed(3)
        train[mode] = train_transform(DataConfig(image_size=32), AugmentConfig(interpolation=mode))(data)
    assert not torch.equal(train["bilinear"], train["bicubic"])


def test_the_val_loader_takes_data_val_interpolation_over_augments(jpeg_split):
    root, split = jpeg_split
    fs = fsspec.filesystem("file")
    for val, expected in ((None, "bicubic"), ("bilinear", "bilinear")):
        data = DataConfig(image_size=32, val_interpolation=val, workers=0)
        loader = eval_loader(data, fs, root, split, 0, 1, 0, False, interpolation="bicubic")
        assert loader.dataset.transform.interpolation == expected


@pytest.fixture
def jpeg_split(tmp_path):
    names = []
    for i in range(6):
        names.append(f"{i}.JPEG")
        image(i, i % 3, size=56).save(tmp_path / names[-1], quality=95)
    return str(tmp_path), Split.of(names, [i % 3 for i in range(6)])


EVERYTHING = AugmentConfig(policy="trivialaugment", color_jitter=0.3, random_erase=0.5,
                           random_erase_value="random", interpolation="bicubic")


def epoch_pixels(root: str, split: Split, items: list[tuple[int, int, int]], workers: int) -> torch.Tensor:
    dataset = ImageDataset(fsspec.filesystem("file"), root, split,
                           train_transform(DataConfig(image_size=32, min_crop_scale=0.3), EVERYTHING),
                           out_size=32)
    loader = DataLoader(EpochItems(dataset, seed=5), batch_size=2, sampler=items, num_workers=workers)
    random.seed(workers)  # other RNGs play no part
    np.random.seed(workers)
    return torch.cat([batch[0] for batch in loader])


@pytest.mark.processes
def test_augmented_pixels_depend_only_on_seed_epoch_and_index(jpeg_split):
    """The same (seed, epoch, index) gives the same pixels in-process and in two loader processes, in
    any order: what a resumed run relies on."""
    root, split = jpeg_split
    items = [(i, 1, 0) for i in range(6)]  # (index, epoch, copy)
    here = epoch_pixels(root, split, items, workers=0)
    assert torch.equal(here, epoch_pixels(root, split, items, workers=2))
    assert torch.equal(here.flip(0), epoch_pixels(root, split, items[::-1], workers=0))
    assert not torch.equal(here, epoch_pixels(root, split, [(i, 2, 0) for i in range(6)], workers=0))


def test_a_default_runs_crops_keep_a_quarter_of_the_image_and_up():
    """data.min_crop_scale's default reaches the crops a run draws: none under a quarter of the image's
    area (the boxes are whole pixels, hence 0.24), yet the smallest allowed are drawn (Inception's 0.08
    went down to 8%; docs/recipes.md, "What each element is worth")."""
    transform = train_transform(DataConfig(image_size=32), AugmentConfig())
    photo = EncodedImage(b"", 400, 300, fast=True)
    torch.manual_seed(0)
    shares = [h * w / (400 * 300) for _, _, h, w in (transform.plan(photo).box for _ in range(2000))]
    assert 0.24 <= min(shares) < 0.27 and max(shares) > 0.95


def test_plan_lists_the_pipeline_in_order():
    cfg = RunConfig.model_validate({
        "data": {"image_size": 176, "val_image_size": 224, "val_resize": 232, "min_crop_scale": 0.08,
                 "decode": "cpu"},  # as preflight resolves it for a bicubic policy
        "augment": {"policy": "randaugment", "num_ops": 2, "magnitude": 15, "color_jitter": 0.4,
                    "random_erase": 0.25, "random_erase_value": "mean", "mixup_alpha": 0.2,
                    "cutmix_alpha": 1.0, "repeated_aug": 4, "interpolation": "bicubic"}})
    assert plan_augmentation(cfg) == [
        "RepeatedAugmentation(k=4): each image 4 times per epoch, on different ranks (the sampler)",
        "RandomResizedCrop(176, scale=(0.08, 1), bicubic, antialias)",
        "RandomHorizontalFlip",
        "RandAugment(num_ops=2, magnitude=15, bicubic)",
        "ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4)",
        "RandomErasing(p=0.25, value=mean)",
        "Normalize(ImageNet mean, std) (on the device)",
        "MixUp(alpha=0.2) / CutMix(alpha=1), mix_prob 1, switch_prob 0.5 (on the device, per batch)",
    ]
    assert val_preprocessing(cfg) == ["Resize(232, bicubic, antialias)", "CenterCrop(224)",
                                      "Normalize(ImageNet mean, std) (on the device)"]
    plain = RunConfig.model_validate({"data": {"hflip": False, "decode": "cpu"},
                                      "augment": {"cutmix_alpha": 1.0}})
    assert plan_augmentation(plain) == ["RandomResizedCrop(224, scale=(0.25, 1), bilinear, antialias)",
                                        "Normalize(ImageNet mean, std) (on the device)",
                                        "CutMix(alpha=1), mix_prob 1 (on the device, per batch)"]


def test_human_plan_prints_a_pipeline_one_step_per_line(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    print_mapping("plan", {"augmentation": ["RandomResizedCrop(224)", "TrivialAugmentWide(bilinear)"],
                           "sizes": [1, 2]})
    lines = capsys.readouterr().out.splitlines()
    assert any("RandomResizedCrop(224)" in line and "Trivial" not in line for line in lines)
    assert any("TrivialAugmentWide(bilinear)" in line for line in lines)
    assert any("[1, 2]" in line for line in lines)


@pytest.mark.parametrize("policy", ["trivialaugment", "randaugment", "autoaugment"])
def test_a_planned_crop_is_drawn_and_rendered_as_the_pipeline_always_did(policy):
    """The pipeline draws first (`TrainTransform.plan`, `Augmentation.plan` on a stand-in) and renders
    after; a reference written as it ran before that split (crop, decode, flip, the v2 ops live on PIL,
    erasing) gives the same bytes, so runs from before resume exactly and data.decode = "gpu" draws alike."""
    cfg = AugmentConfig(policy=policy, color_jitter=0.3, random_erase=0.5, random_erase_value="random")
    transform, ops = train_transform(DataConfig(image_size=24, min_crop_scale=0.2), cfg), augmentation(cfg)
    img = open_image(jpeg(photo(96)))
    for seed in SEEDS:
        torch.manual_seed(seed)
        top, left, h, w = random_resized_crop(96, 96, (0.2, 1.0), (3 / 4, 4 / 3))
        pixels, k = decode(img, math.ceil(96 * 24 / min(w, h)), math.ceil(96 * 24 / min(w, h)))
        out = crop_resize(pixels, (top * k, left * k, h * k, w * k), 24)
        if torch.rand(()) < 0.5:
            out = out.flip(1)
        out = torch.from_numpy(np.array(ops.on_image(Image.fromarray(out.numpy()))))
        reference = ops.on_tensor(out.permute(2, 0, 1)).permute(1, 2, 0)
        torch.manual_seed(seed)
        assert torch.equal(transform(img), reference), seed
