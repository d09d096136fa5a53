"""MixUp and CutMix: their statistics, what they paste and mix, the soft targets and the loss."""

from __future__ import annotations

import pytest
import torch

from ddp_cli.config import AugmentConfig, config_from_dict
from ddp_cli.data.pipeline.seeds import derived_seed
from ddp_cli.train import mixing
from ddp_cli.train.mixing import BatchMixing, Mix, loss_function, partners

SHAPE = (1, 3, 32, 32)  # the images' size is all a draw reads of them
BOTH = AugmentConfig(mixup_alpha=0.8, cutmix_alpha=1.0)


def draws(cfg: AugmentConfig, steps: int = 400, seed: int = 0) -> list[Mix | None]:
    mixing = BatchMixing(cfg, seed)
    return [mixing.draw(step, torch.zeros(SHAPE)) for step in range(steps)]


def numbered(batch: int, side: int = 8) -> torch.Tensor:
    """Image j is all j, in every channel and pixel."""
    return torch.arange(batch, dtype=torch.float32).view(-1, 1, 1, 1).expand(batch, 3, side, side).clone()


def test_partners_are_adjacent_pairs_and_an_odd_last_image_is_its_own():
    assert partners(6, torch.device("cpu")).tolist() == [1, 0, 3, 2, 5, 4]
    assert partners(5, torch.device("cpu")).tolist() == [1, 0, 3, 2, 4]


@pytest.mark.parametrize("alpha", [0.2, 1.0])
def test_mixup_lambda_is_beta_alpha_alpha(alpha):
    lams = torch.tensor([mix.lam for mix in draws(AugmentConfig(mixup_alpha=alpha), steps=3000)])
    variance = 1 / (4 * (2 * alpha + 1))  # Beta(a, a): mean 1/2, variance 1 / (4 (2a + 1))
    assert lams.mean().item() == pytest.approx(0.5, abs=0.03)
    assert lams.var().item() == pytest.approx(variance, rel=0.1)
    assert lams.min() >= 0 and lams.max() <= 1


@pytest.mark.parametrize("batch", [6, 7])
def test_mixup_weights_each_image_with_its_partner(batch):
    x, mix = numbered(batch), Mix(0.3)
    out = mix.images(x)
    expected = 0.3 * torch.arange(batch) + 0.7 * partners(batch, torch.device("cpu"))
    assert torch.allclose(out[:, 0, 0, 0], expected)
    if batch % 2:
        assert torch.equal(out[-1], x[-1])  # its own partner: unmixed


@pytest.mark.parametrize("batch", [6, 7])
def test_cutmix_pastes_the_partners_pixels_over_one_minus_lambda_of_the_image(batch):
    x = numbered(batch, side=32)
    cutmixes = [mix for mix in draws(AugmentConfig(cutmix_alpha=1.0), steps=50) if mix.lam < 1]
    assert len(cutmixes) > 40
    for mix in cutmixes:
        out = mix.images(x)
        pasted = out[:, 0] != x[:, 0]  # pixels that changed, per image
        mine = partners(batch, torch.device("cpu"))
        for j in range(batch - batch % 2):
            assert torch.equal(out[j][:, pasted[j]], x[mine[j]][:, pasted[j]])  # from the partner
            assert torch.equal(out[j][:, ~pasted[j]], x[j][:, ~pasted[j]])  # the rest its own
            assert pasted[j].float().mean().item() == pytest.approx(1 - mix.lam)  # lambda: the area kept
        x1, y1, x2, y2 = mix.box
        assert pasted[0, y1:y2, x1:x2].all() and pasted[0].sum() == (x2 - x1) * (y2 - y1)


MIXES = [Mix(0.3), Mix(0.75, (0, 0, 4, 4)), Mix(1.0)]


@pytest.mark.parametrize("mix", MIXES, ids=["mixup", "cutmix", "none"])
@pytest.mark.parametrize("batch", [6, 7])
def test_target_weights_are_the_pairs_labels_and_sum_to_one(mix, batch):
    labels = torch.tensor([0, 1, 2, 2, 4, 3, 1][:batch])
    targets = mix.targets(labels, 5)
    assert targets.shape == (batch, 5)
    assert torch.allclose(targets.sum(1), torch.ones(batch))
    mine = partners(batch, torch.device("cpu"))
    for j in range(batch):
        expected = torch.zeros(5)
        expected[labels[j]] += mix.lam
        expected[labels[mine[j]]] += 1 - mix.lam
        assert torch.allclose(targets[j], expected)


def test_mix_prob_zero_never_mixes_and_half_mixes_about_half():
    assert all(mix is None for mix in draws(AugmentConfig(mixup_alpha=1.0, mix_prob=0.0)))
    mixed = sum(mix is not None for mix in draws(AugmentConfig(mixup_alpha=1.0, mix_prob=0.5), 1000))
    assert 430 < mixed < 570
    assert all(mix is not None for mix in draws(BOTH))  # mix_prob 1


