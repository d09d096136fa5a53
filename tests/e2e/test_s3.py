"""S3 roots against a real S3 endpoint on loopback (moto's server mode, port 0), not a mock of s3fs.

Credentials are fake and set per test only; the secret must never reach a run directory.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import statistics
import time
from pathlib import Path

import moto.settings
import pytest
import s3fs
import torch
from conftest import ENV, KEY, REPO, SECRET, last_json, run_ddp
from synthetic import make_csv_listed, make_imagenet_loc, plant, write_hf_parquet, write_registry
from typer.testing import CliRunner

from ddp_cli.cli import app
from ddp_cli.data.fetch.storage import FileReader, cache_folder
from ddp_cli.data.registry import load_registry
from ddp_cli.errors import DataError

BUCKET = "ddp-test-data"
runner = CliRunner()


@pytest.fixture(scope="session")
def s3_registry(s3_endpoint, tmp_path_factory) -> Path:
    """`imagenet` (clean: 3 classes x 8 train, 7 val) and `faulty` (faults planted) in one bucket."""
    local = tmp_path_factory.mktemp("s3-upload")
    make_imagenet_loc(local / "imagenet", classes=3, train_per_class=8, val=7)
    shutil.copytree(local / "imagenet", local / "faulty")
    plant(local / "faulty", "ILSVRC/Data/CLS-LOC/train/n00001001/n00001001_3.JPEG", "truncated")
    plant(local / "faulty", "ILSVRC/Data/CLS-LOC/val/ILSVRC2012_val_00000004.JPEG", "missing")
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": s3_endpoint},
                           skip_instance_cache=True)
    fs.mkdir(BUCKET)
    for name in ("imagenet", "faulty"):
        fs.put(f"{local / name}/", f"{BUCKET}/{name}/", recursive=True)
    entries = [{"name": name, "layout": "imagenet-loc",
                "storage": {"driver": "S3", "path": f"s3://{bucket}/{prefix}", "endpoint_url": s3_endpoint}}
               for name, bucket, prefix in (("s3data", BUCKET, "imagenet"), ("s3faulty", BUCKET, "faulty"),
                                            ("nobucket", "ddp-no-such-bucket", "imagenet"))]
    return write_registry(tmp_path_factory.mktemp("s3-registry"), entries)


def invoke(*args: str):
    return runner.invoke(app, list(args))


def one_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def test_datasets_check_on_s3_finds_the_planted_faults(s3_registry, aws):
    result = invoke("datasets", "check", "s3faulty", "--registry", str(s3_registry), "--json")
    assert result.exit_code == 3, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["splits"] == {"train": {"images": 24, "classes": 3}, "val": {"images": 7, "classes": 3}}
    assert out["bad_files"] == [
        {"path": "ILSVRC/Data/CLS-LOC/train/n00001001/n00001001_3.JPEG", "reason": "truncated"},
        {"path": "ILSVRC/Data/CLS-LOC/val/ILSVRC2012_val_00000004.JPEG", "reason": "missing file"},
    ]
    clean = invoke("datasets", "check", "s3data", "--registry", str(s3_registry), "--json")
    assert clean.exit_code == 0, clean.output
    assert json.loads(clean.stdout.strip().splitlines()[-1])["bad_files"] == []


def test_a_csv_listed_data_set_reads_its_listing_from_the_bucket(s3_endpoint, aws, tmp_path):
    """layout csv on S3: the listing and classes file read through s3fs, the listed images checked."""
    rows = make_csv_listed(tmp_path / "tabled")
    plant(tmp_path / "tabled", rows[2]["path"], "garbage")
    (tmp_path / "tabled" / "classes.txt").write_text("moth\nzebra\nant\n")
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": s3_endpoint},
                           skip_instance_cache=True)
    fs.put(f"{tmp_path / 'tabled'}/", f"{BUCKET}/tabled/", recursive=True)
    storage = {"driver": "S3", "path": f"s3://{BUCKET}/tabled", "endpoint_url": s3_endpoint}
    registry = write_registry(tmp_path, [{"name": "tabled", "layout": "csv", "storage": storage,
                                          "csv": {"classes": "classes.txt"}}])
    result = invoke("datasets", "check", "tabled", "--registry", str(registry), "--json")
    assert result.exit_code == 3, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["splits"] == {"train": {"images": 9, "classes": 3}, "val": {"images": 3, "classes": 3}}
    assert out["bad_files"] == [{"path": rows[2]["path"], "reason": "not an image"}]
    shown = json.loads(invoke("datasets", "show", "tabled", "--registry", str(registry), "--json")
                       .stdout.strip().splitlines()[-1])
    assert [c["synset"] for c in shown["classes"]] == ["moth", "zebra", "ant"]


def test_missing_bucket_is_a_data_error(s3_registry, aws):
    result = invoke("datasets", "check", "nobucket", "--registry", str(s3_registry))
    assert result.exit_code == 3
    assert "s3://ddp-no-such-bucket/imagenet: no such bucket" in one_error(result)


def test_missing_prefix_is_a_data_error(s3_endpoint, aws, tmp_path):
    registry = write_registry(tmp_path, [{"name": "x", "layout": "imagenet-loc", "storage": {
        "driver": "S3", "path": f"s3://{BUCKET}/no-such-prefix", "endpoint_url": s3_endpoint}}])
    result = invoke("datasets", "show", "x", "--registry", str(registry))
    assert result.exit_code == 3 and "no such prefix" in one_error(result)


def test_missing_credentials_is_a_data_error(s3_registry, aws):
    aws.delenv("AWS_ACCESS_KEY_ID")
    aws.delenv("AWS_SECRET_ACCESS_KEY")
    result = invoke("datasets", "show", "s3data", "--registry", str(s3_registry))
    assert result.exit_code == 3
    line = one_error(result)
    assert "no AWS credentials found" in line and "AWS_PROFILE" in line


def test_missing_profile_is_a_data_error(s3_endpoint, aws, tmp_path):
    registry = write_registry(tmp_path, [{"name": "p", "layout": "imagenet-loc", "storage": {
        "driver": "S3", "path": f"s3://{BUCKET}/imagenet", "endpoint_url": s3_endpoint,
        "profile": "ddp-no-such-profile"}}])
    result = invoke("datasets", "show", "p", "--registry", str(registry))
    assert result.exit_code == 3 and "ddp-no-such-profile" in one_error(result)


def test_refused_credentials_are_a_data_error(s3_registry, aws):
    aws.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server now checks keys
    result = invoke("datasets", "show", "s3data", "--registry", str(s3_registry))
    assert result.exit_code == 3
    line = one_error(result)
    assert "access refused" in line and SECRET not in result.output


def _read_in_child(reader: FileReader, path: str, queue) -> None:
    try:
        queue.put(reader.read(path))
    except Exception as e:  # report, do not hang the parent
        queue.put(repr(e))


def test_reader_made_before_fork_reads_in_the_forked_child(s3_registry, aws):
    """DataLoader workers are forked; s3fs alone refuses ("This class is not fork-safe")."""
    fs, root = load_registry(s3_registry).get("s3data").open()
    reader = FileReader(fs, root)
    path = "LOC_synset_mapping.txt"
    expected = reader.read(path)  # the parent's filesystem and event loop are live
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(reader, path, queue))
    child.start()
    try:
        assert queue.get(timeout=60) == expected
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert reader.read(path) == expected  # and the parent's still works


def test_cache_serves_later_reads_without_the_bucket(s3_endpoint, aws, tmp_path):
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    fs.pipe_file(f"{BUCKET}/cached/a/b.JPEG", b"first version")
    reader = FileReader(fs, f"{BUCKET}/cached", tmp_path / "cache")
    assert reader.cache == tmp_path / "cache" / s3_endpoint.removeprefix("http://").replace(":", "_") \
        / BUCKET / "cached"
    assert reader.read("a/b.JPEG") == b"first version"
    assert (reader.cache / "a" / "b.JPEG").read_bytes() == b"first version"
    fs.rm(f"{BUCKET}/cached/a/b.JPEG")  # gone from the bucket: only the cache can answer now
    assert reader.read("a/b.JPEG") == b"first version"
    assert [p.name for p in (reader.cache / "a").iterdir()] == ["b.JPEG"]  # no partial files left
    with pytest.raises(FileNotFoundError):
        reader.read("a/never-there.JPEG")


def test_no_cache_for_local_roots(tmp_path):
    import fsspec

    assert cache_folder(fsspec.filesystem("file"), str(tmp_path), tmp_path / "cache") is None


def test_refusal_while_reading_is_a_data_error_naming_the_file(s3_registry, aws):
    """Keys revoked mid-run: the read fails with the file and the fix, not a botocore traceback."""
    fs, root = load_registry(s3_registry).get("s3data").open()
    aws.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    aws.setenv("AWS_ACCESS_KEY_ID", "AKIAREVOKED000000000")
    s3fs.S3FileSystem.clear_instance_cache()
    revoked = FileReader(s3fs.S3FileSystem(client_kwargs=fs.storage_options["client_kwargs"]), root)
    with pytest.raises(DataError, match=f"{root}/LOC_synset_mapping.txt: access refused"):
        revoked.read("LOC_synset_mapping.txt")


CONFIG = """name = "s3"
[data]
dataset = "s3data"
image_size = 32
val_resize = 36
batch_size = 4
[model]
name = "resnet_tiny"
[schedule]
name = "constant"
[train]
epochs = 1
[distributed]
nproc_per_node = 2
backend = "gloo"
timeout_s = 60
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_train_one_epoch_from_s3(s3_registry, tmp_path, workers):
    config = tmp_path / "s3.toml"
    config.write_text(CONFIG)
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    result = run_ddp("train", str(config), "--registry", str(s3_registry), "--run-dir", str(run_dir),
                     "--json", "--set", f"data.workers={workers}", "--set", f'data.cache_dir="{cache}"',
                     cwd=REPO, env=ENV, timeout=180)
    out = last_json(result)
    assert out["world_size"] == 2 and out["final"]["images"] == 7 and out["skipped_images"] == 0
    cached = sorted(p.name for p in cache.rglob("*.JPEG"))
    assert len(cached) == 24 + 7  # every train and val image, downloaded once into the cache
    for path in run_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert SECRET.encode() not in data and KEY.encode() not in data, path
    assert SECRET not in result.stdout + result.stderr


