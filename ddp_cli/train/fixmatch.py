"""FixMatch's loss (Sohn et al. 2020) on one forward pass of labelled, weak and strong images.

The model sees [labelled; weak views; strong views] as one batch (BatchNorm's
statistics over all of them, as the paper). Each weak view's softmax (of its
logits / temperature, without gradient; or the EMA teacher's) gives a
pseudo-label and a confidence; the strong view of the same image is trained
toward that pseudo-label where the confidence reaches the threshold:

    loss = CE(labelled) + lambda_u x mean over all unlabelled of mask x CE(strong, pseudo-label)

The mean is over every unlabelled image, masked or not (the paper's), so each
rank's loss is a mean over equal counts and DDP's gradient average is the
loss of the whole global batch, as one process would compute it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ddp_cli.config import SemiConfig

# the epoch's running sums a FixMatch step adds to (after the loss sum and step count):
SUMS = ("sup_loss", "unsup_loss", "masked", "unlabelled", "pseudo_correct", "pseudo_known")


def pseudo_labels(weak_logits: torch.Tensor, temperature: float,
                  threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(pseudo-labels, mask): the weak view's most probable class and whether it is confident enough."""
    confidence, labels = torch.softmax(weak_logits.detach().float() / temperature, dim=1).max(dim=1)
    return labels, confidence >= threshold


def fixmatch_loss(logits: torch.Tensor, labels: torch.Tensor, hidden: torch.Tensor, semi: SemiConfig,
                  supervised: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  teacher_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, sums) of one forward pass over B labelled then mu x B weak then mu x B strong images.

    `hidden`: the unlabelled images' true labels (-1 where unknown), used only for the sums;
    `teacher_logits`: the weak views' logits from the EMA teacher (else the model's own)."""
    b = len(labels)
    weak, strong = logits[b:].float().chunk(2)
    sup = supervised(logits[:b], labels)
    pseudo, mask = pseudo_labels(weak if teacher_logits is None else teacher_logits,
                                 semi.temperature, semi.threshold)
    unsup = (F.cross_entropy(strong, pseudo, reduction="none") * mask).mean()
    known = mask & (hidden >= 0)
    # the count as a fill on the device: a tensor made on the host would be a blocking copy on a GPU
    counts = [mask.sum(), torch.full((), len(mask), device=mask.device), (known & (pseudo == hidden)).sum(),
              known.sum()]
    sums = torch.stack([sup.detach().double(), unsup.detach().double(),
                        *(count.to(sup.device, torch.float64) for count in counts)])
    return sup + semi.lambda_u * unsup, sums


def summary(sums: list[float], steps: float) -> dict[str, float | None]:
    """The metrics of summed `SUMS` over `steps` micro-steps: mean losses, the share of unlabelled images
    above the threshold, and the pseudo-labels' accuracy among those (None where no label is known)."""
    sup, unsup, masked, unlabelled, correct, known = sums
    return {"sup_loss": sup / max(steps, 1), "unsup_loss": unsup / max(steps, 1),
            "mask_rate": masked / max(unlabelled, 1), "pseudo_label_top1": correct / known if known else None}