def test_switch_prob_picks_mixup_or_cutmix():
    def cutmix_share(cfg: AugmentConfig) -> float:
        return sum(mix.box is not None for mix in draws(cfg)) / 400

    assert cutmix_share(BOTH.model_copy(update={"switch_prob": 0.0})) == 0
    assert cutmix_share(BOTH.model_copy(update={"switch_prob": 1.0})) == 1
    assert cutmix_share(BOTH) == pytest.approx(0.5, abs=0.08)
    assert cutmix_share(AugmentConfig(cutmix_alpha=1.0, switch_prob=0.0)) == 1  # the only one on
    assert cutmix_share(AugmentConfig(mixup_alpha=1.0, switch_prob=1.0)) == 0


def test_the_same_seed_and_step_is_the_same_mix_on_every_rank():
    """Each rank draws alone: whatever its own RNG did before, (seed, step) decides, and the draw leaves
    that RNG as it was (data order, dropout)."""
    torch.manual_seed(1)
    here = draws(BOTH, steps=20)
    torch.rand(100)  # another rank's RNG, elsewhere
    state = torch.get_rng_state()
    there = draws(BOTH, steps=20)
    assert torch.equal(torch.get_rng_state(), state)
    assert here == there
    assert len(set(here)) == 20  # every step its own
    assert draws(BOTH, steps=20, seed=1) != here


def test_the_mixes_are_drawn_from_their_own_stream_not_the_samplers_epoch_seeds():
    """Step s's draws come from (seed, s) in the mixing stream: without it they would replay the sampler's
    (seed, epoch = s) seed, the same numbers feeding two unrelated choices."""
    half = AugmentConfig(mixup_alpha=1.0, mix_prob=0.5)
    mixed = [mix is not None for mix in draws(half, steps=64)]
    replayed = [bool(torch.rand((), generator=torch.Generator().manual_seed(derived_seed(0, step))) < 0.5)
                for step in range(64)]
    assert mixed != replayed


def test_the_partner_index_is_made_on_the_batchs_device(monkeypatch):
    """On CUDA an index made on the host is copied to the GPU at every step; here, where the default device
    is the batch's, the device `partners` is asked for and, under a default device that is not the batch's
    (meta), where it makes the index show it."""
    asked = []

    def recorded(size: int, device: torch.device) -> torch.Tensor:
        asked.append(device)
        return partners(size, device)

    monkeypatch.setattr(mixing, "partners", recorded)
    images, labels = numbered(5), torch.arange(5)
    Mix(0.25).images(images), Mix(0.25, (0, 0, 4, 4)).images(images), Mix(0.25).targets(labels, 5)
    assert asked == [images.device, images.device, labels.device]
    with torch.device("meta"):
        assert partners(5, images.device).device == images.device


def test_ranks_mixing_their_blocks_equal_one_process_mixing_the_global_batch():
    x, labels = torch.randn(8, 3, 16, 16), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    for mix in draws(BOTH, steps=6):
        single = mix.images(x), mix.targets(labels, 4)
        ranks = [(mix.images(x[r:r + 4]), mix.targets(labels[r:r + 4], 4)) for r in (0, 4)]
        assert torch.equal(torch.cat([images for images, _ in ranks]), single[0])
        assert torch.equal(torch.cat([targets for _, targets in ranks]), single[1])


def smoothed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Cross-entropy against (1 - e) t + e/K, written out (timm's mixup_target and SoftTargetCrossEntropy)."""
    smooth = targets * (1 - smoothing) + smoothing / targets.shape[1]
    return -(smooth * logits.log_softmax(1)).sum(1).mean()


@pytest.mark.parametrize("augment", [{}, {"mixup_alpha": 0.8}, {"cutmix_alpha": 1.0},
                                     {"mixup_alpha": 0.8, "cutmix_alpha": 1.0}],
                         ids=["no-mixing", "mixup", "cutmix", "both"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_trainers_loss_smooths_labels_and_mixed_targets_alike(smoothing, augment):
    """The loss the Trainer builds (`loss_function`) keeps `optim.label_smoothing` whether or not MixUp or
    CutMix is on: on labels and one-hots it is the smoothed cross-entropy, and on mixed targets the
    cross-entropy against the mix of the smoothed one-hots."""
    cfg = config_from_dict({"optim": {"label_smoothing": smoothing}, "augment": augment})
    loss_fn = loss_function(cfg)
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 4, 2, 2, 1, 3])
    one_hot = Mix(1.0).targets(labels, 5)
    expected = smoothed_cross_entropy(logits, one_hot, smoothing).item()
    assert loss_fn(logits, labels).item() == pytest.approx(expected, rel=1e-6)
    assert loss_fn(logits, one_hot).item() == pytest.approx(expected, rel=1e-6)
    mixed = Mix(0.3).targets(labels, 5)
    assert torch.allclose(mixed, 0.3 * one_hot + 0.7 * one_hot[partners(6, torch.device("cpu"))])
    expected = smoothed_cross_entropy(logits, mixed, smoothing).item()
    assert loss_fn(logits, mixed).item() == pytest.approx(expected, rel=1e-6)


def test_targets_have_a_column_per_class_when_the_batch_lacks_the_last_classes():
    targets = Mix(0.3).targets(torch.tensor([0, 1, 1, 0]), 5)
    assert targets.shape == (4, 5) and not targets[:, 2:].any()
