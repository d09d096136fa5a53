"""train.ema_bn_epochs: the EMA's BatchNorm statistics recomputed from a fixed train sample before the first
validations (PreciseBN), the sample each rank's equal share, and a run from before the key left as it
trained."""

from __future__ import annotations

import fsspec
import pytest
import torch
import torch.distributed as dist
from replicas import CLASSES, make_config
from synthetic import make_imagenet_loc
from torch import nn

from ddp_cli.config import DataConfig, config_from_dict
from ddp_cli.data.pipeline.loaders import Batch, Loaders, build_loaders, calibration_loader
from ddp_cli.data.pipeline.sampler import ShardSampler
from ddp_cli.data.sources.layouts import build_index
from ddp_cli.data.sources.packed import Split
from ddp_cli.distributed.setup import DistContext, seed_everything
from ddp_cli.models import build_model
from ddp_cli.train.checkpoint import FORMAT_VERSION, Checkpointer, CheckpointStore, migrate
from ddp_cli.train.ema import EmaModel
from ddp_cli.train.trainer import Trainer
from tests.resolved import resolved

CPU = torch.device("cpu")


def conv_bn_dropout() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=0.3), nn.Dropout(0.5), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 5))


def inputs(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 3, 8, 8, generator=g) * 2 + 1 for _ in range(n)]


def test_each_batchnorm_becomes_the_plain_average_of_its_batch_statistics_in_the_eval_network():
    """Not the momentum's exponential average, and not last run's: the mean over the batches of each
    batch's mean and unbiased variance; the momentum and eval mode come back, and dropout, left in eval
    mode, draws nothing from the RNG (so training's random stream is the same with or without it)."""
    ema = EmaModel(conv_bn_dropout(), 0.9)
    norm = ema.module[1]
    norm.running_mean.fill_(5.0)
    norm.running_var.fill_(7.0)
    batches = inputs(3, seed=1)
    rng = torch.get_rng_state()
    ema.recalibrate(iter(batches))
    assert torch.equal(torch.get_rng_state(), rng)
    features = [ema.module[0](x) for x in batches]
    mean = torch.stack([f.mean(dim=(0, 2, 3)) for f in features]).mean(0)
    var = torch.stack([f.var(dim=(0, 2, 3), unbiased=True) for f in features]).mean(0)
    torch.testing.assert_close(norm.running_mean, mean)
    torch.testing.assert_close(norm.running_var, var)
    assert norm.momentum == 0.3 and not any(m.training for m in ema.module.modules())


def test_a_model_without_batchnorm_is_not_run():
    ema = EmaModel(nn.Sequential(nn.Flatten(), nn.Linear(12, 2)), 0.9)

    def never():
        raise AssertionError("the sample was read")
        yield

    ema.recalibrate(never())


def test_the_ranks_statistics_are_averaged(monkeypatch):
    """Each rank recomputes from its share; every rank ends with the mean of all ranks' statistics."""
    peer = EmaModel(conv_bn_dropout(), 0.9)
    peer.recalibrate(iter(inputs(2, seed=3)))
    theirs = [peer.module[1].running_mean.clone(), peer.module[1].running_var.clone()]
    sent = iter(theirs)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor: tensor.add_(next(sent)))
    ema = EmaModel(conv_bn_dropout(), 0.9)
    ema.recalibrate(iter(inputs(2, seed=4)))
    alone = EmaModel(conv_bn_dropout(), 0.9)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    alone.recalibrate(iter(inputs(2, seed=4)))
    torch.testing.assert_close(ema.module[1].running_mean, (alone.module[1].running_mean + theirs[0]) / 2)
    torch.testing.assert_close(ema.module[1].running_var, (alone.module[1].running_var + theirs[1]) / 2)


def batch(seed: int, n: int = 2) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randint(0, 256, (n, 16, 16, 3), dtype=torch.uint8, generator=g),
                 torch.randint(0, CLASSES, (n,), generator=g), [""] * n, [""] * n)


class Val(list):
    """A val loader of one batch of two: `evaluate_each` reads the items' positions off its sampler."""

    sampler = range(2)


class Sample(list):
    """The calibration loader's batches, counting the passes over it."""

    reads = 0

    def __iter__(self):
        Sample.reads += 1
        return super().__iter__()


