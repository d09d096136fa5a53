"""`ddp datasets pack` through the CLI (in process): its JSON, its errors, and packing to S3 (loopback moto),
killed and resumed there."""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
from pathlib import Path

import pytest
import s3fs
from PIL import Image
from synthetic import make_imagefolder, plant, write_registry
from typer.testing import CliRunner

from ddp_cli.cli import app
from ddp_cli.data.pack.destination import Destination
from ddp_cli.data.pack.writer import Packer
from ddp_cli.data.sources.shards import INDEX, read_index, read_samples

BUCKET = "ddp-pack-test"
QUIRKS = {"train/class_0/img_0.jpg": "cmyk", "train/class_0/img_1.jpg": "gray",
          "train/class_1/img_0.jpg": "png"}


@pytest.fixture
def tree(tmp_path) -> Path:
    """An ImageFolder tree, 3 classes x 6 train (a CMYK JPEG, a grayscale one, a PNG named .jpg) and x 3 val,
    and a registry naming it `tree`."""
    root = tmp_path / "tree"
    make_imagefolder(root, classes=3, per_class=6)
    for path, kind in QUIRKS.items():
        plant(root, path, kind)
    return write_registry(tmp_path, [{"name": "tree", "layout": "imagefolder",
                                      "storage": {"driver": "FileSystem", "path": str(root)}}])


def ddp(*args: str):
    return CliRunner().invoke(app, list(args))


