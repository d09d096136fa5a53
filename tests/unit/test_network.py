"""Nodes on other hosts: gloo binds to the interface towards the rendezvous endpoint, not to what the
host name resolves to (127.0.1.1 in many images: a hang across nodes); a user's choice stays; a host
name resolving to loopback is a one-line warning. torch's warnings show, the agent's echo of a
failure we report does not (issue 26)."""

from __future__ import annotations

import logging
import os
import socket
from types import SimpleNamespace

import pytest

from ddp_cli.config import DistributedConfig, RunConfig
from ddp_cli.preflight import launch_workers
from ddp_cli.run import launch, logenv, network
from ddp_cli.run.launch import LaunchOptions

ACROSS = {"nnodes": 2, "endpoint": "node0:29400", "env": {}}


@pytest.mark.parametrize(("endpoint", "expected"), [
    ("node0:29400", ("node0", 29400)), ("10.0.0.1:5", ("10.0.0.1", 5)),
    ("[fe80::1]:29500", ("fe80::1", 29500)), ("node0", ("node0", 0)), ("::1", ("::1", 0)),
])
def test_endpoints_split_as_torchrun_spells_them(endpoint, expected):
    assert network.split_endpoint(endpoint) == expected


def test_the_route_and_its_interface_on_this_host():
    assert network.route_address("127.0.0.1", 29400) == "127.0.0.1"
    assert network.interface_of("127.0.0.1") == "lo"
    assert network.route_address("no-such-host.invalid", 1) is None


@pytest.fixture()
def cluster(monkeypatch):
    """eth0 at 10.0.0.5 (with an alias label eth0:1), routes given per destination."""
    routes: dict[tuple[str, int], str | None] = {}
    addr = lambda a: SimpleNamespace(family=socket.AF_INET, address=a)  # noqa: E731
    monkeypatch.setattr(network.psutil, "net_if_addrs", lambda: {
        "lo": [addr("127.0.0.1")], "eth0": [addr("10.0.0.5")], "eth0:1": [addr("10.9.9.9")]})
    monkeypatch.setattr(network.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
    monkeypatch.setattr(network, "route_address", lambda host, port: routes.get((host, port)))
    return routes


def test_the_interface_towards_the_endpoint(cluster):
    cluster["node0", 29400] = "10.0.0.5"
    assert network.endpoint_interface("node0:29400") == "eth0"
    assert network.interface_of("10.9.9.9") == "eth0"  # an alias label is its device


def test_node_0_whose_name_resolves_to_loopback_takes_the_default_route(cluster):
    cluster["node0", 29400] = "127.0.1.1"
    cluster[network.DEFAULT_ROUTE] = "10.0.0.5"
    assert network.endpoint_interface("node0:29400") == "eth0"
    del cluster[network.DEFAULT_ROUTE]
    assert network.endpoint_interface("node0:29400") is None  # nothing to choose: left to gloo


def test_gloo_is_pointed_only_across_hosts_and_only_without_the_users_choice(cluster):
    cluster["node0", 29400] = "10.0.0.5"
    assert network.gloo_environment(**ACROSS) == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert network.gloo_environment(**{**ACROSS, "nnodes": 1}) == {}
    assert network.gloo_environment(**{**ACROSS, "endpoint": "127.0.0.1:29400"}) == {}  # all nodes here
    assert network.gloo_environment(**{**ACROSS, "endpoint": "localhost:29400"}) == {}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        assert network.gloo_environment(**{**ACROSS, "env": {name: "ib0"}}) == {}


def test_the_launcher_hands_it_to_the_workers(cluster, monkeypatch, tmp_path):
    cluster["node0", 29400] = "10.0.0.5"
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", launch.LAUNCHED):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)  # restored to unset after the test
    seen = {}
    monkeypatch.setattr(launch, "elastic_launch",
                        lambda config, entry: lambda *args: seen.update(os.environ))
    opts = LaunchOptions(nnodes=2, node_rank=1, rdzv_endpoint="node0:29400")
    launch.launch(tmp_path, 1, opts, DistributedConfig())
    assert seen["GLOO_SOCKET_IFNAME"] == "eth0"


def test_a_host_name_resolving_to_loopback_is_one_warning_line(cluster, monkeypatch, caplog):
    cluster["node0", 29400] = "10.0.0.5"
    monkeypatch.setattr(network, "host_address", lambda: "127.0.1.1")
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.WARNING, logger="ddp"):
        launch_workers(RunConfig(), LaunchOptions(nnodes=2, rdzv_endpoint="node0:29400"))
    [line] = caplog.messages
    assert "resolves to 127.0.1.1 (loopback)" in line and "gloo will use eth0" in line
    caplog.clear()
    network.warn_loopback_host(2, "127.0.0.1:29400", {})  # every node on this host: loopback is right
    network.warn_loopback_host(2, "node0:29400", {"GLOO_SOCKET_IFNAME": "eth1"})
    assert not caplog.messages


def test_torch_warnings_show_but_not_the_agents_echo_of_a_failure(monkeypatch):
    assert logenv.LOG_ENV["LOGLEVEL"][0] == "WARNING"
    assert logenv.LOG_ENV["TORCH_CPP_LOG_LEVEL"][0] == "FATAL"  # its ERROR lines carry C++ stack dumps
    agent = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    record = lambda msg: logging.makeLogRecord({"msg": msg, "levelno": logging.ERROR})  # noqa: E731
    monkeypatch.setenv("LOGLEVEL", "WARNING")
    logenv.quiet_torch_logs()
    assert agent.getEffectiveLevel() == logging.WARNING
    assert not agent.filter(record("failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s"))
    spawn = logging.getLogger("torch.multiprocessing.spawn")  # forked workers' context
    assert not spawn.filter(record("Terminating process %s via signal %s"))
    assert agent.filter(record("Unable to shutdown process %s via %s, forcefully exiting via %s"))
    monkeypatch.setenv("LOGLEVEL", "DEBUG")  # -v: everything
    logenv.quiet_torch_logs()
    assert agent.filter(record("failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s"))
    monkeypatch.setenv("LOGLEVEL", "WARNING")
    logenv.quiet_torch_logs()  # torch's own default level again
