"""pretrain.method = "simclr" through the CLI: a stopped run resumes bit-identical, its checkpoint starts a
run on labels, and the commands that serve a classifier refuse it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import LiveRun, last_json, run_ddp
from test_fault_tolerance import EXACT, assert_bit_identical, train

from ddp_cli.models.projection import PROJECTION
from ddp_cli.train.checkpoint import CheckpointStore

# 8 px views of the demo's digits on 2 gloo ranks (the negatives all-gathered), stopped and resumed mid-epoch
SIMCLR = ["--set", "pretrain.method=simclr", "--set", "data.batch_size=16", "--set", "data.image_size=8",
          "--set", "data.val_resize=8", "--set", "model.kwargs={ width = 8 }",
          "--set", "distributed.stop_check_steps=1", "--set", "train.epochs=2"]


@pytest.fixture(scope="module")
def pretrained(demo_registry, tmp_path_factory):
    """The reference: two epochs of SimCLR, never disturbed."""
    run_dir = tmp_path_factory.mktemp("simclr") / "run"
    return last_json(train(demo_registry, run_dir, *SIMCLR)), run_dir


def test_simclr_logs_its_pair_accuracy_validates_its_features_and_resumes_bit_identical(
        demo_registry, tmp_path, pretrained):
    reference, reference_dir = pretrained
    assert 0 < reference["pretrain"]["pair_top1"] <= 1 and reference["final_ema"] is None
    assert reference["final"]["images"] == 359 and 0.1 < reference["final"]["top1"] <= 1  # each once
    records = [json.loads(line) for line in (reference_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["split"] == "pretrain"] == [1, 2]
    saved = torch.load(reference_dir / "checkpoints/last.pt", weights_only=True)
    assert any(f".{PROJECTION}." in k for k in saved["model"])
    run_dir = tmp_path / "run"
    run = LiveRun("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                  str(run_dir), *EXACT, *SIMCLR, env={"DDP_FAULTS": "sigterm@4"})
    assert run.wait(timeout=120) == 143, run.stderr
    stopped = torch.load(CheckpointStore(run_dir / "checkpoints", 1).latest_valid(), weights_only=True)
    assert stopped["epoch"] == 0 and stopped["step_in_epoch"] == 4  # mid-epoch (stop_check_steps 1)
    assert_bit_identical(last_json(train(demo_registry, run_dir, *SIMCLR)), reference, run_dir, reference_dir)


def test_its_checkpoint_starts_a_run_on_labels_and_validate_refuses_it(demo_registry, tmp_path, pretrained):
    _, reference_dir = pretrained
    checkpoint = reference_dir / "checkpoints/last.pt"
    refused = run_ddp("validate", "--checkpoint", str(checkpoint), "--registry", str(demo_registry))
    assert refused.returncode == 2 and "model.weights" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    labelled = last_json(train(demo_registry, tmp_path / "labels", "--set", f'model.weights="{checkpoint}"',
                               "--set", "data.image_size=8", "--set", "data.val_resize=8",
                               "--set", "model.kwargs={ width = 8 }", "--set", "semi.labels_per_class=4",
                               "--set", "data.batch_size=8", "--set", "train.epochs=1"))
    assert labelled["final"]["images"] == 359 and "pretrain" not in labelled
