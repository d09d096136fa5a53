"""A run's val images as small base64 JPEGs for `ddp report --html`'s gallery of mistakes, read from the
data set the run trained on (its dataset.json) by the rows of its index (its index/ folder)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

THUMB = 96  # px: the longer side of a thumbnail


class Thumbnails:
    """Val images as small base64 JPEGs, read from the data set the run trained on (dataset.json) by the
    rows of its index (index/); `None` for one it cannot read (why: `problem`)."""

    def __init__(self, run_dir: Path) -> None:
        self.reader = self.split = self.prefix = None
        self.rows: dict[str, int] = {}
        self.problem = ""
        try:
            from ddp_cli.data.pipeline.loaders import open_reader
            from ddp_cli.data.registry import DatasetEntry
            from ddp_cli.data.sources.table import IndexTable

            entry = DatasetEntry.model_validate_json((run_dir / "dataset.json").read_text())
            index = IndexTable.load(run_dir / "index")
            self.split = index.splits["val"]
            fs, root = entry.open()
            self.reader = open_reader(fs, root, self.split)
            self.prefix = entry.storage.path.rstrip("/") + "/"
            self.rows = {self.split.paths[i]: i for i in range(len(self.split))}
        except Exception as e:  # noqa: BLE001 (the page is made anyway, without pictures)
            self.problem = f"{type(e).__name__}: {e}"

    def __call__(self, path: str) -> str | None:
        if self.reader is None:
            return None
        from PIL import Image

        from ddp_cli.data.pipeline.loaders import read_row

        row = self.rows.get(path.removeprefix(self.prefix or ""))
        if row is None:
            return None
        try:
            with Image.open(io.BytesIO(read_row(self.reader, self.split, row).data)) as image:
                image = image.convert("RGB")
                image.thumbnail((THUMB, THUMB))
                out = io.BytesIO()
                image.save(out, "JPEG", quality=85)
        except Exception:  # noqa: BLE001 (a bad image: shown without its picture)
            return None
        return base64.b64encode(out.getvalue()).decode()
