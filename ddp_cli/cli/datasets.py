"""`ddp datasets ...`: the data set registry's sub-app (list, show, check, pack, index), mounted on `ddp`
by ddp_cli/cli/ddp.py; what each command does is ddp_cli/cli/commands/datasets.py.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated

import typer

from ddp_cli.cli import render
from ddp_cli.cli.clikit import JsonOpt, RegistryOpt, command, group, lazy_module, one_of
from ddp_cli.cli.exits import emit, fail
from ddp_cli.cli.render import err
from ddp_cli.errors import DATA, ConfigError

if TYPE_CHECKING:
    from ddp_cli.cli.commands import datasets
else:  # on first use: see cli/ddp.py
    datasets = lazy_module("ddp_cli.cli.commands.datasets")

datasets_app = group("Inspect the data set registry (data.toml).")

DatasetArg = Annotated[str, typer.Argument(metavar="NAME", help="A data set name in the registry.")]
SplitOpt = Annotated[str, typer.Option(metavar="train|val|all", help="The split(s) to read.")]


@command(datasets_app, "list")
def datasets_list(registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """List the data sets in the registry.

    Examples:

    * `ddp datasets list`
    * `ddp datasets list --registry /shared/data.toml --json`
    """
    rows = datasets.datasets_list(registry)
    emit(rows, as_json, lambda: render.print_datasets(rows))


@command(datasets_app, "show")
def datasets_show(name: DatasetArg, registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Show a data set: its registry entry, split sizes and classes.

    Examples:

    * `ddp datasets show demo`
    * `ddp datasets show imagenet_s3 --json | jq .splits`
    """
    result = datasets.datasets_show(name, registry)
    emit(result, as_json, lambda: render.print_dataset(result))


@command(datasets_app, "check")
def datasets_check(
    name: DatasetArg,
    split: SplitOpt = "all",
    workers: Annotated[int | None, typer.Option(
        min=1, metavar="N", help="Threads reading and decoding (default 4 per CPU, at most 32).")] = None,
    registry: RegistryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Read and decode every image of a split; list every bad file and why. Exit 3 if any.

    Reasons: missing file (named in the listing/CSV), unreadable, not an image, truncated,
    corrupt, unknown synset; an empty split and a class without a train image fail it too.

    Examples:

    * `ddp datasets check demo`
    * `ddp datasets check imagenet_s3 --split val --workers 32 --json`
    """
    if split not in ("train", "val", "all"):
        raise ConfigError(f"--split {split}: use train, val or all")
    with render.progress_bar(err.is_terminal and not as_json, f"checking {name}") as progress:
        result = datasets.datasets_check(name, registry, split, workers, progress)
    if not (as_json and result["bad_files"]):  # with --json the error object carries the findings
        emit(result, as_json, lambda: render.print_check(result))
    if result["bad_files"]:
        fail(f"{len(result['bad_files'])} bad file(s) in data set {name!r}; fix or remove them, or "
             'train with data.on_bad_image = "skip"', DATA, as_json, result)


@command(datasets_app, "pack")
def datasets_pack(
    name: DatasetArg,
    to: Annotated[str, typer.Option(
        "--to", metavar="PATH|s3://BUCKET/PREFIX",
        help="A local folder or an S3 prefix (endpoint from AWS_ENDPOINT_URL).")],
    split: SplitOpt = "all",
    max_side: Annotated[int | None, typer.Option(
        min=8, metavar="PX", help="Shrink images whose longer side is above this (aspect kept).")] = None,
    quality: Annotated[int, typer.Option(
        min=1, max=100, metavar="Q", help="JPEG quality of re-encoded images.")] = 90,
    shard_size: Annotated[float, typer.Option(min=0.01, metavar="MIB", help="Largest shard, MiB.")] = 256,
    workers: Annotated[int | None, typer.Option(
        min=1, metavar="N", help="Threads reading and encoding (default: one per CPU).")] = None,
    on_bad_image: Annotated[str, typer.Option(
        metavar="error|skip", help="error: stop (exit 3) naming the file; skip: leave it out and list it in "
        "the index.")] = "error",
    registry: RegistryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Pack a data set into tar shards (WebDataset convention) + an index: `layout = "shards"`.

    Every image becomes an RGB JPEG (quirk files re-encoded, plain ones copied unless --max-side
    shrinks them). --split all packs train, val and the entry's `unlabeled` split if it names one. A
    killed pack resumes when run again with the same options; a shard is never visible half-written,
    and the data set exists once index.json is written (last).

    Examples:

    * `ddp datasets pack imagenet_local --to /data/imagenet-256 --max-side 256`
    * `ddp datasets pack imagenet_local --to s3://my-bucket/imagenet-shards --json`
    """
    split = one_of(split, ("train", "val", "all"), "--split")
    settings = {"max_side": max_side, "quality": quality, "shard_mib": shard_size,
                "on_bad_image": one_of(on_bad_image, ("error", "skip"), "--on-bad-image")}
    with render.progress_bar(err.is_terminal and not as_json, f"packing {name}") as progress:
        result = datasets.datasets_pack(name, to, registry, split, settings, workers or os.cpu_count() or 1,
                                        progress)
    emit(result, as_json, lambda: render.print_pack(result))


@command(datasets_app, "index")
def datasets_index(
    root: Annotated[str, typer.Argument(
        metavar="ROOT", help="A folder or s3://BUCKET/PREFIX of tar shards; the index is written there.")],
    split: Annotated[list[str] | None, typer.Option(
        metavar="SPLIT=GLOB",
        help="e.g. train='train-*.tar' (default: train=*train*.tar and val=*val*.tar).")] = None,
    classes: Annotated[str | None, typer.Option(
        metavar="FILE", help="A text file naming the classes, one per line, in label order (default: the "
        "labels as names).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Index tar shards written by the webdataset library (`.jpg` + `.cls`), so ddp trains on them.

    Writes index.json and per split <split>-samples.npz (every image's shard, offset, size and
    label; each shard's sha256). Point a registry entry with `layout = "shards"` at the folder.

    Examples:

    * `ddp datasets index /data/wds --split train='shard-train-*.tar' --split val='shard-val-*.tar'`
    """
    if split and not all("=" in item for item in split):
        raise ConfigError("--split: write SPLIT=GLOB, e.g. --split train='train-*.tar'")
    splits = dict(item.split("=", 1) for item in split) if split else {"train": "*train*.tar",
                                                                       "val": "*val*.tar"}
    with render.progress_bar(err.is_terminal and not as_json, f"indexing {root}") as progress:
        result = datasets.datasets_index(root, splits, classes, progress)
    emit(result, as_json, lambda: render.print_index(result))
