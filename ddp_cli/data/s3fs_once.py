"""s3fs's filesystem as ddp uses it: each request made once, and no closing of another process's session.

- `retries = 1`: s3fs retries transient errors itself, `retries` attempts per request, hidden from
  us; `data/retry.py` retries instead, within data.io_retries, and counts (botocore's own retries
  are turned off where the filesystem is made).
- A filesystem closes its HTTP session when it is garbage. In a forked loader process the ones
  inherited from the rank hold the rank's connections, on the rank's event loop: closing them there
  fails ("attached to a different loop", a traceback on stderr per loader process wherever S3 keeps
  connections alive). `close_session` leaves a session of another process's loop alone.
"""

import fsspec.asyn
from s3fs import S3FileSystem


class S3FileSystemOnce(S3FileSystem):
    retries = 1  # attempts per request

    @staticmethod
    def close_session(loop, s3) -> None:
        if loop is not None and loop is not fsspec.asyn.loop[0]:  # fsspec resets its loop in a child
            return
        S3FileSystem.close_session(loop, s3)
