"""FixMatch: the loss and mask on a batch worked out by hand, the labelled subset, the unlabelled stream's
sharding and position, the two views, and what [semi] refuses (in-process, no workers)."""

from __future__ import annotations

import json
import math

import fsspec
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import UNLABELLED_IMAGES, ddp_in_process
from synthetic import image, make_imagefolder, write_registry

from ddp_cli.config import DataConfig, RunConfig, SemiConfig, config_from_dict
from ddp_cli.data.index_build import resolve_dataset
from ddp_cli.data.pipeline.sampler import ShardSampler
from ddp_cli.data.pipeline.semi import (
    UnlabelledStream,
    build_semi_loaders,
    check_unlabelled,
    labelled_rows,
    semi_splits,
    take,
)
from ddp_cli.data.pipeline.views import TwoViews, cutout, fixmatch_views
from ddp_cli.data.sources.packed import Split
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.errors import ConfigError
from ddp_cli.train.fixmatch import fixmatch_loss, pseudo_labels, summary
from tests.resolved import resolved

FIXMATCH = SemiConfig(method="fixmatch", threshold=0.9, lambda_u=2.0)


def test_the_mask_and_the_loss_of_a_batch_worked_out_by_hand():
    """1 labelled image, 2 unlabelled (weak, strong). Weak logits (ln 18, 0) give p = 18/19 = 0.947 >= 0.9:
    pseudo-label 0, kept; (0, 0) gives 0.5: masked out. The loss is CE(labelled) + 2 x mean over BOTH
    unlabelled of mask x CE(strong, pseudo): the masked one counts in the mean, as zero."""
    labelled = [0.0, 0.0]  # CE against class 1: ln 2
    weak = [[math.log(18), 0.0], [0.0, 0.0]]
    strong = [[0.0, math.log(3)], [5.0, -5.0]]  # first: p(class 0) = 1/4, CE = ln 4; second: masked
    logits = torch.tensor([labelled, *weak, *strong])
    hidden = torch.tensor([1, -1])  # the first image's true class is 1: its pseudo-label 0 is wrong
    loss, sums = fixmatch_loss(logits, torch.tensor([1]), hidden, FIXMATCH, F.cross_entropy)
    assert loss.item() == pytest.approx(math.log(2) + 2.0 * math.log(4) / 2)
    sup, unsup, masked, unlabelled, correct, known = sums.tolist()
    assert (sup, unsup) == (pytest.approx(math.log(2)), pytest.approx(math.log(4) / 2))
    assert (masked, unlabelled, correct, known) == (1, 2, 0, 1)
    assert summary(sums.tolist(), 1) == {"sup_loss": pytest.approx(math.log(2)),
                                         "unsup_loss": pytest.approx(math.log(4) / 2),
                                         "mask_rate": 0.5, "pseudo_label_top1": 0.0}


def test_the_threshold_is_inclusive_the_temperature_sharpens_and_pseudo_labels_carry_no_gradient():
    weak = torch.tensor([[math.log(9), 0.0]], requires_grad=True)  # p = 0.9 exactly
    labels, mask = pseudo_labels(weak, temperature=1.0, threshold=0.9)
    assert labels.tolist() == [0] and mask.tolist() == [True]
    assert pseudo_labels(weak, temperature=2.0, threshold=0.9)[1].tolist() == [False]  # 3/4 < 0.9
    assert pseudo_labels(weak, temperature=0.5, threshold=0.95)[1].tolist() == [True]  # 81/82
    assert not labels.requires_grad and not mask.requires_grad


def test_the_ema_teacher_s_logits_make_the_pseudo_labels_and_no_label_known_is_none():
    logits = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 3.0]])  # the model's weak view: not confident
    teacher = torch.tensor([[0.0, 10.0]])
    loss, sums = fixmatch_loss(logits, torch.tensor([0]), torch.tensor([-1]), FIXMATCH, F.cross_entropy,
                               teacher)
    assert sums[2].item() == 1  # masked in by the teacher
    assert loss.item() == pytest.approx(math.log(2) + 2.0 * F.cross_entropy(logits[2:], torch.tensor([1])))
    assert summary(sums.tolist(), 1)["pseudo_label_top1"] is None


