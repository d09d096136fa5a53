"""FixMatch's loss (Sohn et al. 2020) on one forward pass of labelled, weak and strong images, and the
rule that turns the weak views into pseudo-labels (FreeMatch's and SoftMatch's rules: adaptive.py).

The model sees [labelled; weak views; strong views] as one batch (BatchNorm's
statistics over all of them, as the paper). Each weak view's softmax (of its
logits / temperature, without gradient; or the EMA teacher's) gives a
pseudo-label and a weight; the strong view of the same image is trained
toward that pseudo-label with that weight. FixMatch's weight is a mask: 1 where
the confidence reaches the threshold, else 0:

    loss = CE(labelled) + lambda_u x mean over all unlabelled of weight x CE(strong, pseudo-label) + extra

The mean is over every unlabelled image, masked or not (the paper's), so each
rank's loss is a mean over equal counts and DDP's gradient average is the
loss of the whole global batch, as one process would compute it. `extra` is
the rule's own term (FreeMatch's fairness loss; none for FixMatch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ddp_cli.config import SemiConfig

# the epoch's running sums a semi-supervised step adds to (after the loss sum and step count): the weight
# sums ("masked") are weighted counts where the rule weighs images softly (SoftMatch)
SUMS = ("sup_loss", "unsup_loss", "masked", "unlabelled", "pseudo_correct", "pseudo_known")


class Rule(Protocol):
    """How a method turns the weak views' probabilities into pseudo-labels and their weights."""

    def select(self, probs: torch.Tensor,
               strong: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(pseudo-labels, weights in [0, 1], an extra loss term or None) of a micro-batch: `probs` the weak
        views' (no gradient), `strong` the strong views' logits (with gradient)."""
        ...

    def signals(self) -> dict[str, Any]:
        """Its statistics as they stand, for the metrics rows (a host read: at a record only)."""
        ...

    def state_dict(self) -> dict[str, list[float]]: ...

    def load_state_dict(self, state: dict[str, list[float]]) -> None: ...


class Threshold:
    """FixMatch's rule: the most probable class, kept where its probability reaches `semi.threshold`."""

    def __init__(self, semi: SemiConfig) -> None:
        self.threshold = semi.threshold

    def select(self, probs: torch.Tensor,
               strong: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        confidence, labels = probs.max(dim=1)
        return labels, (confidence >= self.threshold).float(), None

    def signals(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, list[float]]:
        return {}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        pass


def weak_probs(weak_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The weak views' class probabilities at `temperature`, without gradient, in fp32."""
    return torch.softmax(weak_logits.detach().float() / temperature, dim=1)


def pseudo_labels(weak_logits: torch.Tensor, temperature: float,
                  threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(pseudo-labels, mask): the weak view's most probable class and whether it is confident enough."""
    confidence, labels = weak_probs(weak_logits, temperature).max(dim=1)
    return labels, confidence >= threshold


def fixmatch_loss(logits: torch.Tensor, labels: torch.Tensor, hidden: torch.Tensor, semi: SemiConfig,
                  supervised: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  teacher_logits: torch.Tensor | None = None,
                  rule: Rule | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, sums) of one forward pass over B labelled then mu x B weak then mu x B strong images.

    `hidden`: the unlabelled images' true labels (-1 where unknown), used only for the sums;
    `teacher_logits`: the weak views' logits from the EMA teacher (else the model's own);
    `rule`: the method's (FixMatch's threshold when None)."""
    b = len(labels)
    weak, strong = logits[b:].float().chunk(2)
    sup = supervised(logits[:b], labels)
    probs = weak_probs(weak if teacher_logits is None else teacher_logits, semi.temperature)
    pseudo, weight, extra = (rule or Threshold(semi)).select(probs, strong)
    unsup = (F.cross_entropy(strong, pseudo, reduction="none") * weight).mean()
    known = (hidden >= 0).float() * weight
    # the count as a fill on the device: a tensor made on the host would be a blocking copy on a GPU
    counts = [weight.sum(), torch.full((), len(weight), device=weight.device),
              (known * (pseudo == hidden)).sum(), known.sum()]
    sums = torch.stack([sup.detach().double(), unsup.detach().double(),
                        *(count.to(sup.device, torch.float64) for count in counts)])
    loss = sup + semi.lambda_u * unsup
    return (loss if extra is None else loss + extra), sums


def summary(sums: list[float], steps: float) -> dict[str, float | None]:
    """The metrics of summed `SUMS` over `steps` micro-steps: mean losses, the unlabelled images' mean
    weight (FixMatch's: the share above the threshold), and the pseudo-labels' accuracy among those,
    weighted alike (None where no label is known)."""
    sup, unsup, masked, unlabelled, correct, known = sums
    return {"sup_loss": sup / max(steps, 1), "unsup_loss": unsup / max(steps, 1),
            "mask_rate": masked / max(unlabelled, 1), "pseudo_label_top1": correct / known if known else None}
