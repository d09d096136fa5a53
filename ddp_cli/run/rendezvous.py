"""torch's c10d rendezvous, with a name for each group of workers it forms (`ddp-c10d`).

The workers of every group meet in the agent's one store (`distributed.setup.agent_store`), so each
group needs keys of its own, and every node of a group must name it alike. torch's own name, the
agent's restart count, differs between nodes after a lost node: a node whose worker failed first
restarts (its count goes up), while another whose workers still looked healthy sees the first one
waiting and restarts as a membership change (its count does not), and the new group's workers then
wait in two key spaces for each other until `distributed.timeout_s`. The rendezvous round is the one
thing all nodes of a group share, and its store is scoped to it: there node 0 of the group writes a
fresh name that every node reads, and hands it to its workers through the environment.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from ddp_cli.distributed.setup import ROUNDS, WORKER_GROUP

BACKEND = "ddp-c10d"
KEY = "ddp/worker-group"


class NamedGroups:
    """A rendezvous handler (torch's, which it wraps) that names each group it forms in $WORKER_GROUP."""

    def __init__(self, inner: RendezvousHandler) -> None:
        self.inner = inner
        self.rounds = 0  # the rendezvous this node's agent has completed: a second one is a restart

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_backend(self) -> str:
        return BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        info = self.inner.next_rendezvous()
        self.rounds += 1
        os.environ[WORKER_GROUP] = group_name(info)  # the agent starts the workers with this environment
        os.environ[ROUNDS] = str(self.rounds)
        return info

    @staticmethod
    def create(params: RendezvousParameters) -> NamedGroups:
        backend, store = create_backend(params)
        return NamedGroups(create_handler(store, backend, params))


def group_name(info: RendezvousInfo) -> str:
    """The group's name, the same on each of its nodes: written by its node 0 into the store of this
    round (a fresh key space each round), read by the others (waiting for it, up to the store's
    timeout: `distributed.rdzv_timeout_s`)."""
    if info.rank == 0:
        info.store.set(KEY, uuid.uuid4().hex)
    return info.store.get(KEY).decode()


def register() -> None:
    """`ddp-c10d` as a rendezvous backend of torch's elastic launcher (again: the registry accepts the
    same creator twice)."""
    rendezvous_handler_registry.register(BACKEND, NamedGroups.create)
