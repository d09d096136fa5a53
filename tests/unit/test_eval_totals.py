"""EvalTotals (validation top-1/top-5/loss) against an independent numpy computation."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ddp_cli.train import metrics
from ddp_cli.train.metrics import EvalTotals

CPU = torch.device("cpu")


def reference(logits: np.ndarray, target: np.ndarray) -> dict[str, np.ndarray]:
    """Per image: how many classes score strictly above the target, and how many tie with it.

    The target is surely in the top k when fewer than k-minus-its-ties score above it
    (all its ties fit too), surely out when k or more score above; in between a tie
    decides, which any order may break.
    """
    mine = logits[np.arange(len(target)), target][:, None]
    above = (logits > mine).sum(axis=1)
    ties = (logits == mine).sum(axis=1) - 1
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return {"above": above, "ties": ties, "nll": -log_softmax[np.arange(len(target)), target]}


def add(t: EvalTotals, batch, positions: list[int] | None = None) -> None:
    logits, target, keep = batch
    t.add(torch.from_numpy(logits), torch.from_numpy(target), torch.from_numpy(keep), positions)


def totals(batches) -> dict[str, float]:
    t = EvalTotals(CPU)
    for batch in batches:
        add(t, batch)
    return t.reduce()


def random_batches(rng, classes: int, sizes, levels: int | None = None):
    """Logits in [0, 1) (or drawn from `levels` values: many ties), random targets, some images dropped."""
    out = []
    for n in sizes:
        if levels:
            logits = rng.integers(0, levels, (n, classes)).astype(np.float32)
        else:
            logits = rng.standard_normal((n, classes)).astype(np.float32)
        out.append((logits, rng.integers(0, classes, n), rng.random(n) > 0.2))
    return out


def kept(batches):
    logits = np.concatenate([b[0][b[2]] for b in batches])
    target = np.concatenate([b[1][b[2]] for b in batches])
    return logits, target


@pytest.mark.parametrize("classes", [5, 10, 1000])
def test_top1_top5_and_loss_match_numpy_without_ties(classes):
    rng = np.random.default_rng(classes)
    batches = random_batches(rng, classes, [64, 1, 37])
    logits, target = kept(batches)
    ref = reference(logits, target)
    assert (ref["ties"] == 0).all()
    got = totals(batches)
    n = len(target)
    assert got["images"] == n
    assert got["top1"] == pytest.approx((ref["above"] == 0).sum() / n, abs=1e-12)
    assert got["top5"] == pytest.approx((ref["above"] < 5).sum() / n, abs=1e-12)
    assert got["loss"] == pytest.approx(ref["nll"].mean(), rel=1e-5)
    if classes == 5:
        assert got["top5"] == 1.0
    if classes == 10:  # the test discriminates: top-5 is neither top-1 nor everything
        assert 0 < got["top1"] < got["top5"] < 1.0


@pytest.mark.parametrize("classes", [8, 100])
def test_top5_with_ties_lies_between_the_sure_hits_and_the_possible_ones(classes):
    rng = np.random.default_rng(7)
    batches = random_batches(rng, classes, [200, 57], levels=4)  # 4 values: ties everywhere
    logits, target = kept(batches)
    ref = reference(logits, target)
    n = len(target)
    got = totals(batches)
    for k, key in ((1, "top1"), (5, "top5")):
        sure = ((ref["above"] + ref["ties"]) < k).sum()  # in whatever order the ties go
        possible = (ref["above"] < k).sum()
        assert sure < possible, "no straddling ties: the test would not exercise them"
        assert sure / n - 1e-12 <= got[key] <= possible / n + 1e-12, key
    assert got["loss"] == pytest.approx(ref["nll"].mean(), rel=1e-5)


def test_an_all_equal_row_and_an_exact_top5_boundary():
    """Targets 0..4 of one row where classes 0-4 score highest: all in the top 5; class 5 is sixth."""
    row = np.array([9, 8, 7, 6, 5, 4, 3, 2], dtype=np.float32)
    logits = np.stack([row] * 8)
    target = np.arange(8)
    got = totals([(logits, target, np.ones(8, dtype=bool))])
    assert got["top1"] == pytest.approx(1 / 8) and got["top5"] == pytest.approx(5 / 8)
    flat = np.zeros((3, 6), dtype=np.float32)  # every class tied: top-1 hits 1 of 6, whichever it is
    got = totals([(flat, np.array([0, 3, 5]), np.ones(3, dtype=bool))])
    assert got["loss"] == pytest.approx(np.log(6), rel=1e-6)
    assert 0 <= got["top1"] <= 1 and 0 <= got["top5"] <= 1


@pytest.mark.parametrize("classes", [2, 3, 4])
def test_fewer_than_five_classes_top5_is_every_image(classes):
    rng = np.random.default_rng(classes)
    batches = random_batches(rng, classes, [50])
    logits, target = kept(batches)
    got = totals(batches)
    assert got["top5"] == 1.0 and got["images"] == len(target)
    assert got["top1"] == pytest.approx((reference(logits, target)["above"] == 0).mean(), abs=1e-12)


def test_dropped_images_do_not_count():
    logits = np.eye(4, dtype=np.float32)[[0, 1, 2, 3]] * 5
    target = np.array([0, 1, 3, 2])  # the last two are wrong
    keep = np.array([True, True, False, False])
    got = totals([(logits, target, keep)])
    assert got["images"] == 2 and got["top1"] == 1.0


def test_any_topk_list_and_the_confusion_matrix_match_numpy():
    """--topk 1,3,10 (and the always-reported 5), the confusion matrix of top-1 predictions and the
    per-class accuracy read off it, against numpy on the same logits."""
    rng = np.random.default_rng(3)
    classes = 12
    batches = random_batches(rng, classes, [40, 7, 33])
    logits, target = kept(batches)
    t = EvalTotals(CPU, topk=(10, 3, 1))
    for lg, tg, keep in batches:
        t.add(torch.from_numpy(lg), torch.from_numpy(tg), torch.from_numpy(keep))
    got = t.reduce()
    above = reference(logits, target)["above"]
    assert sorted(k for k in got if k.startswith("top")) == ["top1", "top10", "top3", "top5"]
    for k in (1, 3, 5, 10):
        assert got[f"top{k}"] == pytest.approx((above < k).mean(), abs=1e-12), k
    expected = np.zeros((classes, classes), dtype=np.int64)
    np.add.at(expected, (target, logits.argmax(axis=1)), 1)
    assert np.array_equal(t.confusion.numpy(), expected)
    assert np.trace(expected) / expected.sum() == pytest.approx(got["top1"])
    names = [f"c{i}" for i in range(classes)]
    rows = t.per_class(names, [n.upper() for n in names])
    assert [r["images"] for r in rows] == np.bincount(target, minlength=classes).tolist()
    assert sum(r["images"] for r in rows) == got["images"] == len(target)
    for r in rows:
        mine = target == r["index"]
        assert r["top1"] == (pytest.approx((logits[mine].argmax(axis=1) == r["index"]).mean())
                             if mine.any() else None)
    assert rows[4] == {"index": 4, "synset": "c4", "description": "C4", "images": rows[4]["images"],
                       "top1": rows[4]["top1"]}


def test_a_k_beyond_the_class_count_is_every_image():
    t = EvalTotals(CPU, topk=(1, 10))
    t.add(torch.randn(9, 4), torch.randint(0, 4, (9,)), torch.ones(9, dtype=torch.bool))
    assert t.reduce()["top10"] == 1.0


def test_a_batch_without_a_keep_mask_counts_every_image():
    logits, target = torch.randn(5, 4), torch.randint(0, 4, (5,))
    masked, unmasked = EvalTotals(CPU), EvalTotals(CPU)
    masked.add(logits, target, torch.ones(5, dtype=torch.bool))
    unmasked.add(logits, target)  # evaluate's batches without a bad file
    assert unmasked.reduce() == masked.reduce() and unmasked.metrics["images"] == 5
    assert torch.equal(unmasked.confusion, masked.confusion)


def test_kept_predictions_are_the_top_k_probabilities_of_counted_images_by_position():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [1.0, 0.0, 5.0]])
    t = EvalTotals(CPU, keep_topk=2)
    t.add(logits, torch.tensor([0, 1, 1]), torch.tensor([True, False, True]), positions=[10, 11, 12])
    t.reduce()
    assert [row[:3] for row in t.kept] == [(10, 0, [1, 2]), (12, 1, [2, 0])]  # position 11 was a stand-in
    probs = logits[0].softmax(0)
    assert t.kept[0][3] == pytest.approx([probs[1].item(), probs[2].item()])


class ThreadedWorld:
    """`world_size` ranks as threads of this process, with the collectives `EvalTotals.reduce` makes (in
    place of torch.distributed): every call meets the other ranks' at a barrier and computes what gloo
    computes, SUM or MAX, so a reduction with the wrong op gives the wrong numbers."""

    ReduceOp = dist.ReduceOp

    def __init__(self, world_size: int) -> None:
        self.world_size, self.barrier = world_size, threading.Barrier(world_size, timeout=30)
        self.slots: list = [None] * world_size
        self.local = threading.local()

    def is_initialized(self) -> bool:
        return True

    def get_rank(self) -> int:
        return self.local.rank

    def get_world_size(self) -> int:
        return self.world_size

    def exchange(self, value) -> list:
        """Every rank's `value`, in rank order."""
        self.slots[self.get_rank()] = value
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()  # all have read before the next call writes
        return everyone

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        stacked = torch.stack(self.exchange(tensor.clone()))
        if op == dist.ReduceOp.SUM:
            tensor.copy_(stacked.sum(0))
        elif op == dist.ReduceOp.MAX:
            tensor.copy_(stacked.max(0).values)
        else:
            raise NotImplementedError(op)

    def gather_object(self, obj, object_gather_list=None, dst: int = 0) -> None:
        everyone = self.exchange(obj)
        if self.get_rank() == dst:
            object_gather_list[:] = everyone

    def run(self, fn) -> list:
        """`fn(rank)` on every rank at once; the results in rank order, a rank's error raised here."""
        results, errors = [None] * self.world_size, []

        def rank_main(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as e:
                errors.append(e)
                self.barrier.abort()  # the other ranks stop waiting for this one

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


@pytest.mark.parametrize("images_on_rank_1", [21, 0], ids=["both-ranks-see-images", "rank-1-sees-none"])
def test_two_ranks_reduce_to_the_totals_and_confusion_matrix_of_one_process(monkeypatch, images_on_rank_1):
    """Both ranks know the class count when both saw images: its reduction must agree on it (MAX), not
    add the ranks' counts (SUM), or the confusion matrix is thrown away; a rank that saw nothing learns
    it from the other. Loss, top-k and kept predictions add up to what one process gets."""
    rng = np.random.default_rng(11)
    classes = 6
    batches = random_batches(rng, classes, [30, images_on_rank_1] if images_on_rank_1 else [30])
    positions = [list(range(30)), list(range(30, 30 + images_on_rank_1))]
    single = EvalTotals(CPU, keep_topk=2)
    for batch, where in zip(batches, positions, strict=False):
        add(single, batch, where)
    expected = single.reduce()
    world = ThreadedWorld(2)
    monkeypatch.setattr(metrics, "dist", world)

    def rank(r: int) -> EvalTotals:
        totals = EvalTotals(CPU, keep_topk=2)
        if r < len(batches):
            add(totals, batches[r], positions[r])
        totals.reduce()
        return totals

    ranks = world.run(rank)
    for totals in ranks:
        assert totals.metrics == pytest.approx(expected)
        assert torch.equal(totals.confusion, single.confusion)
        assert totals.confusion.shape == (classes, classes) and totals.confusion.sum() == expected["images"]
        assert totals.confusion.dtype == torch.int64  # counts, on the rank that saw none too
    assert ranks[0].kept == sorted(single.kept) and ranks[1].kept == []  # gathered on rank 0 only


def test_per_class_counts_and_top1_from_the_confusion_matrix_and_none_for_a_class_without_images():
    logits = torch.tensor([[5.0, 0.0, 1.0], [0.0, 5.0, 1.0], [0.0, 5.0, 1.0], [1.0, 0.0, 5.0]])
    t = EvalTotals(CPU)
    t.add(logits, torch.tensor([0, 0, 1, 0]), torch.tensor([True, True, True, False]))
    t.reduce()
    assert t.per_class(["a", "b", "c"], ["A", "B", "C"]) == [
        {"index": 0, "synset": "a", "description": "A", "images": 2, "top1": 0.5},
        {"index": 1, "synset": "b", "description": "B", "images": 1, "top1": 1.0},
        {"index": 2, "synset": "c", "description": "C", "images": 0, "top1": None},
    ]


def test_class_names_that_do_not_fit_the_matrix_are_an_error_not_a_short_table():
    t = EvalTotals(CPU)
    t.add(torch.eye(3), torch.tensor([0, 1, 2]), torch.ones(3, dtype=torch.bool))
    t.reduce()
    with pytest.raises(ValueError, match="zip"):
        t.per_class(["a", "b"], ["A", "B"])
    with pytest.raises(ValueError, match="zip"):
        t.per_class(["a", "b", "c"], ["A", "B"])


def test_kept_predictions_need_a_position_per_image():
    t = EvalTotals(CPU, keep_topk=1)
    logits, target, keep = torch.eye(3), torch.tensor([0, 1, 2]), torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="zip"):
        t.add(logits, target, keep, positions=[0, 1])
    with pytest.raises(ValueError, match="zip"):
        t.add(logits, target, keep, positions=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="zip"):
        t.add(logits, target, keep)  # no positions: nothing to write them against


