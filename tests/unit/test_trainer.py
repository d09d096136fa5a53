"""The Trainer's arithmetic that only a whole run used to show: the loss divided over gradient accumulation's
micro-batches, the peak LR and the schedule followed on a resume at another world size, and a resumed
epoch's throughput counted over the steps it ran."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from replicas import global_batch, make_config, make_trainer, step_replica

from ddp_cli.data.pipeline.loaders import Batch
from ddp_cli.train import rng
from ddp_cli.train import trainer as trainer_module


@pytest.fixture
def one_rank():
    """A one-process gloo group: a Trainer that is told it is rank 0 of k runs its collectives alone."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def gradients_of_one_step(trainer, micro: list) -> dict[str, torch.Tensor]:
    """The gradients `train_step` hands the optimiser (the step itself left out)."""
    grads = {}
    trainer.optimizer_step = lambda: grads.update(
        {name: p.grad.clone() for name, p in trainer.model.module.named_parameters()})
    trainer.train_step(micro)
    return grads


def parts(images: torch.Tensor, labels: torch.Tensor) -> tuple[Batch]:
    return (Batch(images, labels, [""] * len(labels), [""] * len(labels)),)


def test_grad_accum_divides_the_loss_so_two_micro_batches_give_the_gradient_of_one_batch_of_both(
        one_rank, tmp_path):
    """No BatchNorm (GroupNorm in its place): the gradient of the mean loss over 8 images equals the sum of
    the two micro-batches' gradients of their mean losses, each divided by 2."""
    images, labels = global_batch(0, 8)
    whole = make_trainer(0, 1, make_config({"data": {"batch_size": 8}}), 1, str(tmp_path / "a"),
                         batchnorm=False)
    accum = make_trainer(0, 1, make_config({"data": {"batch_size": 4}, "train": {"grad_accum": 2}}), 1,
                         str(tmp_path / "b"), batchnorm=False)
    expected = gradients_of_one_step(whole, [parts(images, labels)])
    got = gradients_of_one_step(accum, [parts(images[:4], labels[:4]), parts(images[4:], labels[4:])])
    assert expected.keys() == got.keys() and expected
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, msg=name)


class TwoRanks:
    """The RNG states of a checkpoint written by two ranks (each rank's, as `RankRngs` gathers them)."""

    def state_dict(self) -> list[dict]:
        return [rng.capture(), rng.capture()]


def test_a_resume_at_another_world_size_scales_the_peak_lr_by_lr_per_256_and_keeps_the_epoch_fraction(
        one_rank, tmp_path):
    """Written at world size 2 (global batch 8, peak 2.0 x 8 / 256) after 1.5 of 4 epochs of 4 steps;
    resumed at world size 4 (global batch 16, 2 steps an epoch): peak 2.0 x 16 / 256 = 0.125, and the
    cosine (2 warmup steps, 8 steps in all) at step 3, 1.5 epochs in."""
    cfg = make_config({"train": {"epochs": 4}, "schedule": {"name": "cosine", "warmup_steps": 2}})
    two = make_trainer(0, 2, cfg, 4, str(tmp_path / "two"))
    two.checkpointer.register(rng=TwoRanks())
    for step in range(6):
        step_replica(two, 0, 2, step)
        two.state.step += 1
    two.state.epoch, two.state.step_in_epoch, two.state.samples_in_epoch = 1, 2, 2 * 8
    saved = two.checkpointer.save()
    assert two.optimizer.param_groups[0]["lr"] == pytest.approx(
        0.0625 * 0.5 * (1 + math.cos(math.pi * (6 - 2) / (16 - 2))))  # at world size 2, the step it goes on

    four = make_trainer(0, 4, cfg, 2, str(tmp_path / "four"))
    four.resume(saved)
    expected = 0.125 * 0.5 * (1 + math.cos(math.pi * (3 - 2) / (8 - 2)))
    assert [group["lr"] for group in four.optimizer.param_groups] == pytest.approx(
        [expected] * len(four.optimizer.param_groups))
    assert (four.state.step_in_epoch, four.scheduler.last_epoch) == (1, 3)
    four.scheduler.step()  # and the schedule goes on from there, at the new peak
    assert four.optimizer.param_groups[0]["lr"] == pytest.approx(
        0.125 * 0.5 * (1 + math.cos(math.pi * (4 - 2) / (8 - 2))))


def test_a_resume_at_the_same_world_size_takes_the_next_step_at_this_runs_schedule(one_rank, tmp_path):
    """A finished 2-epoch run given 4: its next step's LR is the 4-epoch cosine's, not the 2-epoch one's
    last (0), and the resume says so."""
    short = make_trainer(0, 1, make_config({"train": {"epochs": 2}}), 2, str(tmp_path / "a"))
    for step in range(4):
        step_replica(short, 0, 1, step)
        short.state.step += 1
    short.state.epoch = 2
    saved = short.checkpointer.save()
    longer = make_trainer(0, 1, make_config({"train": {"epochs": 4}}), 2, str(tmp_path / "b"))
    resumed = longer.resume(saved)
    peak = 2.0 * 4 / 256
    expected = peak * 0.5 * (1 + math.cos(math.pi * (4 - 2) / (8 - 2)))
    assert longer.optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    assert resumed.lr == pytest.approx((0.0, expected)) and not resumed.finished
    assert f"LR at the next step 0 -> {expected:.3g}" in resumed.line()


def test_a_resumed_epoch_counts_the_images_of_the_steps_it_ran(one_rank, tmp_path, monkeypatch):
    """Resumed after 3 of 4 steps, the epoch trains one step of 4 images: in one second, 4 images/s (not
    the whole epoch's 16), in its history row and in the run's summary."""
    trainer = make_trainer(0, 1, make_config({}), 4, str(tmp_path))
    trainer.state.step_in_epoch = trainer.state.step = 3
    clock = iter(range(100))
    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    metrics = {"loss": 1.0, "top1": 0.5, "top5": 1.0}
    trainer.train_epoch = lambda epoch: (1.0, set(), {})
    trainer.validate = lambda bad: (SimpleNamespace(metrics=metrics),) * 2  # the model's and its EMA's
    trainer.checkpoint = lambda top1=None: None
    result = trainer.fit()
    assert trainer.state.history[-1]["images_per_second"] == 4.0
    assert result["images_per_second"] == 4.0
