"""`train.compile`: the compiled DDP model trains to the same weights as the eager one, at world size 2,
with gradient accumulation (`no_sync` under compile) and with `distributed.static_graph` (every shipped
config sets it, and DDP's graph splitting under compile has had trouble with it)."""

from __future__ import annotations

import pytest
import torch
from replicas import make_config, make_trainer, step_replica, weights

from ddp_cli.run.loopback import run_workers

pytestmark = pytest.mark.slow
STEPS = 2
RUNS = {  # name: (train.compile, distributed.static_graph, train.grad_accum); static_graph needs 1
    "eager": (False, False, 2), "compiled": (True, False, 2),
    "eager_static": (False, True, 1), "compiled_static": (True, True, 1),
}


def eager_and_compiled(rank: int, world_size: int, folder: str) -> dict[str, dict]:
    """Initial weights, then the weights after STEPS steps of each run."""
    results = {}
    for name, (compile_, static, accum) in RUNS.items():
        cfg = make_config({"train": {"compile": compile_, "grad_accum": accum},
                           "distributed": {"static_graph": static}})
        trainer = make_trainer(rank, world_size, cfg, STEPS, folder)
        assert (trainer.forward is not trainer.model) == compile_
        results.setdefault("start", weights(trainer))
        for step in range(STEPS):
            step_replica(trainer, rank, world_size, step)
        results[name] = weights(trainer)
    return results


def test_compiled_training_matches_eager_at_world_size_2(tmp_path):
    out = run_workers(eager_and_compiled, 2, str(tmp_path), timeout=400)
    for rank in out:
        start = rank["start"]
        for eager, compiled in (("eager", "compiled"), ("eager_static", "compiled_static")):
            moved = max((rank[eager][k] - start[k]).abs().max().item() for k in start
                        if start[k].is_floating_point())
            assert moved > 1e-3, eager
            for key in start:
                torch.testing.assert_close(rank[compiled][key], rank[eager][key], rtol=1e-4, atol=1e-5,
                                           msg=f"{compiled}: {key}")
