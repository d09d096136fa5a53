"""The heart of ddp: k replicas with batch b behave as one process with batch k*b."""

from __future__ import annotations

import pytest
import torch
from replicas import make_config, train_replicas

from ddp_cli.run.loopback import run_workers
from ddp_cli.train.mixing import BatchMixing

STEPS = 4
MIXING = {"augment": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "mix_prob": 1.0, "switch_prob": 0.5},
          "optim": {"name": "sgd", "momentum": 0.9}}
# Adam divides by sqrt(v): for the few elements whose gradient is ~0, the last
# bits of the all-reduce sum decide a sign, so a handful move by ~lr/100.
OPTIMS = [({"name": "sgd", "momentum": 0.9, "nesterov": True}, 1e-5), ({"name": "adamw"}, 1e-3)]
# Each case: 2 replicas (batch b, accumulating `accum` micro-batches) and one process on the combined
# batch (2*b*accum); `batchnorm=False`: GroupNorm in its place.
CASES = {
    "sgd": (4, 1, {"optim": OPTIMS[0][0]}, True),
    "adamw": (4, 1, {"optim": OPTIMS[1][0]}, True),
    "accum": (2, 3, {"optim": {"name": "sgd", "momentum": 0.9}}, True),
    "mixing": (4, 1, MIXING, False),
    "simclr": (3, 1, {"pretrain": {"method": "simclr"}, "optim": {"name": "sgd", "momentum": 0.9}}, False),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[dict], dict]]:
    """Every case's (ranks, single process): all cases' replicas in one spawn of 2 gloo processes and all
    references in one spawn of 1, each case in a folder of its own (a spawn costs a torch import)."""
    folder = tmp_path_factory.mktemp("replicas")
    replicas, single = [], []
    for name, (batch, accum, sections, batchnorm) in CASES.items():
        replicas.append(({**sections, "data": {"batch_size": batch}, "train": {"grad_accum": accum}},
                         STEPS, str(folder / name), batchnorm))
        single.append(({**sections, "data": {"batch_size": 2 * batch * accum}}, STEPS,
                       str(folder / name / "single"), batchnorm))
    ranks = zip(*run_workers(train_replicas, 2, replicas), strict=True)
    references = run_workers(train_replicas, 1, single)[0]
    return dict(zip(CASES, zip(ranks, references, strict=True), strict=True))


def assert_same_weights(a: dict, b: dict, atol: float = 1e-5) -> None:
    """Equal up to float reduction order: every element within atol, nearly all within 1e-5."""
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=atol, msg=name)
        if a[name].is_floating_point():
            assert (a[name] - b[name]).abs().mean() < 1e-6, name


def assert_moved(run: dict) -> None:
    """Training changed the weights it really started from: else every comparison is vacuous."""
    start, end = run["start"], run["end"]
    moved = max((end[k] - v).abs().max().item() for k, v in start.items() if v.is_floating_point())
    assert moved > 1e-3, "training did not change the weights; the comparison would be vacuous"


def assert_same_start(runs: list[dict]) -> None:
    """Replicas and the reference begin from the very same weights (same seed, rank 0 broadcast)."""
    for run in runs[1:]:
        for k, v in runs[0]["start"].items():
            assert torch.equal(run["start"][k], v), k


def assert_equivalent(ranks: list[dict], reference: dict, atol: float = 1e-5) -> None:
    """The same start, real training (the weights moved), and the same end as the reference."""
    assert_same_start([*ranks, reference])
    for run in (*ranks, reference):
        assert_moved(run)
    for run in ranks:
        assert_same_weights(run["end"], reference["end"], atol)


@pytest.mark.parametrize(("optim", "atol"), [("sgd", OPTIMS[0][1]), ("adamw", OPTIMS[1][1])],
                         ids=["sgd", "adamw"])
def test_two_replicas_equal_one_process_on_the_combined_batch(runs, optim, atol):
    ranks, single = runs[optim]
    assert_equivalent(list(ranks), single, atol)


def test_gradient_accumulation_equals_the_larger_batch(runs):
    ranks, single = runs["accum"]
    assert_equivalent(list(ranks), single)


def test_two_replicas_mix_as_one_process_on_the_combined_batch(runs):
    """MixUp and CutMix pair adjacent images with one (seed, step) draw: dealt in blocks, every pair lies
    on one rank, and one process with the combined batch makes the same pairs with the same lambdas.
    GroupNorm in place of BatchNorm: nothing else may couple the images of a batch."""
    mixing = BatchMixing(make_config(MIXING).augment, seed=0)
    kinds = {mixing.draw(step, torch.zeros(1, 3, 16, 16)).box is None for step in range(STEPS)}
    assert kinds == {True, False}, "the steps must include MixUp and CutMix"
    ranks, single = runs["mixing"]
    assert_equivalent(list(ranks), single)


def test_two_replicas_of_simclr_equal_one_process_on_the_combined_batch(runs):
    """NT-Xent's negatives are the global batch's views (all-gathered, every rank's gradient for them
    summed back): 2 ranks of 3 images train as one process on the 6. GroupNorm in place of BatchNorm."""
    ranks, single = runs["simclr"]
    assert_equivalent(list(ranks), single)
