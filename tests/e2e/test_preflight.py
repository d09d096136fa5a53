"""One preflight: whatever `ddp train --dry-run` refuses, `ddp train` refuses with the same line and
exit code, before any worker starts (ddp_cli/cli/preflight.py).

The table runs the CLI in this process, through the real entry point (`ddp_cli.cli:main`), with
`launch` and `prepare_job` replaced by a tripwire; one case also runs as real subprocesses, to
prove the in-process path is the one the installed `ddp` takes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomli_w
import torch
from conftest import REPO, run_ddp
from synthetic import write_registry

from ddp_cli.cli import main
from ddp_cli.cli.commands import training
from ddp_cli.run import launch

DEMO = str(REPO / "configs/demo.toml")
# the CLI sets these for its process; the monkeypatch restores the caller's afterwards
CLI_ENV = {"LOGLEVEL": "CRITICAL", "TORCH_CPP_LOG_LEVEL": "FATAL", "DDP_LOG_LEVEL": "INFO"}


@dataclass
class Bad:
    """A bad input: `ddp train CONFIG ARGS` must exit `code` with `message` in its one error line."""

    args: list[str]
    code: int
    message: str
    gpus: int = 0  # CUDA devices the machine pretends to have
    config: str | None = None  # a config file's text instead of configs/demo.toml
    hide: list[str] = field(default_factory=list)  # modules that cannot be imported


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


BAD = {
    "nesterov without momentum": Bad(sets("optim.nesterov=true", "optim.momentum=0"), 2,
                                     "optim.nesterov: needs optim.momentum > 0"),
    "sync_batchnorm on gloo, 2 workers": Bad(sets("model.sync_batchnorm=true"), 2,
                                             "model.sync_batchnorm: torch's SyncBatchNorm runs on CUDA only"),
    "sync_batchnorm on gloo, 1 worker": Bad([*sets("model.sync_batchnorm=true"), "--nproc-per-node", "1"],
                                            2, "model.sync_batchnorm"),
    "fp16 on CPU": Bad(sets('train.precision="fp16"'), 2, "train.precision: fp16 needs CUDA"),
    "nccl without GPUs": Bad(sets('distributed.backend="nccl"'), 2,
                             "distributed.backend = 'nccl': nccl needs one CUDA device per worker and "
                             "this node has 0 for 2 workers; use distributed.backend"),
    "nccl, more workers than GPUs": Bad([*sets('distributed.backend="nccl"', 'train.precision="fp32"'),
                                         "--nproc-per-node", "2"], 2,
                                        "this node has 1 for 2 workers; use --nproc-per-node 1 or", gpus=1),
    "auto, more workers than GPUs": Bad([*sets('distributed.backend="auto"', 'train.precision="fp32"'),
                                         "--nproc-per-node", "3"], 2,
                                        "distributed.backend = 'auto': nccl needs one CUDA device", gpus=2),
    "batch larger than a rank's share": Bad(sets("data.batch_size=1000"), 2,
                                            "data.batch_size: larger than a rank's share"),
    "grad_accum leaves no step": Bad(sets("distributed.static_graph=false", "train.grad_accum=23"), 2,
                                     "data.batch_size: larger than a rank's share"),
    "unknown model": Bad(sets("model.name=resnet_huge"), 2, "model.name: unknown model 'resnet_huge'"),
    "unknown data set": Bad(sets("data.dataset=nope"), 2, "unknown data set 'nope'"),
    "data set root missing": Bad(sets("data.dataset=gone"), 3, "does not exist"),
    "unknown key": Bad(sets("optim.momentun=0.5"), 2,
                       "optim.momentun: unknown key (did you mean 'momentum'?)"),
    "negative lr": Bad(sets("optim.lr=-0.1"), 2, "optim.lr:"),
    "static_graph with grad_accum 2": Bad(sets("train.grad_accum=2"), 2, "distributed.static_graph:"),
    "classes out of range": Bad(sets("data.classes=11"), 2, "data.classes: 11 is out of range"),
    "weights file missing": Bad(sets("model.weights=/nonexistent/w.pt"), 2,
                                "model.weights: /nonexistent/w.pt: no such file"),
    "a model that cannot be built for the size": Bad(sets("model.name=vit_b_16", "data.image_size=40"), 2,
                                                     "model.name: vit_b_16 cannot be built"),
    "image size the model cannot take": Bad(sets("model.name=inception_v3", "data.image_size=64",
                                                 "data.progressive=false"), 2,
                                            "model.name: inception_v3 cannot take 64x64"),
    "min_image_size above image_size": Bad(sets("data.min_image_size=64"), 2,
                                           "data: min_image_size 64 is above image_size 32"),
    "nnodes 2 without endpoint": Bad(["--nnodes", "2"], 2, "--nnodes > 1 needs --rdzv-endpoint"),
    "resume from a missing path": Bad(["--resume", "/nonexistent/last.pt"], 2,
                                      "--resume /nonexistent/last.pt: no such checkpoint"),
    "wandb not installed": Bad(sets('logging.wandb={project="p", mode="offline"}'), 2,
                               "logging.wandb: the wandb package is not installed", hide=["wandb"]),
    "tensorboard not installed": Bad(sets("logging.tensorboard=true"), 2,
                                     "logging.tensorboard: the tensorboard package is not installed",
                                     hide=["tensorboard"]),
    "TOML syntax error": Bad([], 2, "TOML syntax error", config='name = "x"\n[data\nbatch_size = 3\n'),
}


@pytest.fixture(scope="module")
def registry(demo_root, tmp_path_factory) -> Path:
    """The session's demo and `gone`, a data set whose root does not exist."""
    return write_registry(tmp_path_factory.mktemp("preflight"), [
        {"name": "demo", "layout": "imagenet-loc", "generator": "sklearn-digits",
         "storage": {"driver": "FileSystem", "path": str(demo_root)}},
        {"name": "gone", "layout": "imagenet-loc",
         "storage": {"driver": "FileSystem", "path": str(demo_root.parent / "gone")}},
    ])


