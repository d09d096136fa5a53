"""The training objectives (objectives.py) on a tiny model: each loss is the one the Trainer used to compute
inline, FixMatch's unlabelled stream and its position round-trip through state_dict, and the Trainer
saves and restores that position, and logs the metrics, without knowing which objective it has."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from replicas import CLASSES, make_config
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddp_cli.data.pipeline.loaders import Batch, Loaders, collate
from ddp_cli.data.pipeline.sampler import ShardSampler
from ddp_cli.data.pipeline.semi import UnlabelledStream
from ddp_cli.data.pipeline.transforms import normalising, to_model_input
from ddp_cli.distributed.setup import DistContext, seed_everything
from ddp_cli.train.checkpoint import Checkpointer, CheckpointStore
from ddp_cli.train.ema import EmaModel
from ddp_cli.train.fixmatch import SUMS, fixmatch_loss, summary
from ddp_cli.train.mixing import BatchMixing
from ddp_cli.train.objectives import FixMatch, Supervised, build_objective
from ddp_cli.train.trainer import Trainer
from tests.resolved import resolved

CPU = torch.device("cpu")
SIZE, B, MU, UNLABELLED = 8, 2, 2, 10  # a pass of 10 unlabelled images: 2 micro-steps of 4, 2 dropped


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * SIZE * SIZE, CLASSES))


def labelled(seed: int, n: int = B) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randint(0, 256, (n, SIZE, SIZE, 3), dtype=torch.uint8, generator=g),
                 torch.randint(0, CLASSES, (n,), generator=g), [""] * n, [""] * n)


class Views(Dataset):
    """Unlabelled image i: both views filled with i (weak) and 255 - i (strong), its label i % CLASSES
    (or unknown, -1, for odd i), so a batch tells which images the stream dealt."""

    def __getitem__(self, item: tuple[int, int, int]) -> tuple:
        i = item[0]
        views = torch.stack([torch.full((SIZE, SIZE, 3), i), torch.full((SIZE, SIZE, 3), 255 - i)])
        return views.to(torch.uint8), i % CLASSES if i % 2 == 0 else -1, "", ""


def semi_loaders() -> Loaders:
    stream = UnlabelledStream(ShardSampler(UNLABELLED, 0, 1, shuffle=True, seed=5, batch_size=MU * B,
                                           with_epoch=True))
    return Loaders(None, [], None, DataLoader(Views(), batch_size=MU * B, sampler=stream, collate_fn=collate),
                   stream)


def fixmatch_config(**semi):
    return make_config({"data": {"batch_size": B, "image_size": SIZE}, "train": {"ema_decay": 0.5},
                        "optim": {"label_smoothing": 0.1}, "logging": {"every_steps": 2},
                        "semi": {"method": "fixmatch", "mu": MU, "threshold": 0.4, **semi}})


def test_supervised_is_cross_entropy_on_the_normalised_batch_with_the_run_s_smoothing():
    cfg = make_config({"data": {"image_size": SIZE}, "optim": {"label_smoothing": 0.1}})
    objective = build_objective(cfg, Loaders(None, [], None), CPU, "fp32", None)
    model, batch = tiny_model(), labelled(1)
    assert isinstance(objective, Supervised) and objective.micro_batches([batch]) == [(batch,)]
    loss, sums = objective.loss(model, (batch,), step=0)
    x = to_model_input(batch.images, CPU, cfg.model.channels_last, normalising(cfg.data))
    assert torch.equal(loss, F.cross_entropy(model(x), batch.labels, label_smoothing=0.1))
    assert sums.shape == (0,) and objective.sums == ()
    assert objective.metrics([], 4) == {} and objective.summary({"top1": 1.0}) == {}
    assert objective.state_dict() == {}


def test_mixing_trains_on_the_step_s_mix_against_its_mixed_labels():
    """The step number seeds the draw: the loss is that of the mix drawn for `step`, and another step's
    mix gives another loss (at mix_prob 1, every step mixes)."""
    cfg = make_config({"data": {"image_size": SIZE}, "augment": {"mixup_alpha": 0.4, "mix_prob": 1.0},
                       "optim": {"label_smoothing": 0.1}})
    objective, model, batch = Supervised(cfg, CPU, "fp32"), tiny_model(), labelled(2, 4)
    x = to_model_input(batch.images, CPU, cfg.model.channels_last, normalising(cfg.data))
    for step in (3, 4):
        mix = BatchMixing(cfg.augment, cfg.seed).draw(step, x)
        expected = F.cross_entropy(model(mix.images(x)), mix.targets(batch.labels, CLASSES),
                                   label_smoothing=cfg.optim.label_smoothing)
        assert torch.equal(objective.loss(model, (batch,), step)[0], expected)
    assert not torch.equal(objective.loss(model, (batch,), 3)[0], objective.loss(model, (batch,), 4)[0])


def test_fixmatch_s_loss_is_one_forward_of_labelled_weak_and_strong_with_the_ema_teacher_s_pseudo_labels():
    cfg = fixmatch_config(ema_teacher=True)
    model = tiny_model()
    ema = EmaModel(model, 0.5)
    objective = build_objective(cfg, semi_loaders(), CPU, "fp32", ema)
    assert isinstance(objective, FixMatch) and objective.sums == SUMS
    (batch, unlabelled), = objective.micro_batches([labelled(3)])
    with torch.no_grad():  # a teacher unlike the student: sure of a class the student does not pick first
        student = model(to_model_input(unlabelled.images[:1, 0], CPU, False)).argmax().item()
        ema.module[1].weight.zero_()
        ema.module[1].bias.copy_(F.one_hot(torch.tensor((student + 1) % CLASSES), CLASSES) * 5.0)
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    loss, sums = objective.loss(model, (batch, unlabelled), step=0)
    views = unlabelled.images
    images = torch.cat([batch.images, views[:, 0], views[:, 1]])
    x = to_model_input(images, CPU, cfg.model.channels_last, normalising(cfg.data))
    assert len(seen) == 1 and torch.equal(seen[0], x)  # the student's one forward, in that order
    with torch.no_grad():
        teacher = ema.module(x[B:B + len(views)])
    smoothed = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    hidden = unlabelled.labels
    want_loss, want_sums = fixmatch_loss(model(x), batch.labels, hidden, cfg.semi, smoothed, teacher)
    assert torch.equal(loss, want_loss) and torch.equal(sums, want_sums)
    own = fixmatch_loss(model(x), batch.labels, hidden, cfg.semi, smoothed)[0]
    assert not torch.equal(loss, own)  # the teacher's pseudo-labels, not the student's
    assert objective.metrics(sums.tolist(), 1) == summary(sums.tolist(), 1)
    last = {"mask_rate": 0.5, "pseudo_label_top1": None, "top1": 0.9}
    assert objective.summary(last) == {"semi": {"mask_rate": 0.5, "pseudo_label_top1": None}}


def test_fixmatch_pairs_each_labelled_micro_batch_with_the_next_unlabelled_one_and_resumes_the_stream():
    """Each micro-step takes the stream's next MU x B images and moves its position on; a fresh objective
    loaded with that position deals the very images the first one would have dealt next."""
    first = FixMatch(fixmatch_config(), semi_loaders(), CPU, "fp32", None)
    assert first.state_dict() == {"unlabelled_epoch": 0, "unlabelled_seen": 0, "semi_statistics": {}}
    a, b = labelled(4), labelled(5)
    micro = first.micro_batches([a, b])
    assert [len(part) for part in micro] == [2, 2] and [part[0] for part in micro] == [a, b]
    dealt = [part[1].images[:, 0, 0, 0, 0].tolist() for part in micro]
    assert sorted(dealt[0] + dealt[1]) == sorted(set(dealt[0] + dealt[1]))  # no image twice in a pass
    # the pass is over
    assert first.state_dict() == {"unlabelled_epoch": 1, "unlabelled_seen": 0, "semi_statistics": {}}
    third = first.micro_batches([labelled(6)])[0][1]
    position = first.state_dict()
    assert position == {"unlabelled_epoch": 1, "unlabelled_seen": MU * B, "semi_statistics": {}}
    resumed = FixMatch(fixmatch_config(), semi_loaders(), CPU, "fp32", None)
    resumed.load_state_dict({**position, "step": 7})  # its own fields of the run's progress
    assert resumed.state_dict() == position
    fourth = first.micro_batches([labelled(7)])[0][1]
    again = resumed.micro_batches([labelled(7)])[0][1]
    assert torch.equal(again.images, fourth.images) and torch.equal(again.labels, fourth.labels)
    assert not torch.equal(fourth.images, third.images)


class Records:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def fixmatch_trainer(cfg, folder, records: Records | None = None) -> Trainer:
    seed_everything(cfg.seed)
    loaders = semi_loaders()
    sampler = ShardSampler(4 * B, 0, 1, shuffle=True, batch_size=B, with_epoch=True)
    loaders = Loaders([labelled(10 + i) for i in range(4)], [labelled(20)], sampler, loaders.unlabelled,
                      loaders.unlabelled_stream)
    store = CheckpointStore(folder, keep_last=2)
    return Trainer(resolved(cfg, 3), DistContext(0, 1, 0, 1, CPU, "gloo"), tiny_model(), loaders, 3,
                   Checkpointer(store), metrics=records)


def test_the_trainer_saves_and_restores_the_objective_s_state_and_logs_its_metrics(tmp_path):
    """The stream's position reaches the checkpoint flat, as `unlabelled_epoch` and `unlabelled_seen`,
    and a resume hands it back to the objective; every train record carries the objective's window and
    the epoch its own `semi` record."""
    cfg = fixmatch_config()
    records = Records()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = fixmatch_trainer(cfg, tmp_path, records)
        _, _, metrics = trainer.train_epoch(0)
        path = trainer.save()
        resumed = fixmatch_trainer(cfg, tmp_path / "other")
        resumed.resume(path)
    finally:
        dist.destroy_process_group()
    position = trainer.objective.state_dict()
    # 3 micro-steps of a 2-step pass
    assert position == {"unlabelled_epoch": 1, "unlabelled_seen": MU * B, "semi_statistics": {}}
    saved = torch.load(path, weights_only=True)
    assert {k: saved[k] for k in position} == position
    assert resumed.objective.state_dict() == position
    assert set(metrics) == {"sup_loss", "unsup_loss", "mask_rate", "pseudo_label_top1"}
    train = [r for r in records.records if r["split"] == "train"]
    assert [r["step"] for r in train] == [2, 3] and all(set(metrics) <= set(r) for r in train)
    window = [r["mask_rate"] for r in train]
    assert metrics["mask_rate"] == (2 * window[0] + window[1]) / 3  # the windows make up the epoch


def test_a_supervised_checkpoint_keeps_the_stream_s_fields_at_their_defaults(tmp_path):
    cfg = make_config({"data": {"batch_size": B, "image_size": SIZE}})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sampler = ShardSampler(4 * B, 0, 1, shuffle=True, batch_size=B, with_epoch=True)
        loaders = Loaders([labelled(10 + i) for i in range(4)], [labelled(20)], sampler)
        trainer = Trainer(resolved(cfg, 2), DistContext(0, 1, 0, 1, CPU, "gloo"), tiny_model(), loaders, 2,
                          Checkpointer(CheckpointStore(tmp_path, keep_last=1)))
        _, _, metrics = trainer.train_epoch(0)
        saved = torch.load(trainer.save(), weights_only=True)
    finally:
        dist.destroy_process_group()
    assert metrics == {} and len(trainer.running) == 2
    assert (saved["unlabelled_epoch"], saved["unlabelled_seen"]) == (0, 0)
    assert [len(row) for row in saved["running"]] == [2]
