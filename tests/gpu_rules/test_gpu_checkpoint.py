"""The Checkpointer's save and restore on cuda:3 of an 8-rank NCCL world (fakegpu.py), RNG included.

Fake tensors hold no data, so a save is taken in two halves: under the fake world the Checkpointer
gathers the state (collectives checked, the rank's own GPU's RNG state asked for), and that state,
its fake tensors made real CPU zeros tagged cuda:3 in the file (as a GPU run writes them), is written
for real; the restore then reads that file under the fake world, as a rank on a GPU node does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from ddp_cli.train.checkpoint import Checkpointer, save_checkpoint
from gpu_rules.gpu_parts import gpu_config, gpu_trainer, micro_batches
from gpu_rules.node import DEVICE, RANK, WORLD


class KeptStore:
    """A CheckpointStore that keeps the state it is given (fake tensors cannot be written)."""

    folder = Path("checkpoints")
    mirror = None  # no bucket

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def save(self, state: dict[str, Any], info: dict[str, Any], best: bool) -> Path:
        self.state = state
        return self.path_for(info["step"])

    def path_for(self, step: int) -> Path:
        return self.folder / f"step-{step:09d}.pt"


def made_real(state: Any) -> Any:
    """`state` with each fake tensor a real CPU tensor of its shape and dtype (zeros)."""
    if isinstance(state, FakeTensor):
        with unset_fake_temporarily():
            return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, dict):
        return {key: made_real(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(made_real(value) for value in state)
    return state


def devices(tensors) -> set[str]:
    return {str(t.device) for t in tensors if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("background", [False, True])
def test_a_checkpoint_saves_and_restores_on_the_gpu_with_its_own_gpus_rng(gpu, tmp_path, background):
    """In the background (`checkpoint.background`), the state is copied to CPU memory before the writer
    thread gets it; otherwise the GPU's tensors are written as they are."""
    cfg = gpu_config(train={"precision": "fp16", "ema_decay": 0.9})
    store = KeptStore()
    trainer = gpu_trainer(cfg, Checkpointer(store, background=background))
    with gpu.host_reads():  # GradScaler's step and state, the running loss: reads a save makes anyway
        trainer.train_step(micro_batches(trainer))
        trainer.state.step = 1  # as train_epoch counts it
        trainer.save()
    trainer.checkpointer.close()
    saved, kept = store.state, {"cpu" if background else str(DEVICE)}
    assert devices(saved["model"].values()) == devices(saved["ema"]["module"].values()) == kept
    assert devices(t for s in saved["optimizer"]["state"].values() for t in s.values()) == kept
    assert len(saved["rng"]) == WORLD and torch.equal(saved["rng"][RANK]["cuda"], gpu.cuda.rng[RANK])
    assert ("get_rng_state", RANK) in gpu.cuda.calls

    real = made_real(saved)
    real["rng"][RANK]["cuda"] = torch.full((16,), 99, dtype=torch.uint8)  # to see it restored
    gpu.written_on_gpu(real)
    with unset_fake_temporarily():
        save_checkpoint(real, tmp_path / "step.pt")
    gpu.cuda.calls.clear()
    resumed = gpu_trainer(cfg, Checkpointer(KeptStore()))
    with gpu.host_reads():
        resumed.resume(tmp_path / "step.pt")  # map_location="cpu", then each part onto cuda:3
    assert ("set_rng_state", RANK) in gpu.cuda.calls and int(gpu.cuda.rng[RANK][0]) == 99
    assert devices(resumed.model.module.state_dict().values()) == {str(DEVICE)}
    assert devices(t for s in resumed.optimizer.state.values() for t in s.values()) == {str(DEVICE)}
    assert resumed.state.step == 1 and saved["scaler"]["scale"] == resumed.scaler.get_scale()
