"""data.decode = "gpu" on device="cpu": the same code a GPU runs (device_decode.py), checked against the CPU
path's pixels, its draws, its bad-image policy, and for host syncs (tests/syncs.py)."""

from __future__ import annotations

import io
import logging

import fsspec
import numpy as np
import pytest
import torch
from PIL import Image
from syncs import HostSyncs
from synthetic import image
from torch.utils._python_dispatch import TorchDispatchMode

from ddp_cli.cli.plan import augmentation as plan_augmentation
from ddp_cli.config import AugmentConfig, DataConfig, RunConfig, SemiConfig
from ddp_cli.data.pipeline import device_decode
from ddp_cli.data.pipeline.augment import augmentation, train_transform
from ddp_cli.data.pipeline.batched_ops import BATCHED
from ddp_cli.data.pipeline.device_decode import DeferredBatch, collate_images, decodes_on
from ddp_cli.data.pipeline.images import open_image
from ddp_cli.data.pipeline.loaders import ImageDataset, build_loaders, collate
from ddp_cli.data.pipeline.transforms import Deferred, ValTransform
from ddp_cli.data.pipeline.views import StrongAugment, TwoViews, fixmatch_views
from ddp_cli.data.sources.packed import Split
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.errors import ConfigError, DataError
from ddp_cli.train.inference import evaluate

CPU = torch.device("cpu")
EVERYTHING = AugmentConfig(policy="trivialaugment", color_jitter=0.3, random_erase=0.5,
                           random_erase_value="random")


def jpeg(img: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, "JPEG", **{"quality": 90, **options})
    return buffer.getvalue()


def photo(seed: int, width: int = 320, height: int = 240) -> bytes:
    """Smooth content with detail at every scale (a sum of waves): what decoders agree on to the level."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    channels = [sum(40 / (1 + k) * np.sin(x * rng.uniform(0.005, 0.2) + y * rng.uniform(0.005, 0.2)
                                           + rng.uniform(0, 6)) for k in range(4)) for _ in range(3)]
    return jpeg(Image.fromarray(np.clip(128 + np.stack(channels, -1), 0, 255).astype(np.uint8)))


FILES = [photo(seed, 300 + 20 * seed, 220 + 10 * seed) for seed in range(6)]


def both_paths(data: DataConfig, augment: AugmentConfig, files=FILES) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path's images and the device path's (on device="cpu"), each image drawn from the same seed."""
    cpu, deferred = train_transform(data, augment), train_transform(data, augment, defer=True)
    ours, theirs = [], []
    for seed, data_ in enumerate(files):
        torch.manual_seed(seed)
        ours.append(cpu(open_image(data_)))
        torch.manual_seed(seed)
        theirs.append(deferred(open_image(data_)))
    assert all(isinstance(t, Deferred) for t in theirs)
    return torch.stack(ours), collate_images(theirs).to(CPU)


def test_device_path_matches_the_cpu_path_within_a_level_where_both_decode_whole_images():
    """Stated tolerance: crops the CPU path decodes at full size (224 from ~300 px) differ by at most 2
    levels (the two libjpeg builds' rounding, uint8 vs float resize), 0.5 on average."""
    ours, theirs = both_paths(DataConfig(image_size=224), AugmentConfig())
    diff = (ours.int() - theirs.int()).abs()
    assert theirs.shape == ours.shape and theirs.dtype == torch.uint8
    assert diff.max() <= 2 and diff.float().mean() <= 0.5


def test_device_path_matches_the_dct_scaled_cpu_path_on_average():
    """Stated tolerance: where the CPU path decodes at 1/2-1/8 scale (64 px crops), the device path (whole
    image, then the antialiased resize) is within 3 levels on average and 10 at the 99th percentile."""
    ours, theirs = both_paths(DataConfig(image_size=64), AugmentConfig())
    diff = (ours.int() - theirs.int()).abs().float()
    assert diff.mean() <= 3 and diff.flatten().quantile(0.99) <= 10


def drawn_alike(cpu, deferred, files) -> tuple[list, list]:
    """Each file through the CPU transform and the deferred one from the same seed; the deferred path
    must leave torch's RNG where the CPU path does (the same draws)."""
    ours, theirs = [], []
    for seed, file in enumerate(files):
        torch.manual_seed(seed)
        ours.append(cpu(open_image(file)))
        after_cpu = torch.get_rng_state()
        torch.manual_seed(seed)
        theirs.append(deferred(open_image(file)))
        assert torch.equal(torch.get_rng_state(), after_cpu)
    return ours, theirs


