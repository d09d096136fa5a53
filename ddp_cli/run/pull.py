"""A run dir in the bucket, brought to this node: to resume it (`stage`) or to read one checkpoint of it
(`fetch_checkpoint`: validate, predict, export, --resume PATH).

The bucket is the truth: a staging folder is emptied before the bucket's files come down, so a node's
leftovers (a checkpoint written but never uploaded) are never taken for the run's. A checkpoint counts
only with its manifest, and only once its downloaded bytes match the manifest's sha256: an object
without one (an upload cut short), or one that differs from it, is skipped for the one before.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from ddp_cli.errors import ConfigError, DataError
from ddp_cli.run.bucket import SCHEME, RunBucket, staging_folder
from ddp_cli.train.checkpoint import MANIFEST, manifest_path, verify

log = logging.getLogger("ddp")
CHECKPOINTS = "checkpoints"


def stage(bucket: RunBucket, folder: Path, resume: str) -> None:
    """Make `folder` the bucket's run: emptied; unless `resume` is "never", the run's files come down
    (metrics.jsonl goes on from the bucket's), and with "auto" its newest valid checkpoint."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    bucket.fs  # noqa: B018 - the bucket checked before any worker starts
    if resume == "never":
        return
    bucket.download_files(folder)
    if resume == "auto":
        newest = newest_checkpoint(bucket, folder / CHECKPOINTS)
        if newest:
            log.info(f"{bucket.url_of(f'{CHECKPOINTS}/{newest.name}')}: downloaded to resume from")


def newest_checkpoint(bucket: RunBucket, folder: Path) -> Path | None:
    """The newest checkpoint of the bucket whose object matches its manifest, downloaded into `folder`
    (with its manifest); torn or altered ones are skipped, as `CheckpointStore.latest_valid` does."""
    for name in by_step(bucket):
        local = folder / name
        try:
            bucket.get(f"{CHECKPOINTS}/{name}{MANIFEST}", manifest_path(local))
            bucket.get(f"{CHECKPOINTS}/{name}", local)
            problem = verify(local)
        except FileNotFoundError:
            problem = "no object beside its manifest"
        if problem is None:
            return local
        log.warning("skipping checkpoint %s: %s", bucket.url_of(f"{CHECKPOINTS}/{name}"), problem)
        local.unlink(missing_ok=True)
        manifest_path(local).unlink(missing_ok=True)
    return None


def by_step(bucket: RunBucket) -> list[str]:
    """The run's step checkpoints and last.pt that have a manifest, newest first."""
    steps = {}
    for key in bucket.names(CHECKPOINTS):
        name = key.removeprefix(f"{CHECKPOINTS}/").removesuffix(MANIFEST)
        if key.endswith(".pt" + MANIFEST) and (name.startswith("step-") or name == "last.pt"):
            try:
                steps[name] = int(json.loads(bucket.read(key)).get("step", -1))
            except (FileNotFoundError, ValueError, TypeError, AttributeError):
                continue  # not a manifest: its checkpoint is not trusted
    return sorted(steps, key=lambda n: (steps[n], n.startswith("step-")), reverse=True)


def fetch_checkpoint(url: str, flag: str = "--checkpoint") -> Path:
    """The checkpoint `url` (s3://BUCKET/PREFIX/NAME/checkpoints/FILE.pt), downloaded beside its
    manifest into the node's download cache (`staging_folder(url)` under `downloads/`) and checked
    against it; the caller loads it as a local file. A cached copy that matches the bucket's manifest
    is not downloaded again."""
    run_url, _, file = url.rstrip("/").rpartition("/")
    if not file.endswith(".pt") or "/" not in run_url.removeprefix(SCHEME):
        raise ConfigError(f"{flag} {url}: give s3://BUCKET/PREFIX/.../FILE.pt")
    bucket = RunBucket(run_url)
    local = staging_folder(f"{SCHEME}downloads/{url.removeprefix(SCHEME)}")
    try:
        bucket.get(f"{file}{MANIFEST}", manifest_path(local))
    except FileNotFoundError:
        if not bucket.exists(file):
            raise ConfigError(f"{flag} {url}: no such object; give a .pt from RUN/checkpoints/") from None
        raise DataError(f"{flag} {url}: no manifest ({file}{MANIFEST}) beside it in the bucket (an upload "
                        "cut short?); use another checkpoint of the run") from None
    if local.is_file() and verify(local) is None:
        return local
    try:
        bucket.get(file, local)
    except FileNotFoundError:
        raise ConfigError(f"{flag} {url}: no such object; give a .pt from RUN/checkpoints/") from None
    problem = verify(local)
    if problem:
        raise DataError(f"{flag} {url}: {problem}; use another checkpoint of the run")
    return local