@pytest.fixture()
def tripwire(monkeypatch) -> list[str]:
    """What `train` started: it must start nothing (no run dir, no worker) for a bad input."""
    started: list[str] = []
    monkeypatch.setattr(training, "prepare_job", lambda folder, *a, **k: started.append(f"job {folder}"))
    # training imports `launch` when it launches (torch: not at start-up), so the tripwire sits in run.launch
    monkeypatch.setattr(launch, "launch", lambda folder, *a, **k: started.append(f"workers {folder}"))
    return started


def ddp(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """`ddp ARGS` in this process: (exit code, the one error line)."""
    monkeypatch.setattr(sys, "argv", ["ddp", *args])
    for name, value in CLI_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        main()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return exited.value.code, lines[0]


def pretend_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_dry_run_and_train_refuse_alike_before_any_worker(case, registry, tripwire, monkeypatch, capsys,
                                                          tmp_path):
    bad = BAD[case]
    pretend_gpus(monkeypatch, bad.gpus)
    for name in bad.hide:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` fails, find_spec says None
    config = DEMO
    if bad.config is not None:
        config = str(tmp_path / "bad.toml")
        Path(config).write_text(bad.config)
    args = ["train", config, "--registry", str(registry), *bad.args]
    planned = ddp(monkeypatch, capsys, *args, "--dry-run")
    trained = ddp(monkeypatch, capsys, *args, "--run-dir", str(tmp_path / "run"))
    assert planned == trained
    code, line = trained
    assert code == bad.code and bad.message in line, line
    assert tripwire == [] and not (tmp_path / "run").exists()


def test_a_good_config_gets_through_to_the_workers(registry, tripwire, monkeypatch, capsys, tmp_path):
    """The tripwire trips for a config preflight accepts: the table's refusals are preflight's."""
    monkeypatch.setattr(training, "read_result", lambda folder: {})
    monkeypatch.setattr(sys, "argv", ["ddp", "train", DEMO, "--registry", str(registry), "--json",
                                      "--run-dir", str(tmp_path / "run")])
    for name, value in CLI_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 0, capsys.readouterr().err
    assert tripwire == [f"job {tmp_path / 'run'}", f"workers {tmp_path / 'run'}"]


@pytest.fixture()
def checkpoint(tmp_path) -> Path:
    """The least `ddp validate` reads before its preflight: a ddp checkpoint's marker and classes."""
    path = tmp_path / "last.pt"
    torch.save({"format": 1, "classes": [f"n{i:08d}" for i in range(10)], "config": {}}, path)
    return path


SMALL = {"name": "v", "data": {"dataset": "demo", "image_size": 32, "val_resize": 32, "batch_size": 8},
         "model": {"name": "resnet_tiny"}, "train": {"precision": "fp32"}}


# A config's precision and backend are not among them: inference chooses those for the machine it runs
# on (tests/unit/test_inference_machine.py, tests/e2e/test_gpu_checkpoint_on_cpu.py).
@pytest.mark.parametrize(("section", "key", "value", "gpus", "message"), [
    ("distributed", "backend", "auto", 1, "this node has 1 for 2 workers; use --nproc-per-node 1"),
    ("model", "name", "resnet_huge", 0, "model.name: unknown model 'resnet_huge'"),
])
def test_validate_meets_the_rules_that_apply(section, key, value, gpus, message, checkpoint, registry,
                                             tripwire, monkeypatch, capsys, tmp_path):
    """Workers and model: validate refuses them as train does, before any worker."""
    pretend_gpus(monkeypatch, gpus)
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps({**SMALL, section: {**SMALL.get(section, {}), key: value}}))
    common = ["--registry", str(registry), "--nproc-per-node", "2"]
    validated = ddp(monkeypatch, capsys, "validate", "--checkpoint", str(checkpoint), "--config", str(config),
                    *common)
    planned = ddp(monkeypatch, capsys, "train", str(config), *common, "--dry-run")
    assert validated == planned and validated[0] == 2 and message in validated[1]
    assert tripwire == []


def test_the_real_command_refuses_sync_batchnorm_on_gloo(demo_registry, tmp_path):
    """As subprocesses: the dry run and the run print the same line, exit 2, start nothing."""
    args = ["train", "configs/demo.toml", "--registry", str(demo_registry),
            "--set", "model.sync_batchnorm=true"]
    planned = run_ddp(*args, "--dry-run", timeout=120)
    trained = run_ddp(*args, "--run-dir", str(tmp_path / "run"), timeout=120)
    assert planned.returncode == trained.returncode == 2, trained.stderr
    assert planned.stderr == trained.stderr
    assert trained.stderr.startswith("error: model.sync_batchnorm: torch's SyncBatchNorm runs on CUDA only")
    assert len(trained.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