def test_the_labelled_subset_is_n_per_class_drawn_by_the_seed_alone():
    labels = np.repeat(np.arange(4), 25)
    rows = labelled_rows(labels, 3, seed=0)
    assert np.array_equal(rows, np.sort(rows)) and np.bincount(labels[rows]).tolist() == [3, 3, 3, 3]
    assert np.array_equal(rows, labelled_rows(labels, 3, seed=0))  # any rank, any resume, any loader count
    assert not np.array_equal(rows, labelled_rows(labels, 3, seed=1))
    with pytest.raises(ConfigError, match=r"^semi.labels_per_class: class 0 .* has 25 images, fewer than 26"):
        labelled_rows(labels, 26, seed=0)


def split_of(n: int, classes: int = 4) -> Split:
    return Split.of([f"c{i % classes}/{i}.png" for i in range(n)], np.arange(n) % classes)


def test_fixmatch_keeps_the_rest_unlabelled_with_its_labels_only_for_measuring_and_none_drops_it():
    train = split_of(40)
    labelled, rest = semi_splits(train, None, SemiConfig(method="fixmatch", labels_per_class=2), seed=0)
    assert len(labelled) == 8 and len(rest) == 32
    assert set(labelled.paths) | set(rest.paths) == set(train.paths)  # every image, once
    assert not set(labelled.paths) & set(rest.paths)
    assert all(f"c{label}/" in p for p, label in zip(rest.paths, rest.labels, strict=True))  # labels kept
    baseline, none = semi_splits(train, None, SemiConfig(labels_per_class=2), seed=0)
    assert baseline == labelled and none is None  # method "none": the same 8 labelled images alone
    unlabeled = Split.of(["u/0.png", "u/1.png"], [-1, -1])
    assert semi_splits(train, unlabeled, SemiConfig(method="fixmatch"), seed=0) == (train, unlabeled)
    with pytest.raises(ConfigError, match=r'^semi.method: "fixmatch" needs unlabelled images: name an '):
        semi_splits(train, None, SemiConfig(method="fixmatch"), seed=0)


def test_a_packed_split_s_subset_keeps_each_shard_s_rows_together():
    split = Split.of([f"s{i // 4}/{i}" for i in range(12)], np.zeros(12, int), np.ones((12, 2)),
                     np.array([0, 4, 8, 12]))
    part = take(split, np.array([1, 2, 9]))
    assert list(part.paths) == ["s0/1", "s0/2", "s2/9"] and part.starts.tolist() == [0, 2, 2, 3]


def stream(n: int, rank: int, world: int, batch: int) -> UnlabelledStream:
    return UnlabelledStream(ShardSampler(n, rank, world, shuffle=True, seed=5, batch_size=batch,
                                         with_epoch=True))


def take_steps(streams: list[UnlabelledStream], steps: int, position: tuple[int, int] = (0, 0)):
    """`steps` micro-steps of every rank from `position`: the (index, pass) items per step, the position
    after, as the trainer moves it."""
    for s in streams:
        s.start(*position)
    iters = [iter(s) for s in streams]
    seen = []
    for _ in range(steps):
        seen.append([item[:2] for it, s in zip(iters, streams, strict=True)
                     for item in (next(it) for _ in range(s.sampler.batch_size))])
        position = streams[0].advance(*position)
    return seen, position


def test_unlabelled_sharding_sees_each_image_once_per_pass_across_the_ranks_then_a_fresh_order():
    n = 50  # a pass: 50 // (2 ranks x 4) = 6 steps of 8, 2 images dropped
    steps, position = take_steps([stream(n, r, 2, 4) for r in range(2)], 13)
    first, second = [i for step in steps[:6] for i, _ in step], [i for step in steps[6:12] for i, _ in step]
    assert len(first) == len(set(first)) == 48 and {e for step in steps[:6] for _, e in step} == {0}
    assert len(set(second)) == 48 and {e for step in steps[6:12] for _, e in step} == {1}
    assert first != second
    assert position == (2, 8)  # the 13th step began pass 2