def trainer(cfg, folder, calibration: list | None) -> Trainer:
    seed_everything(cfg.seed)
    sampler = ShardSampler(4, 0, 1, shuffle=True, batch_size=2, with_epoch=True)
    loaders = Loaders([batch(10), batch(11)], Val([batch(20)]), sampler, calibration=calibration)
    return Trainer(resolved(cfg, 2), DistContext(0, 1, 0, 1, CPU, "gloo"), build_model(cfg.model, CLASSES),
                   loaders, 2,                   Checkpointer(CheckpointStore(folder, keep_last=2)))


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def config(**train):
    return make_config({"data": {"batch_size": 2}, "train": {"epochs": 3, **train}})


def test_the_first_n_validations_follow_a_recalibration_from_the_sample_read_once(one_rank, tmp_path,
                                                                                  monkeypatch):
    calls = []
    recalibrate = EmaModel.recalibrate
    monkeypatch.setattr(EmaModel, "recalibrate", lambda self, xs: calls.append(
        (trainer_.state.epoch, [x.shape for x in xs])) or recalibrate(self, iter([])))
    Sample.reads = 0
    trainer_ = trainer(config(ema_bn_epochs=2), tmp_path, Sample([batch(30, 3), batch(31, 3)]))
    trainer_.fit()
    # before the validations of epochs 1 and 2 (state.epoch counts those done), at the val crop, NCHW
    assert calls == [(e, [torch.Size([3, 3, 16, 16])] * 2) for e in (0, 1)]
    assert Sample.reads == 1


def test_the_recalibrated_statistics_are_what_the_epoch_s_checkpoint_holds(one_rank, tmp_path):
    """The saved EMA is the validated one: its BatchNorm statistics, recomputed from the sample, are in
    the epoch's checkpoint, so best.pt and a resume hold what was measured."""
    sample = [batch(30, 4), batch(31, 4)]
    run = trainer(config(epochs=1, ema_bn_epochs=1), tmp_path, sample)
    run.fit()
    saved = torch.load(tmp_path / "last.pt", weights_only=True)["ema"]["module"]
    again = EmaModel(run.model.module, 0.9)
    again.module.load_state_dict(saved)
    again.recalibrate(iter(x for x in [run_input(run, b) for b in sample]))
    for key, value in again.module.state_dict().items():
        if value.is_floating_point():  # num_batches_tracked counts the passes, and is never read in eval
            torch.testing.assert_close(value, saved[key], msg=key)


def run_input(run: Trainer, b: Batch) -> torch.Tensor:
    from ddp_cli.data.pipeline.transforms import normalising, to_model_input
    return to_model_input(b.images, CPU, run.cfg.model.channels_last, normalising(run.cfg.data))


def test_without_a_sample_or_an_ema_nothing_is_recalibrated(one_rank, tmp_path):
    assert trainer(config(ema_bn_epochs=2), tmp_path, None).ema_bn_epochs == 0
    assert trainer(config(ema_bn_epochs=0), tmp_path, [batch(30)]).ema_bn_epochs == 0
    assert trainer(config(ema_bn_epochs=2), tmp_path, [batch(30)]).ema_bn_epochs == 2


@pytest.mark.parametrize(("trained_with", "given", "epochs"), [
    ({"epochs": 8}, {}, 0),                        # a checkpoint from before the key: off
    ({"epochs": 8, "ema_bn_epochs": 4}, {}, 8),    # one that has it: as the config says ("auto": all 8 here)
    ({"epochs": 8}, {"ema_bn_epochs": 1}, 0),      # before the key: off, whatever the config says now
    ({"epochs": 8, "ema_bn_epochs": 0}, {}, 0),    # trained without: goes on without
])
def test_a_run_that_trained_without_recomputing_resumes_without(one_rank, tmp_path, trained_with, given,
                                                                epochs):
    """`migrate` gives a checkpoint from before the key `ema_bn_epochs = 0` (how it trained); the Trainer
    follows the checkpoint's config (`config.resolve.resume`) and writes that 0 into its own checkpoints,
    so every later resume keeps it off."""
    cfg = make_config({"data": {"batch_size": 2, "image_size": 32}, "train": {"epochs": 8, **given}})
    run = trainer(cfg, tmp_path, [batch(30)])
    run.checkpointer.meta = {"config": run.cfg.model_dump(mode="json")}
    written = {**cfg.model_dump(mode="json"), "train": trained_with}
    trained = migrate({"rng": [None], "config": written, "format_version": FORMAT_VERSION})["config"]
    run.follow_trained(config_from_dict(trained))
    assert run.ema_bn_epochs == epochs
    assert (run.checkpointer.meta["config"]["train"]["ema_bn_epochs"] == 0) == (epochs == 0)
    asks = make_config({"data": {"batch_size": 2, "image_size": 32},
                        "train": {"epochs": 8, "ema_bn_epochs": 1}})
    again = trainer(asks, tmp_path, [batch(30)])
    again.follow_trained(config_from_dict(run.checkpointer.meta["config"]))  # the next resume, from those
    assert again.ema_bn_epochs == min(epochs, 1)


