"""The model over a loader, in split order: validation totals (`evaluate`) and top-k answers (`predict`).

Both walk `logits_by_batch`: each batch's logits, of one model or several (averaged with the
horizontally flipped image's under `tta`), with the split positions its items
came from. Loaders that shard without shuffling (`ShardSampler` for val,
PyTorch's sequential one) hand out their items in sampler order, so the
positions are read off the sampler: nothing extra travels through the loader
processes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_cli.data.pipeline.loaders import Batch, requested, skipped_files
from ddp_cli.data.pipeline.transforms import IMAGENET, Norm, to_model_input
from ddp_cli.distributed.setup import queued_copy
from ddp_cli.errors import DataError
from ddp_cli.train.metrics import DEFAULT_TOPK, EvalTotals
from ddp_cli.train.precision import autocast


def raise_bad_images(errors: Sequence[str]) -> None:
    """The dataset hands over bad files (under on_bad_image = "error") and storage failures as messages."""
    for message in errors:
        if message:
            raise DataError(message)


def logits_by_batch(models: Sequence[nn.Module], loader, device: torch.device, precision: str,
                    channels_last: bool, tta: bool = False,
                    norm: Norm = IMAGENET) -> Iterator[tuple[list[int], list[torch.Tensor], Batch]]:
    """Per batch: the items' split positions, each model's float logits, and the batch (read and
    decoded once for all of them: a run's model and its EMA are validated in one pass)."""
    for model in models:
        model.eval()
    positions = iter(loader.sampler)
    for batch in loader:
        x = to_model_input(batch.images, device, channels_last, norm)
        with autocast(device, precision):
            logits = [model(x).float() for model in models]
            if tta:
                logits = [(each + model(x.flip(3)).float()) / 2
                          for each, model in zip(logits, models, strict=True)]
        yield list(islice(positions, len(batch.labels))), logits, batch


@torch.no_grad()
def evaluate_each(
    models: Sequence[nn.Module], loader, device: torch.device, precision: str, channels_last: bool,
    bad: set[str] | None = None, topk: tuple[int, ...] = DEFAULT_TOPK, tta: bool = False,
    keep_topk: int = 0, norm: Norm = IMAGENET,
) -> list[EvalTotals]:
    """Each model's loss, top-k and confusion matrix over this rank's exact shard, summed across ranks.

    Under "skip", a bad image's stand-in is not counted (so `images` is the
    split's good images) and the bad file goes into `bad`.
    """
    every = [EvalTotals(device, topk, keep_topk) for _ in models]
    batches = logits_by_batch(models, loader, device, precision, channels_last, tta, norm)
    for positions, logits, batch in batches:
        raise_bad_images(batch.errors)
        keep = queued_copy(requested(batch.skipped), device) if any(batch.skipped) else None
        labels = batch.labels.to(device, non_blocking=True)
        for totals, each in zip(every, logits, strict=True):
            totals.add(each, labels, keep, positions)
        if bad is not None:
            bad.update(skipped_files(batch.skipped))
    for totals in every:
        totals.reduce()
    return every


def evaluate(model: nn.Module, loader, device: torch.device, precision: str, channels_last: bool,
             bad: set[str] | None = None, topk: tuple[int, ...] = DEFAULT_TOPK, tta: bool = False,
             keep_topk: int = 0, norm: Norm = IMAGENET) -> EvalTotals:
    """`evaluate_each` of one model."""
    (totals,) = evaluate_each([model], loader, device, precision, channels_last, bad, topk, tta, keep_topk,
                              norm)
    return totals


@torch.no_grad()
def predict(model: nn.Module, loader, device: torch.device, precision: str, channels_last: bool,
            k: int, norm: Norm = IMAGENET) -> list[tuple[int, str, list[int], list[float]]]:
    """Every rank's (position, error, top-k classes, probabilities), in split order; a bad image is
    its error message with no classes, and the others are still predicted."""
    rows = []
    for positions, (logits,), batch in logits_by_batch([model], loader, device, precision, channels_last,
                                                       norm=norm):
        probs, classes = logits.softmax(dim=1).topk(min(k, logits.shape[1]), dim=1)
        for position, error, top, p in zip(positions, batch.errors, classes.tolist(), probs.tolist(),
                                           strict=True):
            rows.append((position, error, [], []) if error else (position, "", top, p))
    if dist.is_initialized():
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rows)
        rows = [row for rank in everyone for row in rank]
    return sorted(rows)
