"""s3fs's filesystem as ddp uses it: each request made once, and no closing of another process's session.

- `retries = 1`: s3fs retries transient errors itself, `retries` attempts per request, hidden from
  us; `data/retry.py` retries instead, within data.io_retries, and counts (botocore's own retries
  are turned off where the filesystem is made).
- A filesystem closes its HTTP session when it is garbage. In a forked process (a rank, a loader
  process) the ones inherited from the parent hold the parent's connections, on the parent's event
  loop: closing them there fails ("attached to a different loop"), and dropping them unclosed warns
  ("Unclosed client session"), either on stderr in every forked process wherever S3 keeps
  connections alive. So a forked process keeps its parent's filesystems referenced, never collected
  (fsspec forgets them at the next instantiation), and `close_session` leaves a session of another
  process's loop alone (at a normal exit).
"""

import os

import fsspec.asyn
from s3fs import S3FileSystem


class S3FileSystemOnce(S3FileSystem):
    retries = 1  # attempts per request

    @staticmethod
    def close_session(loop, s3) -> None:
        if loop is not None and loop is not fsspec.asyn.loop[0]:  # fsspec resets its loop in a child
            return
        S3FileSystem.close_session(loop, s3)


_inherited: list[S3FileSystemOnce] = []  # in a forked process: its parent's filesystems, left alone
_forking: list[S3FileSystemOnce] = []  # the parent's, while it forks (fsspec empties its cache in the child)


def _before_fork() -> None:
    _forking[:] = S3FileSystemOnce._cache.values()


def _in_child() -> None:
    _inherited.extend(_forking)
    _forking.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_forking.clear, after_in_child=_in_child)
