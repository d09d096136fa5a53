"""SimCLR's parts (pretrain.method): NT-Xent against a hand-written loop, the features' nearest-class-mean
validation against means computed image by image, exact across ranks, the projection on the model, its
views, and the config rules around it."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import UNLABELLED_IMAGES, ddp_in_process, last_json
from PIL import Image
from torch import nn

from ddp_cli.config import AugmentConfig, DataConfig, PretrainConfig, RunConfig, config_from_dict
from ddp_cli.data.pipeline.augment import replay
from ddp_cli.data.pipeline.images import open_image
from ddp_cli.data.pipeline.loaders import Batch
from ddp_cli.data.pipeline.views import ColourDistortion, contrastive_views
from ddp_cli.errors import ConfigError
from ddp_cli.models import build_model
from ddp_cli.models.projection import PROJECTION, add_projection, projected_classifier
from ddp_cli.models.weights import select_weights, without_projection
from ddp_cli.run.loopback import run_workers
from ddp_cli.train.contrastive import NO_CENTROID, centroid_logits, nt_xent
from ddp_cli.train.objectives import SimCLR
from tests.resolved import resolved
from tests.unit.test_augment import jpeg, photo

SIMCLR = {"pretrain": {"method": "simclr"}, "data": {"image_size": 16}, "model": {"name": "resnet_tiny"}}


def test_nt_xent_is_each_view_s_cross_entropy_toward_its_pair_against_every_other_view():
    g = torch.Generator().manual_seed(0)
    z, temperature = torch.randn(8, 5, generator=g), 0.3  # 4 images: views 0-3, their pairs 4-7
    loss, hits = nt_xent(z, temperature)
    unit = [v / v.norm() for v in z]
    losses, right = [], 0
    for i in range(8):
        pair = (i + 4) % 8
        others = [j for j in range(8) if j != i]
        logits = {j: float(unit[i] @ unit[j]) / temperature for j in others}
        losses.append(-logits[pair] + math.log(sum(math.exp(v) for v in logits.values())))
        right += max(others, key=lambda j: logits[j]) == pair
    assert loss.item() == pytest.approx(sum(losses) / 8, rel=1e-5)
    assert hits.item() == right


def test_nt_xent_of_views_that_match_their_pairs_alone_is_low_and_all_hits():
    z = torch.eye(4).repeat(2, 1)  # each image's two views equal, orthogonal to every other image's
    loss, hits = nt_xent(z, 0.1)
    assert hits.item() == 8 and loss.item() < 1e-3


VIEWS = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(5))  # 6 images' first and second views


def rank_gradient(rank: int, world_size: int) -> tuple[float, torch.Tensor]:
    """(loss, gradient of this rank's projections): its block of the 6 images, first views then second."""
    block = slice(rank * 6 // world_size, (rank + 1) * 6 // world_size)
    z = torch.cat([VIEWS[0, block], VIEWS[1, block]]).requires_grad_()
    loss, _ = nt_xent(z, 0.5)
    loss.backward()
    return loss.item(), z.grad


def test_each_rank_s_projections_get_every_rank_s_gradient_for_them_so_ddp_s_mean_is_one_process_s():
    """Rank r's loss is the mean over its own views; the gathered rows' gradients are summed back, so
    r's projections get k x the one-process gradient of the mean over every view, and DDP's mean of the
    ranks' parameter gradients is the one-process gradient."""
    (loss0, grad0), (loss1, grad1) = run_workers(rank_gradient, 2)
    loss, grad = rank_gradient(0, 1)  # rows: first views of images 0-5, then their second views
    assert (loss0 + loss1) / 2 == pytest.approx(loss, rel=1e-6)
    mine = [torch.cat([grad[0:3], grad[6:9]]), torch.cat([grad[3:6], grad[9:12]])]
    torch.testing.assert_close(grad0, 2 * mine[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad1, 2 * mine[1], rtol=1e-5, atol=1e-7)


def leave_one_out_by_hand(features, labels, keep, classes, temperature):
    """Each image's cosine to every class's mean feature over the kept images, itself left out."""
    rows = []
    for i, f in enumerate(features):
        row = []
        for c in range(classes):
            members = [j for j in range(len(features)) if labels[j] == c and keep[j] and j != i]
            row.append(NO_CENTROID if not members else
                       F.cosine_similarity(f, features[members].mean(0), dim=0).item())
        rows.append(row)
    return torch.tensor(rows) / temperature


def unit_features(n: int, width: int, seed: int) -> torch.Tensor:
    return F.normalize(torch.randn(n, width, generator=torch.Generator().manual_seed(seed)), dim=1)


def test_the_centroid_logits_leave_each_image_out_of_its_own_class_mean():
    features = unit_features(9, 4, 1)
    labels = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 0])
    keep = torch.tensor([True] * 8 + [False])  # the last: a bad file's stand-in, in no mean
    expected = leave_one_out_by_hand(features, labels, keep, 4, 0.5)  # class 3: no image; class 2: itself
    got = centroid_logits(features, labels, keep, 4, 0.5)
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-6)
    assert got[7, 2] == NO_CENTROID / 0.5 and (got[:, 3] == NO_CENTROID / 0.5).all()