def test_predict_reads_s3_objects_and_prefixes(s3_registry, s3_endpoint, trained_demo, tmp_path):
    """Objects and a prefix of one bucket (endpoint from AWS_ENDPOINT_URL), answered as the same files
    are on local disk; a key that does not exist is exit 3 naming it."""
    ckpt = str(trained_demo / "checkpoints" / "last.pt")
    env = {**ENV, "AWS_ENDPOINT_URL": s3_endpoint}
    val = f"s3://{BUCKET}/imagenet/ILSVRC/Data/CLS-LOC/val"
    remote = run_ddp("predict", "--checkpoint", ckpt, f"{val}/ILSVRC2012_val_00000006.JPEG", f"{val}/",
                     "--topk", "2", "--json", env=env)
    assert remote.returncode == 0, remote.stderr[-2000:]
    answers = [json.loads(line) for line in remote.stdout.strip().splitlines()]
    order = (6, 1, 2, 3, 4, 5, 6, 7)
    assert [a["path"] for a in answers] == [f"{val}/ILSVRC2012_val_0000000{i}.JPEG" for i in order]
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": s3_endpoint},
                           skip_instance_cache=True)
    fs.get(f"{val.removeprefix('s3://')}/", f"{tmp_path}/", recursive=True)
    local = run_ddp("predict", "--checkpoint", ckpt, str(tmp_path), "--topk", "2", "--json")
    assert local.returncode == 0, local.stderr[-2000:]
    by_name = {a["path"].rsplit("/", 1)[1]: a["topk"]
               for a in map(json.loads, local.stdout.strip().splitlines())}
    assert len(by_name) == 7
    for a in answers:
        assert a["topk"] == by_name[a["path"].rsplit("/", 1)[1]]


