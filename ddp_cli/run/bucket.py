"""A run dir in object storage (`--run-dir s3://BUCKET/PREFIX/NAME`): its place in the bucket, and the
calls that move one file between the bucket and the node.

The run reads and writes a node-local staging folder like any run dir (`staging_folder`); the bucket
holds the copy that outlives the node (`run.mirror` uploads, `run.pull` downloads). The endpoint and
credentials are found as for `ddp datasets pack --to s3://...`: AWS_ENDPOINT_URL, then botocore's
default chain (environment, AWS_PROFILE and the shared files, instance roles); ddp never sees, writes
or logs a key. Every call is retried on transient errors (`retry.py`, data.io_retries) and counted;
what keeps failing, or is refused, is one DataError naming the object (exit 3).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ddp_cli.data.fetch.retry import IoPolicy, with_retries
from ddp_cli.data.fetch.storage import S3Location, s3_filesystem, storage_error
from ddp_cli.errors import ConfigError, DataError
from ddp_cli.io import writing

T = TypeVar("T")
SCHEME = "s3://"
LOCK = "owner.lock"  # the run dir's owner (run/owner.py), in the bucket itself for an s3:// run dir
# checkpoints go in their own order; the index is rebuilt at launch; the owner's lock is the bucket's own
NOT_MIRRORED = ("checkpoints", "index", LOCK)
PER_RANK = ("logs", "errors")  # what every node has of its own ranks (the rest is rank 0's)
STAGING_ENV = "DDP_STAGING_DIR"  # where node-local staging folders go (default: the temp folder's)


def is_bucket_url(text: str | Path | None) -> bool:
    return text is not None and str(text).startswith(SCHEME)


def staging_folder(url: str) -> Path:
    """The node-local folder a run dir in the bucket is staged in: `$DDP_STAGING_DIR/BUCKET/PREFIX/NAME`
    (default under the temp folder); it holds the run's files between their writing and their upload."""
    root = os.environ.get(STAGING_ENV) or Path(tempfile.gettempdir()) / "ddp-staging"
    return Path(root).expanduser().resolve() / url.removeprefix(SCHEME)


@dataclass
class RunBucket:
    """`s3://BUCKET/PREFIX/NAME` and the calls on files under it, named relative to it (`metrics.jsonl`,
    `checkpoints/last.pt`)."""

    url: str
    policy: IoPolicy = IoPolicy()
    _fs: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        bucket, _, prefix = self.url.removeprefix(SCHEME).partition("/")
        if not bucket or not prefix:
            raise ConfigError(f"{self.url}: give s3://BUCKET/PREFIX/NAME (a run needs a prefix of its own)")
        self.bucket, self.prefix = bucket, prefix

    @property
    def fs(self) -> Any:
        """The bucket's filesystem, opened (and the bucket checked) on first use in this process."""
        if self._fs is None:
            location = S3Location(f"{SCHEME}{self.bucket}", os.environ.get("AWS_ENDPOINT_URL"))
            self._fs, _ = s3_filesystem(location, "create the bucket, or check the URL and AWS_ENDPOINT_URL")
        return self._fs

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def key(self, name: str) -> str:
        return f"{self.bucket}/{self.prefix}/{name}"

    def put(self, local: Path, name: str) -> None:
        """Upload `local` as `name`: one PUT (or multipart upload), so the object appears whole or not."""
        self.call(lambda: self.fs.put_file(str(local), self.key(name)), name)

    def write(self, name: str, data: bytes) -> None:
        """`data` as the object `name`, in one PUT."""
        self.call(lambda: self.fs.pipe_file(self.key(name), data), name)

    def copy(self, source: str, name: str) -> None:
        """`source`'s object copied to `name` inside the bucket (no bytes through the node)."""
        self.call(lambda: self.fs.copy(self.key(source), self.key(name)), name)

    def remove(self, name: str) -> None:
        with suppress(FileNotFoundError):  # gone already: what was wanted
            self.call(lambda: self.fs.rm_file(self.key(name)), name)

    def exists(self, name: str) -> bool:
        self.fs.invalidate_cache(self.key(name))
        return self.call(lambda: self.fs.exists(self.key(name)), name)

    def read(self, name: str) -> bytes:
        """The object `name`'s bytes; FileNotFoundError if there is none."""
        return self.call(lambda: self.fs.cat_file(self.key(name)), name)

    def get(self, name: str, local: Path) -> None:
        """Download `name` to `local`, through a temporary name: a file there is always whole."""
        partial = local.with_name(f".{local.name}.{os.getpid()}.part")
        with writing(local):
            local.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.call(lambda: self.fs.get_file(self.key(name), str(partial)), name)
            os.replace(partial, local)
        finally:
            partial.unlink(missing_ok=True)

    def names(self, folder: str = "") -> list[str]:
        """Every object under the run (or its `folder`), named relative to the run; [] when none."""
        top = self.key(folder).rstrip("/")
        self.fs.invalidate_cache(top)  # what is there now, not what an earlier listing of ours saw
        try:
            found = self.call(lambda: self.fs.find(top), folder or ".")
        except FileNotFoundError:
            return []
        base = self.key("")
        return sorted(path.removeprefix(base) for path in found if path.startswith(base))

    def download_files(self, folder: Path) -> list[str]:
        """The run's files but its checkpoints and index, downloaded into `folder` (what `ddp report`
        draws, and what a resumed run goes on writing); their names."""
        names = [name for name in self.names() if name.split("/")[0] not in NOT_MIRRORED]
        for name in names:
            self.get(name, folder / name)
        return names

    def call(self, call: Callable[[], T], name: str) -> T:
        """`call()`: transient errors retried (`policy`), the rest one DataError naming the object;
        FileNotFoundError and FileExistsError (an `If-None-Match: *` refused) pass through: callers
        decide what a missing or an existing object means."""
        where = self.url_of(name)
        try:
            return with_retries(call, where, self.policy)
        except (FileNotFoundError, FileExistsError, DataError):
            raise
        except Exception as e:
            mapped = storage_error(e, where)
            if mapped is None and isinstance(e, OSError):
                mapped = DataError(f"{where}: {e.strerror or e}")
            if mapped is None:
                raise
            raise mapped from e
