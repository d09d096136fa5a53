"""`ddp bench step`'s config: every row (ddp's Trainer, the bare loop) times the loss and optimizer a
worker would, so the config is resolved as a worker resolves it, not left with derived keys unset."""

from __future__ import annotations

import torch

from ddp_cli.bench.step import StepSpec, step_config
from ddp_cli.config.resolve import autos
from ddp_cli.train.mixing import loss_function


def test_the_timed_steps_config_is_resolved_and_its_loss_runs():
    cfg = step_config(StepSpec(), "fp32", False, ("optim.momentum=0.8",))
    assert autos(cfg) == set() and cfg.optim.momentum == 0.8
    assert cfg.optim.label_smoothing == 0.1  # the default recipe's, derived
    loss = loss_function(cfg)(torch.zeros(2, 10), torch.tensor([0, 1]))
    assert torch.isfinite(loss)
