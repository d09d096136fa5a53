"""GPU paths no CPU box can run: NCCL, bf16/fp16 autocast with the GradScaler, pinned loaders.

Marked `cuda` and skipped where the machine has no GPU; where the driver (NVML) shows GPUs that
torch cannot use (a driver older than torch's CUDA, a CPU wheel), every test fails naming why: a GPU
machine that silently skipped its GPU tests would pass. On a GPU machine: `make test-cuda`
(= pytest -m cuda tests/cuda). Each demo run uses one GPU (nproc_per_node = 1).
"""

from __future__ import annotations

import json
import math
import tomllib

import pytest
import torch
from conftest import REPO, last_json, run_ddp

from ddp_cli.distributed.gpus import gpu_problem

UNUSABLE = gpu_problem()  # None where torch uses the GPUs, or there are none
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available() and not UNUSABLE,
                       reason="needs a CUDA GPU (none here); run `make test-cuda` on a GPU machine"),
]


@pytest.fixture(autouse=True)
def torch_uses_the_gpus() -> None:
    if UNUSABLE:
        pytest.fail(UNUSABLE)

ONE_GPU = ('distributed.backend="nccl"', "distributed.nproc_per_node=1")


def train_demo(demo_registry, run_dir, *sets: str) -> dict:
    args = [a for s in (*ONE_GPU, *sets) for a in ("--set", s)]
    return last_json(run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry),
                             "--run-dir", str(run_dir), "--json", *args, timeout=280))


def run_records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_config(run_dir) -> dict:
    return tomllib.loads((run_dir / "config.toml").read_text())


def test_one_gpu_nccl_demo_reaches_a_sane_accuracy(demo_registry, tmp_path):
    out = train_demo(demo_registry, tmp_path, 'train.precision="fp32"')
    assert out["world_size"] == 1 and out["precision"] == "fp32"
    assert run_config(tmp_path)["distributed"]["backend"] == "nccl"
    assert out["final"]["images"] == 359
    assert out["final"]["top1"] >= 0.9


@pytest.mark.skipif(torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False),
                    reason="this GPU has no native bf16 (compute capability < 8.0)")
def test_bf16_autocast_on_the_gpu_learns(demo_registry, tmp_path):
    out = train_demo(demo_registry, tmp_path, 'train.precision="bf16"', 'distributed.reduce="bf16"')
    assert out["precision"] == "bf16"
    assert out["final"]["images"] == 359 and out["final"]["top1"] >= 0.9
    assert all(math.isfinite(r["loss"]) for r in run_records(tmp_path) if r["split"] == "train")


def test_fp16_autocast_with_the_grad_scaler_finishes_and_checkpoints_the_scaler(demo_registry, tmp_path):
    from ddp_cli.train.checkpoint import load_checkpoint

    out = train_demo(demo_registry, tmp_path, 'train.precision="fp16"', "train.epochs=3")
    assert out["precision"] == "fp16"
    assert out["final"]["images"] == 359 and math.isfinite(out["final"]["loss"])
    losses = [r["loss"] for r in run_records(tmp_path) if r["split"] == "train"]
    assert losses and all(math.isfinite(x) for x in losses)
    scaler = load_checkpoint(tmp_path / "checkpoints/last.pt")["scaler"]
    assert scaler, "GradScaler state missing from the checkpoint (was the scaler enabled?)"
    assert math.isfinite(scaler["scale"]) and scaler["scale"] > 0
    assert out["final"]["top1"] >= 0.5  # it learned, through the scaled backward


