"""Where `ddp datasets pack` writes: a local folder or an S3 prefix, each file whole or not at all.

A file is made complete in a scratch file first, then put in place in one step:
locally a rename on the same filesystem (fsync'd, so a crash cannot leave the new
name on half a file), on S3 one upload (an object appears when its PUT, or its
multipart upload, completes; never half of it). Remote calls are retried on
transient errors like every other S3 access (`retry.py`); a write the storage refuses
(no space, no permission) is a WriteError (`io.writing`), the others one-line
DataErrors naming the object.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

import fsspec

from ddp_cli.data.fetch.retry import with_retries
from ddp_cli.data.fetch.storage import S3Location, s3_filesystem, storage_error
from ddp_cli.errors import ConfigError, DataError
from ddp_cli.io import fsync_dir, write_error, writing

T = TypeVar("T")
WORK = ".pack"  # an unfinished pack's progress and per-shard tables, under the destination
TEMP = ".tmp"  # suffix of scratch files (a killed run's are removed by the next)


class Destination:
    """A local folder or an S3 prefix (endpoint from AWS_ENDPOINT_URL), written file by file."""

    def __init__(self, url: str) -> None:
        self.remote = url.startswith("s3://")
        self._scratch: Path | None = None
        if self.remote:
            self.url = url.rstrip("/")
            bucket, _, prefix = self.url.removeprefix("s3://").partition("/")
            location = S3Location(f"s3://{bucket}", os.environ.get("AWS_ENDPOINT_URL"))
            self.fs, root = s3_filesystem(location, "create the bucket, or check --to and AWS_ENDPOINT_URL")
            self.root = f"{root}/{prefix}".rstrip("/")
            self.fs.invalidate_cache(self.root)  # what is there now, not what an earlier call of ours listed
        else:
            self.fs = fsspec.filesystem("file")
            self.root = self.url = str(Path(url).expanduser().resolve())
            if Path(self.root).exists() and not Path(self.root).is_dir():
                raise ConfigError(f"--to {url}: a file, not a folder; give a folder (made if missing) "
                                  "or s3://BUCKET/PREFIX")

    @property
    def scratch(self) -> Path:
        """Where files are completed before they are put in place: for a local destination its `.pack/`
        (the same filesystem: a rename puts a file in place), else a temporary folder."""
        if self._scratch is None:
            if self.remote:
                self._scratch = Path(tempfile.mkdtemp(prefix="ddp-pack-"))
            else:
                with self._local(WORK):
                    self._scratch = Path(self.root, WORK)
                    self._scratch.mkdir(parents=True, exist_ok=True)
        return self._scratch

    def temp_path(self, name: str) -> Path:
        """A scratch file for `name`, of this process (a hidden name ending in TEMP)."""
        return self.scratch / f".{Path(name).name}.{os.getpid()}{TEMP}"

    def put(self, local: Path, name: str) -> None:
        """Move the complete (and, locally, fsync'd) file `local` to `name`."""
        if self.remote:
            self._call(lambda: self.fs.put_file(str(local), self._key(name)), name, writes=True)
            local.unlink()
        else:
            with self._local(name):
                os.replace(local, Path(self.root, name))
                fsync_dir(Path(self.root, name).parent)

    def write(self, name: str, data: bytes) -> None:
        """`data` as the file `name`, whole or not at all."""
        if self.remote:
            self._call(lambda: self.fs.pipe_file(self._key(name), data), name, writes=True)
            return
        local = self.temp_path(name)  # not io.atomic_write: scratch is in .pack/, the next run cleans it
        with self._local(name), local.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.put(local, name)

    def read(self, name: str) -> bytes | None:
        """The file `name`, or None if there is none."""
        try:
            return self._call(lambda: self.fs.cat_file(self._key(name)), name)
        except FileNotFoundError:
            return None

    def size(self, name: str) -> int | None:
        """The size of the file `name`, or None if there is none."""
        try:
            return self._call(lambda: self.fs.size(self._key(name)), name)
        except FileNotFoundError:
            return None

    def clear_work(self, names: list[str]) -> None:
        """Delete a finished pack's progress files: on S3 each of `names` (under WORK), locally `.pack/`."""
        if not self.remote:
            shutil.rmtree(Path(self.root, WORK), ignore_errors=True)
            return
        for name in names:
            with suppress(FileNotFoundError):
                self._call(lambda name=name: self.fs.rm_file(self._key(name)), name)

    def remove_stale(self) -> None:
        """Delete the scratch files a killed run left in a local `.pack/` (a remote run's scratch folder
        is local and temporary: `close` removes it)."""
        work = Path(self.root, WORK)
        if not self.remote and work.is_dir():
            for stale in work.glob(f".*{TEMP}"):
                stale.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove this process's scratch files (all of a remote run's scratch folder)."""
        if self._scratch is None:
            return
        if self.remote:
            shutil.rmtree(self._scratch, ignore_errors=True)
        else:
            for mine in self._scratch.glob(f".*.{os.getpid()}{TEMP}"):
                mine.unlink(missing_ok=True)

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _call(self, call: Callable[[], T], name: str, writes: bool = False) -> T:
        """`call()` on the destination's filesystem: transient S3 errors retried, a refused write (when
        the call `writes`) a WriteError, the others a DataError naming the file; FileNotFoundError
        passes through (the callers expect it)."""
        where = f"{self.url}/{name}"
        try:
            return with_retries(call, where) if self.remote else call()
        except (FileNotFoundError, DataError):
            raise
        except Exception as e:
            refused = write_error(e, where) if writes else None
            mapped = refused or (storage_error(e, where) if self.remote else None)
            if mapped is not None:
                raise mapped from e
            if isinstance(e, OSError):
                raise DataError(f"{where}: cannot write or read it ({e.strerror or e}); check --to") from e
            raise

    @contextmanager
    def _local(self, name: str) -> Iterator[None]:
        """Local I/O errors as one line naming the file: a refused write (no permission, disk full) as
        `io.writing` says it, any other as a data error."""
        try:
            with writing(f"{self.url}/{name}"):
                yield
        except OSError as e:
            raise DataError(f"{self.url}/{name}: cannot write it ({e.strerror or e}); check --to (a "
                            "writable folder with room for the shards)") from e
