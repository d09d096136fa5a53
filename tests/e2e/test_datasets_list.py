"""`ddp datasets list` without --json: the human table, its headers and one row per data set."""

from __future__ import annotations

from conftest import run_ddp
from synthetic import write_registry

ENTRIES = [
    {"name": "local_one", "layout": "imagenet-loc", "description": "A local ImageNet copy",
     "storage": {"driver": "FileSystem", "path": "/data/imagenet"}},
    {"name": "relative_two", "layout": "imagefolder", "description": "Folders of classes, relative path",
     "storage": {"driver": "FileSystem", "path": "sets/two"}},
    {"name": "bucket_three", "layout": "imagenet-loc", "description": "In a bucket",
     "storage": {"driver": "S3", "path": "s3://some-bucket/imagenet",
                 "endpoint_url": "http://127.0.0.1:9"}},
]
HEADERS = ["name", "driver", "layout", "path", "description"]


def table_rows(text: str) -> list[list[str]]:
    """Rich's box table: the header row (┃ ... ┃) then body rows (│ ... │), cells stripped."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line[:1] in ("┃", "│") and line[-1:] in ("┃", "│"):
            rows.append([cell.strip() for cell in line[1:-1].replace("┃", "│").split("│")])
    return rows


def test_datasets_list_table_shows_headers_and_every_data_set(tmp_path):
    registry = write_registry(tmp_path, ENTRIES)
    result = run_ddp("datasets", "list", "--registry", str(registry), env={"COLUMNS": "200"}, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert rows[0] == HEADERS, result.stdout
    expected = [[e["name"], e["storage"]["driver"], e["layout"],
                 str(tmp_path / "sets/two") if e["storage"]["path"] == "sets/two" else e["storage"]["path"],
                 e["description"]] for e in ENTRIES]
    assert rows[1:] == expected, result.stdout  # one unwrapped row each, in registry order
    assert not result.stdout.lstrip().startswith(("[", "{")), "the human table, not JSON"
