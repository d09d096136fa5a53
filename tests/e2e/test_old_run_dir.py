"""A run dir written by the release before the config package (tests/fixtures/run-0.1.0: the demo, fp32,
3 epochs of 4 steps, 2 workers, its checkpoint after epoch 2) resumes under this release to the weights
that release reached when it ran on (continued.json: its final result and weights). fp32 kernels differ in
their last bits between kinds of CPU, so the comparison is close, not bitwise."""

from __future__ import annotations

import json
import shutil
import tomllib

import pytest
import torch
from conftest import REPO, last_json, run_ddp

FIXTURE = REPO / "tests/fixtures/run-0.1.0"


def test_the_previous_releases_run_dir_resumes_to_its_weights(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    result = run_ddp("train", str(run_dir / "config.toml"), "--run-dir", str(run_dir), "--resume", "auto",
                     "--json", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr
    assert "data.ramp_step: 32 px, as the checkpoint trained (this config derives 8)" in result.stderr
    assert "data.end_image_size: 32 px, as the checkpoint trained (this config derives 24)" in result.stderr
    out = last_json(result)
    expected = json.loads((FIXTURE / "continued.json").read_text())
    for weights in ("final", "final_ema"):
        assert out[weights]["loss"] == pytest.approx(expected[weights]["loss"], rel=1e-3)
        assert out[weights]["top1"] == pytest.approx(expected[weights]["top1"], abs=2 / 359)
    state = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)["model"]
    for name, total in expected["model_sums"].items():
        assert float(state[name].double().sum()) == pytest.approx(total, rel=1e-3, abs=1e-3), name
    written = tomllib.loads((run_dir / "config.toml").read_text())
    old = tomllib.loads((FIXTURE / "config.toml").read_text())
    # the ramp's step and end, keys since, written as the run trained: 32 px steps up to 32 px (its last
    # epoch at 32, not 24)
    assert written["data"] == {**old["data"], "ramp_step": 32, "end_image_size": 32}
    assert written["train"] == old["train"]