def rows_of(split, world: int, seed: int = 0, images: int = 8, **data) -> list[list[int]]:
    cfg = DataConfig(batch_size=3, image_size=16, **data)
    fs = fsspec.filesystem("memory")
    return [list(calibration_loader(cfg, fs, "/nowhere", split, rank, world, seed, False, images).sampler)
            for rank in range(world)]


def test_the_sample_is_fixed_by_the_seed_and_dealt_in_equal_disjoint_shares():
    """Every rank runs the same number of equal batches (SyncBatchNorm gathers in each), none twice."""
    split = Split.of([f"c/{i}.jpg" for i in range(20)], [i % 2 for i in range(20)])
    (alone,) = rows_of(split, 1)
    assert len(alone) == 8 == len(set(alone)) and alone != list(range(8))  # drawn, not the first rows
    assert rows_of(split, 1) == [alone] and rows_of(split, 1, seed=1) != [alone]
    shares = rows_of(split, 3)  # 8 images over 3 ranks: 6, two each
    assert [len(s) for s in shares] == [2, 2, 2] and sorted(sum(shares, [])) == sorted(alone[:6])
    assert rows_of(split, 1, images=50) == [rows_of(split, 1, images=20)[0]]  # at most the split
    assert rows_of(Split.of(["a.jpg"], [0]), 2) == [[], []]  # fewer images than ranks: none anywhere


def test_a_sharded_split_is_sampled_from_its_first_window_of_shards():
    """Rows 0-9 in shard 0, 10-19 in shard 1, ...: with shuffle_shards = 2, only rows under 20."""
    members = [(512 * (i % 10), 100) for i in range(60)]
    split = Split.of([f"s{i // 10}.tar/{i}.jpg" for i in range(60)], [0] * 60, members,
                     [0, 10, 20, 30, 40, 50, 60])
    (rows,) = rows_of(split, 1, images=12, shuffle_shards=2)
    assert len(rows) == 12 and max(rows) < 20


def test_the_sample_is_read_at_the_val_crop(tmp_path):
    root = tmp_path / "data"
    make_imagenet_loc(root, classes=2, train_per_class=6, val=3, size=40)
    fs = fsspec.filesystem("file")
    index = build_index(fs, str(root), "imagenet-loc")
    cfg = DataConfig(image_size=32, val_image_size=24, val_resize=28, batch_size=4, workers=0)
    loaders = build_loaders(cfg, fs, str(root), index, rank=0, world_size=1, seed=0, pin_memory=False,
                            calibration=6)
    assert [tuple(b.images.shape) for b in loaders.calibration] == [(4, 24, 24, 3), (2, 24, 24, 3)]
    assert build_loaders(cfg, fs, str(root), index, 0, 1, 0, False).calibration is None


def test_resuming_a_checkpoint_from_before_the_key_turns_it_off(one_rank, tmp_path):
    """Through `Trainer.resume`: the checkpoint's own config is what tells an old run."""
    cfg = config(epochs=2, ema_bn_epochs=2)
    run = trainer(cfg, tmp_path / "a", [batch(30)])
    run.checkpointer.meta = {"config": cfg.model_dump(mode="json")}
    run.fit()
    state = torch.load(tmp_path / "a" / "last.pt", weights_only=True)
    del state["config"]["train"]["ema_bn_epochs"]  # as a ddp from before the key wrote it
    torch.save(state, tmp_path / "old.pt")
    for path, epochs in ((tmp_path / "a" / "last.pt", 2), (tmp_path / "old.pt", 0)):
        resumed = trainer(config(epochs=3, ema_bn_epochs=2), tmp_path / "b", [batch(30)])
        resumed.resume(path)
        assert resumed.ema_bn_epochs == epochs