def test_predict_names_a_missing_s3_input(s3_registry, s3_endpoint, trained_demo, aws):
    """Checked in the launcher, before any worker starts (`predict_inputs`): exit 3 naming it."""
    from ddp_cli.cli.commands.checkpoints import predict_inputs
    from ddp_cli.train.checkpoint_model import load_trained

    aws.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    trained = load_trained(trained_demo / "checkpoints" / "last.pt")
    val = f"s3://{BUCKET}/imagenet/ILSVRC/Data/CLS-LOC/val"
    with pytest.raises(DataError, match=f"^{val}/nope.JPEG: no such file or folder$"):
        predict_inputs(trained.cfg, trained, [f"{val}/ILSVRC2012_val_00000001.JPEG", f"{val}/nope.JPEG"],
                       None, "val", None)
    with pytest.raises(DataError, match="no such bucket; check the INPUT URLs"):
        predict_inputs(trained.cfg, trained, ["s3://ddp-no-such-bucket/x.jpg"], None, "val", None)


def test_pack_to_s3_then_training_from_s3_shards_equals_training_from_local_ones(s3_registry, s3_endpoint,
                                                                                  tmp_path, aws):
    """The S3 source packed twice, to a bucket prefix and to a local folder (byte-identical shards); a run
    from each ends with the same weights, and the S3 run read whole shards into its node-local cache."""
    aws.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    for to in (f"s3://{BUCKET}/shards", str(tmp_path / "shards")):
        result = invoke("datasets", "pack", "s3data", "--registry", str(s3_registry), "--to", to,
                        "--shard-size", "0.05", "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["splits"]["train"]["images"] == 24
    registry = write_registry(tmp_path, [
        {"name": "remote", "layout": "shards", "storage": {"driver": "S3", "path": f"s3://{BUCKET}/shards",
                                                           "endpoint_url": s3_endpoint}},
        {"name": "local", "layout": "shards",
         "storage": {"driver": "FileSystem", "path": str(tmp_path / "shards")}}])
    config = tmp_path / "s3.toml"
    config.write_text(CONFIG)
    weights = {}
    for name in ("remote", "local"):
        run_dir, cache = tmp_path / f"run-{name}", tmp_path / f"cache-{name}"
        out = last_json(run_ddp("train", str(config), "--registry", str(registry), "--run-dir", str(run_dir),
                                "--json", "--set", f"data.dataset={name}", "--set", "data.workers=1",
                                "--set", "deterministic=true", "--set", f'data.cache_dir="{cache}"',
                                cwd=REPO, env=ENV, timeout=180))
        assert out["final"]["images"] == 7
        weights[name] = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)["model"]
    shards = sorted(p.name for p in (tmp_path / "shards").glob("*.tar"))
    assert sorted(p.name for p in (tmp_path / "cache-remote").rglob("*.tar")) == shards  # each one, whole
    assert not (tmp_path / "cache-local").exists()  # local shards are read in place
    assert all(torch.equal(weights["remote"][k], v) for k, v in weights["local"].items())


