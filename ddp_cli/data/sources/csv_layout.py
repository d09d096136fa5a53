"""`layout = "csv"`: a table of image paths and labels, for the teams whose labels live in one.

The listing is a CSV, or a Parquet file (the `parquet` extra), under the data set's root: a path
column (relative to the root), a label column (a class name, or an integer index) and a split
column (`train`, `val` or `validation`; rows of any other split, such as `test`, are not read);
or one listing per split (`listing = "{split}.csv"`: `train.csv`, `val.csv`) and no split column.
The registry entry's `[datasets.csv]` table (`CsvListing`) names the file and the columns.

Class names are the classes file's lines where `classes` names one (a label is a name from it, or
an index into it); else, where every label is an integer, "0" up to the largest; else the labels'
distinct texts, sorted, so every rank and every run agree. They come from the train and val rows
together, whatever split is read, so a run, its validation and `predict --dataset` number the
classes alike. A row that cannot train (an empty path or label, a label that names no class, a path
listed again: the later row) is `Rejected`; an unsafe path is kept, to be refused as the other
layouts refuse it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import fsspec
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ddp_cli.data.fetch.storage import escapes
from ddp_cli.data.sources.files import read_bytes, read_csv, read_text, require_columns, under
from ddp_cli.data.sources.table import SPLITS, Listing, Rejected
from ddp_cli.errors import DataError, require_extra

if TYPE_CHECKING:
    import pandas as pd

CSV = "csv"
EACH_SPLIT = "{split}"
SPLIT_VALUES = {"train": "train", "val": "val", "validation": "val"}  # a split cell, lower-cased
INTEGER = re.compile(r"[+-]?\d+")


class CsvListing(BaseModel):
    """The registry's `[datasets.csv]`: which file lists the images, and which columns say what."""

    model_config = ConfigDict(extra="forbid")
    listing: str = Field(
        "labels.csv", description="The listing, relative to the root: a .csv, or a .parquet (the parquet "
        'extra). With {split} in it, one listing per split ("{split}.csv": train.csv and val.csv) and no '
        "split column.")
    path_column: str = Field("path", description="The column of image paths, relative to the root.")
    label_column: str = Field("label", description="The column of labels: class names or integer indices.")
    split_column: str = Field(
        "split", description="The column of each row's split: train, val or validation; rows of other "
        "splits are not read. Unused with {split} in listing.")
    classes: str | None = Field(
        None, description="A file of class names, one a line in label order, relative to the root: a "
        "label is a name from it or an index into it. Unset: the labels' distinct names, sorted, or, "
        "where every label is an integer, 0 up to the largest.")

    @field_validator("listing", "classes")
    @classmethod
    def under_the_root(cls, name: str | None) -> str | None:
        if name is not None and (not name.strip() or escapes(name)):
            raise ValueError(f"{name!r} must name a file under the data set's root (relative, no ..)")
        return name

    @model_validator(mode="after")
    def distinct_columns(self) -> CsvListing:
        columns = [self.path_column, self.label_column]
        columns += [] if EACH_SPLIT in self.listing else [self.split_column]
        if len(set(columns)) < len(columns):
            raise ValueError(f"path_column, label_column and split_column must differ (found {columns})")
        return self


def listing(fs: fsspec.AbstractFileSystem, root: str, splits: tuple[str, ...],
            spec: CsvListing | None = None) -> Listing:
    """The rows of `splits`, each labelled by its class name; those that cannot train `Rejected`."""
    import pandas as pd

    spec = spec or CsvListing()
    rows, unsafe = _rows(fs, root, spec)
    labels = pd.Categorical(rows["label"])  # per distinct label, not per row
    names, name_of, unknown = _classes(fs, root, spec, labels.categories.tolist())
    rows["synset"] = np.array([name_of.get(c) for c in labels.categories], dtype=object)[labels.codes]
    empty_path = (rows["path"] == "").to_numpy()
    again = rows["path"].duplicated().to_numpy() & ~empty_path
    reasons = {
        "empty path": empty_path,
        "empty label": (rows["label"] == "").to_numpy(),
        "unknown": (rows["synset"].isna() & (rows["label"] != "")).to_numpy(),
        "again": again,
    }
    bad = np.logical_or.reduce(list(reasons.values()))
    good = rows[~bad]
    frames = {split: good.loc[good["split"] == split, ["path", "synset"]].reset_index(drop=True)
              for split in splits}
    rejected = _rejected(rows, reasons, bad & rows["split"].isin(splits).to_numpy(), unknown)
    return Listing(names, list(names), frames, [u for split in splits for u in unsafe[split]], rejected)


def _rejected(rows: pd.DataFrame, reasons: dict[str, np.ndarray], chosen: np.ndarray,
              unknown: str) -> list[Rejected]:
    """The `chosen` rows, each with the first of `reasons` that holds for it, in words."""
    again = reasons["again"]
    first = rows[~again].drop_duplicates("path").set_index("path") if again.any() else None
    rejected = []
    for i in np.flatnonzero(chosen):
        row = rows.iloc[i]
        reason = next(name for name, rows_of in reasons.items() if rows_of[i])
        if reason == "unknown":
            reason = f"label {row['label']!r} is {unknown}"
        elif reason == "again":
            reason = f"already listed at {_where(first.loc[row['path']])}"
        rejected.append(Rejected(row["path"], reason, _where(row)))
    return rejected


def _where(row: pd.Series) -> str:
    return f"{row['source']} {row['number']}"


