"""Whether a failed collective (or store call) means a peer is gone or hung, not a bug of this rank.

torch raises typed errors for most of it: `DistNetworkError` when a connection to the store or a
peer closes or cannot be made, `DistStoreError` when the store times out waiting for ranks that
never come, `DistBackendError` for NCCL (an aborted communicator, the watchdog's collective
timeout); all are `DistError`s. gloo alone raises a plain RuntimeError for a failed collective
(torch 2.14: its transport's exception is re-raised untyped), so only its messages are matched.
"""

from __future__ import annotations

import torch.distributed as dist

# gloo's transport messages (gloo/transport/tcp/pair.cc, unbound_buffer.cc), raised as RuntimeError:
GLOO_PEER_LOSS = (
    "Connection closed by peer",  # the peer's process exited: its socket closed cleanly
    "Connection reset by peer",  # read on a socket its dead host reset
    "Broken pipe",  # write to a peer that is gone
    "Timed out waiting",  # a send/recv past the process group's timeout: a hung peer
    "Application timeout caused pair closure",  # the next op on a pair a timeout closed
)


def lost_a_peer(error: BaseException) -> bool:
    """A collective or store call failed because another process died or hung."""
    if isinstance(error, dist.DistError):  # DistNetworkError, DistStoreError, DistBackendError
        return True
    return isinstance(error, RuntimeError) and any(mark in str(error) for mark in GLOO_PEER_LOSS)
