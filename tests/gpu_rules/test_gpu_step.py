"""The Trainer's step on cuda:3 of an 8-rank NCCL world (fakegpu.py): every tensor on the rank's GPU, every
collective one NCCL takes, the gradient reduction of each `distributed.reduce` through DDP's bucket
path, and nothing read back to the host (FakeTensorMode raises on `.item()` and the like)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.data import DataLoader

from ddp_cli.data.pipeline.loaders import collate
from gpu_rules.gpu_parts import TinyImages, gpu_config, gpu_trainer, micro_batches
from gpu_rules.node import DEVICE
from tests.resolved import resolved


def step(gpu, trainer, steps: int = 1) -> None:
    """`steps` training steps, none of whose host-to-GPU copies makes the host wait (setting up may)."""
    gpu.blocking.clear()
    for _ in range(steps):
        trainer.train_step(micro_batches(trainer))
    assert not gpu.blocking


def off_the_gpu(tensors) -> list[str]:
    """The devices of those of `tensors` not on this rank's GPU."""
    return [str(t.device) for t in tensors if t.device != DEVICE]


def gradient_reductions(gpu) -> list[tuple[str, list]]:
    return [(backend, shapes) for name, backend, shapes in gpu.collectives.calls if name == "all_reduce"]


@pytest.mark.parametrize(("precision", "autocast"), [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                                    ("auto", torch.bfloat16)])
def test_a_step_with_accumulation_ema_and_clipping_stays_on_the_gpu_and_reads_nothing(gpu, precision,
                                                                                      autocast):
    cfg = gpu_config(train={"precision": precision, "grad_accum": 2, "ema_decay": 0.9},
                     optim={"grad_clip": 1.0}, augment={"mixup_alpha": 0.2})
    trainer = gpu_trainer(cfg)
    module, logits = trainer.model.module, []
    module[-1].register_forward_hook(lambda layer, inputs, output: logits.append(output.dtype))
    step(gpu, trainer)
    assert logits == [autocast, autocast]  # CUDA autocast on ("auto": the GPU computes bf16)
    assert not off_the_gpu(module.state_dict().values())
    momentum = [t for state in trainer.optimizer.state.values() for t in state.values()]
    assert momentum and not off_the_gpu(momentum)
    assert not off_the_gpu(trainer.ema.module.state_dict().values())
    assert not gpu.reads
    # DDP's one gradient all-reduce per step, on the last micro-batch only (no_sync on the first)
    assert gradient_reductions(gpu) == [("nccl", [("cuda:3", "torch.float32", (sum(
        p.numel() for p in module.parameters()),))])]
    assert ("set_device", 3) in gpu.cuda.calls


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "lars", "lamb", "rmsprop"])
def test_every_optimizer_steps_on_the_gpu_in_channels_last_and_reads_nothing(gpu, optimizer):
    trainer = gpu_trainer(gpu_config(optim={"name": optimizer}, model={"channels_last": True}))
    step(gpu, trainer, 2)
    assert not off_the_gpu(t for s in trainer.optimizer.state.values() for t in s.values()
                           if isinstance(t, torch.Tensor) and t.dim())
    assert not gpu.reads


def test_syncbatchnorm_gathers_its_statistics_on_the_gpu(gpu):
    """torch's SyncBatchNorm reads which ranks saw images back to the host at every forward (three
    boolean masks per layer, outside CUDA graph capture): allowed here, counted."""
    trainer = gpu_trainer(gpu_config(model={"sync_batchnorm": True}))
    with gpu.host_reads():
        step(gpu, trainer)
    gathered = [shapes for name, _, shapes in gpu.collectives.calls if name == "all_gather_into_tensor"]
    assert gathered and all(device == "cuda:3" for shapes in gathered for device, _, _ in shapes)
    assert gpu.reads == ["a boolean mask's count"] * 3


