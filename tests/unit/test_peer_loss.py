"""Losing a node, the parts that need no second node: --nnodes, the rules, the messages, the pulse."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp_cli.cli.commands.training import resume_command
from ddp_cli.config import DistributedConfig
from ddp_cli.distributed import heartbeat
from ddp_cli.distributed.heartbeat import Heartbeat, describe_loss
from ddp_cli.distributed.peer_loss import lost_a_peer
from ddp_cli.distributed.setup import DistContext
from ddp_cli.errors import ConfigError
from ddp_cli.run.launch import LaunchOptions, check_rendezvous


@pytest.mark.parametrize(("spec", "nodes"), [("2", (2, None)), ("1:2", (2, 1)), ("3:3", (3, 3))])
def test_nnodes_takes_torchruns_min_max(spec, nodes):
    parsed = LaunchOptions.nodes(spec)
    assert (parsed["nnodes"], parsed["min_nodes"]) == nodes


@pytest.mark.parametrize("spec", ["0", "3:2", "a", "1:", ":2", "1:2:3", "-1"])
def test_a_bad_nnodes_is_a_usage_error_naming_it(spec):
    with pytest.raises(ConfigError, match=f"--nnodes {spec}: expected N or MIN:MAX"):
        LaunchOptions.nodes(spec)


def test_elastic_membership_without_restarts_is_refused():
    opts = LaunchOptions(rdzv_endpoint="node0:29400", **LaunchOptions.nodes("1:2"))
    with pytest.raises(ConfigError, match="--max-restarts"):
        check_rendezvous(opts, DistributedConfig())
    check_rendezvous(LaunchOptions(rdzv_endpoint="node0:29400", max_restarts=2, **LaunchOptions.nodes("1:2")),
                     DistributedConfig())
    check_rendezvous(opts, DistributedConfig(max_restarts=1))


def test_the_resume_command_points_at_the_run_dir_with_resume_auto():
    argv = ["train", "my cfg.toml", "--run-dir", "old", "--resume=never", "--nnodes", "2", "--node-rank",
            "0", "--set", "optim.lr=0.2", "--run-dir=older", "--json"]
    command = resume_command(argv, Path("/runs/x"))
    assert shlex.split(command) == ["ddp", "train", "my cfg.toml", "--nnodes", "2", "--node-rank", "0",
                                    "--set", "optim.lr=0.2", "--json", "--run-dir", "/runs/x",
                                    "--resume", "auto"]


CTX = DistContext(rank=0, world_size=4, local_rank=0, local_world_size=2, device=torch.device("cpu"),
                  backend="gloo")


def test_a_timeout_is_a_hang_and_a_closed_connection_a_loss_naming_rank_and_node():
    hung = describe_loss(RuntimeError("[gloo] Timed out waiting 10000ms for recv"), [3], CTX, 10)
    assert "rank 3 (node 1) stopped answering" in hung and "timeout_s = 10 s" in hung
    gone = describe_loss(RuntimeError("Connection closed by peer [127.0.0.1]:4242"), [2, 3], CTX, 10)
    assert "ranks 2, 3 (node 1) was lost" in gone and "connection closed" in gone
    host = describe_loss(RuntimeError("Connection reset by peer"), None, CTX, 10)
    assert host.startswith("node 0 (rank 0's node, host of the job's store) was lost")


def test_a_connection_to_the_store_that_timed_out_is_not_called_a_collectives_timeout():
    """What 32 ranks on 2 cores met: a rank's connection to node 0's store took longer than 5 s to be
    accepted; it was reported as "a collective timed out after distributed.timeout_s = 600 s"."""
    said = "The client socket has timed out after 5000ms while trying to connect to (localhost, 35065)."
    line = describe_loss(dist.DistNetworkError(said), [], CTX, 600)
    assert "could not be reached in time" in line and f"(DistNetworkError: {said})" in line
    assert "collective" not in line and "600" not in line


def test_an_error_nccl_raised_is_described_in_nccls_words():
    said = "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, remote process exited " \
        "or there was a network error, NCCL version 2.27.5"
    error = dist.DistBackendError(f"{said}\nncclRemoteError: A call failed possibly due to a network error "
                                  "or a remote process exiting prematurely.\nLast error:\n...")
    line = describe_loss(error, [3], CTX, 10)
    assert "rank 3 (node 1) was lost (its connection closed" in line and "\n" not in line
    assert f"(NCCL: {said}); rank 0 saw it" in line


@pytest.mark.parametrize("text", ["Connection closed by peer [10.0.0.2]:5000",
                                  "[gloo] Timed out waiting 30000ms for recv operation to complete",
                                  "Application timeout caused pair closure"])
def test_peer_losses_are_recognised(text):
    assert lost_a_peer(RuntimeError(text))
    assert not lost_a_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


@pytest.mark.parametrize("error", [
    dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed."),  # store host gone
    dist.DistStoreError("Timed out after 4 seconds waiting for clients. 1/2 clients joined."),
    dist.DistBackendError("NCCL communicator was aborted on rank 1."),  # NCCL: aborted, or its watchdog
    dist.DistError("any other failure torch types as distributed"),
])
def test_torchs_typed_errors_are_peer_losses_whatever_they_say(error):
    assert lost_a_peer(error)


def test_a_real_store_whose_host_is_gone_raises_a_typed_error():
    """What TCPStore raises when the host of the job's store (node 0's agent) goes: typed, no text read."""
    from datetime import timedelta

    from ddp_cli.run.loopback import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
    client.add("k", 1)
    del server
    with pytest.raises(dist.DistError) as raised:
        client.add("k", 1)
    assert isinstance(raised.value, dist.DistNetworkError) and lost_a_peer(raised.value)


def test_other_errors_are_not_peer_losses():
    assert not lost_a_peer(ValueError("Connection closed by peer"))  # gloo raises RuntimeError only
    assert not lost_a_peer(KeyError("rng"))
    assert not lost_a_peer(RuntimeError("CUDA out of memory"))


def test_the_pulse_names_the_ranks_that_went_silent(monkeypatch):
    """Ranks 0 and 1 beat into a real TCPStore; rank 2 never does (a frozen node)."""
    from ddp_cli.run.loopback import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(heartbeat, "BEAT_S", 0.2)
    monkeypatch.setattr(heartbeat, "READ_TIMEOUT_S", 1.0)
    world = [DistContext(r, 3, r, 3, torch.device("cpu"), "gloo") for r in range(3)]
    pulses = [Heartbeat.start(world[0], 30), Heartbeat.start(world[1], 30)]
    assert pulses[0].silent() == [2]
    assert pulses[1].silent() == [2]
    del server  # the store's host is gone: the pulse cannot say who is alive
    assert pulses[0].silent() is None


def test_outside_an_elastic_agent_there_is_no_pulse(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert Heartbeat.start(CTX, 30) is None


def test_nodes_without_a_rendezvous_id_derive_the_same_one_from_the_endpoint():
    from ddp_cli.run.launch import run_id

    node = [LaunchOptions(rdzv_endpoint="node0:29400", node_rank=rank, nnodes=2) for rank in (0, 1)]
    assert run_id(node[0]) == run_id(node[1]) == "ddp-node0:29400"
    assert run_id(LaunchOptions(rdzv_endpoint="node0:29400", rdzv_id="job1")) == "job1"
    assert run_id(LaunchOptions()) != run_id(LaunchOptions())  # one node: a fresh job each time


def test_nodes_sharing_a_run_dir_may_clear_its_errors_at_the_same_time(tmp_path, monkeypatch):
    """Both nodes of a resumed job clear `errors/` at start; one must not fail on a file the other
    removed between listing and unlinking (it did: node 1 died, node 0 waited out the rendezvous)."""
    from ddp_cli.run.jobs import clear_errors, first_error, record_error

    record_error(tmp_path, 0, 5, "lost rank 1", original=False)
    listed = Path.glob
    monkeypatch.setattr(Path, "glob", lambda self, pattern: [self / "rank1.json", *listed(self, pattern)])
    clear_errors(tmp_path)  # rank1.json: already gone
    monkeypatch.undo()
    assert first_error(tmp_path) is None


def test_a_host_that_cannot_open_its_store_says_why_and_a_timeout_asks_for_the_other_nodes():
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    from ddp_cli.errors import DataError
    from ddp_cli.run.launch import rendezvous_failure

    busy = RendezvousConnectionError("The connection to the C10d store has failed.")
    busy.__cause__ = RuntimeError("The server socket has failed to listen on any local network address. "
                                  "port: 29400, useIpv6: false, code: -98, name: EADDRINUSE")
    error = rendezvous_failure(busy, "node0:29400", True, 60)
    assert isinstance(error, ConfigError)
    assert str(error) == "--rdzv-endpoint node0:29400: cannot host the rendezvous there (port in use); " \
                         "pick a free port"
    for hosts, err in ((True, RendezvousTimeoutError()), (False, busy)):
        error = rendezvous_failure(err, "node0:29400", hosts, 60)
        assert isinstance(error, DataError) and "rendezvous failed within 60s" in str(error)
        assert "is every node up" in str(error)
    closed = RendezvousConnectionError("The connection to the C10d store has failed.")
    closed.__cause__ = dist.DistNetworkError("Broken pipe\n(a C++ stack)")
    assert "(RendezvousConnectionError: DistNetworkError: Broken pipe)" in str(  # the store's own words
        rendezvous_failure(closed, "node0:29400", False, 60))
