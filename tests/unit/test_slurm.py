"""SLURM's variables and compressed host lists fill the launch options; flags win."""

from __future__ import annotations

import pytest

from ddp_cli.run.launch import LaunchOptions, expand_nodelist, slurm_defaults, with_environment


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node1", ["node1"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a[8-10],b2", ["a8", "a9", "a10", "b2"]),
])
def test_slurm_nodelists_expand(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_slurm_variables_fill_the_launch_but_flags_win():
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "gpu[10-13]", "SLURM_GPUS_ON_NODE": "8"}
    assert slurm_defaults(env) == {"nnodes": 4, "node_rank": 2, "rdzv_id": "slurm-4242",
                                   "rdzv_endpoint": "gpu10:29400", "nproc_per_node": 8}
    opts = with_environment(LaunchOptions(nproc_per_node=2), env)
    assert (opts.nnodes, opts.node_rank, opts.nproc_per_node) == (4, 2, 2)
    assert with_environment(LaunchOptions(), {}) == LaunchOptions()