def test_loaders_pin_memory_on_cuda_and_batches_reach_the_device(demo_registry):
    """The loaders a worker builds pin memory on CUDA; a batch arrives pinned and lands on the GPU
    (non_blocking copy) with the same values as on the CPU."""
    from ddp_cli.config import config_from_dict
    from ddp_cli.data.index_build import resolve_dataset
    from ddp_cli.data.pipeline.loaders import Batch, build_loaders
    from ddp_cli.data.pipeline.transforms import to_model_input

    raw = tomllib.loads((REPO / "configs/demo.toml").read_text())
    raw["data"]["workers"] = 1  # a loader process: pinning happens in the main process's pin thread
    cfg = config_from_dict(raw)
    entry, index = resolve_dataset(cfg, str(demo_registry))
    fs, root = entry.open()
    loaders = build_loaders(cfg.data, fs, root, index, 0, 1, cfg.seed, pin_memory=True)
    assert loaders.train.pin_memory and loaders.val.pin_memory
    for loader in (loaders.train, loaders.val):
        batch = next(iter(loader))
        assert isinstance(batch, Batch)  # pinning keeps the named tuple
        assert batch.images.is_pinned() and batch.labels.is_pinned()
        x = to_model_input(batch.images, torch.device("cuda"), channels_last=True)
        torch.cuda.synchronize()
        assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last)
        on_cpu = to_model_input(batch.images, torch.device("cpu"), channels_last=True)
        torch.testing.assert_close(x.cpu(), on_cpu)



def test_gpu_decode_renders_a_batch_on_the_gpu_without_a_sync_close_to_the_same_code_on_the_cpu(
        demo_registry):
    """data.decode = "gpu" with TrivialAugment and erasing: the loader's batch arrives compressed and
    pinned, nvJPEG decodes it and the plans are replayed on the GPU with no sync of ddp's (sync debug
    mode "error"; torchvision waits for its own decoding stream, which that mode does not see), and the
    images are within a few levels of the same batch rendered on the CPU (libjpeg-turbo's IDCT)."""
    from ddp_cli.config import AugmentConfig, config_from_dict
    from ddp_cli.data.index_build import resolve_dataset
    from ddp_cli.data.pipeline.device_decode import DeferredBatch
    from ddp_cli.data.pipeline.loaders import build_loaders
    from ddp_cli.data.pipeline.transforms import to_model_input

    raw = tomllib.loads((REPO / "configs/demo.toml").read_text())
    raw["data"].update(workers=1, decode="gpu")
    cfg = config_from_dict(raw)
    entry, index = resolve_dataset(cfg, str(demo_registry))
    fs, root = entry.open()
    augment = AugmentConfig(policy="trivialaugment", random_erase=0.5, random_erase_value="random")
    loaders = build_loaders(cfg.data, fs, root, index, 0, 1, cfg.seed, pin_memory=True, augment=augment)
    batch = next(iter(loaders.train))
    assert isinstance(batch.images, DeferredBatch) and batch.images.data.is_pinned()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = to_model_input(batch.images, torch.device("cuda"), channels_last=True)
        on_gpu = batch.images.to("cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last)
    diff = (on_gpu.cpu().int() - batch.images.to("cpu").int()).abs().float()
    assert diff.mean() <= 3, diff.mean()


def test_gpu_decode_never_writes_memory_that_work_queued_before_it_still_reads():
    """nvJPEG's hardware engine writes its output at once, not in stream order (pytorch/vision#9606): fed
    so, a ResNet-50 reached a NaN loss by step 4 on an H100. Each round fills tensors the size of a decoded
    image, queues a long kernel and then a sum of each on the current stream, frees them while the sums
    are queued (their blocks go back to that stream's pool) and decodes; every sum must come out whole.
    The count for torchvision's decode called bare, the same way, is in the message (corrupt where the
    GPU has the engine and torchvision does not guard it)."""
    import io

    import numpy as np
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    from ddp_cli.data.pipeline.device_decode import decode_jpegs

    buffer = io.BytesIO()  # a baseline 4:2:0 JPEG, what the hardware engine decodes
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (384, 512, 3), dtype=np.uint8)).save(
        buffer, "JPEG", quality=90)
    files = [torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)] * 8
    cuda = torch.device("cuda")

    def corrupted_rounds(decode) -> int:
        bad = 0
        for _ in range(30):
            tensors = [torch.full((3, 384, 512), 1, dtype=torch.uint8, device=cuda) for _ in files]
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # tens of ms of GPU time queued before the sums
            sums = torch.stack([t.sum(dtype=torch.int64) for t in tensors])
            del tensors
            decode()
            bad += int((sums != 3 * 384 * 512).any())
        return bad

    bare = corrupted_rounds(lambda: decode_jpeg(files, mode=ImageReadMode.RGB, device=cuda))
    assert corrupted_rounds(lambda: decode_jpegs(files, cuda)) == 0, f"(torchvision bare: {bare} of 30)"