def test_the_loss_is_summed_in_float64_a_huge_loss_does_not_swallow_the_small_ones():
    t = EvalTotals(CPU)
    one = torch.ones(1, dtype=torch.bool)
    t.add(torch.tensor([[0.0, 1e8]]), torch.tensor([0]), one)  # loss 1e8: float32's spacing there is 8
    t.add(torch.tensor([[0.0, 0.0]]), torch.tensor([0]), one)  # loss log 2
    assert t.reduce()["loss"] * 2 == pytest.approx(1e8 + math.log(2), abs=1e-3)


def test_one_image_is_a_whole_epoch_of_one():
    t = EvalTotals(CPU)
    t.add(torch.tensor([[0.0, 3.0]]), torch.tensor([1]), torch.ones(1, dtype=torch.bool))
    metrics = t.reduce()
    assert metrics["images"] == 1 and metrics["top1"] == 1.0
    assert metrics["loss"] == pytest.approx(math.log(1 + math.exp(-3.0)))


def test_a_rank_with_no_images_alone_reduces_to_zeros_and_an_empty_count_matrix():
    t = EvalTotals(CPU)
    assert t.reduce() == {"loss": 0.0, "top1": 0.0, "top5": 0.0, "images": 0}
    assert t.confusion.shape == (0, 0) and t.confusion.dtype == torch.int64


def test_the_totals_stay_on_their_device_whatever_torchs_default_device(monkeypatch):
    """Every tensor the totals make is on their device (on CUDA: no host copy, no all-reduce of a host
    tensor over NCCL); a default device that is not theirs, meta, shows any made on the default."""
    rng = np.random.default_rng(5)
    (batch,) = random_batches(rng, 4, [12])
    with torch.device("meta"):
        empty = EvalTotals(CPU)
        empty.reduce()
        one = EvalTotals(CPU)
        add(one, batch)
        assert one.reduce()["images"] == batch[2].sum()
    assert empty.confusion.device == CPU and one.confusion.device == CPU and one.sums.device == CPU
    world = ThreadedWorld(2)
    monkeypatch.setattr(metrics, "dist", world)

    def rank(r: int) -> EvalTotals:
        with torch.device("meta"):
            totals = EvalTotals(CPU)
            if r == 0:
                add(totals, batch)
            totals.reduce()
        return totals

    assert [t.confusion.device for t in world.run(rank)] == [CPU, CPU]