@pytest.mark.xfail(strict=True, reason="fault 5 (issue 26): GradScaler.step reads found_inf to the host "
                   "every fp16 step (optimizer not fused)")
def test_an_fp16_step_reads_nothing_back(gpu):
    trainer = gpu_trainer(gpu_config(train={"precision": "fp16"}))
    step(gpu, trainer)


def test_an_fp16_step_scales_unscales_and_clips_on_the_gpu(gpu):
    """The GradScaler path, its host read allowed (see the xfail above): scale and found_inf on cuda:3."""
    trainer = gpu_trainer(gpu_config(train={"precision": "fp16"}, optim={"grad_clip": 1.0}))
    with gpu.host_reads():
        step(gpu, trainer, 2)
    assert trainer.scaler._scale.device == DEVICE and trainer.scaler._growth_tracker.device == DEVICE


@pytest.mark.parametrize(("reduce", "wire"), [("sum", torch.float32), ("fp16", torch.float16),
                                              ("bf16", torch.bfloat16)])
def test_each_reduction_hook_all_reduces_its_buckets_on_the_gpu(gpu, reduce, wire):
    trainer = gpu_trainer(gpu_config(distributed={"reduce": reduce, "bucket_cap_mb": 0.0001}))
    step(gpu, trainer)
    reductions = gradient_reductions(gpu)
    assert len(reductions) > 1  # the tiny bucket cap makes several buckets
    assert {dtype for _, shapes in reductions for _, dtype, _ in shapes} == {str(wire)}


def test_powersgd_compresses_on_the_gpu_after_its_warmup(gpu):
    trainer = gpu_trainer(gpu_config(distributed={"reduce": "powersgd", "powersgd_warmup_steps": 2}))
    bucket = sum(p.numel() for p in trainer.model.module.parameters())
    step(gpu, trainer, 2)
    assert [shapes[0][2] for _, shapes in gradient_reductions(gpu)] == [(bucket,), (bucket,)]  # exact
    gpu.collectives.calls.clear()
    step(gpu, trainer)
    compressed = gradient_reductions(gpu)
    assert len(compressed) == 3  # the 1-d tensors exact, then the low-rank factors P and Q
    assert all(shapes[0][:2] == ("cuda:3", "torch.float32") and shapes[0][2] != (bucket,)
               for _, shapes in compressed)
    assert ("synchronize", 3) in gpu.cuda.calls  # PowerSGD's, on this rank's device


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_fixmatch_step_with_an_ema_teacher_stays_on_the_gpu_and_reads_nothing(gpu, precision):
    """FixMatch's one forward of labelled + weak + strong views (pinned uint8 from the loader), the EMA
    teacher's pseudo-labels, the mask and its sums: all on cuda:3, no host read in the step."""
    from dataclasses import replace

    from ddp_cli.data.pipeline.loaders import Batch
    from ddp_cli.distributed.setup import DistContext, choose_device, seed_everything
    from ddp_cli.train.objectives import FixMatch
    from ddp_cli.train.trainer import Trainer
    from gpu_rules.gpu_parts import tiny_loaders, tiny_net
    from gpu_rules.node import RANK, WORLD

    cfg = gpu_config(train={"precision": precision, "ema_decay": 0.9},
                     semi={"method": "fixmatch", "mu": 2, "threshold": 0.0, "ema_teacher": True})
    seed_everything(cfg.seed)
    ctx = DistContext(RANK, WORLD, RANK, WORLD, choose_device("nccl", RANK), "nccl")
    loaders = tiny_loaders()
    trainer = Trainer(resolved(cfg, 2, ctx.world_size, "cuda"), ctx, tiny_net(),
                      replace(loaders, unlabelled=loaders.train), 2)  # FixMatch on
    labelled = [batch for (batch,) in micro_batches(trainer)]
    views = torch.randint(0, 256, (2 * len(labelled[0].labels), 2, 8, 8, 3), dtype=torch.uint8).pin_memory()
    unlabelled = Batch(views, torch.full((len(views),), -1, dtype=torch.long).pin_memory(),
                       [""] * len(views), [""] * len(views))
    gpu.blocking.clear()
    sums = trainer.train_step([(batch, unlabelled) for batch in labelled])
    assert isinstance(trainer.objective, FixMatch)
    assert not off_the_gpu([sums, *trainer.model.module.state_dict().values()])
    assert not gpu.reads and not gpu.blocking


