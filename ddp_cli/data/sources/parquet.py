"""Layout `parquet`: image data sets as the Hugging Face hub ships them, read as they are.

The files are `datasets`' Parquet: an image column (a struct of `bytes` and/or
`path`, `datasets`' Image feature) and an integer class index column: the
registry's `[datasets.parquet] label_column` (`ParquetOptions`), else `label`,
else the one ClassLabel feature the data set declares (CIFAR-100 declares two:
`fine_label` and `coarse_label`, so it must be named). Splits come from the
file names, anywhere under the root (ImageNet-1k: `data/train-00000-of-00294.parquet`,
`data/validation-*`, `data/test-*`), or from the folder a file is in
(`train/0000.parquet`): `train-*` is train, `validation-*`, `valid-*` and `val-*`
are val, `test-*` is test, or `[datasets.parquet] val_split` names the one val
split in place of those (`test`: CIFAR's); a registry entry's `unlabeled` names one more
(`unlabeled-*`: images nobody labelled, every row kept, its label column, if any,
not read). Class names, first found: the label column's ClassLabel names in the
README.md's YAML front matter (`class_label: names:`), `dataset_info.json`, the
features `datasets` writes into each file's schema, a `classes.txt` (a name per
line, line i for label i); else the labels themselves ("0", "1", ...).

The index reads only metadata and the label column: per row its file, row group
and row within the group (`Split.members`), the rows grouped by row group
(`Split.starts`), so the training order reads a few row groups at a time and a
loader reads an image by its row group (fetch/parquet_reader.py). A row whose
label is missing (-1: the hub's test splits) or not a class is left out and
listed; a row with no bytes whose path could leave the root is refused as in
every layout.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fsspec
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ddp_cli.data.fetch.parquet_reader import ROW_MARK, hf_features, image_column, open_parquet
from ddp_cli.data.fetch.retry import with_retries
from ddp_cli.data.fetch.storage import UNSAFE_PATH, escapes
from ddp_cli.data.sources.packed import PARQUET, Split
from ddp_cli.data.sources.table import IndexTable, select_classes
from ddp_cli.errors import DataError, require_extra

SPLIT_OF = {"train": "train", "validation": "val", "valid": "val", "val": "val", "test": "test"}
LABEL = "label"  # the class index column: what `datasets` names a ClassLabel by default
CLASSES_FILE = "classes.txt"
README, DATASET_INFO = "README.md", "dataset_info.json"
READERS = 16  # files whose metadata and labels are read at once (remote: one request each at a time)
T = TypeVar("T")


class ParquetOptions(BaseModel):
    """The registry's `[datasets.parquet]`: which column holds the class index, which split is val."""

    model_config = ConfigDict(extra="forbid")
    label_column: str | None = Field(
        None, min_length=1, description="The column of class indices (a ClassLabel: its names are the class "
        'names), e.g. "fine_label" for CIFAR-100. Unset: label where the files have it, else the one '
        "ClassLabel feature the data set declares.")
    val_split: str | None = Field(
        None, min_length=1, description="The hub split read as ddp's val split: its files <name>-*.parquet, "
        'or in a folder so named, e.g. "test" for a data set shipped as train and test only (CIFAR-10, '
        "CIFAR-100, MNIST). Files named validation-*, valid-* and val-* are then left out (read as no "
        "split; `ddp datasets show` reports each split as read). Unset: validation, valid and val.")

    @field_validator("val_split")
    @classmethod
    def not_train(cls, val_split: str | None) -> str | None:
        if val_split == "train":
            raise ValueError('"train" is the train split; name the split to validate on, e.g. "test"')
        return val_split


def split_names(val_split: str | None = None, extra: tuple[str, ...] = ()) -> dict[str, str]:
    """The split of each file name prefix: `SPLIT_OF`, with `val_split` (if set) the one val name in place
    of validation, valid and val; `extra`: split names besides, each its own split (`unlabeled`)."""
    usual = SPLIT_OF if val_split is None else {
        **{prefix: split for prefix, split in SPLIT_OF.items() if split != "val"}, val_split: "val"}
    return {**usual, **{name: name for name in extra}}


