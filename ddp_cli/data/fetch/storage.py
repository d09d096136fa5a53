"""Data set roots through fsspec: local folders, and S3 through s3fs (the `s3` extra).

S3 credentials come from the standard AWS chain (environment, shared
credentials/config files and `AWS_PROFILE`, SSO, instance roles), found by
botocore itself: our code never sees, prints or writes them; the registry may
name a profile, never a key. What fsspec leaves to us:

- async filesystems (s3fs) refuse to run in a forked child ("not fork-safe"),
  and DataLoader workers are forked: `FileReader` re-creates its filesystem
  once per process (fsspec resets its event loop in the child);
- failures arrive as botocore exceptions: `storage_error` makes them one line
  with the fix (exit 3);
- fsspec's simplecache downloads straight into the cache file, so another
  process (or the next run, after an interrupt) can read a half-written
  file and call the image truncated; our cache writes a temporary file and
  renames it, so a cached file is always whole;
- fsspec joins whatever path it is given: `FileReader` refuses a path that
  could leave the root (or the cache folder), whatever the index holds.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import fsspec

from ddp_cli.data.fetch.retry import IoPolicy, with_retries
from ddp_cli.errors import DataError, require_extra
from ddp_cli.io import writing

UNSAFE_PATH = "unsafe path (absolute, or .. out of its folder)"
CREDENTIALS_HELP = ("set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or storage.profile "
                    "(or anon = true for a public bucket)")


class UnsafePath(ValueError):
    """A path under the root that is absolute or has a `..` component: never read."""


def escapes(path: str) -> bool:
    """Whether `path` is absolute or has a `..` component.

    Index paths are normalised (`layouts` keeps a listed name's `..` only when it
    climbs out of its folder), so such a path is always a listing trying to leave.
    """
    return path.startswith("/") or ".." in path.split("/")


# Mutation testing covers the unsafe-path checks (escapes, FileReader); the S3 setup and the wording of
# its errors are exercised against an endpoint by the e2e tests.
# pragma: no mutate start
def storage_error(e: Exception, where: str) -> DataError | None:
    """The one-line DataError for a storage failure at `where`, or None if `e` is not one."""
    try:
        from botocore import exceptions as boto
    except ImportError:  # pragma: no cover - s3fs brings botocore
        boto = None
    if boto and isinstance(e, boto.NoCredentialsError | boto.PartialCredentialsError):
        return DataError(f"{where}: no AWS credentials found; {CREDENTIALS_HELP}")
    if boto and isinstance(e, boto.ProfileNotFound):
        return DataError(f"{where}: {e}; fix storage.profile or AWS_PROFILE, or add it to ~/.aws/config")
    if boto and isinstance(e, boto.EndpointConnectionError | boto.ConnectTimeoutError):
        return DataError(f"{where}: cannot reach the S3 endpoint ({e}); check storage.endpoint_url "
                         "and the network")
    if boto and isinstance(e, boto.ClientError):
        error = e.response.get("Error", {})
        return DataError(f"{where}: S3 refused the request ({error.get('Code')}: "
                         f"{error.get('Message')}); check the credentials and the bucket policy")
    if isinstance(e, PermissionError):
        return DataError(f"{where}: access refused ({e}); check the AWS credentials and the "
                         "bucket policy")
    if boto and isinstance(e, boto.BotoCoreError):
        return DataError(f"{where}: S3 error: {e}")
    return None


@dataclass(frozen=True)
class S3Location:
    """What `s3_filesystem` needs of a registry entry's storage, for places that have only a URL."""

    path: str  # s3://BUCKET[/PREFIX]
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    anon: bool = False


def s3_filesystem(storage, fix: str = "fix storage.path in the registry"
                  ) -> tuple[fsspec.AbstractFileSystem, str]:
    """An s3fs filesystem for `storage` and the root as bucket/prefix, checked by one listing (`fix`
    says what to do when it is not there)."""
    require_extra("s3", storage.path)
    client = {k: v for k, v in (("endpoint_url", storage.endpoint_url), ("region_name", storage.region))
              if v}
    options = {"anon": storage.anon, "client_kwargs": client,
               "config_kwargs": {"retries": {"total_max_attempts": 1}}}  # retry.py retries, and counts
    if storage.profile:
        options["profile"] = storage.profile
    root = storage.path.removeprefix("s3://").rstrip("/")
    try:
        from ddp_cli.data.fetch.s3fs_once import S3FileSystemOnce

        fs = S3FileSystemOnce(**options)
        with_retries(lambda: fs.ls(root), storage.path)
    except FileNotFoundError as e:
        what = "no such bucket" if "bucket" in str(e).lower() else "no such prefix in the bucket"
        raise DataError(f"{storage.path}: {what}; {fix}") from e
    except Exception as e:
        mapped = storage_error(e, storage.path)
        if mapped is None:
            raise
        raise mapped from e
    return fs, root


