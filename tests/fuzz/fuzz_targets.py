"""The table of parsers and readers of user files the fuzz suite mutates: one `Target` per file.

A target is a valid set of files (`files()`: path under a root -> bytes, made once), the one of
them whose bytes are mutated, and the reader under test, called on the root. A new layout or file
format is one more entry of `TARGETS` (see docs/development.md, "Fuzzing").
"""

from __future__ import annotations

import functools
import io
import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fsspec
from synthetic import encoded, image

from ddp_cli.config import RunConfig, load_config
from ddp_cli.data.pack.wds_index import _samples_bytes, index_shards
from ddp_cli.data.registry import load_registry
from ddp_cli.data.sources.layouts import build_index
from ddp_cli.data.sources.shards import ShardInfo, ShardsIndex, SplitInfo, shards_table
from ddp_cli.observe.report import summarize
from ddp_cli.train.checkpoint import CheckpointStore, save_checkpoint, write_manifest
from ddp_cli.train.checkpoint_model import load_trained

REPO = Path(__file__).resolve().parents[2]
LOCAL = fsspec.filesystem("file")
JPEG = encoded(image(0, 0, size=8))  # a real image, for the trees and tars that must decode


@dataclass(frozen=True)
class Target:
    name: str
    files: Callable[[], dict[str, bytes]]  # a valid set of files, relative path -> bytes
    mutated: str  # the file whose bytes are mutated; a user error must name it
    read: Callable[[Path], object]  # the parser or reader under test, given the root
    names: str = ""  # what its error message must name, if not the mutated file's name

    @property
    def named(self) -> str:
        return self.names or Path(self.mutated).name

    def __str__(self) -> str:
        return self.name


# ---- run config and data.toml ----

def config_files() -> dict[str, bytes]:
    return {"run.toml": (REPO / "configs/demo.toml").read_bytes()}


def registry_v1() -> dict[str, bytes]:
    return {"data.toml": (REPO / "ddp_cli/templates/data.toml").read_bytes()}


def registry_v0() -> dict[str, bytes]:
    return {"Data.toml": b"""data_config_version=0

[[datasets]]
description="digits as the Julia seeds register it"
name="digits"
uuid="6f1d3c0e-8a52-4c1b-9d0e-2a7b5e4c9f10"

    [datasets.storage]
    driver="FileSystem"
    type="BlobTree"
    path="imagefolder"
"""}


def read_registry(name: str) -> Callable[[Path], object]:
    return lambda root: load_registry(root / name)


# ---- layouts: the Kaggle LOC files ----

SYNSETS = ("n01440764", "n01443537")


def loc_files() -> dict[str, bytes]:
    return {
        "LOC_synset_mapping.txt": b"n01440764 tench, Tinca tinca\nn01443537 goldfish, Carassius auratus\n",
        "LOC_val_solution.csv": (b"ImageId,PredictionString\nILSVRC2012_val_00000001,n01440764 1 2 3 4\n"
                                 b"ILSVRC2012_val_00000002,n01443537 5 6 7 8 n01440764 1 1 2 2\n"),
        "ILSVRC/ImageSets/CLS-LOC/train_cls.txt": (b"n01440764/n01440764_10026 1\n"
                                                   b"n01443537/n01443537_10007 2\n"),
        "ILSVRC/Data/CLS-LOC/val/ILSVRC2012_val_00000001.JPEG": b"",
    }


def read_layout(layout: str) -> Callable[[Path], object]:
    return lambda root: build_index(LOCAL, str(root), layout)


# ---- shards: index.json and the samples tables ----

def shards_files() -> dict[str, bytes]:
    rows = [(0, "a", "a.jpg", 512, 10, 0), (0, "b", "b.jpg", 1024, 10, 1)]
    index = ShardsIndex(list(SYNSETS), ["tench", "goldfish"],
                        {split: SplitInfo(2, [ShardInfo("s-000.tar", 2, 2048, "0" * 64)]) for split in
                         ("train", "val")})
    return {"index.json": index.to_json().encode(), "train-samples.npz": _samples_bytes(rows),
            "val-samples.npz": _samples_bytes(rows)}


def read_shards(root: Path) -> object:
    return shards_table(LOCAL, str(root), None, ("train", "val"))


# ---- webdataset tars, as `ddp datasets index` reads them ----