def test_device_path_with_every_augmentation_draws_as_the_cpu_path_and_lands_close():
    """The same draws (the RNG ends in the same state), the same ops; v2's tensor kernels against PIL's:
    1.5 levels on average (rotations' edges differ most)."""
    data = DataConfig(image_size=96)
    cpu, deferred = train_transform(data, EVERYTHING), train_transform(data, EVERYTHING, defer=True)
    ours, theirs = drawn_alike(cpu, deferred, FILES * 3)
    assert any(item.plan.steps[0] for item in theirs) and any(item.plan.steps[1] for item in theirs)
    diff = (torch.stack(ours).int() - collate_images(theirs).to(CPU).int()).abs().float()
    assert diff.mean() <= 1.5


@pytest.mark.parametrize("policy", ["trivialaugment", "randaugment", "autoaugment"])
def test_replayed_steps_equal_the_live_ops_on_tensors(policy):
    """Every functional a policy calls is recorded: replaying the plan equals running the op itself."""
    aug = augmentation(AugmentConfig(policy=policy, color_jitter=0.4, random_erase=1.0, magnitude=15))
    image = torch.from_numpy(np.array(Image.open(io.BytesIO(FILES[0])).convert("RGB")))[:40, :40].contiguous()
    for seed in range(24):  # each op of the policy drawn (RandAugment 2 a time, AutoAugment's pairs)
        torch.manual_seed(seed)
        live = aug.on_tensor(aug.on_image(image.permute(2, 0, 1).clone()))
        torch.manual_seed(seed)
        on_image, on_tensor = aug.plan(40)
        replayed = device_decode.replay(image.permute(2, 0, 1).clone(), on_image + on_tensor, CPU)
        assert torch.equal(live, replayed), seed


