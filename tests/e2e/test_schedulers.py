"""The examples/ of each scheduler, run as that scheduler would: two "pods" or "nodes" as processes on
loopback, each with the environment the scheduler gives it (the operator's PET_* variables, SLURM's,
torchrun's), the example's own command, and a shared folder standing for the volume every pod mounts.

The commands run as written but for three things: `ddp` is this checkout's, the run dir's mount point
is a temporary folder, and the demo is cut short (8 px, a few steps) for the test's time (a GPU
example's config is pointed at the demo's data, a tiny model and gloo).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from ddp_cli.run.loopback import free_port

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples"
SHORT = ["--set", "data.image_size=8", "--set", "data.val_resize=8", "--set", "data.workers=0",
         "--set", "train.epochs=1", "--set", "train.max_steps_per_epoch=4", "--set", "logging.every_steps=1",
         "--set", "distributed.rdzv_timeout_s=60"]
# a GPU example's run on the CPU demo: the --sets after its own win
ON_THE_DEMO = ["--set", "data.dataset=demo", "--set", "model.name=resnet_tiny",
               "--set", "distributed.backend=gloo"]
# the elastic job: the demo to the end (4 epochs, 22 steps each at world size 2, 0.95 top-1 at 8 px),
# a pod lost in epoch 3, both pods in the first world (rdzv_last_call_s), the lost peer noticed within
# 8 s (timeout_s), step checkpoints to go on from
ELASTIC = [f"--set={s}" for s in ("data.image_size=8", "data.val_resize=8", "data.workers=0",
                                   "train.epochs=4", "logging.every_steps=1", "checkpoint.every_steps=5",
                                   "distributed.rdzv_timeout_s=60", "distributed.rdzv_last_call_s=3",
                                   "distributed.timeout_s=8")]
# what a scheduler's pod or node starts from: nothing of the test runner's own distributed variables
CLEAN = {k: v for k, v in os.environ.items()
         if not k.startswith(("PET_", "SLURM_", "TORCHELASTIC_")) and k not in
         ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


@pytest.fixture()
def ddp_on_path(tmp_path) -> dict[str, str]:
    """`ddp` on PATH as this checkout's (the venv's console script may belong to another)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "ddp"
    script.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m ddp_cli \"$@\"\n")
    script.chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


