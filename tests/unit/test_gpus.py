"""GPUs read from the driver (NVML), never by initialising CUDA in the launcher; GPUs torch cannot use
are refused by name (issue 26). No GPU here: NVML and torch.cuda are mocked."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CLI_ENV
from typer.testing import CliRunner

from ddp_cli.cli import app, envinfo
from ddp_cli.cli.commands.machine import auto_choices
from ddp_cli.config import DistributedConfig, RunConfig, TrainConfig
from ddp_cli.distributed import gpus
from ddp_cli.errors import ConfigError
from ddp_cli.preflight import launch_workers
from ddp_cli.run.launch import LaunchOptions

H100 = [gpus.Gpu(i, "NVIDIA H100 80GB HBM3", f"GPU-{i:04d}aaaa", 79.6, (9, 0)) for i in range(8)]
OLD_DRIVER = gpus.Nvml("470.82.01", (11, 4), H100)


class FakeNvml:
    """libnvidia-ml.so.1's functions used, answering through their ctypes out-arguments."""

    def __init__(self, count: int = 2) -> None:
        self.count, self.shut = count, False

    def nvmlInit_v2(self):
        return 0

    def nvmlShutdown(self):
        self.shut = True
        return 0

    def nvmlSystemGetDriverVersion(self, buffer, length):
        buffer.value = b"550.54.15"
        return 0

    def nvmlSystemGetCudaDriverVersion_v2(self, ref):
        ref._obj.value = 12040
        return 0

    def nvmlDeviceGetCount_v2(self, ref):
        ref._obj.value = self.count
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, ref):
        ref._obj.value = 1000 + index.value
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        major._obj.value, minor._obj.value = (8, 0) if handle.value == 1000 else (7, 5)
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, ref):
        ref._obj[0] = 40 * 2**30
        return 0

    def nvmlDeviceGetName(self, handle, buffer, length):
        buffer.value = f"GPU{handle.value - 1000}".encode()
        return 0

    def nvmlDeviceGetUUID(self, handle, buffer, length):
        buffer.value = f"GPU-{handle.value}-uuid".encode()
        return 0


def test_nvml_is_read_through_its_c_api():
    lib = FakeNvml()
    nvml = gpus.read_nvml(lib)
    assert nvml.driver == "550.54.15" and nvml.cuda == (12, 4) and lib.shut
    assert [(g.index, g.name, g.uuid, g.memory_gib, g.capability) for g in nvml.gpus] == [
        (0, "GPU0", "GPU-1000-uuid", 40.0, (8, 0)), (1, "GPU1", "GPU-1001-uuid", 40.0, (7, 5))]


