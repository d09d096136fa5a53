"""Which ranks went silent: a pulse per rank in the job's store, read when a collective fails.

gloo and NCCL say that a collective failed ("Connection closed by peer",
"Timed out waiting 30000ms") but not which rank caused it. So each worker
bumps a counter of its own in the elastic agent's store from a thread, and
after a failure a survivor reads every counter twice, a few beats apart: the
ranks whose counters stood still are the lost or hung ones. Counters, not
clocks, so nodes need not agree on the time; a thread, so a rank that is
alive but blocked in a collective (waiting on the lost one) keeps beating.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ddp_cli.distributed.setup import DistContext, agent_store
from ddp_cli.errors import summary

BEAT_S = 0.5
READ_TIMEOUT_S = 5.0


class Heartbeat:
    def __init__(self, ctx: DistContext, store: dist.Store) -> None:
        self.ctx, self.store = ctx, store
        threading.Thread(target=self._beat, name="ddp-heartbeat", daemon=True).start()

    @classmethod
    def start(cls, ctx: DistContext, connect_timeout_s: float) -> Heartbeat | None:
        """Beating from now on; None outside an elastic agent (no store to beat into). Its connection is
        made with the job's timeout (`connect_timeout_s`), as the process group's was: node 0's store
        is up (the group just formed through it), but with 32 ranks starting on 2 cores it took longer
        than READ_TIMEOUT_S to accept them all, and the rank failed ("client socket has timed out
        after 5000ms while trying to connect"), reported as a collective's timeout."""
        store = agent_store(ctx.world_size, timedelta(seconds=connect_timeout_s))
        return cls(ctx, store) if store is not None else None

    @staticmethod
    def key(rank: int) -> str:
        return f"heartbeat/{rank}"

    def _beat(self) -> None:
        try:
            while True:
                self.store.add(self.key(self.ctx.rank), 1)
                time.sleep(BEAT_S)
        except Exception:  # noqa: BLE001 - the store is gone, and with it the job: nothing to beat for
            return

    def silent(self, beats: int = 3) -> list[int] | None:
        """The other ranks whose counters did not move over `beats` beats; None when the store
        itself no longer answers (its host, node 0's launcher, is gone). Read through a connection of
        its own (the beating thread owns the other)."""
        try:
            reader = agent_store(self.ctx.world_size, timedelta(seconds=READ_TIMEOUT_S))
            before = self._read(reader)
            time.sleep(beats * BEAT_S)
            after = self._read(reader)
        except Exception:  # noqa: BLE001 - TCPStore raises plain RuntimeErrors for a closed connection
            return None
        return [rank for rank in range(self.ctx.world_size)
                if rank != self.ctx.rank and before[rank] == after[rank]]

    def _read(self, reader: dist.Store) -> list[int]:
        return [reader.add(self.key(rank), 0) for rank in range(self.ctx.world_size)]


def describe_loss(error: BaseException, silent: list[int] | None, ctx: DistContext,
                  timeout_s: int) -> str:
    """One line: which rank (and node) was lost or hung, and how we know (NCCL's words, when NCCL
    raised it: a DistBackendError)."""
    text = str(error).lower()
    hung = "timed out" in text or "timeout" in text
    collective = hung and "connect" not in text  # not a connection to the store that took too long to make
    how = (f"stopped answering (a collective timed out after distributed.timeout_s = {timeout_s} s)"
           if collective else "could not be reached in time" if hung else
           "was lost (its connection closed: the process or its node is gone)")
    if str(error).strip():  # the backend's own words (NCCL's, gloo's, the store's): what timed out or closed
        backend = "NCCL" if isinstance(error, dist.DistBackendError) else type(error).__name__
        how += f" ({backend}: {summary(error).split(': ', 1)[1]})"
    if silent is None:
        return f"node 0 (rank 0's node, host of the job's store) {how}; rank {ctx.rank} saw it"
    if not silent:
        return f"a peer of rank {ctx.rank} {how}, but every rank still has a pulse"
    nodes = {rank // ctx.local_world_size for rank in silent}
    ranks = ", ".join(str(rank) for rank in silent)
    return (f"rank{'s' * (len(silent) > 1)} {ranks} (node{'s' * (len(nodes) > 1)} "
            f"{', '.join(str(n) for n in sorted(nodes))}) {how}; rank {ctx.rank} saw it")