def test_the_ema_s_batchnorm_recalibration_stays_on_the_gpu_and_reads_nothing(gpu):
    """train.ema_bn_epochs: the sample's pinned batches copied without the host waiting, the EMA's forward
    and its statistics on the rank's GPU, averaged over the ranks by NCCL all-reduces."""
    trainer = gpu_trainer(gpu_config(train={"ema_decay": 0.9, "precision": "bf16", "ema_bn_epochs": 1}))
    sample = DataLoader(TinyImages(), batch_size=4, sampler=[3, 11, 19, 27], pin_memory=True,
                        collate_fn=collate)
    trainer.loaders = replace(trainer.loaders, calibration=sample)
    gpu.blocking.clear()
    gpu.collectives.calls.clear()
    trainer.recalibrate_ema()
    assert not gpu.blocking and not gpu.reads
    norm = trainer.ema.module[1]
    assert not off_the_gpu([norm.running_mean, norm.running_var])
    reduced = [shapes for name, _, shapes in gpu.collectives.calls if name == "all_reduce"]
    assert reduced == [[("cuda:3", "torch.float32", (4,))]] * 2  # the mean and the variance


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_simclr_step_gathers_every_rank_s_projections_on_the_gpu_and_reads_nothing(gpu, precision):
    """pretrain.method: both views (pinned uint8) in one forward, the projections all-gathered by NCCL,
    the pair hits counted on the device: all on cuda:3, no host read, and the classifier (frozen) outside
    DDP's gradient all-reduce. (The fake world's backward is a stand-in that runs no autograd Function:
    the gathered rows' gradients summed back are proved on gloo, tests/e2e/test_data_parallel.py.)"""
    from ddp_cli.data.pipeline.loaders import Batch
    from ddp_cli.distributed.setup import DistContext, choose_device, seed_everything
    from ddp_cli.models.projection import add_projection
    from ddp_cli.train.objectives import SimCLR
    from ddp_cli.train.trainer import Trainer
    from gpu_rules.gpu_parts import tiny_loaders, tiny_net
    from gpu_rules.node import RANK, WORLD

    cfg = gpu_config(train={"precision": precision}, pretrain={"method": "simclr", "projection_dim": 3})
    seed_everything(cfg.seed)
    ctx = DistContext(RANK, WORLD, RANK, WORLD, choose_device("nccl", RANK), "nccl")
    model = add_projection(tiny_net(), cfg.pretrain)
    trainer = Trainer(resolved(cfg, 2, ctx.world_size, "cuda"), ctx, model, tiny_loaders(), 2)
    views = torch.randint(0, 256, (4, 2, 8, 8, 3), dtype=torch.uint8).pin_memory()
    batch = Batch(views, torch.zeros(4, dtype=torch.long).pin_memory(), [""] * 4, [""] * 4)
    gpu.blocking.clear()
    gpu.collectives.calls.clear()
    sums = trainer.train_step([(batch,)])
    assert isinstance(trainer.objective, SimCLR)
    assert not off_the_gpu([sums, *trainer.model.module.state_dict().values()])
    assert not gpu.reads and not gpu.blocking
    calls = [(name, shapes) for name, _, shapes in gpu.collectives.calls]
    assert ("all_gather", [("cuda:3", "torch.float32", (8, 3))] * (1 + WORLD)) in calls
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert gradient_reductions(gpu)[-1] == ("nccl", [("cuda:3", "torch.float32", (trained,))])