def filesystem_after_fork(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """A forked process's own copy of `fs` (async filesystems refuse to run in a forked child; the
    inherited one is left to the parent: `s3fs_once.S3FileSystemOnce.close_session`)."""
    return type(fs)(*fs.storage_args, **fs.storage_options)
# pragma: no mutate end


class FileReader:
    """Reads files under a data set root: fork-safe, optionally through a local cache of remote files;
    remote reads retried on transient errors (`policy`)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, cache_dir: str | Path | None = None,
                 policy: IoPolicy = IoPolicy()) -> None:
        self._fs, self._pid = fs, os.getpid()
        self.root = root.rstrip("/")
        self.cache = cache_folder(fs, self.root, cache_dir)
        self.policy = policy
        self._ready: dict[str, bytes | Exception] = {}  # what `prefetch` read for the next `read`s
        self._threads: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool): none crosses a fork

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._pid != os.getpid():  # a forked DataLoader worker: a filesystem of its own
            self._fs, self._pid = filesystem_after_fork(self._fs), os.getpid()
        return self._fs

    def prefetch(self, paths: list[str]) -> None:
        """Read `paths` together, `policy.concurrency` requests in flight, for the `read`s that follow
        (each takes its file, or raises its error, until the next `prefetch`: under repeated augmentation
        a batch holds an image twice, read once): a batch of remote files costs about one round trip,
        not one per file. Local roots read on demand."""
        self._ready = {}
        paths = list(dict.fromkeys(paths))
        if _is_local(self._fs) or self.policy.concurrency < 2 or len(paths) < 2:
            return
        if self._threads is None or self._threads[0] != os.getpid():
            self._threads = os.getpid(), ThreadPoolExecutor(self.policy.concurrency, "fetch")

        def one(path: str) -> bytes | Exception:
            try:
                return self.read(path)
            except Exception as e:  # noqa: BLE001 - handed to the `read` of this path, raised there
                return e

        self._ready = dict(zip(paths, self._threads[1].map(one, paths), strict=True))

    def read(self, path: str) -> bytes:
        """The bytes of `root/path`; FileNotFoundError if missing, OSError for local I/O errors,
        DataError for remote storage failures (credentials, access, network), UnsafePath
        if `path` could leave the root."""
        if path in self._ready:
            ready = self._ready[path]
            if isinstance(ready, Exception):
                raise ready
            return ready
        if escapes(path):
            raise UnsafePath(UNSAFE_PATH)
        local = self.cache / path if self.cache else None
        if local is not None and local.is_file():
            return local.read_bytes()
        where = f"{self.root}/{path}"
        one_request = {} if _is_local(self._fs) else {"max_concurrency": 1}  # s3fs: no HEAD for the size
        try:
            data = with_retries(lambda: self.fs.cat_file(where, **one_request), where, self.policy)
        except DataError:  # transient failures past the budget
            raise
        except Exception as e:  # missing files and local I/O errors pass through: bad images
            mapped = None if _is_local(self._fs) else storage_error(e, f"{self.root}/{path}")
            if mapped is None:
                raise
            raise mapped from e
        if local is not None:
            with writing(local):  # the cache's disk full: one line naming the file, in any process
                local.parent.mkdir(parents=True, exist_ok=True)
                partial = local.with_name(f".{local.name}.{os.getpid()}.part")
                partial.write_bytes(data)
                os.replace(partial, local)  # atomic: readers see a whole file or none
        return data


def cache_folder(fs: fsspec.AbstractFileSystem, root: str, cache_dir: str | Path | None) -> Path | None:
    """`cache_dir/<endpoint host or protocol>/<bucket/prefix>` for remote roots; None for local ones."""
    if not cache_dir or _is_local(fs):
        return None
    endpoint = (fs.storage_options.get("client_kwargs") or {}).get("endpoint_url")
    host = urlparse(endpoint).netloc.replace(":", "_") if endpoint else _protocol(fs)
    return Path(os.path.expandvars(os.path.expanduser(str(cache_dir)))) / host / root.lstrip("/")


def _protocol(fs: fsspec.AbstractFileSystem) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return _protocol(fs) in ("file", "local")