def test_the_stream_resumes_from_its_position_exactly_and_at_another_world_size_deals_the_rest():
    whole, _ = take_steps([stream(50, r, 2, 4) for r in range(2)], 9)
    _, position = take_steps([stream(50, r, 2, 4) for r in range(2)], 4)
    resumed, _ = take_steps([stream(50, r, 2, 4) for r in range(2)], 5, position)
    assert resumed == whole[4:]  # the same items, the same ranks
    one, after = take_steps([stream(50, 0, 1, 4)], 4, position)  # 1 rank: the pass's rest, then pass 1
    rest = [i for step in whole[4:6] for i, _ in step]  # the 2-rank run's rest of pass 0: 16 images
    assert sorted(i for step in one[:4] for i, _ in step) == sorted(rest)
    assert after == (1, 0)


def test_a_pass_must_hold_one_micro_step_of_every_rank():
    cfg = RunConfig(data=DataConfig(batch_size=8), semi=SemiConfig(method="fixmatch", mu=7))
    check_unlabelled(112, 2, cfg)
    with pytest.raises(ConfigError, match=r"^semi.mu: the 111 unlabelled images are fewer than one step "):
        check_unlabelled(111, 2, cfg)


@pytest.mark.parametrize(("keys", "message"), [
    ({"augment": {"mixup_alpha": 0.2}}, "augment.mixup_alpha: MixUp/CutMix mix the labelled batch"),
    ({"augment": {"cutmix_alpha": 1.0}}, "augment.mixup_alpha: MixUp/CutMix mix the labelled batch"),
    ({"data": {"min_image_size": 16, "image_size": 32}}, "data.min_image_size: progressive resizing"),
    ({"semi": {"method": "fixmatch", "ema_teacher": True}, "train": {"ema_decay": 0}},
     "semi.ema_teacher: needs an EMA; set train."),
    ({"semi": {"method": "fixmatch", "mu": 0}}, "semi.mu: Input should be greater than 0"),
    ({"semi": {"method": "fixmatch", "threshold": 1.5}}, "semi.threshold: Input should be less than"),
    ({"semi": {"method": "mixmatch"}}, "semi.method: Input should be 'none', 'fixmatch', 'freematch' or "
     "'softmatch'"),
    ({"semi": {"method": "freematch", "stats_momentum": 1.0}}, "semi.stats_momentum: Input should be less"),
    ({"semi": {"method": "softmatch", "n_sigma": 0}}, "semi.n_sigma: Input should be greater than 0"),
    ({"semi": {"method": "freematch", "fairness_weight": -1}},
     "semi.fairness_weight: Input should be greater"),
    ({"semi": {"method": "softmatch"}, "augment": {"mixup_alpha": 0.2}},
     "augment.mixup_alpha: MixUp/CutMix mix the labelled batch"),
])
def test_what_fixmatch_does_not_compose_with_is_refused_naming_the_key_and_the_fix(keys, message):
    raw = {**keys, "semi": {"method": "fixmatch", **keys.get("semi", {})}}
    with pytest.raises(ConfigError, match="^config: " + message.replace(".", r"\.").replace("(", r"\(")):
        config_from_dict(raw)


def test_what_composes_with_fixmatch_is_accepted():
    config_from_dict({"semi": {"method": "fixmatch", "ema_teacher": True}, "train": {"ema_decay": 0.999},
                      "augment": {"repeated_aug": 2, "policy": "randaugment"}, "model": {"freeze": ["stem"]}})
    # method "none": MixUp and progressive resizing stay the user's, with labels_per_class or not
    config_from_dict({"semi": {"labels_per_class": 5}, "augment": {"mixup_alpha": 0.2},
                      "data": {"min_image_size": 16, "image_size": 32}})


def test_the_views_are_flipped_only_where_data_hflip_and_semi_weak_say_so():
    def views(hflip: bool, weak: str = "flip+crop") -> TwoViews:
        return fixmatch_views(DataConfig(image_size=8, hflip=hflip), RunConfig().augment,
                              SemiConfig(method="fixmatch", weak=weak))

    # weak view first, strong second; a mirrored digit: another glyph
    assert not views(False).first.hflip and not views(False).second.hflip
    assert views(True).first.hflip and views(True).second.hflip
    assert not views(True, "crop").first.hflip