FEATURES, LABELS = unit_features(10, 6, 2), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 2])


def centroid_shard(rank: int, world_size: int) -> torch.Tensor:
    """A rank's logits from its block of the ten images, the class sums reduced across ranks."""
    block = slice(rank * 5, (rank + 1) * 5) if world_size == 2 else slice(None)
    return centroid_logits(FEATURES[block], LABELS[block], torch.ones(len(LABELS[block]), dtype=torch.bool),
                           3, 0.2)


def test_every_val_image_is_judged_against_the_means_of_every_rank_s_images():
    ranks = run_workers(centroid_shard, 2)
    torch.testing.assert_close(torch.cat(ranks), centroid_shard(0, 1), rtol=1e-6, atol=1e-6)


def projected(seed: int = 0, sequential: bool = False) -> nn.Module:
    """resnet_tiny, or a model of one's own as an nn.Sequential (whose forward runs every child it has),
    with SimCLR's projection."""
    torch.manual_seed(seed)
    tiny = RunConfig().model.model_copy(update={"name": "resnet_tiny"})
    model = (nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
             if sequential else build_model(tiny, 3, 16))
    return add_projection(model, PretrainConfig(method="simclr", projection_dim=5))


@pytest.mark.parametrize("sequential", [False, True], ids=["resnet_tiny", "sequential"])
def test_the_projection_is_the_output_in_training_the_classifier_s_in_eval_and_the_classifier_frozen(
        sequential):
    model, x = projected(sequential=sequential), torch.rand(2, 3, 16, 16)
    assert model.train()(x).shape == (2, 5) and model.eval()(x).shape == (2, 3)
    classifier = projected_classifier(model)
    assert not any(p.requires_grad for n, p in classifier.named_parameters() if PROJECTION not in n)
    assert all(p.requires_grad for n, p in model.named_parameters() if PROJECTION in n)
    twin = copy.deepcopy(model)  # as the EMA copies it: the copy's hook runs the copy's projection
    with torch.no_grad():
        projected_classifier(twin).get_submodule(PROJECTION).mlp[2].bias.add_(1.0)
    assert torch.allclose(twin.train()(x), model.train()(x) + 1.0, atol=1e-5)


def test_a_model_whose_classifier_is_no_linear_is_refused_naming_the_key():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Conv2d(4, 3, 1))
    with pytest.raises(ConfigError, match="pretrain.method: .* Linear"):
        add_projection(model, PretrainConfig(method="simclr"))


def test_model_weights_from_a_pretrain_checkpoint_are_its_features_and_initial_classifier():
    tiny = RunConfig().model.model_copy(update={"name": "resnet_tiny"})
    trained, fresh = projected(seed=0), build_model(tiny, 3, 16)
    found = without_projection(trained.state_dict())
    assert found.keys() == fresh.state_dict().keys()
    loaded = select_weights(fresh.state_dict(), found, tiny.model_copy(update={"weights": "pre.pt"}), 3)
    fresh.load_state_dict(loaded)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in found.items())


def test_simclr_s_step_counts_its_views_and_pair_hits():
    cfg = resolved(config_from_dict(SIMCLR), 4, 1)
    model, objective = projected(), SimCLR(cfg, torch.device("cpu"), "fp32")
    views = torch.randint(0, 256, (3, 2, 16, 16, 3), dtype=torch.uint8)
    loss, sums = objective.loss(model.train(), (Batch(views, torch.zeros(3, dtype=torch.long), [""] * 3,
                                                      [""] * 3),), 0)
    assert loss.requires_grad and sums[1].item() == 6 and 0 <= sums[0].item() <= 6
    assert objective.metrics([3.0, 6.0], 1) == {"pair_top1": 0.5}


