"""FreeMatch's and SoftMatch's rules (adaptive.py): their statistics, thresholds, weights and fairness term
against a batch worked out by hand, the same statistics on every rank of a 2-rank gloo world as one
process computes over the global batch, and their round trip through a checkpoint's lists."""

from __future__ import annotations

import math
import multiprocessing

import pytest
import torch
import torch.distributed as dist
from syncs import HostSyncs

from ddp_cli.config import SemiConfig
from ddp_cli.train.adaptive import FreeMatch, SoftMatch


def rule_of(method: str, **keys) -> FreeMatch | SoftMatch:
    """The method's rule at the papers' momentum, 0.999 (a resolved config holds a number; unset, the
    resolve pass derives it from the run's steps)."""
    return (FreeMatch if method == "freematch" else SoftMatch)(SemiConfig(method=method, stats_momentum=0.999,
                                                                          **keys))


# 4 weak views of 2 classes: top probabilities 0.9, 0.6, 0.7, 0.8 (mean 0.75), classes 0, 0, 0, 1
PROBS = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.7, 0.3], [0.2, 0.8]])
# the strong views' probabilities, as logits: their classes 0, -, 1, 1 (the second one, masked out)
STRONG = torch.tensor([[0.8, 0.2], [0.5, 0.5], [0.4, 0.6], [0.1, 0.9]]).log()


def test_freematch_s_threshold_its_per_class_modulation_the_mask_and_the_fairness_term_by_hand():
    """Momentum 0.5 from tau = p~ = h~ = 1/2: tau = (0.5 + 0.75) / 2 = 0.625; p~ = ((0.5, 0.5) + the batch's
    mean (0.6, 0.4)) / 2 = (0.55, 0.45); h~ = ((0.5, 0.5) + (3/4, 1/4)) / 2 = (0.625, 0.375). Class 0's
    threshold is tau (0.625), class 1's tau x 0.45 / 0.55 = 0.511: 0.6 (class 0) is masked out, 0.8 (class
    1) kept. The fairness term: the kept strong views' histogram (1/3, 2/3) and mean (1.3/3, 1.7/3), each
    over its histogram, normalised: (1.3, 0.85) / 2.15, against p~ / h~ normalised: (0.88, 1.2) / 2.08."""
    rule = FreeMatch(SemiConfig(method="freematch", stats_momentum=0.5, fairness_weight=0.1))
    pseudo, mask, fair = rule.select(PROBS, STRONG)
    assert pseudo.tolist() == [0, 0, 0, 1] and mask.tolist() == [1, 0, 1, 1]
    state = rule.state_dict()
    assert state["tau"] == [pytest.approx(0.625)]
    assert state["p_model"] == pytest.approx([0.55, 0.45])
    assert state["label_hist"] == pytest.approx([0.625, 0.375])
    signals = rule.signals()
    assert signals["freematch_tau"] == pytest.approx(0.625)
    assert signals["class_thresholds"] == pytest.approx([0.625, 0.625 * 0.45 / 0.55])
    want = 0.1 * (0.88 / 2.08 * math.log(1.3 / 2.15) + 1.2 / 2.08 * math.log(0.85 / 2.15))
    assert fair.item() == pytest.approx(want, rel=1e-5)


def test_freematch_s_fairness_term_is_zero_where_nothing_passes_and_off_at_weight_zero():
    """Momentum 0: tau is the batch's own mean top probability, and the threshold is inclusive."""
    rule = FreeMatch(SemiConfig(method="freematch", stats_momentum=0.0))
    assert rule.select(torch.full((4, 2), 0.5), STRONG)[1].tolist() == [1, 1, 1, 1]  # 0.5 >= tau 0.5
    rule = FreeMatch(SemiConfig(method="freematch", stats_momentum=0.9))
    rule.load_state_dict({"tau": [1.0], "p_model": [0.5, 0.5], "label_hist": [0.5, 0.5]})
    _, mask, fair = rule.select(PROBS, STRONG)  # tau = 0.9 + 0.1 x 0.75 = 0.975: none passes
    assert mask.sum().item() == 0 and fair.item() == 0
    assert rule_of("freematch", fairness_weight=0).select(PROBS, STRONG)[2] is None