def split_of(path: str, names: dict[str, str] = SPLIT_OF) -> str | None:
    """The split a Parquet file under the root belongs to, from its name or else its folder's; `names`:
    `split_names`' (the longest prefix first: `val_extra-0` is not `val`)."""
    pattern = re.compile(rf"^({'|'.join(map(re.escape, sorted(names, key=len, reverse=True)))})(?:[-_.].*)?$")
    *folders, name = path.split("/")
    for candidate in (name.removesuffix(".parquet"), *(folders[-1:])):
        match = pattern.match(candidate)
        if match:
            return names[match.group(1)]
    return None


def parquet_files(fs: fsspec.AbstractFileSystem, root: str,
                  names: dict[str, str] = SPLIT_OF) -> dict[str, list[str]]:
    """Per split, its Parquet files under `root` (relative, sorted: shard 00000 first); `names` as
    `split_of`'s."""
    found = with_retries(lambda: fs.find(root), root)
    prefix = fs._strip_protocol(root).rstrip("/") + "/"
    files: dict[str, list[str]] = {}
    for path in sorted(p.removeprefix(prefix) for p in found if p.endswith(".parquet")):
        split = split_of(path, names)
        if split and not any(part.startswith(".") for part in path.split("/")):
            files.setdefault(split, []).append(path)
    return files


@dataclass
class FileRows:
    """What the index needs of one file: rows per row group, each row's label (-1: none) and the rows
    whose image is a path that could leave the root (`row`, `path`)."""

    groups: np.ndarray
    labels: np.ndarray
    unsafe: list[tuple[int, str]] = field(default_factory=list)


def read_rows(fs: fsspec.AbstractFileSystem, root: str, file: str, label: str | None) -> FileRows:
    """`file`'s row groups and labels (the label column alone: no image is read; `label` None: none read,
    every row's label -1); DataError naming the file and the column when a column is missing."""
    where = f"{root}/{file}"
    return readable(where, lambda: file_rows(opened(fs, where), where, label))


def first_schema(fs: fsspec.AbstractFileSystem, root: str, file: str) -> Any:
    where = f"{root}/{file}"
    return readable(where, lambda: opened(fs, where).schema_arrow)


def opened(fs: fsspec.AbstractFileSystem, where: str) -> Any:
    return with_retries(lambda: open_parquet(fs, where), where)


def readable(where: str, read: Callable[[], T]) -> T:
    """`read()` of the file `where`; a DataError naming it when it is gone or no readable Parquet (cut
    short, corrupted: pyarrow's OSError or ArrowException, found by the fuzz suite)."""
    require_extra("parquet", f"{where}: layout parquet")
    import pyarrow as pa

    try:
        return read()
    except FileNotFoundError as e:
        raise DataError(f"{where}: missing (listed a moment ago); check the root") from e
    except (OSError, pa.ArrowException) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"{where}: not a readable Parquet file ({first}); fetch it again") from e


def file_rows(parquet: Any, where: str, label: str | None) -> FileRows:
    """`read_rows` of the opened file."""
    schema = parquet.schema_arrow
    image, names = image_column(schema), ", ".join(schema.names)
    if image is None:
        raise DataError(f"{where}: no image column (a struct of bytes and/or path, as `datasets` writes "
                        f"its Image feature); its columns: {names}")
    meta = parquet.metadata
    groups = np.array([meta.row_group(g).num_rows for g in range(meta.num_row_groups)], dtype=np.int64)
    if label is None:
        return FileRows(groups, np.full(int(groups.sum()), -1, np.int64), unsafe_rows(parquet, image, groups))
    if label not in schema.names:
        raise DataError(f"{where}: no column {label!r} (its columns: {names}); layout parquet reads the "
                        "class index from it: fix [datasets.parquet] label_column in the registry entry")
    import pyarrow as pa

    if not pa.types.is_integer(schema.field(label).type):
        raise DataError(f"{where}: column {label!r} holds {schema.field(label).type}, not class indices")
    labels = with_retries(lambda: parquet.read(columns=[label]).column(label), where)
    return FileRows(groups, labels.fill_null(-1).to_numpy().astype(np.int64),
                    unsafe_rows(parquet, image, groups))