def test_a_batch_mixes_rendered_rows_and_deferred_jpegs(tmp_path):
    """CMYK, a PNG named .JPEG and a truncated JPEG are the loader's (PIL judges the truncated one);
    whole YCbCr JPEGs are deferred, in one buffer, and rendered into their rows."""
    cmyk = jpeg(Image.new("CMYK", (60, 45), (0, 255, 255, 0)), quality=95)
    png = io.BytesIO()
    Image.new("RGB", (50, 40), (0, 0, 255)).save(png, "PNG")
    names = {"a.JPEG": FILES[0], "cmyk.JPEG": cmyk, "png.JPEG": png.getvalue(), "b.JPEG": FILES[1],
             "cut.JPEG": FILES[2][:len(FILES[2]) // 2]}
    for name, data in names.items():
        (tmp_path / name).write_bytes(data)
    table = Split.of(list(names), list(range(len(names))))
    dataset = ImageDataset(fsspec.filesystem("file"), str(tmp_path), table,
                           train_transform(DataConfig(image_size=32), AugmentConfig(), defer=True),
                           on_bad_image="error", out_size=32)
    torch.manual_seed(0)
    batch = collate([dataset[i] for i in range(len(names))])
    images = batch.images
    assert isinstance(images, DeferredBatch) and images.rows == [0, 3]
    assert [item.where for item in images.items] == [f"{tmp_path}/a.JPEG", f"{tmp_path}/b.JPEG"]
    assert images.ends == [len(FILES[0]), len(FILES[0]) + len(FILES[1])]
    assert batch.errors[4].startswith(f"bad image {tmp_path}/cut.JPEG: truncated")
    out = images.to(CPU)
    assert out.shape == (5, 32, 32, 3)
    assert (out[1].int() - torch.tensor([255, 0, 0])).abs().max() <= 3  # rendered in the loader
    assert (out[2].int() - torch.tensor([0, 0, 255])).abs().max() <= 3
    assert out[0].float().std() > 5 and out[3].float().std() > 5  # decoded by the rank


def refusing(monkeypatch, refused: bytes) -> None:
    """The device's decoder refusing the batch, and alone the file `refused`."""
    real = device_decode.decode_jpeg

    def decoder(data, mode, device):
        if isinstance(data, list) or data.numpy().tobytes() == refused:
            raise RuntimeError("nvjpeg: unsupported")
        return real(data, mode=mode, device=device)
    monkeypatch.setattr(device_decode, "decode_jpeg", decoder)


def deferred_batch(files, on_bad_image="error") -> DeferredBatch:
    transform = train_transform(DataConfig(image_size=32), AugmentConfig(), defer=True)
    torch.manual_seed(0)
    return collate_images([transform(open_image(f)).located(f"file{i}", on_bad_image)
                           for i, f in enumerate(files)])


def test_an_image_the_device_refuses_is_decoded_on_the_cpu_through_the_same_steps(monkeypatch):
    expected = deferred_batch(FILES[:3]).to(CPU)
    refusing(monkeypatch, FILES[1])
    assert torch.equal(deferred_batch(FILES[:3]).to(CPU), expected)  # same libjpeg-turbo on this CPU


def broken_scan() -> bytes:
    """A JPEG whose scan header names a component the frame lacks: every decoder refuses it."""
    data = bytearray(FILES[3])
    data[data.index(b"\xff\xda") + 5] = 0x09
    return bytes(data)


def past_the_loader(batch: DeferredBatch, row: int, data: bytes) -> DeferredBatch:
    """`batch` with the file of deferred `row` replaced by `data`, as if the loader's checks had let it by
    (they refuse this one: its header does not parse for libjpeg-turbo)."""
    files = [f.numpy().tobytes() for f in batch.files()]
    files[row] = data
    items = [Deferred(f, item.plan, item.interpolation).located(item.where, item.on_bad_image)
             for f, item in zip(files, batch.items, strict=True)]
    return collate_images(items)


def test_an_image_neither_decoder_takes_stops_the_run_naming_it_or_is_left_blank_under_skip(caplog):
    with pytest.raises(DataError, match=r'bad image file1: corrupt \(.*\) \(set data.on_bad_image = "skip"'):
        past_the_loader(deferred_batch(FILES[:2]), 1, broken_scan()).to(CPU)
    with caplog.at_level(logging.WARNING, logger="ddp"):
        out = past_the_loader(deferred_batch(FILES[:2], "skip"), 1, broken_scan()).to(CPU)
    assert out[1].abs().sum() == 0 and out[0].float().std() > 5
    assert "bad image file1: corrupt" in caplog.text


def test_the_device_path_makes_no_host_sync():
    """Collated on the host, rendered on "the device" (here the CPU, as HostSyncs counts): every policy
    step, jitter and erasing included, queued without a read or a blocking copy."""
    transform = train_transform(DataConfig(image_size=24), EVERYTHING, defer=True)
    with HostSyncs(CPU) as syncs:
        items = []
        for seed, file in enumerate(FILES * 10):  # 60 images: each of TrivialAugment's 14 ops drawn
            torch.manual_seed(seed)
            items.append(transform(open_image(file)))
        out = collate_images(items).to(CPU)
    drawn = {functional.__name__ for item in items for functional, _ in item.plan.steps[0]}
    assert {"affine", "rotate", "adjust_sharpness", "autocontrast", "equalize", "posterize"} <= drawn
    assert out.shape == (60, 24, 24, 3)
    assert len(syncs) == 0, syncs.report()


class Launches(TorchDispatchMode):
    """Counts the device operations dispatched under it that launch work: on a GPU, each a kernel or more
    the host launches. Views launch nothing; the decoder (torchvision's image:: ops) is left out: on a
    GPU a batch's JPEGs are one nvJPEG call (`decode_jpeg(list, device=cuda)`), on this CPU stand-in
    libjpeg-turbo decodes them one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view and func.namespace != "image"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("augment", [AugmentConfig(), AugmentConfig(policy="randaugment"),
                                     AugmentConfig(policy="trivialaugment")])
def test_the_launches_a_batch_are_the_same_at_batch_64_and_256(augment):
    """Decode, crop, resize, flip and policy as a fixed number of launches a batch: 256 images launch no
    more than 64 do. The crops come from every image at once (one gather, `padded_crops`), are resized
    and flipped in two batched products, and the policy's steps are replayed a group of images at a time,
    one group per distinct call (`replay_grouped`): the larger batch repeats the smaller one's draws (the
    same seeds), so it holds the same calls, over other crops of other images."""
    transform = train_transform(DataConfig(image_size=24), augment, defer=True)

    def launches(count: int) -> int:
        items = []
        for i, file in enumerate((FILES * 60)[:count]):
            torch.manual_seed(i % 64)
            items.append(transform(open_image(file)))
        batch = collate_images(items)
        with Launches() as ops:
            batch.to(CPU)
        return ops.count

    assert launches(64) == launches(256)


SMALL = [photo(seed, 64 + 4 * seed, 48 + 2 * seed) for seed in range(6)]  # a batch of 512 crops: one chunk


def two_views(defer: bool, size: int = 224) -> TwoViews:
    return fixmatch_views(DataConfig(image_size=size), AugmentConfig(), SemiConfig(method="fixmatch"), defer)


def test_fixmatch_s_two_views_deferred_draw_as_the_cpu_path_and_land_close():
    """The weak and strong views of one decode on the device, from the draws the CPU path makes (the RNG ends
    in the same state): the weak view within training's stated tolerance (2 levels, 0.5 on average, where
    both decode whole images); the strong view's RandAugment and Cutout through v2's tensor kernels against
    PIL's, 1.5 levels on average (rotations' and shears' edges differ most: no bitwise match across them)."""
    cpu, deferred = two_views(defer=False), two_views(defer=True)
    ours, theirs = drawn_alike(cpu, deferred, FILES * 4)
    assert all(isinstance(t, Deferred) and len(t.plans) == 2 for t in theirs)
    assert all(not t.plan.steps for t in theirs) and all(t.more[0].steps[1] for t in theirs)  # Cutout each
    rendered = collate_images(theirs).to(CPU)
    assert rendered.shape == (24, 2, 224, 224, 3)
    diff = (torch.stack(ours).int() - rendered.int()).abs().float()
    assert diff[:, 0].max() <= 2 and diff[:, 0].mean() <= 0.5
    assert diff[:, 1].mean() <= 1.5