def last_json(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


def members(tar_path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(tar_path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar]


def one_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def test_pack_json_names_what_it_wrote_and_every_image_is_a_small_rgb_jpeg(tree, tmp_path):
    result = ddp("datasets", "pack", "tree", "--registry", str(tree), "--to", str(tmp_path / "out"),
                 "--max-side", "24", "--shard-size", "0.02", "--workers", "2", "--json")
    assert result.exit_code == 0, result.output
    out = last_json(result)
    assert out["to"] == str(tmp_path / "out") and out["index"] == str(tmp_path / "out" / INDEX)
    assert out["seconds"] > 0 and set(out["splits"]) == {"train", "val"}
    for split, images in (("train", 18), ("val", 9)):
        row = out["splits"][split]
        tars = sorted((tmp_path / "out").glob(f"{split}-*.tar"))
        assert row == {"images": images, "shards": len(tars), "skipped": 0,
                       "bytes": sum(t.stat().st_size for t in tars)}
        jpegs = [data for t in tars for name, data in members(t) if name.endswith(".jpg")]
        assert len(jpegs) == images
        for data in jpegs:  # the quirks too: all RGB JPEGs, 40 px shrunk to 24
            img = Image.open(io.BytesIO(data))
            assert (img.format, img.mode, img.size) == ("JPEG", "RGB", (24, 24))
    assert out["splits"]["train"]["shards"] > 1
    meta = read_index(Destination(str(tmp_path / "out")).fs, str(tmp_path / "out"))
    assert (meta.max_side, meta.quality, meta.source["train_order_seed"]) == (24, 90, 0)
    assert sorted((tmp_path / "out").iterdir()) == sorted(  # nothing but the data set: no .pack, no scratch
        [tmp_path / "out" / INDEX, *(tmp_path / "out").glob("*.tar"),
         *(tmp_path / "out" / f"{s}-samples.npz" for s in ("train", "val"))])
    (tmp_path / "plain").write_text("")  # a file made as usual: the umask decides who may read it
    assert {p.stat().st_mode for p in (tmp_path / "out").iterdir()} == {(tmp_path / "plain").stat().st_mode}
    again = ddp("datasets", "pack", "tree", "--registry", str(tree), "--to", str(tmp_path / "out"), "--json")
    assert again.exit_code == 2 and "a finished pack is already there" in one_error(again)
    assert last_json(again)["exit_code"] == 2


def test_pack_errors_are_one_line_with_the_exit_code(tree, tmp_path):
    missing = ddp("datasets", "pack", "nope", "--registry", str(tree), "--to", str(tmp_path / "a"), "--json")
    assert missing.exit_code == 2 and "nope" in one_error(missing)
    assert set(last_json(missing)) == {"error", "exit_code"} and last_json(missing)["exit_code"] == 2
    (tmp_path / "file").write_text("")
    on_a_file = ddp("datasets", "pack", "tree", "--registry", str(tree), "--to", str(tmp_path / "file"))
    assert on_a_file.exit_code == 2 and "a file, not a folder" in one_error(on_a_file)
    root = tmp_path / "tree"
    plant(root, "train/class_2/img_3.jpg", "truncated")
    bad = ddp("datasets", "pack", "tree", "--registry", str(tree), "--to", str(tmp_path / "b"),
              "--shard-size", "0.02", "--json")
    assert bad.exit_code == 3
    assert f"{root}/train/class_2/img_3.jpg: truncated" in one_error(bad)
    assert last_json(bad)["exit_code"] == 3
    assert not (tmp_path / "b" / INDEX).exists() and not list((tmp_path / "b").rglob("*.tmp"))
    skipped = ddp("datasets", "pack", "tree", "--registry", str(tree), "--to", str(tmp_path / "b"),
                  "--shard-size", "0.02", "--on-bad-image", "skip", "--split", "train", "--json")
    assert skipped.exit_code == 2 and "other options" in one_error(skipped)  # --split differs: refused
    skipped = ddp("datasets", "pack", "tree", "--registry", str(tree), "--to", str(tmp_path / "b"),
                  "--shard-size", "0.02", "--on-bad-image", "skip", "--json")
    assert skipped.exit_code == 0, skipped.output  # the stopped pack goes on, the bad file left out
    assert last_json(skipped)["splits"]["train"] == {**last_json(skipped)["splits"]["train"], "images": 17,
                                                     "skipped": 1}
    meta = read_index(Destination(str(tmp_path / "b")).fs, str(tmp_path / "b"))
    assert meta.splits["train"].skipped == [{"path": "train/class_2/img_3.jpg", "reason": "truncated"}]


@pytest.fixture
def bucket(s3_endpoint, aws, tmp_path, monkeypatch) -> s3fs.S3FileSystem:
    """An empty bucket on the loopback server, AWS_ENDPOINT_URL pointing at it, and a scratch folder of
    our own (to see that a pack leaves nothing in it)."""
    aws.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    if fs.exists(BUCKET):
        fs.rm(BUCKET, recursive=True)
    fs.mkdir(BUCKET)
    (tmp_path / "scratch").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    return fs


def test_pack_to_s3_killed_and_resumed_equals_the_local_pack(tree, bucket, tmp_path, monkeypatch):
    local = ddp("datasets", "pack", "tree", "--registry", str(tree), "--to", str(tmp_path / "local"),
                "--shard-size", "0.02", "--json")
    assert local.exit_code == 0, local.output
    to = f"s3://{BUCKET}/packs/tree"
    uploads: list[str] = []
    real_put, real_close = Destination.put, Packer.close_shard
    monkeypatch.setattr(Destination, "put", lambda self, path, name: (uploads.append(name),
                                                                      real_put(self, path, name)))

    def dies_after_two(self, *args):
        if len(uploads) == 2:
            raise KeyboardInterrupt  # as a kill would, between two shards
        real_close(self, *args)

    monkeypatch.setattr(Packer, "close_shard", dies_after_two)
    killed = ddp("datasets", "pack", "tree", "--registry", str(tree), "--to", to, "--shard-size", "0.02")
    assert killed.exit_code == 130 and "interrupted" in one_error(killed)
    keys = sorted(k.removeprefix(f"{BUCKET}/packs/tree/") for k in bucket.find(f"{BUCKET}/packs/tree"))
    assert keys == sorted([*uploads, ".pack/progress.json", *(f".pack/{name}.npz" for name in uploads)])
    assert not list((tmp_path / "scratch").iterdir())  # the unfinished shard's scratch file removed

    monkeypatch.setattr(Packer, "close_shard", real_close)
    done_before = list(uploads)
    resumed = ddp("datasets", "pack", "tree", "--registry", str(tree), "--to", to, "--shard-size", "0.02",
                  "--json")
    assert resumed.exit_code == 0, resumed.output
    assert not set(uploads[len(done_before):]) & set(done_before)  # finished shards not uploaded again
    assert last_json(resumed)["splits"] == last_json(local)["splits"]
    assert last_json(resumed)["index"] == f"{to}/{INDEX}"
    wanted = sorted(p.name for p in (tmp_path / "local").iterdir())
    bucket.invalidate_cache()  # this test's own listing of the prefix, from before the resume
    keys = sorted(k.removeprefix(f"{BUCKET}/packs/tree/") for k in bucket.find(f"{BUCKET}/packs/tree"))
    assert keys == wanted  # no .pack/ left behind
    for name in wanted:
        local_bytes = (tmp_path / "local" / name).read_bytes()
        assert bucket.cat_file(f"{BUCKET}/packs/tree/{name}") == local_bytes, name
    assert not list((tmp_path / "scratch").iterdir())
    samples = read_samples(bucket, f"{BUCKET}/packs/tree", "val")
    meta = read_index(bucket, f"{BUCKET}/packs/tree")
    shard = bucket.cat_file(f"{BUCKET}/packs/tree/{meta.splits['val'].shards[samples.shard[0]].name}")
    image = shard[samples.offset[0]:samples.offset[0] + samples.size[0]]
    assert image == (tmp_path / "tree" / samples.path[0]).read_bytes()  # a plain JPEG, copied as it was
