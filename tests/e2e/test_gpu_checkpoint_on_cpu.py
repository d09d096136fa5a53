"""A checkpoint trained on GPUs (fp16, backend nccl) validates on this CPU machine: inference chooses
backend and precision for the machine it runs on (issue 26; the choice itself:
tests/unit/test_inference_machine.py)."""

from __future__ import annotations

from conftest import last_json, run_ddp

from ddp_cli.io import load_plain
from ddp_cli.train.checkpoint import save_checkpoint


def test_an_fp16_nccl_checkpoint_validates_on_the_cpu(trained_demo, tmp_path):
    state = load_plain(trained_demo / "checkpoints" / "last.pt")
    state["config"]["train"]["precision"] = "fp16"
    state["config"]["distributed"]["backend"] = "nccl"
    gpu_made = tmp_path / "gpu.pt"
    save_checkpoint({k: v for k, v in state.items() if k != "format"}, gpu_made)
    out = last_json(run_ddp("validate", "--checkpoint", str(gpu_made), "--json"))  # exit 2 before
    assert out["images"] == 359 and out["top1"] >= 0.8