def test_batched_kernels_equal_v2_s_kernels_image_by_image():
    """Every call `batched_ops` covers, replayed on a group with each image's own magnitude, equals v2's
    kernel on each image alone up to float rounding (one level): TrivialAugment's 14 ops at 31 magnitudes,
    colour jitter's factors, erasing with one colour, FixMatch's random-magnitude RandAugment and Cutout."""
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (120, 3, 24, 24), dtype=torch.uint8, generator=g)
    plans = [augmentation(AugmentConfig(policy="trivialaugment", color_jitter=0.4, random_erase=1.0,
                                        random_erase_value=0.0)).plan,
             StrongAugment(SemiConfig(method="fixmatch"), "bilinear").plan]
    calls: dict[object, list] = {}
    for seed in range(len(images)):
        for plan in plans:
            torch.manual_seed(seed)
            for functional, kwargs in sum(plan(24), []):
                if functional in BATCHED and BATCHED[functional].takes(kwargs):
                    calls.setdefault(functional, []).append((seed, kwargs))
    assert set(calls) == set(BATCHED)
    for functional, drawn in calls.items():
        rows = [seed for seed, _ in drawn]
        alone = torch.stack([functional(images[seed], **kwargs) for seed, kwargs in drawn])
        together = BATCHED[functional].kernel(images[rows], [kwargs for _, kwargs in drawn])
        assert (alone.int() - together.int()).abs().max() <= 1, functional.__name__


def test_the_launches_of_fixmatch_s_two_view_batch_are_the_same_at_batch_64_and_256():
    """Both views of 256 images (512 crops, each strong one RandAugment at its own magnitude from 1-30 and a
    Cutout square of its own) launch no more than 64 images' views do: every image's draws its own here, so
    the count holds because each functional's calls are replayed as one group whatever their magnitudes
    (`batched_ops`), not because the calls repeat. The count is a few launches per (step position,
    functional), bounded by the policy, not by the batch: 64 images already draw each of RandAugment's
    functionals at both positions. (A batch whose padded crops pass `BUDGET` is resized a chunk at a time:
    these small photos fit one.)"""
    transform = two_views(defer=True, size=24)

    def launches(count: int) -> int:
        items = []
        for seed in range(count):
            torch.manual_seed(seed)
            items.append(transform(open_image(SMALL[seed % len(SMALL)])))
        batch = collate_images(items)
        with Launches() as ops:
            assert batch.to(CPU).shape == (count, 2, 24, 24, 3)
        return ops.count

    assert launches(64) == launches(256)


