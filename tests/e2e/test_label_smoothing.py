"""optim.label_smoothing: the loss the trainer steps on is smoothed cross-entropy, by the formula.

For K classes and smoothing e, the target distribution is (1 - e) on the label plus e/K on
every class, so loss = -(1 - e) log p_y - (e/K) sum_k log p_k (Szegedy et al. 2016).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from replicas import CLASSES, global_batch, make_config, make_trainer

from ddp_cli.data.pipeline.loaders import Batch
from ddp_cli.data.pipeline.transforms import to_model_input
from ddp_cli.run.loopback import run_workers

SMOOTHING = [0.0, 0.1, 0.3]


def losses(rank: int, world_size: int, folder: str) -> dict:
    """Per smoothing: the logits of the first step's batch (before the step) and the step's loss."""
    out = {}
    for eps in SMOOTHING:
        cfg = make_config({"optim": {"label_smoothing": eps}})
        trainer = make_trainer(rank, world_size, cfg, 1, folder)
        images, labels = global_batch(0, cfg.data.batch_size)
        x = to_model_input(images, torch.device("cpu"), cfg.model.channels_last)
        with torch.no_grad():  # BatchNorm in eval (make_trainer): the same logits the step sees
            logits = trainer.model.module(x)
        loss = trainer.train_step([(Batch(images, labels, [""] * len(labels), [""] * len(labels)),)])
        out[eps] = (logits.double().numpy(), labels.numpy(), float(loss))
    return out


def smoothed_cross_entropy(logits: np.ndarray, labels: np.ndarray, eps: float) -> float:
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    classes = logits.shape[1]
    target = np.full_like(log_p, eps / classes)
    target[np.arange(len(labels)), labels] += 1 - eps
    return float(-(target * log_p).sum(axis=1).mean())


@pytest.fixture(scope="module")
def stepped(tmp_path_factory) -> dict:
    return run_workers(losses, 1, str(tmp_path_factory.mktemp("smoothing")))[0]


@pytest.mark.parametrize("eps", SMOOTHING)
def test_the_step_loss_is_smoothed_cross_entropy(stepped, eps):
    logits, labels, loss = stepped[eps]
    assert logits.shape == (len(labels), CLASSES)
    assert loss == pytest.approx(smoothed_cross_entropy(logits, labels, eps), rel=1e-5)


def test_smoothing_changes_the_loss(stepped):
    """Same weights, same batch: only the smoothing differs, so the losses must (else it is ignored)."""
    plain = stepped[0.0][2]
    for eps in SMOOTHING[1:]:
        logits, labels, loss = stepped[eps]
        np.testing.assert_array_equal(logits, stepped[0.0][0])
        assert abs(loss - plain) > 1e-3
