"""`ddp predict`'s INPUT arguments as one split under one root: files as given, folders walked for images.

Local inputs share the root "/" (each path made absolute); S3 inputs the root
of their bucket. The split keeps the order given (a folder's images sorted),
so answers come back in the order a user listed them, and each label is -1
(unknown).
"""

from __future__ import annotations

import os
from pathlib import Path

import fsspec

from ddp_cli.data.sources.packed import Split
from ddp_cli.data.sources.table import IMAGE_EXTENSIONS
from ddp_cli.errors import ConfigError, DataError

S3 = "s3://"


def input_root(inputs: list[str]) -> str:
    """Where the inputs live: "/" for local files, "s3://BUCKET" for one bucket; mixing is refused."""
    remote = [i for i in inputs if i.startswith(S3)]
    if not remote:
        return "/"
    buckets = {i.removeprefix(S3).split("/", 1)[0] for i in remote}
    if len(remote) != len(inputs) or len(buckets) > 1:
        raise ConfigError("INPUT: local files and S3 objects (or several buckets) in one call; run "
                          "`ddp predict` once per bucket or folder tree")
    return S3 + buckets.pop()


def expand_inputs(fs: fsspec.AbstractFileSystem, root: str, inputs: list[str]) -> Split:
    """Every image the inputs name, as paths under `root` (the filesystem's own root path)."""
    paths: list[str] = []
    for given in inputs:
        where = in_root(given)
        if fs.isdir(where):
            found = sorted(p for p in fs.find(where) if p.lower().endswith(IMAGE_EXTENSIONS))
            if not found:
                raise DataError(f"{given}: no images in this folder (looked for "
                                f"{', '.join(IMAGE_EXTENSIONS)}, in subfolders too)")
            paths += found
        elif fs.isfile(where):
            paths.append(where)
        else:
            raise DataError(f"{given}: no such file or folder")
    prefix = root.rstrip("/") + "/"
    return Split.of([p.removeprefix(prefix) for p in paths], [-1] * len(paths))


def in_root(given: str) -> str:
    """`given` as the filesystem names it: an absolute local path, or bucket/key."""
    if given.startswith(S3):
        return given.removeprefix(S3).rstrip("/")
    return os.path.abspath(Path(given).expanduser())