def _rows(fs: fsspec.AbstractFileSystem, root: str,
          spec: CsvListing) -> tuple[pd.DataFrame, dict[str, list[str]]]:
    """Every train and val row, paths normalised: `path`, `label`, `split`, where it is (`source`
    "labels.csv line", `number`); and per split its unsafe rows (`file: column 'value'`)."""
    import pandas as pd

    files = ({split: spec.listing.replace(EACH_SPLIT, split) for split in SPLITS}
             if EACH_SPLIT in spec.listing else {None: spec.listing})
    parts, unsafe = [], {split: [] for split in SPLITS}
    for split, name in files.items():
        frame, source, first = _read(fs, f"{root}/{name}", spec, split is None)
        frame = pd.DataFrame({
            "path": frame[spec.path_column].str.strip(),
            "label": frame[spec.label_column].str.strip(),
            "split": (frame[spec.split_column].str.strip().str.lower().map(SPLIT_VALUES) if split is None
                      else split),
            "source": f"{name} {source}",
            "number": np.arange(first, first + len(frame)),
        }).dropna(subset=["split"])
        odd = frame["path"].str.contains("..", regex=False) | frame["path"].str.startswith("/")
        for split_name in SPLITS:  # only the rows `under` might change: 1.33 M rows cost seconds
            rows = frame.loc[odd & (frame["split"] == split_name), "path"]
            paths, found = under("", rows.tolist(), name, spec.path_column, suffix="")
            frame.loc[rows.index, "path"] = paths
            unsafe[split_name] += found
        parts.append(frame)
    return pd.concat(parts, ignore_index=True), unsafe


def _read(fs: fsspec.AbstractFileSystem, path: str, spec: CsvListing,
          needs_split: bool) -> tuple[pd.DataFrame, str, int]:
    """The listing's columns as strings ("" where empty), what its rows are called ("line", "row"),
    and the first row's number."""
    columns = (spec.path_column, spec.label_column)
    fix = ("rename the column, or name the listing's columns in the registry entry's [datasets.csv] "
           "(path_column, label_column, split_column)")
    if path.lower().endswith(".parquet"):
        frame, source, first = _read_parquet(fs, path, columns, (spec.split_column,), fix), "row", 1
    else:
        frame, source, first = read_csv(fs, path, columns, fix), "line", 2  # line 1 is the header
    if needs_split and spec.split_column not in frame.columns:
        raise DataError(f"{path}: no {spec.split_column} column (found {', '.join(frame.columns)}); add "
                        "one (train or val per row), name it in the registry entry's [datasets.csv] "
                        'split_column, or give one listing per split: listing = "{split}.csv"')
    return frame, source, first


def _read_parquet(fs: fsspec.AbstractFileSystem, path: str, columns: tuple[str, ...],
                  optional: tuple[str, ...], fix: str) -> pd.DataFrame:
    """The Parquet listing's `columns` (and those of `optional` it has) as strings, "" for nulls."""
    import pandas as pd

    require_extra("parquet", f"{path}: a Parquet listing", "give a CSV listing")
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(pa.BufferReader(read_bytes(fs, path)))
        found = file.schema_arrow.names
        require_columns(path, found, columns, fix)
        table = file.read(columns=[c for c in (*columns, *optional) if c in found])
    except pa.ArrowException as e:
        raise DataError(f"{path}: not a Parquet file ({e}); write the listing with pyarrow or pandas, "
                        "or give a CSV") from e
    out = {}
    for name in table.column_names:
        try:
            out[name] = pc.fill_null(table[name].cast(pa.string()), "").to_pandas()  # stays Arrow strings
        except pa.ArrowException as e:
            raise DataError(f"{path}: column {name} holds {table.schema.field(name).type}, not text or "
                            "integers; write it as strings or integers") from e
    return pd.DataFrame(out)


def _classes(fs: fsspec.AbstractFileSystem, root: str, spec: CsvListing,
             labels: list[str]) -> tuple[list[str], dict[str, str | None], str]:
    """The class names in label order; per distinct label of `labels` its class name (None: no class
    has it); and what a label with none is (`label 'x' is ...`)."""
    distinct = [value for value in labels if value]
    if spec.classes:
        names = _class_file(fs, f"{root}/{spec.classes}")
        known = set(names)

        def class_of(value: str) -> str | None:
            if value in known:
                return value
            return names[int(value)] if INTEGER.fullmatch(value) and 0 <= int(value) < len(names) else None

        return names, {v: class_of(v) for v in distinct}, (
            f"neither a class of {spec.classes} nor an index 0 to {len(names) - 1}")
    if distinct and all(INTEGER.fullmatch(value) for value in distinct):
        count = max(int(value) for value in distinct) + 1
        names = [str(i) for i in range(count)]
        index_of = {v: str(int(v)) if int(v) >= 0 else None for v in distinct}
        return names, index_of, "not a class index (0 or more)"
    names = sorted(distinct)
    return names, {v: v for v in distinct}, "every label is a class"


def _class_file(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """The classes file's names, one a line (blank lines skipped); a name listed twice is a DataError."""
    seen: dict[str, int] = {}
    for number, line in enumerate(read_text(fs, path).splitlines(), 1):
        name = line.strip()
        if name in seen:
            raise DataError(f"{path}: class {name!r} is listed twice (lines {seen[name]} and {number}); "
                            "list each class once")
        if name:
            seen[name] = number
    return list(seen)