def test_the_two_views_are_two_draws_of_one_pipeline_the_same_for_the_same_seed():
    data, pretrain = DataConfig(image_size=24), PretrainConfig(method="simclr", color_strength=1.0)
    views, img = contrastive_views(data, AugmentConfig(), pretrain), open_image(jpeg(photo(64)))
    torch.manual_seed(3)
    pair = views(img)
    torch.manual_seed(3)
    assert pair.shape == (2, 24, 24, 3) and torch.equal(views(img), pair)
    assert not torch.equal(pair[0], pair[1])


def test_the_colour_distortion_is_recorded_and_replayed_as_the_live_ops_run_it():
    """Grey too: its functional is recorded (augment.RECORDED), so the drawn steps replay to the bytes
    the v2 ops give on the same draws, on PIL's kernels (the loaders) and on v2's tensor ones (the
    device's replay, data.decode = "gpu")."""
    distortion, pixels = ColourDistortion(1.0), photo(32)
    greys = 0
    for seed in range(30):
        torch.manual_seed(seed)
        steps = distortion.plan(32)
        greys += any(f.__name__ == "rgb_to_grayscale" for f, _ in steps[0])
        torch.manual_seed(seed)
        live = torch.from_numpy(np.array(distortion.on_image(Image.fromarray(pixels.numpy()))))
        assert torch.equal(distortion.apply(pixels.clone(), steps), live), seed
        torch.manual_seed(seed)
        live = distortion.on_image(pixels.permute(2, 0, 1))
        assert torch.equal(replay(pixels.permute(2, 0, 1), steps[0]), live), seed
    assert greys > 0


def test_report_gives_simclr_s_last_pair_accuracy_and_draws_its_curve(tmp_path):
    import json

    import matplotlib.pyplot as plt

    from ddp_cli.observe.report import figure, summarize
    from tests.unit.test_served_weights import make_run

    run = make_run(tmp_path / "run", "top1", ema=False)
    with (run / "metrics.jsonl").open("a") as out:
        for epoch, share in ((1, 0.2), (2, 0.5), (3, 0.6)):
            out.write(json.dumps({"split": "pretrain", "epoch": epoch, "step": 4 * epoch,
                                  "pair_top1": share}) + "\n")
    assert summarize(run)["pretrain"] == {"pair_top1": 0.6}
    assert "pretrain" not in summarize(make_run(tmp_path / "plain", "top1"))
    fig = figure(run)
    curves = {line.get_label(): list(line.get_ydata()) for line in fig.axes[1].get_lines()}
    assert curves["pair top-1 (SimCLR)"] == [0.2, 0.5, 0.6]
    plt.close(fig)


def test_validate_predict_and_export_refuse_a_pretrain_checkpoint_naming_model_weights(tmp_path):
    from ddp_cli.train.checkpoint_model import load_trained

    model = projected()
    cfg = config_from_dict(SIMCLR)
    torch.save({"format": 1, "model": model.state_dict(), "ema": None, "final": {"top1": 0.5},
                "config": cfg.model_dump(mode="json"), "classes": ["a", "b", "c"], "dataset": {"name": "d"}},
               tmp_path / "c.pt")
    with pytest.raises(ConfigError, match="pretrain.method.*model.weights = this file"):
        load_trained(tmp_path / "c.pt")


def test_data_decode_auto_times_simclr_s_batches_of_two_views():
    """The decode probe (data.decode = "auto") times the run's own train batches: under pretrain.method,
    N x 2 views each."""
    from ddp_cli.data.pipeline.decode_probe import time_path
    from ddp_cli.data.pipeline.transforms import normalising

    views = torch.randint(0, 256, (3, 2, 8, 8, 3), dtype=torch.uint8)
    batches = [Batch(views, torch.zeros(3, dtype=torch.long), [""] * 3, [""] * 3)] * 3
    timed = time_path(batches, 2, torch.device("cpu"), True, normalising(DataConfig()))
    assert timed.images == 6 and timed.seconds > 0


