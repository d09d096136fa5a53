"""Fine-tuning works: a run from a planted "pretrained" file beats the same run from scratch at equal
epochs, and the modules it froze for its first epoch move only from the second (through the worker,
DDP, the optimiser's groups and the schedule)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from conftest import last_json, run_ddp

from ddp_cli.train.checkpoint_model import load_trained

# the demo's first 5 classes at 8 px, two short epochs of 3 steps on one worker
RUN = ["train.precision=fp32", "data.image_size=8", "data.val_resize=8", "data.workers=0", "train.epochs=2",
       "data.classes=5", "train.max_steps_per_epoch=3"]
FINE_TUNE = ["model.new_head=true", 'model.freeze=["stem", "stages.0"]', "model.freeze_epochs=1",
             "optim.head_lr_mult=10"]


def train(registry: Path, run_dir: Path, sets: list[str]) -> dict:
    return last_json(run_ddp("train", "configs/demo.toml", "--registry", str(registry), "--run-dir",
                             str(run_dir), "--nproc-per-node", "1", "--json", "--quiet",
                             *[arg for s in sets for arg in ("--set", s)]))


def test_fine_tuning_a_pretrained_file_beats_training_from_scratch(trained_demo, demo_registry, tmp_path):
    """`trained_demo` (all 10 digits, 3 epochs) is the pretrained file: a ddp checkpoint, with a 10-class
    head that `new_head` replaces for the 5 classes here."""
    pretrained = trained_demo / "checkpoints" / "last.pt"
    with ThreadPoolExecutor(2) as pool:  # the two runs side by side: 2 cores, one worker each
        scratch = pool.submit(train, demo_registry, tmp_path / "scratch", RUN)
        tuned = pool.submit(train, demo_registry, tmp_path / "tuned",
                            [*RUN, f"model.weights={pretrained}", *FINE_TUNE])
        scratch, tuned = scratch.result(), tuned.result()
    assert tuned["final"]["top1"] >= scratch["final"]["top1"] + 0.1, (tuned["final"], scratch["final"])
    start, epoch_1, end = (load_trained(path, "model").state_dict for path in (  # the trained weights
        pretrained, tmp_path / "tuned/checkpoints/step-000000003.pt", tuned["checkpoint"]))
    frozen = [k for k in start if k.startswith(("stem.", "stages.0.")) and k.endswith(("weight", "bias"))]
    assert frozen and all(torch.equal(start[k], epoch_1[k]) for k in frozen)
    assert all(not torch.equal(start[k], end[k]) for k in frozen)
    assert not torch.equal(start["stages.2.conv1.weight"], epoch_1["stages.2.conv1.weight"])
    assert end["head.2.weight"].shape[0] == 5
