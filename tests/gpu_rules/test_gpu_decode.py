"""data.decode = "gpu" on cuda:3 of an 8-rank NCCL world (fakegpu.py): a loader's batch of compressed JPEGs
and their plans, pinned as the DataLoader pins it, decoded and rendered on the rank's GPU and trained on,
every tensor on cuda:3 and nothing read back to the host. nvJPEG itself (a C++ kernel fake tensors cannot
run) is played by empty images of each file's size on the device: what it returns."""

from __future__ import annotations

import functools
import io

import numpy as np
import torch
from PIL import Image

from ddp_cli.config import AugmentConfig, DataConfig, SemiConfig
from ddp_cli.data.pipeline import device_decode
from ddp_cli.data.pipeline.augment import train_transform
from ddp_cli.data.pipeline.images import open_image
from ddp_cli.data.pipeline.loaders import Batch, collate
from ddp_cli.data.pipeline.transforms import to_model_input
from ddp_cli.data.pipeline.views import fixmatch_views
from ddp_cli.distributed.setup import choose_device
from gpu_rules.gpu_parts import BATCH, SIZE, gpu_config, gpu_trainer
from gpu_rules.node import DEVICE, RANK

EVERYTHING = AugmentConfig(policy="trivialaugment", color_jitter=0.3, random_erase=1.0,
                           random_erase_value="random")


def jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40 + seed, 50 + seed, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


def nvjpeg_on_fake_tensors(monkeypatch, decoded: list[str]) -> None:
    """nvJPEG as empty images; `decoded` gets the device and current stream of each call."""
    fresh = functools.cache(device_decode.decoder_stream.__wrapped__)  # a stream of this fake world's
    monkeypatch.setattr(device_decode, "decoder_stream", fresh)

    def decode_jpeg(files, mode, device):
        decoded.append((str(device), torch.cuda.current_stream(device).name))
        sizes = [open_image(f.numpy().tobytes()).size for f in files]
        return [torch.empty((3, h, w), dtype=torch.uint8, device=device) for w, h in sizes]
    monkeypatch.setattr(device_decode, "decode_jpeg", decode_jpeg)


def png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (30, 20), (0, 0, 255)).save(buffer, "PNG")
    return buffer.getvalue()


def loader_batch(count: int, augment: AugmentConfig = EVERYTHING) -> Batch:
    """A batch as a loader process hands it over (deferred JPEGs and, last, a PNG the loader rendered,
    collated), then pinned."""
    transform = train_transform(DataConfig(image_size=SIZE), augment, defer=True)
    items = []
    for seed in range(count - 1):
        torch.manual_seed(seed)
        items.append((transform(open_image(jpeg(seed))).located(f"img{seed}", "error"), seed % 2, "", ""))
    items.append((transform(open_image(png())), 0, "", ""))
    batch = collate(items)
    assert batch.images.pixel_rows == [count - 1]
    return Batch(batch.images.pin_memory(), batch.labels.pin_memory(), batch.skipped, batch.errors)


def test_a_deferred_batch_is_decoded_augmented_and_normalised_on_the_ranks_gpu(gpu, monkeypatch):
    decoded = []
    nvjpeg_on_fake_tensors(monkeypatch, decoded)
    device = choose_device("nccl", RANK)  # bound, as a worker's is before its loaders
    batch = loader_batch(12)  # every image erased, a policy op on most
    gpu.blocking.clear()
    assert any(item.plan.steps[0] for item in batch.images.items)
    x = to_model_input(batch.images, device, channels_last=True)
    (called,) = decoded  # one batched call, on this rank's GPU, with the decoder's stream current
    assert called[0] == str(DEVICE) and called[1] != "default"
    # the caller's stream waits for the decoder's; each output is released to the decoder's pool only once
    # the caller's work with it has run (nvJPEG's engine writes its output at once: device_decode.py)
    assert ("wait_stream", "default", called[1]) in gpu.cuda.calls
    assert [c for c in gpu.cuda.calls if c[0] == "record_stream"] == [("record_stream", "default")] * 11
    assert x.device == DEVICE and x.shape == (12, 3, SIZE, SIZE) and x.dtype == torch.float32
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert not gpu.reads and not gpu.blocking


def test_a_training_step_on_deferred_batches_stays_on_the_gpu(gpu, monkeypatch):
    nvjpeg_on_fake_tensors(monkeypatch, [])
    trainer = gpu_trainer(gpu_config(augment={"policy": "trivialaugment"}, model={"channels_last": True}))
    batch = loader_batch(BATCH)
    gpu.blocking.clear()
    trainer.train_step([(batch,)])
    assert not gpu.reads and not gpu.blocking


def test_fixmatch_s_two_view_batch_is_decoded_once_and_both_views_rendered_on_the_ranks_gpu(gpu, monkeypatch):
    """The unlabelled batch under data.decode = "gpu": each JPEG decoded once, its weak and strong views (the
    strong one's RandAugment at its own magnitude, Cutout) rendered on cuda:3 a functional at a time
    (`batched_ops`), nothing read back to the host."""
    decoded = []
    nvjpeg_on_fake_tensors(monkeypatch, decoded)
    device = choose_device("nccl", RANK)
    views = fixmatch_views(DataConfig(image_size=SIZE), AugmentConfig(), SemiConfig(method="fixmatch"),
                           defer=True)
    items = []
    for seed in range(16):
        torch.manual_seed(seed)
        items.append((views(open_image(jpeg(seed))).located(f"img{seed}", "error"), -1, "", ""))
    batch = collate(items).images.pin_memory()
    gpu.blocking.clear()
    out = batch.to(device)
    assert len(decoded) == 1 and out.device == DEVICE and out.shape == (16, 2, SIZE, SIZE, 3)
    assert not gpu.reads and not gpu.blocking
