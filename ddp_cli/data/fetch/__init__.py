"""Bytes from storage: fsspec roots (local, S3), whole-object downloads, shard reads, retries with backoff.
May import errors and io only: the bottom of data/."""
