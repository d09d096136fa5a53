"""`train.compile`: the compiled DDP model trains to the same weights as the eager one (~30 s compile)."""

from __future__ import annotations

import pytest
import torch
from replicas import make_config, make_trainer, step_replica, weights

from ddp_cli.run.loopback import run_workers

pytestmark = pytest.mark.slow
STEPS = 2


def eager_and_compiled(rank: int, world_size: int, folder: str) -> dict[str, dict]:
    """Initial weights, then the weights after STEPS steps, eager and compiled."""
    results = {}
    for name, compile_ in (("eager", False), ("compiled", True)):
        cfg = make_config({"train": {"compile": compile_, "grad_accum": 2}})  # no_sync under compile too
        trainer = make_trainer(rank, world_size, cfg, STEPS, folder)
        assert (trainer.forward is not trainer.model) == compile_
        results.setdefault("start", weights(trainer))
        for step in range(STEPS):
            step_replica(trainer, rank, world_size, step)
        results[name] = weights(trainer)
    return results


def test_compiled_training_matches_eager(tmp_path):
    out = run_workers(eager_and_compiled, 1, str(tmp_path), timeout=300)[0]
    start, eager, compiled = out["start"], out["eager"], out["compiled"]
    assert max((eager[k] - start[k]).abs().max().item() for k in start if start[k].is_floating_point()) > 1e-3
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-4, atol=1e-5, msg=key)
