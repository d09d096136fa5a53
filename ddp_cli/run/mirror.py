"""The run's copy in the bucket, kept by one background thread of the writer rank (`BucketMirror`).

Training writes its staging folder as any run dir; the checkpoint store tells the mirror when a
checkpoint is final (`saved`) and when one is pruned (`removed`), and the mirror repeats each in the
bucket, in order, while the next steps run:

- a checkpoint: its object, then its manifest (sha256) last, so a checkpoint is complete in the bucket
  when its manifest is there (`run.pull` trusts nothing else); last.pt / best.pt as copies made inside
  the bucket, each followed by its own manifest;
- pruned: the manifest first, then the object (never a manifest naming a missing object);
- the run's other files (metrics.jsonl, evaluation.json, logs, the config copy): S3 objects cannot be
  appended to, so each file that changed is uploaded whole again after every checkpoint and at the end
  (`upload_files`; they are small: metrics.jsonl is one line per logging window).

A request that keeps failing (past data.io_retries) stops the mirror; the trainer raises its error at
the next step (`raise_if_failed`) or at the end (`close`): exit 3, naming the object and the last
checkpoint that is complete in the bucket.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from ddp_cli.errors import DataError
from ddp_cli.run.bucket import NOT_MIRRORED, RunBucket
from ddp_cli.train.checkpoint import manifest_path

log = logging.getLogger("ddp")


def upload_files(bucket: RunBucket, folder: Path, sent: dict[str, tuple[int, int]],
                 only: tuple[str, ...] = ()) -> None:
    """Upload every file of `folder` (or of its folders `only`) but its checkpoints and index that changed
    since `sent` says (its (size, mtime) at the last upload, updated here)."""
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        top = name.split("/")[0]
        skipped = top in NOT_MIRRORED or path.name.startswith(".") or (only and top not in only)
        if skipped or not path.is_file():
            continue
        try:
            stat = path.stat()
            if sent.get(name) != (stat.st_size, stat.st_mtime_ns):
                bucket.put(path, name)
                sent[name] = (stat.st_size, stat.st_mtime_ns)
        except FileNotFoundError:  # gone since the listing (a file replaced by its next version)
            continue


def renamed(manifest: bytes, alias: Path) -> bytes:
    """A checkpoint's manifest as its alias's (`write_manifest` names the file it describes)."""
    return json.dumps({**json.loads(manifest), "file": alias.name}).encode()


class BucketMirror:
    """Repeats the checkpoint store's finished writes in the bucket, on a thread of its own."""

    def __init__(self, bucket: RunBucket, folder: Path) -> None:
        self.bucket, self.folder, self.url = bucket, folder, bucket.url
        self.safe: str | None = None  # the newest checkpoint complete in the bucket
        self.failure: DataError | None = None
        self.sent: dict[str, tuple[int, int]] = {}
        self.tasks: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="ddp-upload", daemon=True)
        self.thread.start()

    def saved(self, path: Path, aliases: list[Path]) -> None:
        """`path` and its manifest are final (and `aliases` of it, each with its manifest)."""
        self.tasks.put(lambda: self._checkpoint(path, aliases))
        self.tasks.put(lambda: upload_files(self.bucket, self.folder, self.sent))

    def removed(self, path: Path) -> None:
        """`path` was pruned."""
        self.tasks.put(lambda: self._remove(path))

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """The run's files uploaded a last time, every upload done; an upload that failed is raised."""
        self.tasks.put(lambda: upload_files(self.bucket, self.folder, self.sent))
        self.tasks.put(None)
        self.thread.join()
        self.raise_if_failed()

    def _name(self, path: Path) -> str:
        return path.relative_to(self.folder).as_posix()

    def _checkpoint(self, path: Path, aliases: list[Path]) -> None:
        name = self._name(path)
        try:
            manifest = manifest_path(path).read_bytes()
            self.bucket.put(path, name)
        except FileNotFoundError:  # pruned here before its turn came (its removal is queued next)
            log.warning("warning: %s was pruned on the node before its turn to upload: the bucket upload is "
                        "slower than the checkpoints come (the bucket's newest is %s); raise "
                        "checkpoint.every_steps or checkpoint.keep_last, or use a faster link",
                        self.bucket.url_of(name), self.safe or "none yet")
            self._aliases_as_they_are(aliases)
            return
        self.bucket.write(self._name(manifest_path(path)), manifest)  # now it counts
        self.safe = self.bucket.url_of(name)
        for alias in aliases:  # a copy of the object, and the manifest of that very object
            self.bucket.copy(name, self._name(alias))
            self.bucket.write(self._name(manifest_path(alias)), renamed(manifest, alias))

    def _aliases_as_they_are(self, aliases: list[Path]) -> None:
        """The aliases' files uploaded as they are here now (a newer save may have replaced one between
        its file and its manifest: resuming checks the sha256 and skips such a pair)."""
        for alias in aliases:
            with suppress(FileNotFoundError):
                self.bucket.put(alias, self._name(alias))
                self.bucket.put(manifest_path(alias), self._name(manifest_path(alias)))

    def _remove(self, path: Path) -> None:
        self.bucket.remove(self._name(manifest_path(path)))  # no longer a checkpoint, then no object
        self.bucket.remove(self._name(path))

    def _work(self) -> None:
        while (task := self.tasks.get()) is not None:
            if self.failure is not None:
                continue  # nothing after a failed upload: the order is what makes a checkpoint safe
            try:
                task()
            except Exception as e:  # noqa: BLE001 - raised on the training thread (`raise_if_failed`)
                log.debug("upload failed", exc_info=True)
                self.failure = DataError(f"{e if isinstance(e, DataError) else f'{self.bucket.url}: {e}'}; "
                                         f"{self.where_to_resume()}")

    def where_to_resume(self) -> str:
        safe = (f"the last checkpoint complete in the bucket is {self.safe}" if self.safe
                else "no checkpoint of this session reached the bucket (any it resumed from is there)")
        return f"{safe}; resume with --run-dir {self.bucket.url} --resume auto"
