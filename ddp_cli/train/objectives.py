"""What a training step minimises, built once from the config (as torchtitan builds its `loss_fn`).

The Trainer's loop is the same whatever the method: it moves each micro-step's
batches to the device (`on_device`, the one place a training batch crosses over),
hands them and its model's forward to an `Objective`, and gets back the loss to
step on and the running sums behind the method's metrics. The method's own
parts live here, assembled from `mixing.py` and `fixmatch.py`:

- `Supervised`: cross-entropy against the labels, or, with MixUp/CutMix on,
  against the step's mix of them (one draw per step, seeded by (seed, step):
  nothing to checkpoint);
- `FixMatch`: the labelled loss plus the unlabelled images' (their stream
  across epochs and its position, the EMA teacher's pseudo-labels, the mask
  and pseudo-label metrics), with its rule for pseudo-labels: FixMatch's fixed
  threshold, or FreeMatch's and SoftMatch's, which keep running statistics
  (adaptive.py);
- `SimCLR`: no labels read, each image's two views pulled together against the
  global batch's others (contrastive.py), through the model's projection.

A new method is a class beside these and a line in `build_objective`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from ddp_cli.config import RunConfig
from ddp_cli.data.pipeline.loaders import Batch, Loaders
from ddp_cli.data.pipeline.transforms import model_input, normalising
from ddp_cli.train.adaptive import FreeMatch, SoftMatch
from ddp_cli.train.contrastive import nt_xent
from ddp_cli.train.ema import EmaModel
from ddp_cli.train.fixmatch import SUMS, Rule, Threshold, fixmatch_loss, summary
from ddp_cli.train.inference import raise_bad_images
from ddp_cli.train.mixing import BatchMixing, loss_function
from ddp_cli.train.precision import autocast

Forward = Callable[[torch.Tensor], torch.Tensor]
Micro = tuple[Batch, ...]  # one micro-step's batches: the labelled one, then any the objective adds


class Objective(Protocol):
    """A training method, as the Trainer sees it.

    Its running sums (`sums`, added up over the epoch beside the loss, checkpointed
    in `running`) make its metrics; its state is a few of the run's progress fields
    (checkpoint.RunState declares them, at a checkpoint's top level), so the
    checkpoint format is the same whatever the method.
    """

    name: str  # its metrics' split in metrics.jsonl and its key in `ddp train --json`
    sums: tuple[str, ...]  # the running sums each micro-step adds, after the loss

    def micro_batches(self, labelled: list[Batch]) -> list[Micro]:
        """A step's micro-steps from its labelled micro-batches (fetching whatever else it takes)."""
        ...

    def loss(self, forward: Forward, micro: Micro, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, sums) of one micro-step of optimisation step `step` (0-based, the one being taken), its
        batches on the device (`on_device`); the Trainer divides the loss by the step's micro-steps."""
        ...

    def metrics(self, sums: list[float], micro_steps: float) -> dict[str, Any]:
        """Its metrics from `sums` summed over `micro_steps` micro-steps of every rank."""
        ...

    def summary(self, last_epoch: dict[str, Any]) -> dict[str, Any]:
        """What `ddp train --json` adds, from the last epoch's record."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Its fields of the run's progress, as they stand: written into RunState before every save."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Its fields from the run's progress, on resume (RunState's defaults where a checkpoint had none)."""
        ...


def on_device(micro: Micro, device: torch.device) -> Micro:
    """A micro-step's batches on `device`, their bad images raised first: images (uint8 NHWC as loaded, or
    decoded there, data.decode = "gpu") and labels, each copied as it is without the host waiting (pinned
    on a GPU; a cat on the host would make a pageable tensor, whose copy is synchronous)."""
    for batch in micro:
        raise_bad_images(batch.errors)
    return tuple(batch._replace(images=batch.images.to(device, non_blocking=True),
                                labels=batch.labels.to(device, non_blocking=True)) for batch in micro)


def build_objective(cfg: RunConfig, loaders: Loaders, device: torch.device, precision: str,
                    ema: EmaModel | None) -> Objective:
    """SimCLR under pretrain.method; FixMatch and its successors where the loaders bring unlabelled images
    (`semi.method` on); else supervised."""
    if cfg.pretrain.on():
        return SimCLR(cfg, device, precision)
    if loaders.unlabelled is not None:
        return FixMatch(cfg, loaders, device, precision, ema)
    return Supervised(cfg, device, precision)


class Supervised:
    """Cross-entropy against the labels, or against the step's mix of them with MixUp/CutMix on."""

    name, sums = "supervised", ()

    def __init__(self, cfg: RunConfig, device: torch.device, precision: str) -> None:
        self.device, self.precision = device, precision
        self.channels_last, self.norm = cfg.model.channels_last, normalising(cfg.data)
        self.loss_fn = loss_function(cfg)  # labels or mixes
        self.mixing = BatchMixing(cfg.augment, cfg.seed) if cfg.augment.mixing() else None
        self.no_sums = torch.zeros(0, dtype=torch.float64, device=device)  # a labelled step counts nothing

    def micro_batches(self, labelled: list[Batch]) -> list[Micro]:
        return [(batch,) for batch in labelled]

    def loss(self, forward: Forward, micro: Micro, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        (batch,) = micro
        x, y = model_input(batch.images, self.channels_last, self.norm), batch.labels
        mix = self.mixing.draw(step, x) if self.mixing else None
        if mix:
            x = mix.images(x)
        with autocast(self.device, self.precision):
            logits = forward(x)
            return self.loss_fn(logits, mix.targets(y, logits.shape[1]) if mix else y), self.no_sums

    def metrics(self, sums: list[float], micro_steps: float) -> dict[str, Any]:
        return {}

    def summary(self, last_epoch: dict[str, Any]) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class SimCLR(Supervised):
    """SimCLR's NT-Xent on each micro-batch's two views (N x 2 x H x W x C), in one forward of [first views;
    second views] through the model, whose output in training is its projection (models/projection.py)."""

    name, sums = "pretrain", ("pair_hits", "views")

    def __init__(self, cfg: RunConfig, device: torch.device, precision: str) -> None:
        super().__init__(cfg, device, precision)
        self.temperature = cfg.pretrain.temperature

    def loss(self, forward: Forward, micro: Micro, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        (batch,) = micro  # its labels never read
        views = batch.images
        x = model_input(torch.cat([views[:, 0], views[:, 1]]), self.channels_last, self.norm)
        with autocast(self.device, self.precision):
            projections = forward(x)
        loss, hits = nt_xent(projections, self.temperature)
        views_counted = torch.full((), len(x), dtype=torch.float64, device=self.device)
        return loss, torch.stack([hits.double(), views_counted])

    def metrics(self, sums: list[float], micro_steps: float) -> dict[str, Any]:
        """pair_top1: the share of views whose most similar other view is their pair."""
        hits, views = sums
        return {"pair_top1": hits / views} if views else {}

    def summary(self, last_epoch: dict[str, Any]) -> dict[str, Any]:
        return {self.name: {"pair_top1": last_epoch.get("pair_top1")}}


RULES: dict[str, type] = {"fixmatch": Threshold, "freematch": FreeMatch, "softmatch": SoftMatch}


class FixMatch(Supervised):
    """FixMatch (`fixmatch.py`) and its successors: each labelled micro-batch with the next unlabelled one
    (both views of each image), in one forward of [labelled; weak views; strong views], pseudo-labelled
    by the method's rule.

    The unlabelled stream runs across epochs; its position, (pass, images consumed
    by all ranks), is its state, with the rule's running statistics. It starts
    where the run stands, at the first micro-batch after a fresh start or a resume.
    """

    name, sums = "semi", SUMS

    def __init__(self, cfg: RunConfig, loaders: Loaders, device: torch.device, precision: str,
                 ema: EmaModel | None) -> None:
        super().__init__(cfg, device, precision)
        self.semi, self.ema, self.loaders = cfg.semi, ema, loaders
        self.rule: Rule = RULES[cfg.semi.method](cfg.semi)
        self.epoch = self.seen = 0  # the stream's position: its pass, and its positions consumed
        self.unlabelled: Iterator[Batch] | None = None  # the endless stream, from its position

    def micro_batches(self, labelled: list[Batch]) -> list[Micro]:
        unlabelled = [self.next_unlabelled() for _ in labelled]  # after every labelled one, as they load
        return list(zip(labelled, unlabelled, strict=True))

    def next_unlabelled(self) -> Batch:
        """The next unlabelled micro-batch, the stream's position moved on past it."""
        stream = self.loaders.unlabelled_stream
        if self.unlabelled is None:
            stream.start(self.epoch, self.seen)
            self.unlabelled = iter(self.loaders.unlabelled)
        self.epoch, self.seen = stream.advance(self.epoch, self.seen)
        return next(self.unlabelled)

    def loss(self, forward: Forward, micro: Micro, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch, unlabelled = micro  # on the device, joined there; views: N x 2 x H x W x C, weak then strong
        views, y, hidden = unlabelled.images, batch.labels, unlabelled.labels
        x = model_input(torch.cat([batch.images, views[:, 0], views[:, 1]]), self.channels_last, self.norm)
        teacher = self.teacher_logits(x[len(y):len(y) + len(views)]) if self.semi.ema_teacher else None
        with autocast(self.device, self.precision):
            logits = forward(x)
            return fixmatch_loss(logits, y, hidden, self.semi, self.loss_fn, teacher, self.rule)

    @torch.no_grad()
    def teacher_logits(self, weak: torch.Tensor) -> torch.Tensor:
        """The EMA weights' logits of the weak views (semi.ema_teacher), in eval mode."""
        with autocast(self.device, self.precision):
            return self.ema.module(weak).float()

    def metrics(self, sums: list[float], micro_steps: float) -> dict[str, Any]:
        """The sums' metrics and the rule's statistics as they stand (the same on every rank)."""
        return {**summary(sums, micro_steps), **self.rule.signals()}

    def summary(self, last_epoch: dict[str, Any]) -> dict[str, Any]:
        """The last epoch's mask rate and pseudo-label accuracy, and the rule's statistics at the end."""
        keys = ("mask_rate", "pseudo_label_top1")
        return {self.name: {**{k: last_epoch.get(k) for k in keys}, **self.rule.signals()}}

    def state_dict(self) -> dict[str, Any]:
        return {"unlabelled_epoch": self.epoch, "unlabelled_seen": self.seen,
                "semi_statistics": self.rule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.seen = state["unlabelled_epoch"], state["unlabelled_seen"]
        self.rule.load_state_dict(state["semi_statistics"])
