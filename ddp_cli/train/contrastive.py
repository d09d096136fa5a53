"""SimCLR's loss over the global batch, and the features' validation (pretrain.method = "simclr").

NT-Xent (Chen et al. 2020): each view's cross-entropy of its cosine similarities
(over the temperature) to every other view of the step, its image's other view
the target. The negatives are the whole global batch's: each rank's projections
are all-gathered (`gathered`, with a backward that sums every rank's gradient for
them), each rank's loss is the mean over its own views, and DDP's mean of the
gradients is then the gradient of the mean over every view, as one process
with the global batch computes it.

The classifier is untrained, so validation measures the features: each val
image is classified by the nearest class mean of the val features (cosine), its
own feature left out of its class's mean; the class sums are summed across
ranks, so every image counts once at any world size, and the similarities (over
the temperature) are the logits EvalTotals counts as any classifier's.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp_cli.data.pipeline.loaders import requested, skipped_files
from ddp_cli.data.pipeline.transforms import Norm
from ddp_cli.distributed.setup import queued_copy
from ddp_cli.models.projection import projected_classifier
from ddp_cli.train.inference import logits_by_batch, raise_bad_images
from ddp_cli.train.metrics import EvalTotals

NO_CENTROID = -2.0  # the similarity to a class with no other image: below any cosine


class Gathered(torch.autograd.Function):
    """Every rank's rows, in rank order; backward: the sum of every rank's gradient for this rank's rows."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, rows.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        n = grad.shape[0] // dist.get_world_size()
        return grad[dist.get_rank() * n:(dist.get_rank() + 1) * n]


def gathered(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(every rank's rows, where this rank's begin): the rows alone outside a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows, 0
    return Gathered.apply(rows), dist.get_rank() * len(rows)


def nt_xent(projections: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, pair hits) of this rank's 2n projections, the first views of its n images then their second:
    the mean NT-Xent of its views against every view of every rank, and how many of its views have their
    pair as the most similar (SimCLR's contrastive accuracy)."""
    z = F.normalize(projections.float(), dim=1)
    everyone, offset = gathered(z)
    rows = torch.arange(len(z), device=z.device)
    own = rows + offset
    half = len(z) // 2
    pair = own + torch.where(rows < half, half, -half)
    itself = torch.full((), float("-inf"), device=z.device)  # a fill on the device, no copy from the host
    similarity = (z @ everyone.T / temperature).index_put((rows, own), itself)
    hits = (similarity.detach().argmax(dim=1) == pair).sum()
    return F.cross_entropy(similarity, pair), hits


class Features:
    """The input of a pretrain model's classifier at each forward (its pooled features), caught by a hook
    while inside."""

    def __init__(self, model: nn.Module) -> None:
        self.classifier = projected_classifier(model)
        self.caught: torch.Tensor | None = None

    def __enter__(self) -> Features:
        self.handle = self.classifier.register_forward_hook(self.catch)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()

    def catch(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        self.caught = F.normalize(inputs[0].float(), dim=1)


@torch.no_grad()
def centroid_evaluate_each(models: Sequence[nn.Module], loader, device: torch.device, precision: str,
                           channels_last: bool, bad: set[str] | None, norm: Norm,
                           temperature: float) -> list[EvalTotals]:
    """Each model's nearest-class-mean top-k, loss and confusion matrix over the val split (see the
    module's docstring), summed across ranks; under "skip" a bad image's stand-in counts nowhere."""
    kept: list[list[torch.Tensor]] = [[] for _ in models]
    labels, keeps, seen = [], [], 0
    with ExitStack() as stack:
        hooks = [stack.enter_context(Features(model)) for model in models]
        for _, logits, batch in logits_by_batch(models, loader, device, precision, channels_last, norm=norm):
            raise_bad_images(batch.errors)
            seen = logits[0].shape[1]
            for features, hook in zip(kept, hooks, strict=True):
                features.append(hook.caught)
            labels.append(batch.labels.to(device, non_blocking=True))
            keeps.append(queued_copy(requested(batch.skipped), device))
            if bad is not None:
                bad.update(skipped_files(batch.skipped))
    classes = class_count(seen, device)
    y = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long, device=device)
    keep = torch.cat(keeps) if keeps else torch.zeros(0, dtype=torch.bool, device=device)
    every = []
    for features in kept:
        f = torch.cat(features) if features else torch.zeros(0, 1, device=device)
        totals = EvalTotals(device)
        totals.add(centroid_logits(f, y, keep, classes, temperature), y, keep)
        totals.reduce()
        every.append(totals)
    return every


def class_count(seen: int, device: torch.device) -> int:
    """The classes, agreed by every rank (one with no val image saw none)."""
    count = torch.tensor(seen, device=device)
    if dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def centroid_logits(features: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor, classes: int,
                    temperature: float) -> torch.Tensor:
    """Each image's cosine similarity to every class's mean feature, its own left out of its class's, over
    the temperature. `features` are unit vectors; the class sums are over every rank's kept images (all-
    reduced); a mean's direction is its sum's, so for image i and its class: f.(S - f) = f.S - 1 and
    |S - f|^2 = |S|^2 - 2 f.S + 1. A class with no other image is NO_CENTROID away."""
    weight = keep.double()[:, None]
    width = features.shape[1]
    sums = torch.zeros(classes, width, dtype=torch.float64, device=features.device)
    sums.index_add_(0, labels, features.double() * weight)
    counts = torch.zeros(classes, dtype=torch.float64, device=features.device)
    counts.index_add_(0, labels, weight[:, 0])
    if dist.is_initialized():
        width = torch.tensor(width, device=features.device)  # a rank with no val image has no width
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        if sums.shape[1] < width:
            sums = torch.zeros(classes, int(width), dtype=torch.float64, device=features.device)
            features = features.new_zeros(0, int(width))
        dist.all_reduce(sums)
        dist.all_reduce(counts)
    own = F.one_hot(labels, classes).double() * weight  # n x classes: 1 at its class where counted
    dots = features.double() @ sums.T
    squares = (sums * sums).sum(dim=1)[None] - own * (2 * dots - 1)
    similarity = (dots - own) / squares.clamp_min(1e-24).sqrt()
    return (similarity.where(counts[None] - own > 0, NO_CENTROID) / temperature).float()