def test_cutout_greys_a_square_within_the_largest_side(monkeypatch):
    monkeypatch.setattr(torch, "rand", lambda n: torch.tensor([1.0, 0.5, 0.5]))  # largest, centred
    functional, kwargs = cutout(8, 8, 0.5)
    out = functional(torch.zeros(3, 8, 8, dtype=torch.uint8), **kwargs).permute(1, 2, 0)
    assert (out == 127).all(dim=2).sum().item() == 16  # a 4 x 4 square: half the side
    assert out[2:6, 2:6].eq(127).all()


def semi_config(**semi) -> RunConfig:
    return config_from_dict({"data": {"dataset": "semi", "image_size": 8, "batch_size": 2, "workers": 0},
                             "semi": semi})


def test_a_registry_unlabeled_folder_becomes_the_unlabelled_split_and_survives_the_hand_off(
        with_unlabeled, tmp_path):
    _, index = resolve_dataset(semi_config(method="fixmatch", mu=2), str(with_unlabeled))
    unlabeled = index.splits["unlabeled"]
    assert len(unlabeled) == 20 and set(unlabeled.labels.tolist()) == {-1}
    assert sum(p.startswith("unlabeled/more/") for p in unlabeled.paths) == 10
    index.save(tmp_path / "index")
    assert IndexTable.load(tmp_path / "index").splits["unlabeled"] == unlabeled  # what the workers read
    assert "unlabeled" not in resolve_dataset(semi_config(), str(with_unlabeled))[1].splits  # not read


def test_pack_all_packs_the_unlabeled_split_too_and_fixmatch_reads_it_from_shards(with_unlabeled, tmp_path):
    """`datasets pack --split all` packs an entry's unlabeled folder as the split `unlabeled` (labels -1,
    `.cls` "-1", no synset), which the packed entry names like any other; its images decode."""
    import tarfile

    from conftest import last_json

    from ddp_cli.data.pipeline.loaders import open_reader, read_row
    from ddp_cli.data.sources.shards import read_samples

    packed = tmp_path / "packed"
    out = last_json(ddp_in_process("datasets", "pack", "semi", "--to", str(packed), "--registry",
                                   str(with_unlabeled), "--json"))
    assert {name: split["images"] for name, split in out["splits"].items()} == {
        "train": 18, "val": 9, "unlabeled": 20}
    samples = read_samples(fsspec.filesystem("file"), str(packed), "unlabeled")
    assert sorted(samples.path) == sorted(f"unlabeled/{'more/' if i % 2 else ''}u{i}.png" for i in range(20))
    with tarfile.open(packed / "unlabeled-000000.tar") as tar:
        member = tar.getmembers()[1]
        assert member.name.endswith(".cls") and tar.extractfile(member).read() == b"-1"
        assert json.loads(tar.extractfile(tar.getmembers()[2]).read())["synset"] == ""
    (tmp_path / "reg").mkdir()
    packed_entry = {"name": "semi", "layout": "shards", "unlabeled": "unlabeled",
                    "storage": {"driver": "FileSystem", "path": str(packed)}}
    registry = write_registry(tmp_path / "reg", [packed_entry])
    entry, index = resolve_dataset(semi_config(method="fixmatch", mu=2), str(registry))
    unlabeled = index.splits["unlabeled"]
    assert len(unlabeled) == 20 and set(unlabeled.labels.tolist()) == {-1}
    assert read_row(open_reader(*entry.open(), unlabeled), unlabeled, 7).size == (12, 12)


def test_the_labelled_subset_is_the_same_on_every_rank_at_any_loader_count_and_when_rebuilt(with_unlabeled):
    cfg = semi_config(method="fixmatch", labels_per_class=2, mu=2)
    entry, index = resolve_dataset(cfg, str(with_unlabeled))
    fs, root = entry.open()

    def labelled(rank: int, world: int, workers: int) -> Split:
        loaders = build_semi_loaders(resolved(cfg, loader_workers=workers), fs, root, index, rank, world,
                                     pin_memory=False)
        return loaders.train.dataset.dataset.split

    first = labelled(0, 1, 0)
    assert len(first) == 6 and np.bincount(first.labels).tolist() == [2, 2, 2]
    assert all(labelled(*where) == first for where in ((0, 2, 0), (1, 2, 1), (0, 1, 1)))