def unsafe_rows(parquet: Any, image: str, groups: np.ndarray) -> list[tuple[int, str]]:
    """Rows with no bytes whose path could leave the root. Only row groups whose statistics do not rule
    out a missing `bytes` are read (the hub's files embed every image: none is)."""
    starts = np.concatenate([[0], np.cumsum(groups)])
    found = []
    for g in range(len(groups)):
        if no_missing_bytes(parquet.metadata.row_group(g), image):
            continue
        for row, value in enumerate(parquet.read_row_group(g, columns=[image]).column(image).to_pylist()):
            value = value or {}
            if value.get("bytes") is None and value.get("path") and escapes(value["path"]):
                found.append((int(starts[g]) + row, value["path"]))
    return found


def no_missing_bytes(group: Any, image: str) -> bool:
    """Whether the row group's statistics say every row has its image bytes."""
    for c in range(group.num_columns):
        column = group.column(c)
        if column.path_in_schema == f"{image}.bytes":
            stats = column.statistics
            return stats is not None and stats.has_null_count and stats.null_count == 0
    return False


def parquet_table(fs: fsspec.AbstractFileSystem, root: str, classes: int | list[str] | None,
                  splits: tuple[str, ...], on_bad_image: str,
                  spec: ParquetOptions | None = None) -> IndexTable:
    """The index table of a `datasets`-style Parquet root (module docstring); `spec`: the registry's
    `[datasets.parquet]`, if any."""
    spec = spec or ParquetOptions()
    prefixes = split_names(spec.val_split)
    files = parquet_files(fs, root, prefixes)
    for name in splits:
        if name not in files:
            raise DataError(missing_split(root, name, files, prefixes, spec.val_split))
    wanted = [(name, file) for name in splits for file in files[name]]
    schema = first_schema(fs, root, wanted[0][1])
    label = label_column(fs, root, wanted[0][1], schema, spec.label_column)
    rows, unsafe = read_files(fs, root, wanted, label, on_bad_image)
    names = class_names(fs, root, label, schema)
    if names is None:
        top = max((int(r.labels.max()) for r in rows.values() if len(r.labels)), default=-1)
        names = [str(i) for i in range(top + 1)]
    keep = select_classes(names, names, classes)
    relabel = np.full(len(names), -1, dtype=np.int64)
    relabel[keep] = np.arange(len(keep))
    out, problems = {}, []
    for name in splits:
        split, bad = split_rows([(file, rows[name, file]) for file in files[name]], relabel)
        out[name] = split
        problems += bad
    return IndexTable([names[i] for i in keep], [names[i] for i in keep], out, problems, unsafe)


def parquet_unlabeled(fs: fsspec.AbstractFileSystem, root: str, name: str, on_bad_image: str) -> Split:
    """Split `name` of a Parquet root (files `<name>-*`, or in a folder so named) as images nobody
    labelled: every row, of label -1, the label column not read."""
    found = parquet_files(fs, root, split_names(extra=(name,)))
    files = found.get(name)
    if not files:
        raise DataError(f"{root}: no Parquet files of the unlabeled split {name!r} (named {name}-* anywhere "
                        f"under the root, or in a folder so named); found: {found_splits(found)}")
    rows, _ = read_files(fs, root, [(name, file) for file in files], None, on_bad_image)
    return split_rows([(file, rows[name, file]) for file in files], None)[0]


def read_files(fs: fsspec.AbstractFileSystem, root: str, wanted: list[tuple[str, str]], label: str | None,
               on_bad_image: str) -> tuple[dict[tuple[str, str], FileRows], list[str]]:
    """`read_rows` of each (split, file), several at once, and the rows whose image path is unsafe
    (`file#row: image path '...'`): a DataError under on_bad_image "error", else left to the loader."""
    with ThreadPoolExecutor(min(READERS, len(wanted))) as pool:
        rows = dict(zip(wanted, pool.map(lambda item: read_rows(fs, root, item[1], label), wanted),
                        strict=True))
    unsafe = [f"{file}{ROW_MARK}{row}: image path {path!r}" for (_, file), r in rows.items()
              for row, path in r.unsafe]
    if unsafe and on_bad_image == "error":
        raise DataError(f"{root}/{unsafe[0]}: {UNSAFE_PATH}, never read ({len(unsafe)} such row(s)); fix "
                        'the data, or set data.on_bad_image = "skip" to skip them')
    return rows, unsafe