@pytest.fixture
def through(s3_endpoint, tmp_path):
    """A fault proxy in front of the loopback server, and a registry whose `s3data`/`s3faulty` read
    through it."""
    from ddp_cli.bench.faultproxy import FaultProxy, Faults

    def start(**faults):
        proxy = FaultProxy(s3_endpoint, Faults(**faults)).__enter__()
        started.append(proxy)
        entries = [{"name": name, "layout": "imagenet-loc",
                    "storage": {"driver": "S3", "path": f"s3://{BUCKET}/{prefix}", "endpoint_url": proxy.url}}
                   for name, prefix in (("s3data", "imagenet"), ("s3faulty", "faulty"))]
        folder = tmp_path / f"proxy-{len(started)}"
        folder.mkdir()
        return proxy, write_registry(folder, entries)

    started: list = []
    yield start
    for proxy in started:
        proxy.__exit__(None, None, None)


def test_a_batch_of_s3_objects_is_read_together_and_loads_as_one_by_one(s3_registry, through, aws):
    """`__getitems__` (what the DataLoader calls) reads a batch's objects concurrently, then makes each
    item as `__getitem__` does: same pixels, same seeds, the same bad-file handling (skip and error)."""
    from ddp_cli.config import AugmentConfig, DataConfig
    from ddp_cli.data.fetch.retry import IoPolicy
    from ddp_cli.data.pipeline.augment import train_transform
    from ddp_cli.data.pipeline.loaders import EpochItems, ImageDataset
    from ddp_cli.data.sources.layouts import build_index

    proxy, registry = through(latency_ms=30)
    entry = load_registry(registry).get("s3faulty")
    fs, root = entry.open()
    split = build_index(fs, root, entry.layout, on_bad_image="skip").splits["train"]
    cfg = DataConfig(image_size=16)
    for policy in ("skip", "error"):
        def items(policy=policy):
            transform = train_transform(cfg, AugmentConfig(policy="trivialaugment"))
            dataset = ImageDataset(fs, root, split, transform, policy, 16, policy=IoPolicy(concurrency=8))
            return EpochItems(dataset, seed=3)
        batch = [(i, 1, 0) for i in range(len(split))]
        quiet(proxy)  # the last round's requests all answered: each round's peak is its own
        one_by_one = [items()[item] for item in batch]
        peak_before = proxy.counts.peak_in_flight
        together = items().__getitems__(batch)
        # one at a time (a request answered may still be closing at the proxy as the next one starts,
        # so 2 at most), then io_concurrency's 8 at once (30 ms each: well over 2 of them overlap)
        assert 8 >= proxy.counts.peak_in_flight >= 3 > 2 >= peak_before
        for a, b in zip(together, one_by_one, strict=True):
            assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
        assert any(item[2] or item[3] for item in together)  # the planted truncated file met either way


