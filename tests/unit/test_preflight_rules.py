"""Preflight's own rules (ddp_cli/preflight.py), called directly: the workers a torchrun started,
--resume, the facts it hands the resolve pass (model.weights made absolute, the model family),
SyncBatchNorm on CPU, the node's loaders, and `preflight` itself on a fake index and loader rule
(what it computes and hands on). The whole preflight is met through the CLI in test_cli_errors,
test_gpus and test_shared_memory."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from ddp_cli import preflight
from ddp_cli.config import ModelConfig, RunConfig
from ddp_cli.data.pipeline.autotune import LoaderChoice
from ddp_cli.distributed.setup import DistContext
from ddp_cli.errors import ConfigError, WriteError
from ddp_cli.io import owner
from ddp_cli.observe.startup import StartupClock
from ddp_cli.run.launch import LaunchOptions
from ddp_cli.train.precision import native_precision

NATIVE = native_precision(torch.device("cpu"))  # what this CPU computes natively: bf16 or fp32
CPU_WORKERS = preflight.Workers(nproc=2, nnodes=3, backend="gloo", device="cpu", native_precision="fp32")


def test_joined_workers_are_the_local_ones_on_world_over_local_nodes():
    ctx = DistContext(rank=5, world_size=12, local_rank=1, local_world_size=4, device=torch.device("cpu"),
                      backend="gloo")
    cfg = RunConfig().resolved({"distributed.backend": "gloo", "train.precision": "fp32"})
    workers = preflight.joined_workers(cfg, ctx)
    assert workers == preflight.Workers(4, 3, "gloo", "cpu", NATIVE)
    assert workers.world_size == 12 and isinstance(workers.nnodes, int)  # the plan prints "3", not "3.0"


@pytest.mark.parametrize("resume", ["auto", "never"])
def test_resume_auto_and_never_pass_as_they_are(resume):
    assert preflight.checked_resume(resume) == resume


def test_resume_a_file_is_made_absolute_and_a_missing_one_is_a_config_error(tmp_path, monkeypatch):
    (tmp_path / "c.pt").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    assert preflight.checked_resume("c.pt") == str(tmp_path / "c.pt")
    with pytest.raises(ConfigError, match=r"^--resume gone\.pt: no such checkpoint; use auto, never or a"):
        preflight.checked_resume("gone.pt")
    with pytest.raises(ConfigError, match="no such checkpoint"):
        preflight.checked_resume(str(tmp_path))  # a folder is not a checkpoint


def test_a_weights_file_is_made_absolute_and_a_weight_name_stays_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig().resolved({"model.weights": "w/model.pt"})
    assert preflight.node_facts(cfg, CPU_WORKERS).weights_file == str(tmp_path / "w" / "model.pt")
    named = RunConfig().resolved({"model.weights": "DEFAULT"})
    assert preflight.node_facts(named, CPU_WORKERS).weights_file is None
    facts = preflight.node_facts(RunConfig(), CPU_WORKERS)
    assert (facts.weights_file, facts.device, facts.world_size, facts.takes_any_size) == (None, "cpu", 6,
                                                                                          True)
    vit = RunConfig().resolved({"model.name": "vit_b_16"})
    assert preflight.node_facts(vit, CPU_WORKERS).takes_any_size is False


def test_sync_batchnorm_is_refused_on_cpu_only():
    on = ModelConfig(sync_batchnorm=True)
    with pytest.raises(ConfigError) as refused:
        preflight.check_sync_batchnorm(on, "cpu")
    assert str(refused.value) == (
        "model.sync_batchnorm: torch's SyncBatchNorm runs on CUDA only and these workers train on CPU "
        "(gloo); set model.sync_batchnorm = false (each worker then normalises with its own batch)")
    preflight.check_sync_batchnorm(on, "cuda")
    preflight.check_sync_batchnorm(ModelConfig(sync_batchnorm=False), "cpu")


@pytest.fixture()
def loader_rule(monkeypatch):
    """`measure_loaders` and the /dev/shm check recorded (each has its own tests): the rule gives 3."""
    calls = {}

    def choose(*args, **kwargs):
        calls["choose"] = args, kwargs
        return LoaderChoice(workers=3, prefetch_factor=0, rule="the rule")

    monkeypatch.setattr(preflight, "measure_loaders", choose)
    monkeypatch.setattr(preflight, "check_shared_memory", lambda *args: calls.setdefault("shm", args))
    return calls


def fake_dataset(train_images: int = 1000):
    """A data set entry whose root is ("FS", "ROOT"), and an index of 3 classes."""
    entry = SimpleNamespace(open=lambda: ("FS", "ROOT"))
    splits = {"train": list(range(train_images)), "val": ["v"]}
    index = SimpleNamespace(classes=["a", "b", "c"], splits=splits)
    return entry, index


@pytest.mark.parametrize("split", ["train", "val"])
def test_node_loaders_are_measured_for_the_split(loader_rule, split):
    cfg = RunConfig().resolved({"augment.policy": "trivialaugment"})
    entry, index = fake_dataset()
    model = torch.nn.Linear(1, 1)
    choice = preflight.measure_node_loaders(cfg, CPU_WORKERS, entry, index, model, split)
    assert (choice.workers, choice.rule) == (3, "the rule")
    args, kwargs = loader_rule["choose"]
    assert args == (cfg.data, "cpu", 2, "FS", "ROOT", index.splits[split], model)
    assert kwargs == {"train": split == "train", "augment": cfg.augment}


def test_inference_resolves_a_checkpoints_loaders_on_this_node_and_checks_them_against_shm(loader_rule):
    trained = RunConfig().resolved({"data.workers": "auto", "data.prefetch_factor": "auto",
                                    "train.precision": "auto"})
    entry, index = fake_dataset()
    cfg = preflight.resolved_for_inference(trained, CPU_WORKERS, entry, index, torch.nn.Linear(1, 1), "val")
    assert (cfg.data.workers, cfg.data.prefetch_factor, cfg.train.precision) == (3, 2, "fp32")
    assert loader_rule["shm"] == (cfg.data, 3, 2, 2)  # the resolved loaders, for this node's 2 workers
    given = RunConfig().resolved({"data.workers": 1})
    assert preflight.resolved_for_inference(given, CPU_WORKERS, entry, index, None, "val").data.workers == 1


def test_preflight_keeps_what_its_checks_computed(loader_rule):
    cfg = RunConfig().resolved({"model.name": "resnet_tiny", "data.image_size": 32, "data.batch_size": 10,
                                "train.grad_accum": 2, "optim.lr_per_256": 0.64})
    entry, index = fake_dataset(1000)
    clock = StartupClock(last=0.0)
    build = SimpleNamespace(result=lambda: (entry, index))
    plan = preflight.preflight(cfg, build, CPU_WORKERS, "auto", clock)
    assert (plan.entry, plan.index, plan.workers, plan.resume) == (entry, index, CPU_WORKERS, "auto")
    assert (plan.cfg.data.workers, plan.cfg.data.prefetch_factor) == (3, 2)  # "auto" made concrete
    assert (plan.loaders.workers, plan.loaders.prefetch_factor, plan.loaders.rule) == (3, 2, "the rule")
    assert loader_rule["choose"][1]["train"] is True and loader_rule["shm"] == (plan.cfg.data, 3, 2, 2)
    assert plan.cfg.data.progressive and plan.cfg.data.min_image_size == 24  # resolved: the default recipe
    assert plan.model.head[-1].out_features == 3 and plan.model.head[-1].weight.is_meta
    assert plan.steps_per_epoch == 8  # 1000 images // 6 ranks // batch 10 = 16 batches, 2 per step
    assert isinstance(plan.steps_per_epoch, int)  # whole batches: the plan prints 8, not 8.0
    # the EMA's "auto" decay made concrete for config.toml: 8 steps an epoch, so averaged over 100 steps
    assert plan.cfg.train.ema_decay == pytest.approx(0.99) and plan.cfg.checkpoint.best_metric == "ema_top1"
    # and its BatchNorm recalibration's: the 12 epochs that end within those 100 steps (all at 24 px)
    assert plan.cfg.train.ema_bn_epochs == 12
    assert loader_rule["choose"][0][6] is plan.model  # the auto rule times this model
    assert plan.global_batch == 120 and plan.lr == pytest.approx(0.64 * 120 / 256)
    assert list(clock.phases) == ["index", "model_check", "data_workers"]


def test_preflight_without_a_clock_and_its_first_refusals(loader_rule, tmp_path):
    cfg = RunConfig().resolved({"model.name": "resnet_tiny", "data.image_size": 32, "data.batch_size": 10})
    build = SimpleNamespace(result=lambda: fake_dataset(60))
    assert preflight.preflight(cfg, build, CPU_WORKERS).resume == "never"
    with pytest.raises(ConfigError, match="^data.batch_size: larger than a rank's share"):
        preflight.preflight(cfg, SimpleNamespace(result=lambda: fake_dataset(59)), CPU_WORKERS)
    with pytest.raises(ConfigError, match="^--resume"):
        preflight.preflight(cfg, build, CPU_WORKERS, str(tmp_path / "gone.pt"))
    synced = cfg.resolved({"model.sync_batchnorm": True})
    with pytest.raises(ConfigError, match="^model.sync_batchnorm"):
        preflight.preflight(synced, build, CPU_WORKERS)
    gpu_workers = preflight.Workers(nproc=2, nnodes=3, backend="nccl", device="cuda", native_precision="fp32")
    assert preflight.preflight(synced, build, gpu_workers).cfg.model.sync_batchnorm


def test_a_run_dir_under_a_file_is_a_config_error_naming_the_flag(tmp_path):
    (tmp_path / "demo.toml").write_text("")
    for given in (tmp_path / "demo.toml" / "sub", tmp_path / "demo.toml"):
        with pytest.raises(ConfigError) as refused:
            preflight.check_run_dir(preflight.RunDir(given))
        assert str(refused.value) == (f"--run-dir {given}: {tmp_path / 'demo.toml'} is a file, not a folder; "
                                      "give a folder for --run-dir (made if missing)")
    preflight.check_run_dir(preflight.RunDir(tmp_path / "new" / "run"))  # made when the run starts


@pytest.mark.parametrize("read_only", [False, True], ids=["no-permission", "read-only-fs"])
def test_a_run_dir_nobody_can_write_in_is_exit_6_naming_the_flag(tmp_path, monkeypatch, read_only):
    """Before anything is measured, not by the first worker's write. (Root may write anywhere: the
    access check stands in for the user the test cannot be.)"""
    folder = tmp_path / "runs"
    folder.mkdir(mode=0o555)
    real = os.access
    monkeypatch.setattr(preflight.os, "access",  # the folder refuses writes, not a look
                        lambda path, mode: not (path == folder and mode & os.W_OK) and real(path, mode))
    flags = os.ST_RDONLY if read_only else 0
    monkeypatch.setattr(preflight.os, "statvfs", lambda path: SimpleNamespace(f_flag=flags if path == folder
                                                                               else 1 / 0))
    with pytest.raises(WriteError) as refused:
        preflight.check_run_dir(preflight.RunDir(folder / "demo", "checkpoint.dir"))
    who = owner(folder.stat().st_uid)
    words = "read-only file system" if read_only else f"permission denied ({folder}: owner {who}, mode 0555)"
    assert str(refused.value) == (f"checkpoint.dir {folder / 'demo'}: cannot write in {folder}: {words}; "
                                  "give a checkpoint.dir you can write")
    assert refused.value.exit_code == 6


def test_preflight_checks_the_run_dir_before_the_index(tmp_path):
    """The cheap check first: a run dir under a file is refused before the index is waited for."""
    (tmp_path / "f").write_text("")
    never = SimpleNamespace(result=lambda: pytest.fail("the index was waited for"))
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        preflight.preflight(RunConfig(), never, CPU_WORKERS, run_dir=preflight.RunDir(tmp_path / "f" / "x"))


def test_validate_meets_its_launchs_workers_and_a_model_for_the_checkpoints_classes(monkeypatch):
    monkeypatch.setattr(preflight, "cuda_devices", lambda: 0)
    cfg = RunConfig().resolved({"model.name": "resnet_tiny", "data.image_size": 32,
                                "distributed.backend": "gloo", "train.precision": "fp32"})
    workers, model = preflight.validation_workers(cfg, 7, LaunchOptions(nproc_per_node=2))
    assert workers == preflight.Workers(2, 1, "gloo", "cpu", NATIVE)
    assert model.head[-1].out_features == 7


def test_our_launch_checks_the_rendezvous_warns_of_loopback_and_places_its_workers(monkeypatch):
    seen = {}
    monkeypatch.setattr(preflight, "check_rendezvous", lambda *args: seen.setdefault("rendezvous", args))
    monkeypatch.setattr(preflight, "warn_loopback_host", lambda *args: seen.setdefault("loopback", args))
    monkeypatch.setattr(preflight, "resolve_nproc", lambda *args: seen.setdefault("nproc", args) and 3)
    monkeypatch.setattr(preflight, "cuda_devices", lambda: 0)
    cfg = RunConfig().resolved({"distributed.backend": "gloo", "train.precision": "fp32"})
    opts = LaunchOptions(nnodes=2, rdzv_endpoint="head:29500")
    workers = preflight.launch_workers(cfg, opts)
    assert workers == preflight.Workers(3, 2, "gloo", "cpu", NATIVE)
    assert seen == {"rendezvous": (opts, cfg.distributed), "loopback": (2, "head:29500", os.environ),
                    "nproc": (opts, cfg.distributed)}


def test_workers_take_a_gpu_each_where_the_driver_shows_enough(monkeypatch):
    monkeypatch.setattr(preflight, "cuda_devices", lambda: 2)  # counted through the driver: CUDA untouched
    cfg = RunConfig().resolved({"distributed.backend": "auto", "train.precision": "fp16"})
    placed = preflight.place_workers(cfg, 2, 1)
    assert (placed.nproc, placed.nnodes, placed.backend, placed.device) == (2, 1, "nccl", "cuda")
    with pytest.raises(ConfigError, match="this node has 2 for 3 workers"):
        preflight.place_workers(cfg, 3, 1)


def test_gpus_torch_cannot_use_refuse_any_backend_but_gloo(monkeypatch):
    monkeypatch.setattr("ddp_cli.distributed.setup.gpu_problem", lambda: "the driver is too old")
    monkeypatch.setattr(preflight, "cuda_devices", lambda: 0)
    fp32 = {"train.precision": "fp32"}
    with pytest.raises(ConfigError, match="^distributed.backend = 'auto': the driver is too old"):
        preflight.place_workers(RunConfig().resolved(fp32), 1, 1)
    gloo = RunConfig().resolved({**fp32, "distributed.backend": "gloo"})
    assert preflight.place_workers(gloo, 1, 1).device == "cpu"


def test_an_unreadable_ddp_faults_stops_preflight_not_each_worker(loader_rule, monkeypatch):
    cfg = RunConfig().resolved({"model.name": "resnet_tiny", "data.image_size": 32, "data.batch_size": 10})
    build = SimpleNamespace(result=lambda: fake_dataset(60))
    monkeypatch.setenv("DDP_FAULTS", "sigterm@soon")
    with pytest.raises(ConfigError, match="^DDP_FAULTS: cannot read 'sigterm@soon'"):
        preflight.preflight(cfg, build, CPU_WORKERS)
    monkeypatch.setenv("DDP_FAULTS", "sigterm@6")
    assert preflight.preflight(cfg, build, CPU_WORKERS).resume == "never"


def test_loaders_as_set_are_not_measured(loader_rule):
    """data.workers given: no measurement (it costs a decode of the split's images), the number as set."""
    cfg = RunConfig().resolved({"model.name": "resnet_tiny", "data.image_size": 32, "data.batch_size": 10,
                                "data.workers": 2})
    plan = preflight.preflight(cfg, SimpleNamespace(result=lambda: fake_dataset(1000)), CPU_WORKERS)
    assert "choose" not in loader_rule
    assert (plan.cfg.data.workers, plan.loaders.rule) == (2, "data.workers as set")
    entry, index = fake_dataset()
    given = preflight.resolved_for_inference(cfg, CPU_WORKERS, entry, index, None, "val")
    assert "choose" not in loader_rule and given.data.workers == 2
    model = torch.nn.Linear(1, 1)
    preflight.resolved_for_inference(RunConfig(), CPU_WORKERS, entry, index, model, "val")
    assert loader_rule["choose"][0][6] is model  # the rule times the checkpoint's model


def test_fp16_workers_on_cpu_are_refused_where_they_are_placed(monkeypatch):
    monkeypatch.setattr(preflight, "cuda_devices", lambda: 0)
    with pytest.raises(ConfigError, match="train.precision: fp16 needs CUDA"):
        preflight.place_workers(RunConfig().resolved({"train.precision": "fp16"}), 1, 1)


def test_the_facts_of_a_gpu_node_and_of_weights_that_are_not_timms(monkeypatch):
    monkeypatch.setattr("ddp_cli.data.pipeline.device_decode.torchvision.version.cuda", "12.8")
    gpus = preflight.Workers(nproc=8, nnodes=1, backend="nccl", device="cuda", native_precision="bf16")
    assert preflight.node_facts(RunConfig(), gpus).gpu_decode is True
    assert preflight.node_facts(RunConfig(), CPU_WORKERS).gpu_decode is False
    # "pretrained" names timm's weights only: for a torchvision model no cache is looked up here (the
    # model check refuses it with its own words)
    torchvision_named = RunConfig().resolved({"model.weights": "pretrained"})
    assert preflight.node_facts(torchvision_named, gpus).pretrained is None


def test_a_checkpoint_is_estimated_as_its_parameters_buffers_and_optimiser_state():
    """checkpoint_bytes on the meta device: parameters once, buffers once, the EMA's copy of both, and
    the optimiser's per-parameter tensors (SGD with momentum: one)."""
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.BatchNorm1d(10)).to("meta")
    params = (10 * 10 + 10 + 10 + 10) * 4
    buffers = (10 + 10) * 4 + 8  # running mean and var (float32), num_batches_tracked (int64)
    plain = RunConfig().resolved({"train.ema_decay": 0, "optim.momentum": 0.0})
    assert preflight.checkpoint_bytes(plain, model) == params + buffers
    ema = RunConfig().resolved({"train.ema_decay": 0.99, "optim.momentum": 0.9})
    assert preflight.checkpoint_bytes(ema, model) == 2 * (params + buffers) + params
