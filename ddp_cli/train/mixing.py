"""MixUp and CutMix on the device, per batch, so that k ranks mix exactly as one process does.

Pairing. torchvision.transforms.v2's MixUp and CutMix mix image i with image
i-1 (`roll(1)`): one cycle through the whole batch, which runs from one rank's
block into the next, so no rank's batch could mix as the global batch does.
Here image j's partner is j XOR 1: each adjacent pair mixes both ways. The
sampler deals each global batch in blocks (data/sampler.py), so with an even
per-rank batch every pair lies on one rank, and one process with the global
batch makes the very same pairs. With an odd batch the last image is its own
partner (mixing it with itself leaves it as it is), and the pairs of k ranks
are no longer those of one process.

Randomness. One draw per optimisation step, from a generator seeded by (seed,
step): the same on every rank, in the single process and after a resume, and
shared by the step's micro-batches. Whether the step mixes (mix_prob), MixUp
or CutMix (switch_prob, when both alphas are set), then v2's own
`make_params`: MixUp's lambda ~ Beta(alpha, alpha); CutMix's lambda, its box
(a uniform centre, sides sqrt(1 - lambda) of the image's, clipped at the
edges) and lambda corrected to the area the box leaves. Applying them (a
weighted sum, a pasted box) is what v2's `transform` does along roll(1); here
the same two operations go along the pairs.

Targets. Image j's target is lam * onehot(y_j) + (1 - lam) * onehot(y_partner),
weights summing to 1. nn.CrossEntropyLoss takes these probabilities as they
are, and its label smoothing, (1 - e) t + e/K, is affine in t: smoothing the
mixed target is mixing the smoothed one-hots (timm's mixup_target). So the
trainer's loss function stays the one it had.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms import v2

from ddp_cli.config import AugmentConfig, RunConfig
from ddp_cli.data.pipeline.seeds import MIXING, derived_seed


def partners(size: int, device: torch.device) -> torch.Tensor:
    """Each position's partner: j XOR 1 (an odd batch's last image is its own)."""
    return torch.arange(size, device=device).bitwise_xor(1).clamp_(max=size - 1)


@dataclass(frozen=True)
class Mix:
    """One step's mix: each image keeps `lam` of itself and takes the rest from its partner."""

    lam: float
    box: tuple[int, int, int, int] | None = None  # CutMix: (x1, y1, x2, y2), pasted from the partner

    def images(self, x: torch.Tensor) -> torch.Tensor:
        """The mixed (N, C, H, W) batch, a new tensor in `x`'s memory format."""
        partner = partners(len(x), x.device)
        if self.box is None:
            return x.mul(self.lam).add_(x[partner], alpha=1 - self.lam)
        x1, y1, x2, y2 = self.box
        out = x.clone()
        out[..., y1:y2, x1:x2] = x[partner, :, y1:y2, x1:x2]
        return out

    def targets(self, labels: torch.Tensor, classes: int) -> torch.Tensor:
        """(N, classes) mixing weights of the labels, each row summing to 1."""
        own = F.one_hot(labels, classes).float()
        return own.mul(self.lam).add_(own[partners(len(own), own.device)], alpha=1 - self.lam)


def loss_function(cfg: RunConfig) -> nn.CrossEntropyLoss:
    """The training loss, for labels and for mixed targets alike: `optim.label_smoothing` applies to both
    (smoothing a mix is mixing the smoothed one-hots, see above)."""
    return nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)


class BatchMixing:
    """The `[augment]` MixUp/CutMix of a run: `draw(step, images)` is the step's `Mix`, or None."""

    def __init__(self, cfg: AugmentConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self.mixup = v2.MixUp(alpha=cfg.mixup_alpha) if cfg.mixup_alpha else None
        self.cutmix = v2.CutMix(alpha=cfg.cutmix_alpha) if cfg.cutmix_alpha else None

    def draw(self, step: int, images: torch.Tensor) -> Mix | None:
        """Step `step`'s mix (`images` give CutMix's box its bounds); None when the step is not mixed."""
        with torch.random.fork_rng(devices=[]):  # v2 draws from the CPU's global RNG: seeded, then restored
            torch.default_generator.manual_seed(derived_seed(self.seed, step, stream=MIXING))  # not CUDA's
            if torch.rand(()) >= self.cfg.mix_prob:
                return None
            if self.cutmix and (self.mixup is None or torch.rand(()) < self.cfg.switch_prob):
                params = self.cutmix.make_params([images])
                return Mix(params["lam_adjusted"], params["box"])
            return Mix(self.mixup.make_params([images])["lam"])
