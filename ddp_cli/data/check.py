"""`ddp datasets check`: read and decode every file of a split; report every bad one and why.

Reasons: "missing file" (named in the listing or CSV, absent from the root),
"unreadable (...)", "not an image", "truncated", "corrupt (...)", "unknown
synset" (a CSV row whose class is not in the synset mapping), and "unsafe path
(...)" (a listed name that is absolute or climbs out of its folder: never read). Files
are read through the same reader and decoded by the same decoder as in
training, so what check passes, training reads; JPEGs are decoded at 1/8 scale,
which still runs the whole entropy-coded stream (where truncation and
corruption show) for a fraction of the cost. Threads do the work: reads wait on
the disk or the network, and libjpeg-turbo and PIL decode without the GIL.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec

from ddp_cli.data.images import BadImage, decode
from ddp_cli.data.layouts import SPLITS, build_index
from ddp_cli.data.loaders import fetch
from ddp_cli.data.storage import FileReader

CHUNK = 4096  # files in flight at once: a million futures would not fit in memory


def default_workers() -> int:
    return min(32, 4 * (os.cpu_count() or 1))


def check_dataset(
    fs: fsspec.AbstractFileSystem,
    root: str,
    layout: str,
    splits: tuple[str, ...] = SPLITS,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Scan `splits` of the data set at `root`; `progress(done, total)` is called as files are checked."""
    started = time.perf_counter()
    index = build_index(fs, root, layout, splits=splits)
    reader = FileReader(fs, root)
    paths = [path for split in splits for path in index.splits[split].paths]
    bad = list(index.problems)
    with ThreadPoolExecutor(workers or default_workers(), thread_name_prefix="check") as pool:
        for start in range(0, len(paths), CHUNK):
            chunk = paths[start:start + CHUNK]
            for offset, reason in enumerate(pool.map(lambda p: check_file(reader, p), chunk)):
                if reason:
                    bad.append({"path": chunk[offset], "reason": reason})
                if progress:
                    progress(start + offset + 1, len(paths))
    return {
        "splits": index.counts(),
        "bad_files": sorted(bad, key=lambda b: b["path"]),
        "seconds": time.perf_counter() - started,
    }


def check_file(reader: FileReader, path: str) -> str | None:
    """Why `path` cannot be trained on, or None if it can."""
    try:
        decode(fetch(reader, path), 1, 1)
    except BadImage as e:
        return str(e)
    return None