def quiet(proxy, timeout_s: float = 10.0) -> None:
    """Wait (bounded) until the proxy has no request in flight, then start its peak afresh: a request
    the client has its answer to may still be closing at the proxy."""
    deadline = time.monotonic() + timeout_s
    while proxy.counts.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    proxy.counts.peak_in_flight = 0


@pytest.fixture
def blobs(s3_registry, s3_endpoint, aws):
    """Four 1 MiB objects under s3://BUCKET/blobs/ (the bucket is s3_registry's), read as remote shards are:
    whole, into a local cache."""
    import random

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    data = {f"{i}.tar": random.Random(i).randbytes(1 << 20) for i in range(4)}
    for name, blob in data.items():
        fs.pipe_file(f"{BUCKET}/blobs/{name}", blob)
    return data


def shard_reader(endpoint: str, cache: Path, retries: int):
    from ddp_cli.data.fetch.retry import IoPolicy
    from ddp_cli.data.fetch.shard_reader import ShardReader
    from ddp_cli.data.fetch.storage import S3Location, s3_filesystem

    fs, root = s3_filesystem(S3Location(f"s3://{BUCKET}/blobs", endpoint_url=endpoint))
    return ShardReader(fs, root, cache, policy=IoPolicy(retries=retries, wait_s=0.001))


def test_remote_shards_are_downloaded_whole_one_get_each_by_the_synchronous_client(blobs, s3_endpoint,
                                                                                   tmp_path, monkeypatch):
    from ddp_cli.bench.faultproxy import FaultProxy

    async def not_s3fs(*args, **kwargs):
        raise AssertionError("s3fs's get_file: 64 KiB per event-loop turn, a third more CPU")

    monkeypatch.setattr(s3fs.S3FileSystem, "_get_file", not_s3fs)
    with FaultProxy(s3_endpoint) as proxy:
        reader = shard_reader(proxy.url, tmp_path, retries=0)
        before = proxy.counts.requests
        for name, blob in blobs.items():
            assert reader.fetch(name).read_bytes() == blob
        assert proxy.counts.requests - before == len(blobs)  # a GET each: no HEAD, no ranges


def test_a_shard_download_that_fails_transiently_is_retried_counted_and_whole(blobs, s3_endpoint, tmp_path):
    """Half the GETs refused (503 SlowDown, or the connection reset): each refusal is one counted retry,
    none hidden in botocore, and every shard arrives whole."""
    from ddp_cli.bench.faultproxy import FaultProxy, Faults
    from ddp_cli.data.fetch.retry import count_retries, retries_so_far

    count_retries()
    with FaultProxy(s3_endpoint, Faults(fail_rate=0.5, drop_share=0.5, seed=3)) as proxy:
        reader = shard_reader(proxy.url, tmp_path, retries=12)
        retried, refused = retries_so_far(), proxy.counts.refused
        for name, blob in blobs.items():
            assert reader.fetch(name).read_bytes() == blob
        assert proxy.counts.refused - refused == retries_so_far() - retried > proxy.counts.dropped > 0
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".lock")) == \
        sorted(blobs)  # no partial file left behind