def test_the_unlabelled_loader_yields_both_views_of_images_nobody_labelled(with_unlabeled):
    cfg = semi_config(method="fixmatch", mu=2)
    entry, index = resolve_dataset(cfg, str(with_unlabeled))
    loaders = build_semi_loaders(resolved(cfg), *entry.open(), index, 0, 1, pin_memory=False)
    batch = next(iter(loaders.unlabelled))
    assert batch.images.shape == (4, 2, 8, 8, 3) and batch.labels.tolist() == [-1] * 4
    assert not torch.equal(batch.images[:, 0], batch.images[:, 1])  # weak and strong differ


def test_the_dry_run_refuses_what_the_data_set_cannot_give_in_one_line(with_unlabeled, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[data]\ndataset = "semi"\nimage_size = 8\nbatch_size = 2\n'
                      '[model]\nname = "resnet_tiny"\n[distributed]\nnproc_per_node = 1\n')
    refusals = {
        ("semi.labels_per_class=7",): "semi.labels_per_class: class 0 of the train split has 6 images, fewer "
                                      "than 7; lower semi.labels_per_class",
        ("semi.method=fixmatch", "semi.mu=11"): "semi.mu: the 20 unlabelled images are fewer than one step "
                                                "takes (world size 1 x batch_size 2 x mu 11); lower semi.mu "
                                                "or data.batch_size"}
    for keys, line in refusals.items():
        result = ddp_in_process("train", str(config), "--registry", str(with_unlabeled), "--dry-run",
                                *(arg for key in keys for arg in ("--set", key)))
        assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(line), result.stderr
    plan = ddp_in_process("train", str(config), "--registry", str(with_unlabeled), "--dry-run", "--json",
                          "--set", "semi.method=fixmatch", "--set", "semi.mu=2")
    semi = json.loads(plan.stdout)["semi"]
    assert (semi["labelled_images"], semi["unlabelled_images"], semi["unlabelled_per_step"]) == (18, 20, 4)
    assert semi["unlabelled_from"] == "the registry's unlabeled split"
    assert semi["strong"][-2:] == ["RandAugment(num_ops=2, magnitude=random 1-30)", "Cutout(up to 0.5 of the "
                                   "side, grey)"]
    # the keys the resolve pass fitted to the method, each with its reason; none where the config sets them
    fitted = semi["recipe_for_the_method"]
    assert fitted.keys() == {"optim.label_smoothing", "train.ema_decay"}
    assert fitted["optim.label_smoothing"].startswith("0.0 (off under fixmatch: smoothing caps the")
    assert json.loads(plan.stdout)["recipe"]["label_smoothing"] == 0.0
    sets = ("semi.method=softmatch", "semi.mu=2", "optim.label_smoothing=0.1", "train.ema_decay=0.99")
    given = ddp_in_process("train", str(config), "--registry", str(with_unlabeled), "--dry-run", "--json",
                           *(arg for key in sets for arg in ("--set", key)))
    fitted = json.loads(given.stdout)["semi"]["recipe_for_the_method"]
    assert fitted.keys() == {"semi.stats_momentum"}
    assert fitted["semi.stats_momentum"].startswith("0.99 (1 - 1/100")


def test_ddp_report_summarises_and_draws_fixmatch_s_curves(tmp_path):
    import matplotlib.pyplot as plt

    from ddp_cli.observe.report import figure, summarize

    window = {"sup_loss": 1.0, "unsup_loss": 0.0, "mask_rate": 0.0, "pseudo_label_top1": None}
    records = [{"split": "train", "epoch": 1, "step": 5, "loss": 1.0, "lr": 0.1, **window},
               {"split": "val", "epoch": 1, "step": 5, "loss": 1.0, "top1": 0.5, "top5": 0.9},
               {"split": "semi", "epoch": 1, "step": 5, **window,
                "mask_rate": 0.25, "pseudo_label_top1": 0.75}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert summarize(tmp_path)["semi"] == {"mask_rate": 0.25, "pseudo_label_top1": 0.75}
    loss_ax, acc_ax = figure(tmp_path).axes[:2]
    assert {line.get_label() for line in loss_ax.lines} >= {"supervised (window)", "unlabelled (window)"}
    assert {line.get_label() for line in acc_ax.lines} >= {"mask rate", "pseudo-label top-1"}
    plt.close("all")
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[1]) + "\n")  # a supervised run: as before
    assert "semi" not in summarize(tmp_path)


