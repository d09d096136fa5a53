"""The Trainer's bookkeeping, named: running sums, metrics rows, an epoch's end, batches on the device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddp_cli.data.pipeline.loaders import Batch
from ddp_cli.errors import DataError
from ddp_cli.train.checkpoint import RunState
from ddp_cli.train.fixmatch import SUMS
from ddp_cli.train.objectives import on_device
from ddp_cli.train.records import EpochEnd, row
from ddp_cli.train.running import RunningSums
from tests.resolved import resolved

CPU = torch.device("cpu")


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_running_sums_are_one_flat_float64_tensor_named_loss_steps_then_the_objectives():
    sums = RunningSums(SUMS, CPU)
    assert sums.columns == ("loss", "steps", *SUMS) and len(sums) == 2 + len(SUMS)
    assert sums.flat.dtype == torch.float64 and sums.flat.shape == (8,)
    step = torch.arange(1.0, 8.0, dtype=torch.float64)  # a step's loss, then its six sums
    sums.add(step)
    sums.add(step)
    assert sums.flat.tolist() == [2.0, 2.0, *(2 * step[1:]).tolist()]
    assert (sums.loss.item(), sums.steps.item()) == (2.0, 2.0)
    assert sums.objective.tolist() == (2 * step[1:]).tolist()
    assert sums.mean_loss().item() == 1.0
    read = sums.read()
    assert (read.loss, read.steps, read.objective) == (2.0, 2.0, (2 * step[1:]).tolist())
    sums.zero()
    assert sums.flat.tolist() == [0.0] * 8 and sums.mean_loss().item() == 0.0  # no step: no division by 0


def test_a_supervised_run_sums_the_loss_and_steps_only():
    sums = RunningSums((), CPU)
    sums.add(torch.tensor([0.5], dtype=torch.float64))
    assert sums.columns == ("loss", "steps") and sums.flat.tolist() == [0.5, 1.0]
    assert sums.read().objective == []


def test_running_sums_serialise_as_a_checkpoint_row_per_rank_and_restore_from_it(one_rank):
    sums = RunningSums(("a", "b"), CPU)
    sums.add(torch.tensor([1.5, 2.0, 3.0], dtype=torch.float64))
    state = RunState(running=sums.gathered(1))
    assert state.running == [[1.5, 1.0, 2.0, 3.0]]  # [loss, steps, *objective], as checkpoints keep it
    restored = RunningSums(("a", "b"), CPU)
    restored.restore(state.running_of(0, 1, len(restored)))
    assert torch.equal(restored.flat, sums.flat)
    restored.restore(RunState().running_of(0, 1, len(restored)))  # a fresh epoch: zeros
    assert restored.flat.tolist() == [0.0] * 4


def test_a_window_is_what_the_ranks_added_since_the_mark(one_rank):
    sums = RunningSums(("a",), CPU)
    sums.add(torch.tensor([1.0, 4.0], dtype=torch.float64))
    mark = sums.reduced()
    assert mark.flat is not sums.flat and mark.names == ("a",)
    sums.add(torch.tensor([3.0, 6.0], dtype=torch.float64))
    since = (sums.reduced() - mark).read()
    assert (since.loss, since.steps, since.objective) == (3.0, 1.0, [6.0])
    assert mark.read().loss == 1.0  # the mark is a copy, not a view of the sums


def test_a_metrics_row_starts_with_split_the_one_based_epoch_and_the_step():
    record = row("train", 0, 7, loss=1.0, lr=0.1)
    assert list(record) == ["split", "epoch", "step", "loss", "lr"]
    assert record == {"split": "train", "epoch": 1, "step": 7, "loss": 1.0, "lr": 0.1}


def test_an_epochs_end_is_written_as_the_history_row_and_the_validation_keys_their_readers_know():
    val = {"loss": 0.5, "top1": 0.8, "top5": 0.9, "images": 10}
    end = EpochEnd(2, 1.25, val, {"loss": 0.4, "top1": 0.85, "top5": 0.95, "images": 10}, 3.0, 64.0, 2, 5,
                   0.01, 224, {"mask_rate": 0.5})
    assert end.history_row() == {"epoch": 2, "train_loss": 1.25, "val_loss": 0.5, "top1": 0.8, "top5": 0.9,
                                 "ema_top1": 0.85, "seconds": 3.0, "images_per_second": 64.0, "skipped": 2,
                                 "io_retries": 5, "mask_rate": 0.5}
    assert list(end.history_row()) == ["epoch", "train_loss", "val_loss", "top1", "top5", "ema_top1",
                                       "seconds", "images_per_second", "skipped", "io_retries", "mask_rate"]
    assert end.validation_keys() == {"lr": 0.01, "image_size": 224, "images_per_second": 64.0,
                                     "skipped_images": 2, "io_retries": 5}
    assert list(end.validation_keys()) == ["lr", "image_size", "images_per_second", "skipped_images",
                                           "io_retries"]
    without_ema = EpochEnd(1, 1.0, val, None, 1.0, 1.0, 0, 0, 0.1, 32)
    assert "ema_top1" not in without_ema.history_row() and list(without_ema.history_row())[-1] == "io_retries"


def test_a_micro_steps_batches_go_to_the_device_once_their_bad_images_raised_first():
    images = torch.zeros(2, 4, 4, 3, dtype=torch.uint8)
    good = Batch(images, torch.tensor([0, 1]), ["", ""], ["", ""])
    moved = on_device((good, good), CPU)
    assert len(moved) == 2 and all(isinstance(batch, Batch) for batch in moved)
    assert moved[0].images.dtype == torch.uint8 and moved[0].images.shape == images.shape  # as loaded
    assert moved[0].labels.tolist() == [0, 1] and moved[0].skipped == ["", ""]
    bad = good._replace(errors=["", "bad.jpg: not an image"])
    with pytest.raises(DataError, match="bad.jpg"):
        on_device((good, bad), CPU)


def test_the_trainer_writes_each_record_through_one_row_helper(one_rank):
    from replicas import CLASSES, make_config

    from ddp_cli.data.pipeline.loaders import Loaders
    from ddp_cli.distributed.setup import DistContext
    from ddp_cli.models import build_model
    from ddp_cli.train.trainer import Trainer

    class Rows:  # a metrics sink
        def __init__(self) -> None:
            self.written: list[dict] = []

        def write(self, record: dict) -> None:
            self.written.append(record)

    cfg, rows = make_config({}), Rows()
    told = []
    trainer = Trainer(resolved(cfg, 4), DistContext(0, 1, 0, 1, CPU, "gloo"), build_model(cfg.model, CLASSES),
                      Loaders(None, [], None), 4, metrics=rows,
                      on_validation=lambda totals, epoch: told.append(epoch))
    trainer.state.step = 9
    trainer.log("world_size", 1, world_size=2)
    assert rows.written == [{"split": "world_size", "epoch": 2, "step": 9, "world_size": 2}]
    assert trainer.on_validation is not None and trainer.stop_after_epoch is None  # hooks: the constructor's