def test_the_val_crop_is_deferred_and_rendered_close_to_the_cpu_paths():
    """Validation's resize and centre crop, the same box on both paths: where the CPU decodes whole images
    (a 256 px resize of ~300 px photos), within 2 levels, 0.5 on average, as training's crops."""
    cpu, deferred = ValTransform(224, 256), ValTransform(224, 256, defer=True)
    theirs = [deferred(open_image(file)) for file in FILES]
    assert all(isinstance(t, Deferred) and t.plan.steps is None and not t.plan.flip for t in theirs)
    diff = (torch.stack([cpu(open_image(file)) for file in FILES]).int()
            - collate_images(theirs).to(CPU).int()).abs()
    assert diff.max() <= 2 and diff.float().mean() <= 0.5


def test_the_launches_of_a_val_batch_are_the_same_at_batch_64_and_256():
    transform = ValTransform(24, 28, defer=True)

    def launches(count: int) -> int:
        batch = collate_images([transform(open_image(file)) for file in (FILES * 60)[:count]])
        with Launches() as ops:
            batch.to(CPU)
        return ops.count

    assert launches(64) == launches(256)


def mean_colour_model() -> torch.nn.Module:
    """Logits = the image's mean of each channel: `synthetic.image`'s label is its brightest channel."""
    return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())


def test_validation_takes_the_device_path_with_gpu_decode_and_scores_as_the_cpu_path(tmp_path):
    """data.decode = "gpu": the val loader hands the rank deferred JPEGs (rendered on its device; here the
    CPU stand-in), and validation's top-1 and loss are the CPU path's."""
    names = []
    for i in range(24):
        names.append(f"{i}.JPEG")
        image(i, i % 3, size=48 + 4 * (i % 5)).save(tmp_path / names[-1], quality=90)
    split = Split.of(names, [i % 3 for i in range(24)])
    index = IndexTable(["a", "b", "c"], ["", "", ""], {"val": split})
    scores = {}
    for decode in ("cpu", "gpu"):
        data = DataConfig(image_size=32, val_resize=36, batch_size=8, workers=0, decode=decode)
        loader = build_loaders(data, fsspec.filesystem("file"), str(tmp_path), index, 0, 1, 0, False,
                               train=False).val
        assert isinstance(next(iter(loader)).images, DeferredBatch) == (decode == "gpu")
        scores[decode] = evaluate(mean_colour_model(), loader, CPU, "fp32", False).metrics
    assert scores["gpu"]["top1"] == scores["cpu"]["top1"] > 0.9 and scores["gpu"]["images"] == 24
    assert scores["gpu"]["loss"] == pytest.approx(scores["cpu"]["loss"], rel=1e-2)


def test_workers_decode_on_the_gpu_where_they_train_on_cuda_and_torchvision_can(monkeypatch):
    """The fact data.decode "auto" resolves from (config.resolve; test_resolve.py has the rule)."""
    monkeypatch.setattr(device_decode.torchvision.version, "cuda", "12.8")
    assert decodes_on("cuda", {}) and not decodes_on("cpu", {})
    assert decodes_on("cpu", {device_decode.STAND_IN: "1"})  # the CPU stand-in, measured on request
    monkeypatch.setattr(device_decode.torchvision.version, "cuda", None)
    assert not decodes_on("cuda", {})


def test_gpu_decode_with_a_bicubic_policy_is_refused_naming_the_keys():
    with pytest.raises(ConfigError, match='data.decode: "gpu" replays augment.policy "trivialaugment".*'
                                         'augment.interpolation = "bilinear"'):
        RunConfig().resolved({"data.decode": "gpu", "augment.policy": "trivialaugment",
                              "augment.interpolation": "bicubic"})
    with pytest.raises(ConfigError, match='data.decode: "gpu" replays semi.strong "randaugment\\+cutout"'):
        RunConfig().resolved({"data.decode": "gpu", "semi.method": "fixmatch",
                              "augment.interpolation": "bicubic"})


def test_the_dry_run_plan_says_where_the_jpegs_are_decoded():
    gpu = RunConfig().resolved({"data.decode": "gpu"})
    assert plan_augmentation(gpu)[0].startswith('decode_jpeg on the device (data.decode = "gpu")')
    assert not plan_augmentation(RunConfig().resolved({"data.decode": "cpu"}))[0].startswith("decode_jpeg")