class Pods:
    """Processes started in sessions of their own, each killed whole at the end whatever happened."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        self.procs.append(proc)
        return proc

    def finish(self, timeout: float = 200) -> list[tuple[int, str, str]]:
        """Each pod's exit code, stdout and stderr, all to the end."""
        outputs = [p.communicate(timeout=timeout) for p in self.procs]
        return [(p.returncode, *out) for p, out in zip(self.procs, outputs, strict=True)]

    def kill(self, proc: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def close(self) -> None:
        for proc in self.procs:
            self.kill(proc)
            proc.communicate()


@pytest.fixture()
def pods():
    started = Pods()
    yield started
    started.close()


def container(manifest: Path, replica: str = "Master") -> tuple[dict, dict]:
    """The PyTorchJob and the container of its `replica` pods."""
    doc = yaml.safe_load(manifest.read_text())
    return doc, doc["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"][0]


def mounted(command: list[str], tmp_path: Path) -> list[str]:
    """The container's command with its /runs volume in a temporary folder, on the test's registry."""
    return [arg.replace("/runs/", f"{tmp_path}/runs/") for arg in command]


def result_of(stdout: str) -> dict:
    """The run's JSON result line (under `torchrun --tee`, after its `[rank]:` prefix)."""
    lines = [line[line.index("{"):] for line in stdout.splitlines() if '{"run_dir"' in line]
    assert lines, stdout
    return json.loads(lines[-1])


def test_a_pytorchjob_of_two_pods_with_two_processes_each_is_one_world_of_4(
        pods, demo_registry, ddp_on_path, tmp_path):
    doc, pod = container(EXAMPLES / "kubeflow/pytorchjob.yaml")
    replicas = {name: spec["replicas"] for name, spec in doc["spec"]["pytorchReplicaSpecs"].items()}
    n, nproc, port = sum(replicas.values()), doc["spec"]["nprocPerNode"], str(free_port())
    assert (n, nproc) == (2, "2")
    for rank in range(n):  # as the operator sets them (pkg/controller.v1/pytorch: envvar.go, master.go)
        env = {**CLEAN, **ddp_on_path, **{e["name"]: e["value"] for e in pod["env"]},
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(n), "RANK": str(rank),
               "PET_NNODES": str(n), "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": nproc,
               "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port, "PYTHONUNBUFFERED": "0"}
        pods.start([*mounted(pod["command"], tmp_path), "--registry", str(demo_registry), "--json", *SHORT],
                   env)
    finished = pods.finish()
    assert [code for code, _, _ in finished] == [0, 0], "\n".join(err[-2500:] for _, _, err in finished)
    for _, stdout, _ in finished:
        result = result_of(stdout)
        assert result["world_size"] == 4 and result["final"]["images"] == 359, result
    config = tmp_path / "runs/ddp-demo/config.toml"
    assert config.is_file()  # the command's own --run-dir, on the shared volume


def test_an_elastic_pytorchjob_goes_on_without_a_lost_pod_and_reaches_095(
        pods, demo_registry, ddp_on_path, tmp_path):
    """Node loss under an elastic job: the survivor restarts from the last step checkpoint at world size 1
    and still trains the demo to its accuracy."""
    doc, pod = container(EXAMPLES / "kubeflow/pytorchjob-elastic.yaml", "Worker")
    policy, port = doc["spec"]["elasticPolicy"], str(free_port())
    run_dir = tmp_path / "runs/ddp-elastic"
    started = []
    for index in range(doc["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]):  # elastic.go's variables
        env = {**CLEAN, **ddp_on_path, **{e["name"]: e["value"] for e in pod["env"]},
               "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}", "PET_RDZV_BACKEND": policy["rdzvBackend"],
               "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
               "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
               "PET_NPROC_PER_NODE": doc["spec"]["nprocPerNode"],
               "HOSTNAME": f"{doc['metadata']['name']}-worker-{index}"}
        started.append(pods.start([*mounted(pod["command"], tmp_path), "--registry", str(demo_registry),
                                   "--json", *ELASTIC], env))
    # both pods in the world (pod 1's worker is rank 1), then pod 1 is lost in epoch 3 of 4
    wait_until(lambda: (run_dir / "logs/rank1.stderr.log").exists(), started[0])
    wait_until(lambda: train_step(run_dir / "metrics.jsonl") >= 50, started[0])
    pods.kill(started[1])  # its launcher and its worker, at once
    stdout, stderr = started[0].communicate(timeout=240)
    assert started[0].returncode == 0, stderr[-3000:]
    result = result_of(stdout)
    assert result["restarts"] >= 1 and result["world_sizes"][-2:] == [2, 1], result
    assert result["world_size"] == 1 and result["final"]["top1"] >= 0.95, result
    assert result["final"]["images"] == 359
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    changes = [(r["previous"], r["world_size"]) for r in records if r.get("split") == "world_size"]
    assert changes[-1] == (2, 1), changes


def train_step(metrics: Path) -> int:
    """The newest train step metrics.jsonl records (0 before the first); a line being written is skipped."""
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line).get("step", 0) for line in lines if line.endswith("}") and '"train"' in line]
    return max(steps, default=0)


def wait_until(condition, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline and proc.poll() is None, f"not within {timeout} s"
        time.sleep(0.2)


def torchrun(nnodes: int, nproc: int, *how: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node",
            str(nproc), *how]


def test_a_trainjob_starts_ddp_under_torchrun_and_ddp_trains_as_its_workers(
        pods, demo_registry, ddp_on_path, tmp_path):
    trainer = yaml.safe_load((EXAMPLES / "kubeflow/trainjob.yaml").read_text())["spec"]["trainer"]
    nnodes, nproc, port = trainer["numNodes"], trainer["numProcPerNode"], str(free_port())
    for rank in range(nnodes):  # the torch-distributed runtime: torchrun reads PET_* as its flags
        env = {**CLEAN, **ddp_on_path, **{e["name"]: e["value"] for e in trainer["env"]},
               "PET_NNODES": str(nnodes), "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(rank),
               "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port}
        pods.start([sys.executable, "-m", "torch.distributed.run", "--no-python",
                    *mounted(trainer["command"], tmp_path), "--registry", str(demo_registry), "--json",
                    *SHORT], env)
    finished = pods.finish()
    assert [code for code, _, _ in finished] == [0, 0], "\n".join(err[-2500:] for _, _, err in finished)
    result = result_of(finished[0][1])  # rank 0's process, on node 0, prints the run's result
    assert result["world_size"] == 4 and result["final"]["images"] == 359, result


def test_the_torchx_line_and_the_sbatch_script_launch_two_nodes(pods, demo_registry, ddp_on_path, tmp_path):
    """TorchX's dist.ddp: torchrun with a c10d rendezvous on node 0's host, whichever agent binds it
    first hosting it (one process per node here, on 2 cores, for the line's 8 GPUs); the sbatch
    script: `srun` starts its command once per node (its ResNet-50 on ImageNet over NCCL made the
    demo's data, a tiny model and gloo by later --sets, for a machine without GPUs)."""
    line = (EXAMPLES / "torchx/run.sh").read_text().split("torchx run", 1)[1]
    words = shlex.split(line.replace("\\\n", ""))
    nnodes = int(words[words.index("-j") + 1].split("x")[0])
    module, args = words[words.index("-m") + 1], words[words.index("--") + 1:]
    port = str(free_port())
    for _ in range(nnodes):
        how = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "torchx-app",
               "--tee", "3", "--role", "", "-m", module]  # dist.ddp's torchrun flags (no node rank)
        pods.start([*torchrun(nnodes, 1, *how), *mounted(args, tmp_path), "--registry", str(demo_registry),
                    "--json", *SHORT], {**CLEAN, **ddp_on_path, "OMP_NUM_THREADS": "1"})
    script = (EXAMPLES / "slurm/train.sbatch").read_text().replace("\\\n", "")
    nodes = int(next(s.split("=")[1] for s in script.splitlines() if s.startswith("#SBATCH --nodes")))
    command = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "#SBATCH --gpus-per-node=8" in script and "distributed.backend=nccl" in command  # a GPU job
    slurm_port = str(free_port())
    for node in range(nodes):  # what srun gives each node's task
        env = {**CLEAN, **ddp_on_path, "SLURM_JOB_ID": "77", "SLURM_NNODES": str(nodes),
               "SLURM_NODEID": str(node), "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": slurm_port,
               "OMP_NUM_THREADS": "1"}
        line = command.removeprefix("srun ").replace('"runs/resnet50-$SLURM_JOB_ID"',
                                                     str(tmp_path / "slurm-run"))
        pods.start([*shlex.split(line), "--registry", str(demo_registry), "--nproc-per-node", "1", "--json",
                    *SHORT, *ON_THE_DEMO], env)
    finished = pods.finish()
    assert [code for code, _, _ in finished] == [0] * (nnodes + nodes), \
        "\n".join(err[-2500:] for _, _, err in finished)
    torchx_result, slurm_result = result_of(finished[0][1]), result_of(finished[nnodes][1])
    assert torchx_result["world_size"] == nnodes and slurm_result["world_size"] == nodes
    assert slurm_result["final"]["images"] == torchx_result["final"]["images"] == 359
