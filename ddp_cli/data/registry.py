"""The data set registry: a DataSets.jl-style `data.toml`, resolved to fsspec roots.

Search order: `--registry`, `$DDP_DATA_TOML`, `./data.toml`. Relative paths
resolve against the registry file's folder; `~` and `$VARS` expand. DataSets.jl's
own files load as they are (FluxDistributed.jl's `Data.toml`): version 0,
`storage.type` (a Julia type) dropped, no `layout` (then "auto": looked up in
the root when the data set is opened).
"""

from __future__ import annotations

import os
import re
import uuid as uuidlib
from pathlib import Path
from typing import Any, Literal

import fsspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ddp_cli.config.errors import describe_validation_error
from ddp_cli.data.sources.csv_layout import CSV, CsvListing
from ddp_cli.data.sources.layouts import KNOWN_LAYOUTS, LayoutOptions, infer_layout
from ddp_cli.data.sources.parquet import PARQUET, ParquetOptions
from ddp_cli.errors import ConfigError, DataError, did_you_mean
from ddp_cli.userfiles import parse_toml, read_text, user_path

DRIVERS = ("FileSystem", "S3")
AUTO = "auto"
VERSIONS = (0, 1)  # DataSets.jl's data_config_version; both read the same


def one_of(value: str, known: tuple[str, ...] | list[str], what: str) -> str:
    """`value` if it is known; else the error names what was found and what is known."""
    if value not in known:
        raise ValueError(f"unknown {what} {value!r}; known: {', '.join(known)}")
    return value


class Storage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    driver: str = Field(description="Where the root lives: FileSystem or S3.")
    path: str = Field(description="Local folder, or s3://bucket/prefix.")
    endpoint_url: str | None = Field(None, description="S3: an S3-compatible endpoint.")
    region: str | None = Field(None, description="S3: the bucket's region.")
    profile: str | None = Field(None, description="S3: a named AWS profile.")
    anon: bool = Field(False, description="S3: anonymous access (public buckets).")

    @model_validator(mode="before")
    @classmethod
    def drop_julia_type(cls, data: Any) -> Any:
        """DataSets.jl's `type` ("Blob", "BlobTree") names the Julia object to build: nothing for us."""
        return {k: v for k, v in data.items() if k != "type"} if isinstance(data, dict) else data

    @field_validator("driver")
    @classmethod
    def known_driver(cls, driver: str) -> str:
        return one_of(driver, DRIVERS, "driver")


class DatasetEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="The name run configs use.")
    uuid: uuidlib.UUID | None = Field(None, description="A stable identity, as in DataSets.jl.")
    description: str = Field("", description="One line for `ddp datasets list`.")
    layout: str = Field(AUTO, description="How files are arranged: imagenet-loc, imagefolder, shards "
                        "(written by `ddp datasets pack`), csv (a table of paths and labels) or parquet "
                        "(Hugging Face datasets); auto (the default) looks at the root when the data set "
                        "is opened.")
    generator: Literal["sklearn-digits"] | None = Field(
        None, description="Build the root offline on first use from data a package ships."
    )
    storage: Storage
    csv: CsvListing | None = Field(None, description='layout = "csv": the listing and its columns '
                                   "([datasets.csv]); unset, the defaults.")
    parquet: ParquetOptions | None = Field(None, description='layout = "parquet": which column holds the '
                                           "class index and which split is val ([datasets.parquet]); unset, "
                                           "the defaults.")
    unlabeled: str | None = Field(None, description="A split of images nobody labelled, whatever the layout: "
                                  "a folder under the root, every image under it; with layout shards a split "
                                  "of index.json, with parquet the files <name>-*.parquet (their labels "
                                  "ignored). semi.method = \"fixmatch\" learns from it.")

    @field_validator("layout")
    @classmethod
    def known_layout(cls, layout: str) -> str:
        return one_of(layout, [AUTO, *KNOWN_LAYOUTS], "layout")

    @model_validator(mode="after")
    def layout_table_for_its_layout(self) -> DatasetEntry:
        for layout in (CSV, PARQUET):
            if getattr(self, layout) is not None and self.layout != layout:
                raise ValueError(f'[datasets.{layout}] is for layout = "{layout}" (this entry\'s layout: '
                                 f'{self.layout}); set layout = "{layout}" or remove the table')
        return self

    @model_validator(mode="after")
    def val_split_not_unlabeled(self) -> DatasetEntry:
        """A Parquet split read as val and as images nobody labelled would be trained on and scored."""
        val_split = self.parquet.val_split if self.parquet is not None else None
        if val_split is not None and val_split == self.unlabeled:
            raise ValueError(f"[datasets.parquet] val_split {val_split!r} is this entry's unlabeled split "
                             "too; name another split for one of them")
        return self

    @property
    def layout_options(self) -> LayoutOptions | None:
        """The entry's table of its layout's own options ([datasets.csv] or [datasets.parquet]), if any."""
        return self.csv if self.csv is not None else self.parquet

    def open(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """The filesystem and root path; settles `layout = "auto"` from what the root holds."""
        fs, root = self._root()
        if self.layout == AUTO:
            self.layout = infer_layout(fs, root)
        return fs, root

    def _root(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """The filesystem and root path; builds a generated data set on first use."""
        if self.storage.driver == "S3":
            from ddp_cli.data.fetch.storage import s3_filesystem

            return s3_filesystem(self.storage)
        root = self.storage.path
        if self.generator == "sklearn-digits":
            from ddp_cli.data.sources.demo import ensure_demo

            ensure_demo(Path(root))
        if not Path(root).is_dir():
            raise DataError(f"data set {self.name!r}: root {root} does not exist; "
                            "fix storage.path in the registry")
        return fsspec.filesystem("file"), root


class Registry(BaseModel):
    path: Path
    datasets: list[DatasetEntry]

    def get(self, name: str) -> DatasetEntry:
        for entry in self.datasets:
            if entry.name == name:
                return entry
        names = [d.name for d in self.datasets]
        raise ConfigError(f"unknown data set {name!r} in {self.path}{did_you_mean(name, names)}")


def find_registry(explicit: str | Path | None = None) -> Path:
    """`--registry`, then `$DDP_DATA_TOML`, then `./data.toml`."""
    for candidate, origin in (
        (explicit, "--registry"),
        (os.environ.get("DDP_DATA_TOML"), "$DDP_DATA_TOML"),
        ("data.toml", "./data.toml"),
    ):
        if candidate:
            path = Path(os.path.expandvars(os.path.expanduser(str(candidate))))
            if path.is_file():
                return path.resolve()
            if origin != "./data.toml":
                raise ConfigError(f"{origin}: registry {path} not found; give an existing data.toml")
    raise ConfigError("no data.toml here; pass --registry PATH or set $DDP_DATA_TOML")


def load_registry(explicit: str | Path | None = None) -> Registry:
    path = find_registry(explicit)
    raw = parse_toml(read_text(path, ConfigError), str(path), ConfigError)
    version = raw.get("data_config_version")
    if type(version) is not int or version not in VERSIONS:  # not `true`, not 1.0
        raise ConfigError(f"{path}: data_config_version must be 0 or 1 (found {version!r})")
    unknown = set(raw) - {"data_config_version", "datasets"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key {sorted(unknown)[0]!r}; "
                          "expected data_config_version and [[datasets]]")
    items = raw.get("datasets", [])
    if not isinstance(items, list):
        raise ConfigError(f"{path}: datasets must be an array of tables, written [[datasets]]")
    entries = [_parse_entry(path, i, item) for i, item in enumerate(items)]
    for key in ("name", "uuid"):
        first: dict[Any, int] = {}
        for i, entry in enumerate(entries):
            value = getattr(entry, key)
            if value is not None and value in first:
                raise ConfigError(f"{path}: datasets[{i}] ({entry.name!r}): {key} {str(value)!r} appears "
                                  f"twice (also datasets[{first[value]}]); each data set needs its own")
            first.setdefault(value, i)
    return Registry(path=path, datasets=entries)


def _parse_entry(path: Path, index: int, item: Any) -> DatasetEntry:
    label = f"{path}: datasets[{index}]" + (f" ({item['name']!r})" if isinstance(item, dict)
                                            and "name" in item else "")
    try:
        entry = DatasetEntry.model_validate(item)
    except ValidationError as e:
        raise ConfigError(f"{label}: {describe_validation_error(e, DatasetEntry)}") from e
    storage = entry.storage
    storage.path = _expand(storage.path, f"{label}: storage.path")
    if storage.endpoint_url:
        storage.endpoint_url = _expand(storage.endpoint_url, f"{label}: storage.endpoint_url")
    if storage.driver == "FileSystem":
        storage.path = str((path.parent / storage.path).resolve())
    elif not storage.path.startswith("s3://") or not storage.path[5:].strip("/"):
        raise ConfigError(f"{label}: storage.path must be s3://BUCKET or s3://BUCKET/PREFIX for driver S3")
    return entry


def _expand(value: str, where: str) -> str:
    """`~` and `$VARS`/`${VARS}`; a variable that is not set is an error, not a literal `$X`."""
    expanded = os.path.expandvars(user_path(value, where))
    missing = re.search(r"\$(\w+|\{\w+\})", expanded)
    if missing:
        raise ConfigError(f"{where}: environment variable {missing.group(0)} is not set; set it or "
                          "write the path out")
    return expanded
