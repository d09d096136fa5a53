"""s3fs's filesystem making each request once: `data/retry.py` retries, within data.io_retries, and counts.

(s3fs retries transient errors itself, `retries` attempts per request, hidden from
us; botocore's own retries are turned off where the filesystem is made.)
"""

from s3fs import S3FileSystem


class S3FileSystemOnce(S3FileSystem):
    retries = 1  # attempts per request