class ValBatches:
    """A val loader as `logits_by_batch` reads one: its batches, and the split positions its sampler
    hands out."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches, self.sampler = batches, range(sum(len(b.labels) for b in batches))

    def __iter__(self):
        return iter(self.batches)


def test_the_features_validation_reads_the_classifier_s_input_and_counts_no_stand_in():
    """centroid_evaluate_each: the hooked features of each val image (not the logits), the nearest
    leave-one-out class mean, a bad file's stand-in in no mean and no count, the run's bad files kept."""
    from ddp_cli.data.pipeline.transforms import model_input, normalising
    from ddp_cli.train.contrastive import centroid_evaluate_each

    model, norm = projected().eval(), normalising(DataConfig())
    g = torch.Generator().manual_seed(7)
    images = torch.randint(0, 256, (8, 16, 16, 3), dtype=torch.uint8, generator=g)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    skipped = [""] * 7 + ["bad.jpg"]
    loader = ValBatches([Batch(images[:5], labels[:5], skipped[:5], [""] * 5),
                         Batch(images[5:], labels[5:], skipped[5:], [""] * 3)])
    bad: set[str] = set()
    (totals,) = centroid_evaluate_each([model], loader, torch.device("cpu"), "fp32", False, bad, norm, 0.2)
    caught = []
    head = projected_classifier(model).register_forward_hook(lambda m, i, o: caught.append(i[0]))
    with torch.no_grad():
        model(model_input(images, False, norm))
    head.remove()
    features, keep = F.normalize(caught[0], dim=1), torch.tensor([True] * 7 + [False])
    expected = leave_one_out_by_hand(features, labels, keep, 3, 0.2)
    right = (expected.argmax(dim=1) == labels)[keep].sum().item()
    assert totals.metrics["images"] == 7 and bad == {"bad.jpg"}
    assert totals.metrics["top1"] == pytest.approx(right / 7)
    loss = F.cross_entropy(expected[keep].float(), labels[keep]).item()  # the means: kept images only
    assert totals.metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert totals.confusion.sum().item() == 7


@pytest.mark.parametrize("dataset", ["packed", "hub"])
def test_simclr_reads_the_train_split_then_the_registry_s_unlabeled_split_each_image_once_an_epoch(
        unlabeled_elsewhere, dataset):
    from ddp_cli.data.index_build import resolve_dataset
    from ddp_cli.data.pipeline.semi import build_semi_loaders

    cfg = config_from_dict({**SIMCLR, "data": {"dataset": dataset, "image_size": 8, "batch_size": 2,
                                               "workers": 0}})
    entry, index = resolve_dataset(cfg, str(unlabeled_elsewhere))
    train, unlabeled = index.splits["train"], index.splits["unlabeled"]
    images = len(train) + UNLABELLED_IMAGES  # 4 + 12: 4 steps of 2 ranks x 2
    dealt = []
    for rank in range(2):
        loaders = build_semi_loaders(resolved(cfg, world_size=2), *entry.open(), index, rank, 2, False)
        assert loaders.unlabelled is None and loaders.train.dataset.dataset.split == train.joined(unlabeled)
        for batch in loaders.train:
            assert batch.images.shape == (2, 2, 8, 8, 3) and list(batch.errors) == ["", ""]
            assert batch.images.float().std() > 0  # each image read, no blank stand-in
        dealt += [index for index, _, _ in loaders.train_sampler]
    assert sorted(dealt) == list(range(images))


def test_the_dry_run_says_how_many_images_simclr_reads_and_from_where(with_unlabeled, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[data]\ndataset = "semi"\nimage_size = 8\nbatch_size = 2\n[pretrain]\nmethod = '
                      '"simclr"\n[model]\nname = "resnet_tiny"\n[distributed]\nnproc_per_node = 1\n')
    plan = last_json(ddp_in_process("train", str(config), "--registry", str(with_unlabeled), "--dry-run",
                                    "--json"))
    assert (plan["pretrain"]["images"], plan["steps_per_epoch"]) == (18 + 20, 19)
    assert plan["pretrain"]["images_from"] == "the train split, then the registry's unlabeled split"
    registry = with_unlabeled.read_text().replace('unlabeled = "unlabeled"', "")
    with_unlabeled.write_text(registry)
    plan = last_json(ddp_in_process("train", str(config), "--registry", str(with_unlabeled), "--dry-run",
                                    "--json"))
    assert (plan["pretrain"]["images"], plan["pretrain"]["images_from"]) == (18, "the train split")