def split_rows(files: list[tuple[str, FileRows]],
               relabel: np.ndarray | None) -> tuple[Split, list[dict[str, str]]]:
    """One split's rows, grouped by row group in file order, and the rows left out for their label;
    `relabel` None: an unlabelled split, every row kept, of label -1."""
    sizes = np.concatenate([r.groups for _, r in files]) if files else np.zeros(0, np.int64)
    group_of = np.repeat(np.arange(len(sizes)), sizes)
    group_starts = np.concatenate([[0], np.cumsum(sizes)])
    in_file = np.concatenate([np.arange(r.groups.sum()) for _, r in files]) if files else group_of
    file_of = np.repeat(np.arange(len(files)), [int(r.groups.sum()) for _, r in files])
    firsts = np.concatenate([[0], np.cumsum([len(r.groups) for _, r in files])])  # first group of each file
    labels = np.concatenate([r.labels for _, r in files]) if files else group_of
    if relabel is None:
        known, mapped, chosen = np.ones(len(labels), bool), labels, np.arange(len(labels))
    else:
        known = (labels >= 0) & (labels < len(relabel))
        mapped = np.where(known, relabel[np.clip(labels, 0, max(len(relabel) - 1, 0))], -1) if len(relabel) \
            else np.full(len(labels), -1)
        chosen = np.flatnonzero(mapped >= 0)
    names = [file for file, _ in files]
    problems = [{"path": f"{names[file_of[i]]}{ROW_MARK}{in_file[i]}",
                 "reason": "no label" if labels[i] < 0 else f"label {labels[i]} is not a class"}
                for i in np.flatnonzero(~known)]
    paths = (f"{names[f]}{ROW_MARK}{r}" for f, r in zip(file_of[chosen].tolist(), in_file[chosen].tolist(),
                                                         strict=True))
    groups = group_of[chosen]
    members = np.stack([groups - firsts[file_of[chosen]], chosen - group_starts[groups]], 1)
    starts = np.searchsorted(groups, np.arange(len(sizes) + 1))
    return Split.of(paths, mapped[chosen], members, starts, container=PARQUET), problems


def missing_split(root: str, split: str, files: dict[str, list[str]], names: dict[str, str],
                  val_split: str | None) -> str:
    """Why `split` has no files: the names looked for (as `val_split` set them), the splits found, and
    for a val missing beside test files (CIFAR's train and test only) the key that reads test as val."""
    chosen = " as [datasets.parquet] val_split says" if split == "val" and val_split else ""
    fix = ('; to validate on its test files, set [datasets.parquet] val_split = "test" in the registry entry'
           if split == "val" and val_split is None and "test" in files else "")
    return (f"{root}: no Parquet files of the {split} split (named {name_pattern(split, names)} anywhere "
            f"under the root, or in a folder so named{chosen}); found: {found_splits(files)}{fix}")


def name_pattern(split: str, names: dict[str, str] = SPLIT_OF) -> str:
    return " or ".join(f"{prefix}-*" for prefix, name in names.items() if name == split)


def found_splits(files: dict[str, list[str]]) -> str:
    return ", ".join(f"{name} ({len(f)} files)" for name, f in files.items()) or "no Parquet file"


def label_column(fs: fsspec.AbstractFileSystem, root: str, file: str, schema: Any, named: str | None) -> str:
    """The class index column: `named` (the registry's), else `label` where `file` has it, else the one
    ClassLabel feature among its columns the data set declares; else a DataError naming the file, its
    columns, the ClassLabel features found and the registry key that names one."""
    if named is not None or LABEL in schema.names:
        return named or LABEL
    found = next((columns for declared in class_labels(fs, root, schema)
                  if (columns := [name for name in declared if name in schema.names])), [])
    if len(found) == 1:
        return found[0]
    what = (f"{len(found)} ClassLabel features ({', '.join(found)}); name one" if found
            else "no ClassLabel feature in its metadata; name the class index column")
    fix = " or ".join(f'label_column = "{name}"' for name in found) or 'label_column = "..."'
    raise DataError(f"{root}/{file}: no column {LABEL!r} (its columns: {', '.join(schema.names)}) and {what} "
                    f"in the registry entry: [datasets.parquet] {fix}")


