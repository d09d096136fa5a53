"""Where a run or a checkpoint is, and who holds it: a folder, or an s3:// URL (a run dir in a bucket:
run.bucket); a run dir held by its owner's lock for a command's block (run.owner).
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime
from pathlib import Path

from ddp_cli.config import RunConfig
from ddp_cli.errors import ConfigError
from ddp_cli.run.bucket import RunBucket


def run_location(path: Path | None, flag: str) -> Path | str | None:
    """`path`, or the s3:// URL it spells (a Path keeps `s3://bucket/x` as `s3:/bucket/x`): a run dir in
    object storage (run.bucket). Other URLs are refused: a run would land in a local folder named after
    them while its user believes it is remote."""
    text = str(path) if path is not None else ""
    if re.match(r"s3:/", text):
        return RunBucket(re.sub(r"^s3:/+", "s3://", text)).url  # checked: a bucket and a prefix
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/", text):
        url = re.sub(r"^([^:]+):/+", r"\1://", text)
        raise ConfigError(f"{flag} {url}: ddp writes runs to a folder or to s3://BUCKET/PREFIX/NAME; give "
                          "one of those (a volume the storage is mounted on works)")
    return path


def local_checkpoint(path: str | Path, flag: str = "--checkpoint") -> str:
    """`path`, or where the checkpoint its s3:// URL names was downloaded to (checked against its
    manifest: run.pull)."""
    url = run_location(Path(path), flag)
    if isinstance(url, str):
        from ddp_cli.run.pull import fetch_checkpoint

        return str(fetch_checkpoint(url, flag))
    return str(path)


def default_run_dir(cfg: RunConfig) -> Path:
    return Path("runs") / f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"


def owned(run_dir: Path | str, owner: bool, flag: str = "--run-dir") -> AbstractContextManager:
    """The run dir (a folder or an s3:// URL) held by this process for the block (`run.owner`), before
    anything is written into it; `owner` is false on the nodes that join node 0's run."""
    from ddp_cli.run.owner import owning

    if not owner:
        return nullcontext()
    return owning(run_dir if isinstance(run_dir, str) else Path(run_dir).resolve(), flag)


def bucket_of(run_dir: Path | str | None) -> str | None:
    """The s3:// URL of a run dir in a bucket (`run_location` gives those as strings), else None."""
    return run_dir if isinstance(run_dir, str) else None


def run_dir_of(path: Path) -> Path | None:
    """The run dir a file written by a command lies in (its folder, or the folder above: `evaluations/`),
    known by its metrics.jsonl or its lock; None elsewhere."""
    from ddp_cli.run.owner import LOCK

    for folder in (path.parent, path.parent.parent):
        if (folder / "metrics.jsonl").is_file() or (folder / LOCK).is_file():
            return folder
    return None
