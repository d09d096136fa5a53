"""A whole remote object into a local file; from S3 through botocore's synchronous client, not s3fs.

shard_reader.py downloads remote shards whole, in the loader processes, on the
cores that decode, so every millisecond spent receiving is one not spent
decoding. s3fs's `get_file` hands the body over 64 KiB per turn of its event
loop; botocore's synchronous client reads it straight off the socket, with
no event loop turning between the chunks, so less CPU goes to each byte.

The client is made from the options `storage.s3_filesystem` gives s3fs
(profile or the default credential chain, anon, endpoint and region, botocore
config with its retries off), so it asks the same endpoint as the same
principal. Its errors are botocore's, which `retry.transient` and
`storage.storage_error` read already; a missing key becomes FileNotFoundError,
as s3fs makes it. botocore checks the body's length and checksum as it is
read. Other filesystems (memory ones, in tests) use their `get_file`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import fsspec

CHUNK = 1 << 20  # bytes per read: more saves no CPU (measured), and a shard never sits whole in memory
MISSING = {"NoSuchKey", "NotFound", "404"}
_made = threading.Lock()  # botocore sessions are not thread-safe: one client made at a time


def download(fs: fsspec.AbstractFileSystem, path: str, target: Path) -> None:
    """Write the object at `path` (bucket/key for S3) to `target`, truncating what is there."""
    if "s3" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        fs.get_file(path, str(target))
        return
    from botocore.exceptions import ClientError

    bucket, _, key = path.partition("/")
    try:
        body = client(fs).get_object(Bucket=bucket, Key=key)["Body"]
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in MISSING:
            raise FileNotFoundError(path) from e
        raise
    with body, open(target, "wb") as out:
        for chunk in iter(lambda: body.read(CHUNK), b""):
            out.write(chunk)


def client(fs: fsspec.AbstractFileSystem):  # noqa: ANN201 - botocore's S3 client class is generated
    """This process's botocore S3 client for `fs`'s options (none crosses a fork: its connections would be
    the parent's); clients are thread-safe, so the threads of a process share it."""
    made = getattr(fs, "_ddp_sync_client", None)
    if made is None or made[0] != os.getpid():
        with _made:
            made = getattr(fs, "_ddp_sync_client", None)
            if made is None or made[0] != os.getpid():
                made = os.getpid(), _new_client(fs.storage_options)
                fs._ddp_sync_client = made
    return made[1]


def _new_client(options: dict):  # noqa: ANN202
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config

    config = Config(**(options.get("config_kwargs") or {}))
    if options.get("anon"):
        config = config.merge(Config(signature_version=UNSIGNED))
    session = botocore.session.Session(profile=options.get("profile"))
    return session.create_client("s3", config=config, **(options.get("client_kwargs") or {}))
