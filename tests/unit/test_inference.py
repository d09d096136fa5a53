"""What validate and predict are built on: the flip TTA, per-input answers with errors, a checkpoint read
as a classifier (live or EMA weights), and INPUT arguments expanded into one split."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddp_cli.config import RunConfig
from ddp_cli.data.pipeline.loaders import collate
from ddp_cli.data.sources.inputs import expand_inputs, input_root
from ddp_cli.errors import ConfigError, DataError
from ddp_cli.train.checkpoint_model import load_trained
from ddp_cli.train.inference import evaluate, evaluate_each, predict

CPU = torch.device("cpu")
MEAN, STD = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])


class Images(Dataset):
    """uint8 HWC images with labels; item `bad` carries an error message instead."""

    def __init__(self, n: int, bad: int = -1) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 8, 8, 3), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(0, 4, (n,), generator=g)
        self.bad = bad

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], int(self.labels[i]), "", "truncated" if i == self.bad else ""


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(3, 5, 3), nn.Flatten(), nn.Linear(5 * 6 * 6, 4))


def by_hand(net: nn.Module, images: torch.Tensor, flip: bool) -> torch.Tensor:
    """The model's logits on normalised NCHW float images, written out independently of ddp."""
    x = ((images.float() / 255 - MEAN) / STD).permute(0, 3, 1, 2)
    with torch.no_grad():
        out = net(x)
        return (out + net(x.flip(3))) / 2 if flip else out


@pytest.mark.parametrize("tta", [False, True])
def test_flip_tta_averages_the_logits_of_the_image_and_its_mirror(tta):
    data, net = Images(10), model()
    totals = evaluate(net, DataLoader(data, batch_size=4, collate_fn=collate), CPU, "fp32", False, tta=tta,
                      keep_topk=4)
    logits = by_hand(net, data.images, flip=tta)
    nll = nn.functional.cross_entropy(logits, data.labels)
    assert totals.metrics["loss"] == pytest.approx(nll.item(), rel=1e-5)
    assert totals.metrics["top1"] == pytest.approx((logits.argmax(1) == data.labels).float().mean().item())
    probs = torch.tensor([row[3] for row in totals.kept])
    order = torch.tensor([row[2] for row in totals.kept])
    torch.testing.assert_close(probs, logits.softmax(1).gather(1, order))
    plain = evaluate(net, DataLoader(data, batch_size=4, collate_fn=collate), CPU, "fp32", False, tta=not tta)
    assert plain.metrics["loss"] != pytest.approx(totals.metrics["loss"], rel=1e-6)  # the flip matters


def test_a_model_and_its_ema_are_validated_in_one_pass_each_as_if_alone():
    """The trainer's validation of the model and its EMA reads (and decodes) the val split once."""
    data, net = Images(10), model()
    other = copy.deepcopy(net)
    with torch.no_grad():
        other[0].weight.mul_(-1)
    reads = []
    loader = DataLoader(data, batch_size=4, collate_fn=lambda items: reads.append(1) or collate(items))
    both = evaluate_each([net, other], loader, CPU, "fp32", False, topk=(1, 3))
    assert len(reads) == 3  # 10 images in batches of 4: once through
    for totals, alone in zip(both, (net, other), strict=True):
        nll = nn.functional.cross_entropy(by_hand(alone, data.images, flip=False), data.labels)
        assert totals.metrics["loss"] == pytest.approx(nll.item(), rel=1e-5)
    assert both[0].metrics["loss"] != pytest.approx(both[1].metrics["loss"])


def test_predict_answers_every_input_in_order_and_a_bad_one_with_its_error():
    data, net = Images(7, bad=3), model()
    rows = predict(net, DataLoader(data, batch_size=3, collate_fn=collate), CPU, "fp32", False, k=2)
    assert [row[0] for row in rows] == list(range(7))
    assert rows[3][1:] == ("truncated", [], [])
    expected = by_hand(net, data.images, flip=False).softmax(1).topk(2, dim=1)
    for position, error, top, probs in rows:
        if position != 3:
            assert error == "" and top == expected.indices[position].tolist()
            assert probs == pytest.approx(expected.values[position].tolist())


