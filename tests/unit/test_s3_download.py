"""The synchronous S3 client that downloads remote shards is made from the options s3fs is given (the
endpoint, region, anonymity, profile and botocore config of `storage.s3_filesystem`), one per process.
Its downloads, against a loopback S3 server and through the fault proxy: tests/e2e/test_s3.py."""

from __future__ import annotations

import multiprocessing
import os

import pytest
from botocore import UNSIGNED
from botocore.exceptions import ProfileNotFound

from ddp_cli.data.fetch.s3_download import client


class Options:
    """What the client is made from: a filesystem's protocol and storage options."""

    protocol = ("s3", "s3a")

    def __init__(self, **storage_options: object) -> None:
        self.storage_options = storage_options


S3FS_OPTIONS = {"anon": False,  # what storage.s3_filesystem gives s3fs
                "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-3"},
                "config_kwargs": {"retries": {"total_max_attempts": 1}}}


def test_the_client_has_the_filesystems_endpoint_region_and_retries_off(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "fake")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake")
    made = client(Options(**S3FS_OPTIONS))
    assert made.meta.endpoint_url == "http://127.0.0.1:9" and made.meta.region_name == "eu-west-3"
    assert made.meta.config.retries["total_max_attempts"] == 1  # retry.py retries, and counts
    assert made.meta.config.signature_version is not UNSIGNED


def test_an_anonymous_filesystem_gives_an_unsigned_client():
    made = client(Options(**{**S3FS_OPTIONS, "anon": True}))
    assert made.meta.config.signature_version is UNSIGNED
    assert made.meta.config.retries["total_max_attempts"] == 1


def test_the_filesystems_profile_is_the_clients(monkeypatch, tmp_path):
    config = tmp_path / "config"
    config.write_text("[profile ddp-test]\nregion = ap-south-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    options = {k: v for k, v in S3FS_OPTIONS.items() if k != "client_kwargs"}
    assert client(Options(**options, profile="ddp-test")).meta.region_name == "ap-south-1"
    with pytest.raises(ProfileNotFound):  # storage_error makes it "fix storage.profile ..."
        client(Options(**options, profile="ddp-no-such-profile"))


def _made_here(fs: Options, parents: int, queue) -> None:
    queue.put((os.getpid(), id(client(fs)) != parents, fs._ddp_sync_client[0] == os.getpid()))


@pytest.mark.processes
def test_each_process_makes_its_own_client_and_its_threads_share_it():
    fs = Options(**S3FS_OPTIONS)
    first = client(fs)
    assert client(fs) is first
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_made_here, args=(fs, id(first), queue))
    child.start()
    pid, new, own = queue.get(timeout=30)
    child.join(timeout=30)
    assert pid != os.getpid() and new and own  # the parent's connections stay the parent's
    assert client(fs) is first
