"""The schedulers' variables, read through one table (`run.schedulers`): which scheduler, what it gives
the launch, and flags win. The environments are the ones each scheduler sets, as its docs and operator
code spell them."""

from __future__ import annotations

import json

import pytest
from test_cli_torchrun_flags import DEMO, invoke

from ddp_cli.errors import ConfigError
from ddp_cli.run.launch import LaunchOptions, with_environment
from ddp_cli.run.schedulers import expand_nodelist, recognise, under_agent

# a PyTorchJob with a Master and one Worker replica and `nprocPerNode: 2` (training operator v1)
PYTORCHJOB = {"MASTER_ADDR": "demo-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1",
              "PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "2",
              "PET_MASTER_ADDR": "demo-master-0", "PET_MASTER_PORT": "23456", "PYTHONUNBUFFERED": "0"}
# the same job with an elasticPolicy (min 1, max 3 workers, no Master): worker pods have no RANK
ELASTIC = {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "demo-worker-0:23456", "PET_NNODES": "1:3",
           "PET_MAX_RESTARTS": "3", "PET_NPROC_PER_NODE": "auto", "HOSTNAME": "demo-worker-2"}
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
         "SLURM_JOB_NODELIST": "gpu[10-13]", "SLURM_GPUS_ON_NODE": "8"}


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node1", ["node1"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a[8-10],b2", ["a8", "a9", "a10", "b2"]),
])
def test_slurm_nodelists_expand(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_slurm_variables_fill_the_launch_but_flags_win():
    found = recognise(SLURM)
    assert (found.name, found.in_process) == ("slurm", False)
    assert found.settings == {"nnodes": 4, "node_rank": 2, "rdzv_id": "slurm-4242",
                              "rdzv_endpoint": "gpu10:29400", "nproc_per_node": 8}
    assert recognise({**SLURM, "MASTER_PORT": "29555"}).settings["rdzv_endpoint"] == "gpu10:29555"
    opts = with_environment(LaunchOptions(nproc_per_node=2), SLURM)
    assert (opts.nnodes, opts.node_rank, opts.nproc_per_node) == (4, 2, 2)
    assert with_environment(LaunchOptions(), {}) == LaunchOptions()


def test_a_pytorchjob_pod_launches_its_processes_and_does_not_take_the_pod_rank_for_a_process_rank():
    found = recognise(PYTORCHJOB)
    assert (found.name, found.in_process) == ("kubeflow", False) and not under_agent(PYTORCHJOB)
    assert found.settings == {"nnodes": 2, "min_nodes": None, "node_rank": 1, "nproc_per_node": 2,
                              "rdzv_endpoint": "demo-master-0:23456"}
    assert found.took == {k: PYTORCHJOB[k] for k in ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR",
                                                     "PET_MASTER_PORT", "PET_NPROC_PER_NODE")}
    opts = with_environment(LaunchOptions(nproc_per_node=1), PYTORCHJOB)
    assert (opts.nnodes, opts.node_rank, opts.nproc_per_node, opts.rdzv_endpoint) == \
        (2, 1, 1, "demo-master-0:23456")


def test_an_older_operator_and_a_job_without_pet_nnodes_still_form_the_world():
    old = {"MASTER_ADDR": "j-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2",
           "PET_N_PROC_PER_NODE": "4"}
    assert recognise(old).settings == {"nnodes": 3, "node_rank": 2, "rdzv_endpoint": "j-master-0:23456",
                                       "nproc_per_node": 4}


def test_an_elastic_pytorchjob_pod_takes_its_index_from_its_name_and_restarts_from_the_policy():
    found = recognise(ELASTIC)
    assert found.settings == {"nnodes": 3, "min_nodes": 1, "node_rank": 2, "max_restarts": 3,
                              "rdzv_endpoint": "demo-worker-0:23456"}  # nproc "auto": ddp's own
    assert found.took["HOSTNAME"] == "2" and found.took["PET_NPROC_PER_NODE"] == "auto"
    assert recognise({**ELASTIC, "PET_RDZV_ID": "run7"}).settings["rdzv_id"] == "run7"


@pytest.mark.parametrize(("env", "words"), [
    ({**ELASTIC, "PET_RDZV_BACKEND": "etcd"}, ["PET_RDZV_BACKEND=etcd", "rdzvBackend to c10d"]),
    ({**ELASTIC, "PET_NNODES": "3:1"}, ["PET_NNODES 3:1", "MIN:MAX"]),
    ({**ELASTIC, "HOSTNAME": "pod-a"}, ["this pod's index", "PET_NODE_RANK"]),
    ({**PYTORCHJOB, "PET_NODE_RANK": "one"}, ["PET_NODE_RANK='one'", "whole number"]),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "m"}, ["no PET_MASTER_PORT", "m is"]),
])
def test_a_scheduler_environment_that_cannot_work_names_the_variable(env, words):
    with pytest.raises(ConfigError) as e:
        recognise(env)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("env", [
    {**PYTORCHJOB, "TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0"},  # Trainer v2: torchrun wraps ddp
    {**SLURM, "TORCHELASTIC_RUN_ID": "x", "RANK": "5", "WORLD_SIZE": "8"},  # srun torchrun ...
    {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},  # env:// by hand
])
def test_inside_an_agent_ddp_trains_in_process_whatever_else_is_set(env):
    found = recognise(env)
    assert (found.name, found.in_process, found.settings) == ("torchrun", True, {}) and under_agent(env)
    assert recognise({}).name is None and not recognise({}).in_process


def test_the_dry_run_says_which_scheduler_and_what_it_read(demo_registry, monkeypatch):
    for name, value in {**PYTORCHJOB, "PET_MASTER_ADDR": "127.0.0.1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    result = invoke("train", DEMO, "--registry", str(demo_registry), "--set", "data.workers=0",
                    "--set", 'distributed.backend="gloo"', "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    assert plan["scheduler"] == "kubeflow" and plan["world_size"] == 4 and plan["nproc_per_node"] == 2
    assert plan["scheduler_variables"]["PET_NPROC_PER_NODE"] == "2"