def checkpoint(path, ema: bool, best_metric: str = "top1") -> None:
    """A checkpoint as ddp wrote one before descriptions were kept (no format version)."""
    torch.manual_seed(0)
    from ddp_cli.models import TinyResNet

    live, average = TinyResNet(3).state_dict(), TinyResNet(3).state_dict()
    cfg = RunConfig.model_validate({"model": {"name": "resnet_tiny"}, "data": {"image_size": 32},
                                    "checkpoint": {"best_metric": best_metric}})
    torch.save({"format": 1, "model": live, "ema": {"module": average, "updates": 5} if ema else None,
                "final": {"top1": 0.5}, "final_ema": {"top1": 0.6} if ema else None,
                "config": cfg.model_dump(mode="json"), "classes": ["a", "b", "c"],
                "dataset": {"name": "d"}}, path)


def test_a_checkpoint_as_a_classifier_with_its_live_or_ema_weights(tmp_path):
    checkpoint(tmp_path / "c.pt", ema=True)
    live, ema = load_trained(tmp_path / "c.pt", "model"), load_trained(tmp_path / "c.pt", "ema")
    assert live.final == {"top1": 0.5} and ema.final == {"top1": 0.6}
    assert live.descriptions == ["a", "b", "c"]  # written before descriptions were kept: the synsets
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert not torch.equal(live.build()(x), ema.build()(x))
        torch.testing.assert_close(ema.build()(x), ema.build()(x))
    assert not live.build().training


@pytest.mark.parametrize(("best_metric", "ema", "chosen"), [
    ("ema_top1", True, "ema"),  # a run with the default EMA: best.pt judged by the EMA's top-1
    ("top1", True, "model"),  # a run that judged by the trained weights (every run before EMA by default)
    ("ema_top1", False, "model"),  # a file without the EMA's weights
])
def test_auto_weights_are_those_the_run_judged_its_best_by(tmp_path, best_metric, ema, chosen):
    checkpoint(tmp_path / "c.pt", ema=ema, best_metric=best_metric)
    trained = load_trained(tmp_path / "c.pt")
    assert trained.weights == chosen and trained.final == {"top1": 0.6 if chosen == "ema" else 0.5}


def test_ema_weights_of_a_run_without_ema_are_a_clear_error(tmp_path):
    checkpoint(tmp_path / "c.pt", ema=False)
    with pytest.raises(ConfigError, match="holds no EMA weights.*--weights model"):
        load_trained(tmp_path / "c.pt", "ema")


def test_inputs_expand_to_files_in_order_and_folders_walked_for_images(tmp_path):
    import fsspec

    (tmp_path / "a" / "deep").mkdir(parents=True)
    for name in ("a/z.jpg", "a/b.PNG", "a/deep/c.jpeg", "a/notes.txt", "single.webp"):
        (tmp_path / name).write_bytes(b"x")
    local = fsspec.filesystem("file")
    split = expand_inputs(local, "/", [str(tmp_path / "single.webp"), str(tmp_path / "a")])
    root = str(tmp_path).lstrip("/")
    assert list(split.paths) == [f"{root}/single.webp", f"{root}/a/b.PNG", f"{root}/a/deep/c.jpeg",
                                 f"{root}/a/z.jpg"]
    assert set(split.labels.tolist()) == {-1}
    with pytest.raises(DataError, match="no such file or folder"):
        expand_inputs(fsspec.filesystem("file"), "/", [str(tmp_path / "missing.jpg")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no images in this folder"):
        expand_inputs(fsspec.filesystem("file"), "/", [str(tmp_path / "empty")])


def test_input_roots_local_one_bucket_and_no_mixing():
    assert input_root(["x.jpg", "/abs/y"]) == "/"
    assert input_root(["s3://b/k1.jpg", "s3://b/folder/"]) == "s3://b"
    for mixed in (["x.jpg", "s3://b/k"], ["s3://b/k", "s3://c/k"]):
        with pytest.raises(ConfigError, match="once per bucket"):
            input_root(mixed)


def evaluate_one_image(rank: int, world_size: int) -> dict:
    """A val split of one image over two ranks: rank 1 sees none."""
    from ddp_cli.data.pipeline.sampler import ShardSampler

    data = Images(1)
    loader = DataLoader(data, batch_size=4, sampler=ShardSampler(1, rank, world_size, shuffle=False),
                        collate_fn=collate)
    totals = evaluate(model(), loader, CPU, "fp32", False, topk=(1, 3))
    return {**totals.metrics, "confusion": totals.confusion.tolist()}


@pytest.mark.processes
def test_a_rank_without_val_images_still_reduces_the_confusion_matrix():
    from ddp_cli.run.loopback import run_workers

    zero, one = run_workers(evaluate_one_image, 2)
    assert zero == one and zero["images"] == 1
    assert len(zero["confusion"]) == 4 and sum(map(sum, zero["confusion"])) == 1