def test_no_driver_is_none(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(gpus.ctypes, "CDLL", missing)
    assert gpus.read_nvml() is None


@pytest.mark.parametrize(("spec", "expected"), [
    (None, [0, 1, 2, 3, 4, 5, 6, 7]),
    ([3, 1], [3, 1]),
    ([2, 9, 4], [2]),  # CUDA stops at the first device that does not exist
    (["GPU-0005"], [5]),  # a UUID prefix
    ([], []),
])
def test_cuda_visible_devices_choose_among_the_drivers_gpus(spec, expected):
    assert [g.index for g in gpus.visible(H100, spec)] == expected


@pytest.fixture()
def driver_too_old(monkeypatch):
    """8 GPUs in NVML, a driver for CUDA 11.4, torch built for CUDA 13.0: torch sees no GPU."""
    monkeypatch.setattr(gpus, "read_nvml", lambda lib=None: OLD_DRIVER)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")


def test_a_driver_too_old_for_torch_is_named_with_both_fixes(driver_too_old):
    problem = gpus.gpu_problem()
    assert "8 GPUs" in problem and "470.82.01" in problem and "CUDA up to 11.4" in problem
    assert "built for CUDA 13.0" in problem and "newer NVIDIA driver" in problem
    assert "https://download.pytorch.org/whl/cu118" in problem  # the newest wheel CUDA 11.4 runs


def test_auto_on_such_a_node_is_refused_not_run_on_the_cpu(driver_too_old):
    cfg = RunConfig(train=TrainConfig(precision="auto"))  # backend and nproc_per_node "auto"
    with pytest.raises(ConfigError, match=r"distributed.backend = 'auto': .*470\.82\.01.*CUDA 13\.0"):
        launch_workers(cfg, LaunchOptions())
    gloo = RunConfig(distributed=DistributedConfig(backend="gloo"))
    assert launch_workers(gloo, LaunchOptions()).backend == "gloo"  # the CPU, asked for by name


def test_ddp_env_shows_the_same_finding(driver_too_old):
    refused = auto_choices()["auto_refused"]
    assert refused.endswith('set distributed.backend = "gloo" to train on the CPU regardless')
    info = envinfo.machine()
    assert info["gpu_problem"] == gpus.gpu_problem() and info["gpus"] == []
    assert info["nvidia"] == {"driver": "470.82.01", "cuda": "11.4", "gpus": 8}


def test_a_cpu_build_of_torch_on_a_gpu_node_is_named(monkeypatch, driver_too_old):
    monkeypatch.setattr(torch.version, "cuda", None)
    problem = gpus.gpu_problem()
    assert "CPU-only build" in problem and "cu118" in problem


def test_no_problem_where_torch_uses_the_gpus_or_there_are_none(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpus.gpu_problem(H100, (12, 4), "550.54.15") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpus.gpu_problem([], None, None) is None


def test_the_driver_version_from_the_kernel_module_without_nvml(monkeypatch, tmp_path):
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.104.05  Release Build  "
                       "(dvs-builder@U16-I3-B03-4-3)  Thu Aug 17 19:37:51 UTC 2023\nGCC version:  gcc 12\n")
    monkeypatch.setattr(gpus, "read_nvml", lambda lib=None: None)
    monkeypatch.setattr(gpus, "DRIVER_FILE", version)
    assert gpus.driver_version() == "535.104.05"


@pytest.fixture()
def eight_h100s(monkeypatch):
    """A node torch uses 8 GPUs of, where initialising CUDA in this process is an error."""
    def initialised(*args, **kwargs):
        raise AssertionError("the launcher initialised CUDA")

    monkeypatch.setattr(gpus, "read_nvml", lambda lib=None: gpus.Nvml("550.54.15", (12, 4), H100))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in ("_lazy_init", "init", "current_device", "get_device_properties", "get_device_capability"):
        monkeypatch.setattr(torch.cuda, name, initialised)


def test_the_launcher_places_gpu_workers_without_initialising_cuda(eight_h100s):
    workers = launch_workers(RunConfig(train=TrainConfig(precision="auto")), LaunchOptions())
    assert (workers.nproc, workers.backend, workers.device, workers.native_precision) == (
        8, "nccl", "cuda", "bf16")
    assert auto_choices() == {"precision_auto": "bf16", "backend_auto": "nccl", "nproc_per_node_auto": 8}
    assert [g["capability"] for g in envinfo.gpus()] == ["9.0"] * 8


def test_a_dry_run_on_a_gpu_node_leaves_cuda_uninitialised(eight_h100s, demo_registry):
    sets = ["--set", "train.precision='auto'", "--set", "distributed.backend='auto'"]
    result = CliRunner().invoke(app, ["train", "configs/demo.toml", "--registry", str(demo_registry), *sets,
                                      "--dry-run", "--json"], env=CLI_ENV)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    assert (plan["world_size"], plan["backend"], plan["precision"]) == (2, "nccl", "bf16")  # demo: 2 per node


def test_bf16_support_of_older_gpus_is_read_from_the_driver_too(monkeypatch):
    turing = [gpus.Gpu(0, "Tesla T4", "GPU-t4", 15.0, (7, 5))]
    monkeypatch.setattr(gpus, "read_nvml", lambda lib=None: gpus.Nvml("550.54.15", (12, 4), turing))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    from ddp_cli.train.precision import native_precision

    assert native_precision(torch.device("cuda", 0)) == "fp32"
