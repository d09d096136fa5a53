"""Which network interface the workers' gloo group binds to when nodes meet over the network.

Without GLOO_SOCKET_IFNAME, gloo binds to the address the host name resolves
to, and many images map it to 127.0.1.1 in /etc/hosts: each node then offers
its peers a loopback address and the group never connects (a hang, the gloo
group beside NCCL included). So for multi-node runs we choose as a torch user
would by hand: the interface the kernel routes to the rendezvous endpoint by
(every node reaches that host, so that network joins them), else the default
route's. A user's GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME is left alone: they
chose the network.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Mapping

import psutil

log = logging.getLogger("ddp")

USER_CHOICE = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
DEFAULT_ROUTE = ("192.0.2.1", 9)  # TEST-NET-1 (RFC 5737): routed by the default route, never contacted


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT or [V6]:PORT as (host, port); a missing port is 0."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or (host.count(":") and not host.startswith("[")):  # no port, or a bare IPv6 address
        host, port = endpoint, "0"
    return host.strip("[]"), int(port) if port.isdigit() else 0


def route_address(host: str, port: int) -> str | None:
    """The local address the kernel would send to `host` from: a UDP socket's connect() only looks the
    route up (nothing is sent). None where the host does not resolve or nothing routes to it."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def interface_of(address: str) -> str | None:
    """The name of the interface holding `address` (an alias label such as eth0:1 as its device)."""
    devices = {name for _, name in socket.if_nameindex()}
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name if name in devices else name.split(":")[0]
    return None


def endpoint_interface(endpoint: str) -> str | None:
    """The interface towards the rendezvous endpoint; where that is this node's loopback (node 0 named
    by a host name that resolves to 127.0.1.1), the default route's."""
    address = route_address(*split_endpoint(endpoint))
    if address is None or is_loopback(address):
        address = route_address(*DEFAULT_ROUTE)
    return interface_of(address) if address and not is_loopback(address) else None


def across_hosts(nnodes: int, endpoint: str | None, env: Mapping[str, str]) -> bool:
    """A run whose nodes may be other machines, and the user chose no interface. An endpoint at a
    loopback address (127.0.0.1, localhost) has every node on this one: no choice to make."""
    if nnodes <= 1 or not endpoint or any(env.get(name) for name in USER_CHOICE):
        return False
    host = split_endpoint(endpoint)[0]
    return host != "localhost" and not is_loopback(host)


def gloo_environment(nnodes: int, endpoint: str | None, env: Mapping[str, str]) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME for the workers of a run across hosts, where the user set neither variable."""
    if not across_hosts(nnodes, endpoint, env):
        return {}
    name = endpoint_interface(endpoint)
    return {"GLOO_SOCKET_IFNAME": name} if name else {}


def host_address() -> str | None:
    """What this node's host name resolves to (what gloo binds to without GLOO_SOCKET_IFNAME)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def warn_loopback_host(nnodes: int, endpoint: str | None, env: Mapping[str, str]) -> None:
    """One line where a multi-node run's host name resolves to loopback and the user chose no
    interface: what gloo will bind to instead, or how to choose one."""
    address = host_address() if across_hosts(nnodes, endpoint, env) else None
    if not address or not is_loopback(address):
        return
    chosen = gloo_environment(nnodes, endpoint, env).get("GLOO_SOCKET_IFNAME")
    fix = (f"gloo will use {chosen} (the interface towards --rdzv-endpoint); set GLOO_SOCKET_IFNAME to "
           "choose another" if chosen else "set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the interface "
           "of the network that joins the nodes")
    log.warning(f"warning: host name {socket.gethostname()} resolves to {address} (loopback), which other "
                f"nodes cannot reach; {fix}")
