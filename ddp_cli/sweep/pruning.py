"""The trial's side of pruning: at each epoch's end, rank 0 reports the epoch's validation metric to
the study and asks its pruner; every rank learns the answer, and a pruned run stops there, after
that epoch's checkpoint, as a run that ended early (exit 0), not as a failure.

`ddp sweep` names the trial in the environment of the `ddp train` it starts (TRIAL_ENV); without
it a run has no gate. The storage failing on the way only costs the pruning: a warning, and the
run goes on to its last epoch.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from ddp_cli.distributed.setup import DistContext
from ddp_cli.sweep.storage import masked, open_storage

log = logging.getLogger("ddp")
TRIAL_ENV = "DDP_SWEEP_TRIAL"  # JSON: storage, study, trial (id), metric, pruner


def build_pruner(spec: dict[str, Any]) -> Any:
    """The Optuna pruner of a space's [pruner] table (`space.PRUNERS`)."""
    import optuna

    options = {k: v for k, v in spec.items() if k != "name"}
    if spec["name"] == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(**options)
    if spec["name"] == "median":
        return optuna.pruners.MedianPruner(**options)
    return optuna.pruners.NopPruner()


class EpochGate:
    """Called by the Trainer at each epoch's end on every rank (a collective): prune here?"""

    def __init__(self, trial: dict[str, Any], ctx: DistContext) -> None:
        self.spec, self.ctx = trial, ctx
        self.trial: Any = None
        self.broken = False  # the storage failed once: said once, no pruning from then on

    def __call__(self, val: dict[str, float], epoch: int) -> bool:
        decision = torch.zeros(1, dtype=torch.int64, device=self.ctx.device)
        if self.ctx.is_main:
            decision += self.should_prune(val[self.spec["metric"]], epoch)
        dist.broadcast(decision, src=0)
        return bool(decision.item())

    def should_prune(self, value: float, epoch: int) -> bool:
        if self.broken:
            return False
        try:
            trial = self.trial or self.open()
            trial.report(value, epoch)
            return bool(trial.should_prune())
        except Exception as e:
            self.broken = True
            log.warning(f"warning: sweep trial {self.spec['number']}: cannot report epoch {epoch} to "
                        f"{masked(self.spec['storage'])} ({type(e).__name__}: {e}); this run goes on "
                        "without pruning")
            return False

    def open(self) -> Any:
        import optuna

        study = optuna.load_study(study_name=self.spec["study"], storage=open_storage(
            self.spec["storage"], heartbeat=False), pruner=build_pruner(self.spec["pruner"]))
        self.trial = optuna.trial.Trial(study, self.spec["trial"])
        return self.trial


def epoch_gate(ctx: DistContext) -> EpochGate | None:
    """The gate of the trial this run is, as `ddp sweep` named it; None for a run of its own."""
    text = os.environ.get(TRIAL_ENV)
    return EpochGate(json.loads(text), ctx) if text else None