def class_labels(fs: fsspec.AbstractFileSystem, root: str, schema: Any) -> Iterator[dict[str, list[str]]]:
    """The ClassLabel features (name: class names) each source declares, in order: README.md's front
    matter, dataset_info.json, the schema's `datasets` features; each file read only when asked for."""
    readme = read_text(fs, f"{root}/{README}")
    if readme is not None:
        yield readme_class_labels(readme)
    info = read_text(fs, f"{root}/{DATASET_INFO}")
    if info is not None:
        yield class_label_features(info_features(info, f"{root}/{DATASET_INFO}"))
    yield class_label_features(hf_features(schema))


def class_names(fs: fsspec.AbstractFileSystem, root: str, label: str, schema: Any) -> list[str] | None:
    """The class names, from the first source that has them (module docstring), or None."""
    for declared in class_labels(fs, root, schema):
        if label in declared:
            return declared[label]
    listed = read_text(fs, f"{root}/{CLASSES_FILE}")
    if listed is not None:
        return [line.strip() for line in listed.splitlines() if line.strip()]
    return None


def read_text(fs: fsspec.AbstractFileSystem, where: str) -> str | None:
    try:
        return with_retries(lambda: fs.cat_file(where), where).decode("utf-8", "replace")
    except FileNotFoundError:
        return None


def class_label_features(features: Any) -> dict[str, list[str]]:
    """The ClassLabels of `datasets`' features as JSON: {name: {"_type": "ClassLabel", "names": [...]}}."""
    items = features.items() if isinstance(features, dict) else ()
    return {name: [str(n) for n in feature["names"]] for name, feature in items
            if isinstance(feature, dict) and isinstance(feature.get("names"), list)}


def info_features(text: str, where: str) -> Any:
    """`dataset_info.json`'s features: at the top, or under a single config name (dataset_infos.json)."""
    try:
        info = json.loads(text)
    except ValueError as e:
        raise DataError(f"{where}: not JSON ({e}); fix it or remove it") from e
    if isinstance(info, dict) and "features" not in info and len(info) == 1:
        info = next(iter(info.values()))
    return info.get("features") if isinstance(info, dict) else None


def readme_class_labels(text: str) -> dict[str, list[str]]:
    """The ClassLabel features of a README's YAML front matter (the hub's dataset card), each with its
    `class_label: names:` (the first, if several configs name it). Read without a YAML library: the
    names block is a map of index to name (or a list)."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    end = next((i for i, line in enumerate(lines[1:], 1) if line.strip() == "---"), len(lines))
    found: dict[str, list[str]] = {}
    feature = None
    for i in range(1, end):
        stripped = lines[i].strip()
        if stripped.startswith("- name:"):
            feature = unquote(stripped.removeprefix("- name:").strip())
        elif stripped == "names:" and feature is not None and "class_label" in lines[i - 1]:
            found.setdefault(feature, names_block(lines, i, end))
    return found


def names_block(lines: list[str], at: int, end: int) -> list[str]:
    """The names under `lines[at]` ("names:"), indented deeper: `'0': tench` or `- tench`."""
    indent = len(lines[at]) - len(lines[at].lstrip())
    named: dict[int, str] = {}
    listed: list[str] = []
    i = at + 1
    while i < end and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
        entry = lines[i].strip()
        if entry.startswith("- "):
            listed.append(unquote(entry[2:].strip()))
        elif ":" in entry:
            key, _, value = entry.partition(":")
            if unquote(key.strip()).isdigit():
                named[int(unquote(key.strip()))] = unquote(value.strip())
        i += 1
    if named:
        return [named.get(k, str(k)) for k in range(max(named) + 1)]
    return listed


def unquote(value: str) -> str:
    """A YAML scalar as written in a dataset card: 'single' ('' for '), "double" (JSON escapes), or plain."""
    if len(value) >= 2 and value[0] == value[-1] == "'":
        return value[1:-1].replace("''", "'")
    if len(value) >= 2 and value[0] == value[-1] == '"':
        try:
            return json.loads(value)
        except ValueError:
            return value[1:-1]
    return value