def wds_tar() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, label in (("s/0001", b"0"), ("s/0002", b"1")):
            for ext, data in (("jpg", b"\xff\xd8fake-jpeg\xff\xd9"), ("cls", label)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def wds_files() -> dict[str, bytes]:
    return {"w-000.tar": wds_tar(), "classes.txt": b"tench\ngoldfish\n"}


def index_wds(root: Path) -> object:
    """`ddp datasets index`, then the shards layout reading what it wrote."""
    index_shards(str(root), {"train": "w-*.tar"}, str(root / "classes.txt"))
    return shards_table(LOCAL, str(root), None, ("train",))


# ---- checkpoints and their manifests ----

@functools.cache
def checkpoint_bytes() -> tuple[bytes, bytes]:
    """A small ddp checkpoint and its manifest, written by the store's own functions."""
    import tempfile

    import torch

    state = {"config": RunConfig().model_dump(mode="json"), "classes": list(SYNSETS),
             "descriptions": ["tench", "goldfish"], "model": {"fc.weight": torch.ones(2, 3)},
             "ema": None, "final": {"top1": 0.5}, "dataset": {"name": "demo"}, "step": 3}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step-000000003.pt"
        written = save_checkpoint(state, path)
        write_manifest(path, {"step": 3, "epoch": 1}, written)
        return path.read_bytes(), Path(f"{path}.json").read_bytes()


def checkpoint_files() -> dict[str, bytes]:
    pt, manifest = checkpoint_bytes()
    return {"step-000000003.pt": pt, "step-000000003.pt.json": manifest}


def bare_checkpoint() -> dict[str, bytes]:
    """Without its manifest, so the mutated bytes reach the loader (a manifest would refuse them)."""
    return {"step-000000003.pt": checkpoint_bytes()[0]}


def read_checkpoint(root: Path) -> object:
    """What `--resume auto` and `ddp validate --checkpoint` read."""
    CheckpointStore(root, 2).latest_valid()
    return load_trained(root / "step-000000003.pt")


# ---- ddp report's inputs ----

METRICS = [{"split": "train", "epoch": 1, "step": 4, "loss": 1.2, "lr": 0.1, "images_per_second": 90.0},
           {"split": "val", "epoch": 1, "step": 4, "loss": 0.5, "top1": 0.8, "top5": 0.95},
           {"split": "train", "epoch": 2, "step": 8, "loss": 0.9, "lr": 0.05, "images_per_second": 95.0},
           {"split": "val", "epoch": 2, "step": 8, "loss": 0.4, "top1": 0.9, "top5": 0.99}]
EVALUATION = {"time": 1.0, "source": "train epoch 2", "top1": 0.9, "classes": 2, "per_class": [
    {"index": i, "synset": s, "description": s, "images": 5, "top1": 0.9} for i, s in enumerate(SYNSETS)],
    "confusion": [[5, 0], [1, 4]]}


def report_files() -> dict[str, bytes]:
    return {"metrics.jsonl": "".join(json.dumps(r) + "\n" for r in METRICS).encode(),
            "evaluation.json": json.dumps(EVALUATION).encode(),
            "result.json": json.dumps({"top1": 0.9}).encode()}


# ---- the table layouts: a csv listing, Hugging Face Parquet and its class names ----

def csv_files() -> dict[str, bytes]:
    return {"labels.csv": (b"path,label,split\nimages/a.png,cat,train\nimages/b.png,dog,train\n"
                           b"images/c.png,cat,val\nimages/d.png,dog,val\n")}


@functools.cache
def parquet_files() -> dict[str, bytes]:
    """A hub-style Parquet data set (two files a split, groups of 2 rows), its README's class names and
    a dataset_info.json naming the same classes."""
    import tempfile

    from synthetic import write_hf_parquet

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_hf_parquet(root, {"train": 4, "validation": 2}, classes=2, row_group=2, size=8)
        (root / "dataset_info.json").write_text(json.dumps(
            {"features": {"label": {"_type": "ClassLabel", "names": ["class 0", "class 1"]}}}))
        return {str(f.relative_to(root)): f.read_bytes() for f in root.rglob("*") if f.is_file()}


TARGETS: list[Target] = [
    Target("config", config_files, "run.toml", lambda root: load_config(root / "run.toml")),
    Target("registry-v1", registry_v1, "data.toml", read_registry("data.toml")),
    Target("registry-v0", registry_v0, "Data.toml", read_registry("Data.toml")),
    Target("loc-synsets", loc_files, "LOC_synset_mapping.txt", read_layout("imagenet-loc")),
    Target("loc-val-csv", loc_files, "LOC_val_solution.csv", read_layout("imagenet-loc")),
    Target("loc-train-list", loc_files, "ILSVRC/ImageSets/CLS-LOC/train_cls.txt",
           read_layout("imagenet-loc")),
    Target("shards-index", shards_files, "index.json", read_shards),
    Target("shards-samples", shards_files, "train-samples.npz", read_shards),
    Target("wds-tar", wds_files, "w-000.tar", index_wds),
    Target("wds-classes", wds_files, "classes.txt", index_wds),
    Target("checkpoint", bare_checkpoint, "step-000000003.pt", read_checkpoint),
    Target("checkpoint-manifest", checkpoint_files, "step-000000003.pt.json", read_checkpoint,
           names="step-000000003.pt"),
    Target("report-metrics", report_files, "metrics.jsonl", summarize),
    Target("report-evaluation", report_files, "evaluation.json", summarize),
    Target("csv-listing", csv_files, "labels.csv", read_layout("csv")),
    Target("parquet-file", parquet_files, "data/train-00000-of-00002.parquet", read_layout("parquet")),
    Target("parquet-readme", parquet_files, "README.md", read_layout("parquet")),
    Target("parquet-dataset-info", parquet_files, "dataset_info.json", read_layout("parquet")),
]
BY_NAME = {t.name: t for t in TARGETS}