def test_a_shard_that_keeps_failing_or_is_missing_is_an_error_naming_it(blobs, s3_endpoint, tmp_path):
    from ddp_cli.bench.faultproxy import FaultProxy, Faults

    with FaultProxy(s3_endpoint, Faults(fail_paths="blobs/2.tar")) as proxy:
        reader = shard_reader(proxy.url, tmp_path, retries=2)
        with pytest.raises(DataError, match=f"{BUCKET}/blobs/2.tar: the storage failed 3 times in a row"):
            reader.fetch("2.tar")
        assert proxy.counts.refused == 3  # within the budget: 1 + 2 retries, no more
        with pytest.raises(FileNotFoundError, match=f"{BUCKET}/blobs/9.tar"):
            reader.fetch("9.tar")
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


def train_through(registry, tmp_path, name, *extra):
    config = tmp_path / "s3.toml"
    config.write_text(CONFIG)
    return run_ddp("train", str(config), "--registry", str(registry), "--run-dir", str(tmp_path / name),
                   "--json", "--set", "data.workers=1", "--set", "deterministic=true",
                   "--set", "data.io_retry_wait_s=0.01", *extra,
                   cwd=REPO, env=ENV, timeout=180)


def test_transient_s3_failures_are_retried_counted_and_change_nothing(s3_registry, through, tmp_path):
    """5% of GETs failing, 503 SlowDown or (a third of them) the connection reset (seed 1; a one-epoch run
    makes ~45): the run retries them, says how many, and ends with the weights of a run that met none."""
    proxy, registry = through(fail_rate=0.05, drop_share=0.3, seed=1)
    result = train_through(registry, tmp_path, "flaky")
    flaky = last_json(result)
    assert "Traceback" not in result.stderr and "Unclosed" not in result.stderr  # forked S3 sessions: quiet
    clean = last_json(train_through(s3_registry, tmp_path, "clean"))
    assert proxy.counts.refused > proxy.counts.dropped > 0  # seed 1: of 45 requests, 3 x 503 and 2 resets
    assert flaky["io_retries"] > 0 and clean["io_retries"] == 0
    assert flaky["final"] == clean["final"]
    a, b = (torch.load(tmp_path / run / "checkpoints/last.pt", weights_only=True)["model"]
            for run in ("flaky", "clean"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    epochs = [json.loads(line) for line in (tmp_path / "flaky" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["io_retries"] for r in epochs if r.get("split") == "val") == flaky["io_retries"]


def test_an_object_that_keeps_failing_ends_the_run_naming_it_the_last_checkpoint_intact(s3_registry, through,
                                                                                        tmp_path):
    """A validation image that always fails, after a checkpoint at every step of the epoch: exit 3 naming
    it once the budget (2 retries: 3 requests, no more) is spent; the last checkpoint whole."""
    from ddp_cli.train.checkpoint import read_manifest, verify

    key = "imagenet/ILSVRC/Data/CLS-LOC/val/ILSVRC2012_val_00000002.JPEG"
    proxy, registry = through(fail_paths=key)
    result = train_through(registry, tmp_path, "failing", "--set", "data.io_retries=2",
                           "--set", "checkpoint.every_steps=1")
    assert result.returncode == 3, result.stderr[-2000:]
    line = next(x for x in result.stderr.splitlines() if x.startswith("error:"))
    assert f"{BUCKET}/{key}: the storage failed 3 times in a row" in line and "data.io_retries" in line
    assert proxy.counts.refused == 3  # every request of it: none hidden, none past the budget
    last = tmp_path / "failing" / "checkpoints" / "last.pt"
    assert verify(last) is None  # whole, and the newest: 3 steps of 2 ranks x 4 images, the epoch's
    assert read_manifest(last)["step"] == 2  # last one saved only after validation, which failed


def test_bench_data_rates_each_storage_and_reads_s3_through_the_latency_proxy(s3_registry, aws, tmp_path):
    """Local files, their shards, and the same files on S3 (serial and batched rows) behind the proxy:
    every row measured, each ratio its rate over the first row's."""
    local = tmp_path / "local"
    make_imagenet_loc(local, classes=3, train_per_class=8, val=7)
    registry = load_registry(s3_registry)
    entries = [e.model_dump(mode="json", exclude_none=True) for e in registry.datasets if e.name == "s3data"]
    entries += [{"name": "files", "layout": "imagenet-loc",
                 "storage": {"driver": "FileSystem", "path": str(local)}},
                {"name": "packed", "layout": "shards",
                 "storage": {"driver": "FileSystem", "path": f"{local}-shards"}}]
    path = write_registry(tmp_path, entries)
    assert invoke("datasets", "pack", "files", "--registry", str(path), "--to", f"{local}-shards",
                  "--shard-size", "0.05").exit_code == 0
    result = invoke("bench", "data", "files", "packed", "s3data", "--registry", str(path),
                    "--latency-ms", "5", "--workers", "0", "--seconds", "3", "--batch-size", "4",
                    "--image-size", "16", "--rounds", "2", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert [(r["dataset"], r["storage"]) for r in out["rows"]] == [
        ("files", "local files"), ("packed", "local shards"), ("s3data", "s3 files serial"),
        ("s3data", "s3 files batched")]
    first = out["rows"][0]["images"] / out["rows"][0]["seconds"]
    for row in out["rows"]:
        assert row["images"] > 0 and abs(row["ratio"] - row["images"] / row["seconds"] / first) < 1e-9
        assert len(row["round_ratios"]) == 2 and row["median_ratio"] == statistics.median(row["round_ratios"])
    assert out["rows"][0]["round_ratios"] == [1.0, 1.0]  # each round's rates over that round's first row
    assert out["proxied_requests"] >= out["rows"][2]["images"]  # one GET per image at least, through it


PARQUET_CONFIG = CONFIG.replace('dataset = "s3data"', 'dataset = "hub"').replace(
    "image_size = 32\nval_resize = 36", "image_size = 16\nval_resize = 16")


@pytest.mark.slow
def test_parquet_on_s3_resumes_mid_epoch_exactly_and_validates_exactly_at_1_and_2_ranks(s3_registry,
                                                                                       s3_endpoint, tmp_path):
    """Hugging Face-style Parquet in the bucket (two files per split, 4-row groups, a test split too): a run
    resumed from its step-2 checkpoint ends bit-identical, reading row groups by range from forked loader
    processes; `validate` at 1 rank counts exactly what training's validation counted at 2."""
    write_hf_parquet(tmp_path / "hub", {"train": 48, "validation": 7, "test": 3})
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": s3_endpoint},
                           skip_instance_cache=True)
    fs.put(f"{tmp_path / 'hub'}/", f"{BUCKET}/hub/", recursive=True)
    registry = write_registry(tmp_path, [{"name": "hub", "layout": "parquet", "storage": {
        "driver": "S3", "path": f"s3://{BUCKET}/hub", "endpoint_url": s3_endpoint}}])
    config = tmp_path / "parquet.toml"
    config.write_text(PARQUET_CONFIG)
    runs = {}
    for name, extra in (("reference", []), ("resumed", ["--resume", str(tmp_path / "reference/checkpoints/"
                                                                         "step-000000002.pt")])):
        runs[name] = last_json(run_ddp(
            "train", str(config), "--registry", str(registry), "--run-dir", str(tmp_path / name), "--json",
            "--set", "checkpoint.every_steps=2", "--set", "deterministic=true", "--set", "data.workers=1",
            "--set", "data.shuffle_shards=2", *extra, cwd=REPO, env=ENV, timeout=180))
    reference, resumed = runs["reference"], runs["resumed"]
    assert reference["world_size"] == 2 and reference["final"]["images"] == 7
    assert resumed["final"] == reference["final"]
    a, b = (torch.load(tmp_path / name / "checkpoints/last.pt", weights_only=True)["model"] for name in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    last = str(tmp_path / "reference/checkpoints/last.pt")
    one = last_json(run_ddp("validate", "--checkpoint", last, "--registry", str(registry), "--nproc-per-node",
                            "1", "--json", cwd=REPO, env=ENV, timeout=120))
    assert one["world_size"] == 1 and one["images"] == 7 and one["weights"] == "ema"  # the default EMA's
    assert one["top1"] == reference["final_ema"]["top1"]
    assert one["loss"] == pytest.approx(reference["final_ema"]["loss"], rel=1e-6)
