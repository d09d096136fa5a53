"""A worker on cuda:3 of an 8-rank NCCL world (fakegpu.py): joining (device bound before NCCL), a whole
training job (run/training.py: loaders pinned, the replica check, an epoch with validation, the stop
agreement on the CPU group, a checkpoint's state gathered), and the validate and predict jobs from a
checkpoint written on a GPU."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
from replicas import CLASSES

from ddp_cli.config.resolve import Facts, resolve
from ddp_cli.distributed import setup
from ddp_cli.distributed.setup import DistContext, choose_device
from ddp_cli.observe.startup import StartupClock
from ddp_cli.run import inference_jobs, training
from ddp_cli.run.jobs import Job
from ddp_cli.run.writers import writes_folder
from ddp_cli.train.checkpoint import save_checkpoint
from gpu_rules.gpu_parts import gpu_config, tiny_loaders, tiny_net
from gpu_rules.node import DEVICE, RANK, WORLD

CLASS_NAMES = [f"n{i:08d}" for i in range(CLASSES)]
INDEX = SimpleNamespace(classes=CLASS_NAMES, descriptions=CLASS_NAMES, splits={"val": None})
ENTRY = SimpleNamespace(name="tiny", open=lambda: (None, "root"), model_dump=lambda mode=None: {},
                        storage=SimpleNamespace(path="root"))


@pytest.fixture
def worker_env(monkeypatch):
    env = {"RANK": RANK, "WORLD_SIZE": WORLD, "LOCAL_RANK": RANK, "LOCAL_WORLD_SIZE": WORLD}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)  # StopRequest's handlers: not here


def test_a_worker_binds_its_gpu_before_joining_nccl(gpu, worker_env, monkeypatch):
    joined = []
    monkeypatch.setattr(setup, "torch_sees_gpus", lambda: True)
    monkeypatch.setattr(setup.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(setup.dist, "init_process_group",
                        lambda **kwargs: joined.append({**kwargs, "bound": gpu.cuda.bound}))
    ctx = setup.setup("auto")
    assert (ctx.device, ctx.backend, ctx.rank, ctx.local_rank) == (DEVICE, "nccl", RANK, RANK)
    assert [(j["backend"], j["device_id"], j["bound"]) for j in joined] == [("nccl", DEVICE, True)]


def loaders_recording(pins: list[bool]):
    def build_loaders(*args, pin_memory: bool, **kwargs):
        pins.append(pin_memory)
        return tiny_loaders(pin_memory)
    return build_loaders


def test_a_training_job_runs_its_epoch_on_the_gpu(gpu, worker_env, monkeypatch, tmp_path):
    """train_job as a worker runs it; the host reads it makes (a logging window, the replica check, the
    validation totals, the checkpoint's running loss) are allowed here and counted by fault 5's test."""
    pins = []
    monkeypatch.setattr(training, "build_semi_loaders", loaders_recording(pins))
    monkeypatch.setattr(training, "build_model", lambda *args: tiny_net())
    cfg = gpu_config(train={"ema_decay": 0.9, "precision": "bf16"}, model={"channels_last": True})
    cfg = resolve(cfg, Facts("cuda", "bf16", WORLD, 2))  # as preflight hands it to the workers
    ctx = DistContext(RANK, WORLD, RANK, WORLD, choose_device("nccl", RANK), "nccl")
    with gpu.host_reads():
        writes = writes_folder(tmp_path, ctx)  # who writes the run dir: a broadcast and a barrier
        result = training.train_job(cfg, ctx, tmp_path, ENTRY, INDEX, Job("train", quiet=True),
                                    StartupClock(), writes)
    assert pins == [True] and result["epochs"] == 1 and result["world_size"] == WORLD
    backends = {(name, backend) for name, backend, _ in gpu.collectives.calls}
    assert ("all_reduce", "gloo") in backends  # the stop agreement, on the CPU control group
    assert ("all_gather_object", "nccl") in backends  # the checkpoint's RNG states, gathered
    assert ("get_rng_state", RANK) in gpu.cuda.calls


def checkpoint_from_a_gpu(gpu, path) -> None:
    """A checkpoint of tiny_net as a GPU run writes one (tensors tagged cuda:3 in the file)."""
    state = {"model": tiny_net().state_dict(), "config": gpu_config().model_dump(mode="json"),
             "classes": CLASS_NAMES, "descriptions": CLASS_NAMES, "dataset": {}}
    gpu.written_on_gpu(state)
    save_checkpoint(state, path)


def test_validate_and_predict_run_a_gpu_checkpoint_on_the_gpu(gpu, monkeypatch, tmp_path):
    pins = []
    monkeypatch.setattr(inference_jobs, "build_loaders", loaders_recording(pins))
    monkeypatch.setattr(inference_jobs, "eval_loader", lambda *args, pin_memory, **kwargs:
                        loaders_recording(pins)(pin_memory=pin_memory).val)
    monkeypatch.setattr("ddp_cli.train.checkpoint_model.build_model", lambda *args: tiny_net())
    checkpoint_from_a_gpu(gpu, tmp_path / "gpu.pt")
    cfg, ctx = gpu_config(), DistContext(RANK, WORLD, RANK, WORLD, choose_device("nccl", RANK), "nccl")
    with gpu.host_reads():
        validated = inference_jobs.validate_job(cfg, ctx, ENTRY, INDEX, Job(
            "validate", checkpoint=str(tmp_path / "gpu.pt"), predictions="p.csv"))
        predicted = inference_jobs.predict_job(cfg, ctx, tmp_path, ENTRY, INDEX, Job(
            "predict", checkpoint=str(tmp_path / "gpu.pt"), topk=[2]), writes=False)
    assert pins == [True, True] and validated["world_size"] == WORLD and predicted["images"] >= 0
    reduced = [shapes for name, backend, shapes in gpu.collectives.calls if name == "all_reduce"]
    assert [dtype for (_, dtype, _), in reduced] == ["torch.float64", "torch.int64", "torch.int64"]
    assert all(device == "cuda:3" for (device, _, _), in reduced)