@pytest.mark.parametrize(("signals", "label"), [
    ({"freematch_tau": 0.6, "class_thresholds": [0.6, 0.3]}, "FreeMatch tau"),
    ({"softmatch_mu": 0.7, "softmatch_sigma": 0.1}, "SoftMatch mu")])
def test_ddp_report_shows_freematch_s_and_softmatch_s_own_statistics(tmp_path, signals, label):
    import matplotlib.pyplot as plt

    from ddp_cli.observe.report import figure, summarize

    window = {"sup_loss": 1.0, "unsup_loss": 0.0, "mask_rate": 0.5, "pseudo_label_top1": 0.75}
    records = [{"split": "train", "epoch": 1, "step": 5, "loss": 1.0, "lr": 0.1, **window},
               {"split": "val", "epoch": 1, "step": 5, "loss": 1.0, "top1": 0.5, "top5": 0.9},
               {"split": "semi", "epoch": 1, "step": 5, **window, **signals}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert summarize(tmp_path)["semi"] == {"mask_rate": 0.5, "pseudo_label_top1": 0.75, **signals}
    acc_ax = figure(tmp_path).axes[1]
    assert label in {line.get_label() for line in acc_ax.lines}
    plt.close("all")


def test_the_trainer_batches_labelled_weak_and_strong_in_one_forward_with_the_ema_teacher(monkeypatch):
    """The real Trainer on a one-rank gloo group, FixMatch with the EMA teacher and 2 micro-steps: every
    student forward takes B labelled + 2 x mu x B views, the teacher sees the weak views, the stream's
    position moves one micro-step of every rank at a time, and the epoch's metrics come back."""
    from replicas import CLASSES, make_config

    from ddp_cli.data.pipeline.loaders import Batch, Loaders
    from ddp_cli.distributed.setup import DistContext, seed_everything
    from ddp_cli.models import build_model
    from ddp_cli.train.trainer import Trainer

    b, mu, steps, accum = 2, 3, 2, 2
    g = torch.Generator().manual_seed(0)
    labelled = [Batch(torch.randint(0, 256, (b, 8, 8, 3), dtype=torch.uint8, generator=g),
                      torch.randint(0, CLASSES, (b,), generator=g), [""] * b, [""] * b)
                for _ in range(steps * accum)]
    unlabelled = [Batch(torch.randint(0, 256, (mu * b, 2, 8, 8, 3), dtype=torch.uint8, generator=g),
                        torch.randint(-1, CLASSES, (mu * b,), generator=g), [""] * mu * b, [""] * mu * b)
                  for _ in range(steps * accum)]
    cfg = make_config({"data": {"batch_size": b, "image_size": 8}, "train": {"grad_accum": accum,
                                                                             "ema_decay": 0.5},
                       "semi": {"method": "fixmatch", "mu": mu, "threshold": 0.0, "ema_teacher": True}})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        seed_everything(cfg.seed)
        loaders = Loaders(labelled, labelled[:1], ShardSampler(steps * accum * b, 0, 1, shuffle=True,
                                                                batch_size=b, with_epoch=True),
                          unlabelled, stream(20, 0, 1, mu * b))
        trainer = Trainer(resolved(cfg, steps), DistContext(0, 1, 0, 1, torch.device("cpu"), "gloo"),
                          build_model(cfg.model, CLASSES), loaders, steps)
        sizes, taught = [], []
        trainer.model.module.register_forward_hook(lambda module, args, out: sizes.append(len(args[0])))
        monkeypatch.setattr(trainer.objective, "teacher_logits", lambda weak: (taught.append(len(weak)),
                                                                      torch.zeros(len(weak), CLASSES))[1])
        _, _, semi = trainer.train_epoch(0)
    finally:
        dist.destroy_process_group()
    assert sizes == [b + 2 * mu * b] * steps * accum and taught == [mu * b] * steps * accum
    assert semi["mask_rate"] == 1.0  # threshold 0: every pseudo-label counts
    # the stream's position: 20 // 6 = 3 micro-steps a pass
    assert trainer.objective.state_dict() == {"unlabelled_epoch": 1, "unlabelled_seen": 6,
                                              "semi_statistics": {}}


@pytest.mark.parametrize("dataset", ["packed", "hub"])
def test_an_unlabeled_split_of_packed_shards_or_parquet_loads_and_is_dealt_once_a_pass(unlabeled_elsewhere,
                                                                                        dataset):
    cfg = semi_config(method="fixmatch", mu=1).resolved({"data.dataset": dataset})
    entry, index = resolve_dataset(cfg, str(unlabeled_elsewhere))
    unlabeled = index.splits["unlabeled"]
    assert len(unlabeled) == UNLABELLED_IMAGES and set(unlabeled.labels.tolist()) == {-1}
    assert len(index.splits["train"]) == 4 and set(index.splits["train"].labels.tolist()) == {0, 1}
    fs, root = entry.open()
    dealt = []
    for rank in range(2):
        loaders = build_semi_loaders(resolved(cfg, world_size=2), fs, root, index, rank, 2, pin_memory=False)
        batches = iter(loaders.unlabelled)
        for _ in range(3):  # a pass: 12 images in 3 micro-steps of 2 ranks x 2
            batch = next(batches)
            assert batch.images.shape == (2, 2, 8, 8, 3) and batch.labels.tolist() == [-1, -1]
            assert list(batch.skipped) == ["", ""] and list(batch.errors) == ["", ""]  # each image read
            assert batch.images.float().std() > 0  # no blank stand-in
        stream = iter(loaders.unlabelled_stream)
        dealt += [next(stream) for _ in range(3 * 2)]
    assert sorted(index for index, _, _ in dealt) == list(range(UNLABELLED_IMAGES))  # once each, pass 0
    assert {epoch for _, epoch, _ in dealt} == {0}


def test_with_gpu_decode_the_unlabelled_views_reach_the_rank_deferred_and_fixmatch_trains_on_them(tmp_path):
    """data.decode = "gpu" (here on the CPU stand-in): the unlabelled loader hands over each JPEG once with
    both views' plans; the rank renders them (weak, strong) and FixMatch's one forward takes them in that
    order: pseudo-labels from the weak views, the loss on the strong ones."""
    from torch import nn

    from ddp_cli.data.pipeline.device_decode import DeferredBatch
    from ddp_cli.data.pipeline.transforms import normalising, to_model_input
    from ddp_cli.train.objectives import FixMatch, on_device

    root = tmp_path / "data"
    make_imagefolder(root, per_class=6, size=12)
    (root / "unlabeled").mkdir()
    for i in range(20):
        image(i, i % 3, 16).save(root / "unlabeled" / f"u{i}.jpg", quality=90)
    registry = write_registry(tmp_path, [{"name": "semi", "layout": "imagefolder", "unlabeled": "unlabeled",
                                          "storage": {"driver": "FileSystem", "path": str(root)}}])
    data = {"dataset": "semi", "image_size": 8, "batch_size": 2, "workers": 0, "decode": "gpu"}
    semi = {"method": "fixmatch", "mu": 2, "threshold": 0.0}
    cfg = resolved(config_from_dict({"data": data, "semi": semi}))
    entry, index = resolve_dataset(cfg, str(registry))
    loaders = build_semi_loaders(cfg, *entry.open(), index, 0, 1, pin_memory=False)
    objective = FixMatch(cfg, loaders, torch.device("cpu"), "fp32", None)
    (micro,) = objective.micro_batches([next(iter(loaders.train))])
    deferred = micro[1].images
    assert isinstance(deferred, DeferredBatch) and deferred.views == 2 and len(deferred.rows) == 4
    labelled, unlabelled = on_device(micro, torch.device("cpu"))
    views = unlabelled.images
    assert views.shape == (4, 2, 8, 8, 3) and not torch.equal(views[:, 0], views[:, 1])
    torch.manual_seed(0)
    model, seen = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3)), []
    model.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    loss, sums = objective.loss(model, (labelled, unlabelled), step=0)
    x = to_model_input(torch.cat([labelled.images, views[:, 0], views[:, 1]]), torch.device("cpu"),
                       cfg.model.channels_last, normalising(cfg.data))
    assert len(seen) == 1 and torch.equal(seen[0], x)  # labelled, weak views, strong views
    want = fixmatch_loss(model(x), labelled.labels, unlabelled.labels, cfg.semi, objective.loss_fn)
    assert torch.equal(loss, want[0]) and torch.equal(sums, want[1]) and sums[3] == 4