def test_softmatch_s_mean_variance_weights_and_distribution_alignment_by_hand():
    """Momentum 0.5 from mu = 1/2, sigma^2 = 1: the first batch is not aligned (no mean prediction yet):
    mu = (0.5 + 0.75) / 2 = 0.625, sigma^2 = (1 + 0.05 / 3) / 2 (the batch's unbiased variance), and the
    mean prediction becomes the batch's, (0.6, 0.4). Weights: 1 at or above mu, 0.6's exp(-(0.025)^2 /
    (2 sigma^2 / 4)). The second batch is aligned: each row times (1/2) / (0.6, 0.4), renormalised."""
    rule = SoftMatch(SemiConfig(method="softmatch", stats_momentum=0.5))
    pseudo, weight, extra = rule.select(PROBS, STRONG)
    var = (1 + 0.05 / 3) / 2
    assert extra is None and pseudo.tolist() == [0, 0, 0, 1]
    assert weight.tolist() == pytest.approx([1, math.exp(-0.025 ** 2 / (2 * var / 4)), 1, 1])
    state = rule.state_dict()
    assert state["mu"] == [pytest.approx(0.625)] and state["var"] == [pytest.approx(var)]
    assert state["p_model"] == pytest.approx([0.6, 0.4]) and state["batches"] == [1.0]
    assert rule.signals() == {"softmatch_mu": pytest.approx(0.625),
                              "softmatch_sigma": pytest.approx(var ** 0.5)}
    pseudo, weight, _ = rule.select(PROBS, STRONG)
    # 0.857, 0.5, 0.778, 0.857
    aligned = [max(a / 0.6, b / 0.4) / (a / 0.6 + b / 0.4) for a, b in PROBS.tolist()]
    mean = sum(aligned) / 4
    var2 = (var + sum((a - mean) ** 2 for a in aligned) / 3) / 2
    mu2 = (0.625 + mean) / 2
    assert rule.state_dict()["mu"] == [pytest.approx(mu2, rel=1e-5)]
    assert rule.state_dict()["var"] == [pytest.approx(var2, rel=1e-5)]
    assert pseudo.tolist() == [0, 0, 0, 1]  # (0.6/0.6, 0.4/0.4): a tie, the first class
    assert weight.tolist() == pytest.approx([1 if a >= mu2 else math.exp(-(a - mu2) ** 2 / (2 * var2 / 4))
                                             for a in aligned], rel=1e-5)
    off = SoftMatch(SemiConfig(method="softmatch", stats_momentum=0.5, dist_align=False))
    off.select(PROBS, STRONG)
    off.select(PROBS, STRONG)
    assert off.state_dict()["mu"] == [pytest.approx((0.625 + 0.75) / 2)]  # never aligned


@pytest.mark.parametrize("method", ["freematch", "softmatch"])
def test_the_statistics_round_trip_through_a_checkpoint_s_lists_exactly(method):
    """A rule loaded with another's state_dict (plain floats, as RunState saves them) continues exactly."""
    rules = {"freematch": FreeMatch, "softmatch": SoftMatch}
    semi = SemiConfig(method=method, stats_momentum=0.999)
    first = rules[method](semi)
    g = torch.Generator().manual_seed(0)
    batches = [torch.softmax(torch.randn(8, 3, generator=g) * 3, dim=1) for _ in range(3)]
    first.select(batches[0], batches[0].log())
    resumed = rules[method](semi)
    resumed.load_state_dict(first.state_dict())
    for probs in batches[1:]:
        a, b = first.select(probs, probs.log()), resumed.select(probs, probs.log())
        assert all(torch.equal(x, y) for x, y in zip(a[:2], b[:2], strict=True))
    assert torch.equal(first.flat, resumed.flat)
    assert rules[method](semi).state_dict() == {}  # nothing yet: RunState's default


@pytest.mark.parametrize("method", ["freematch", "softmatch"])
def test_a_rule_reads_nothing_back_to_the_host_until_a_record_or_a_save(method):
    cpu = torch.device("cpu")
    rule = rule_of(method)
    with HostSyncs(cpu) as syncs:
        for _ in range(2):  # the first makes the statistics, the second moves them
            probs = PROBS.clone().to(cpu, non_blocking=True)
            strong = STRONG.clone().to(cpu, non_blocking=True)
            pseudo, weight, extra = rule.select(probs, strong)
            (weight.sum() + (0 if extra is None else extra)).add_(1)
        assert len(syncs) == 0, syncs.report()
        rule.signals()
        assert len(syncs) > 0


def rank_batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.softmax(torch.randn(6, 3, generator=g) * 2, dim=1)


def two_ranks(rank: int, store: str, method: str, out: str) -> None:
    """A rank of a 2-process gloo world: two micro-steps of its own batch, then its statistics saved."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        rule = rule_of(method)
        for _ in range(2):
            probs = rank_batch(rank)
            rule.select(probs, probs.log())
        torch.save(rule.flat, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("method", ["freematch", "softmatch"])
def test_every_rank_holds_the_same_statistics_the_global_batch_s_as_one_process_computes(method, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = str(tmp_path / "flat")
    ranks = [ctx.Process(target=two_ranks, args=(rank, str(tmp_path / "store"), method, out))
             for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        for process in ranks:
            process.join(timeout=120)
            assert process.exitcode == 0
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
    flat = [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(2)]
    assert torch.equal(flat[0], flat[1])  # bit for bit: a resume at another world size keeps them
    one = rule_of(method)
    for _ in range(2):
        probs = torch.cat([rank_batch(0), rank_batch(1)])
        one.select(probs, probs.log())
    assert torch.allclose(flat[0], one.flat, rtol=1e-6, atol=1e-9)


def test_the_plan_names_each_method_s_rule_its_keys_and_the_signals_it_logs():
    from ddp_cli.cli.plan import rule_plan

    fix = rule_plan(SemiConfig(method="fixmatch", threshold=0.9))
    assert fix["threshold"] == 0.9 and "freematch_tau" not in fix["signals"]
    free = rule_plan(SemiConfig(method="freematch", stats_momentum=0.99, fairness_weight=0.0))
    assert (free["stats_momentum"], free["fairness_weight"]) == (0.99, 0.0) and "threshold" not in free
    assert {"freematch_tau", "class_thresholds"} <= set(free["signals"])
    soft = rule_plan(SemiConfig(method="softmatch", dist_align=False))
    assert (soft["n_sigma"], soft["dist_align"]) == (2.0, False) and "alignment" not in soft["pseudo_labels"]
    assert {"softmatch_mu", "softmatch_sigma"} <= set(soft["signals"])
