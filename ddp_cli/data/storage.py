"""Remote roots through fsspec: S3 via s3fs with the standard AWS credential chain."""

from __future__ import annotations

import fsspec

from ddp_cli.errors import DataError


def s3_filesystem(storage) -> tuple[fsspec.AbstractFileSystem, str]:
    """An s3fs filesystem for `storage` and the root as bucket/prefix (credentials never logged)."""
    options = {"anon": storage.anon, "profile": storage.profile,
               "client_kwargs": {k: v for k, v in (("endpoint_url", storage.endpoint_url),
                                                   ("region_name", storage.region)) if v}}
    fs = fsspec.filesystem("s3", **{k: v for k, v in options.items() if v is not None})
    root = storage.path.removeprefix("s3://").rstrip("/")
    try:
        fs.ls(root)
    except FileNotFoundError as e:
        raise DataError(f"{storage.path}: no such bucket or prefix; fix storage.path") from e
    except PermissionError as e:
        raise DataError(f"{storage.path}: access refused; check the AWS credentials/profile") from e
    return fs, root
