"""Users' files: the paths they write (in configs, registries, flags) and their text (TOML, JSON, CSV,
listings), each turned into what ddp reads in one place, every failure a user error naming the file.

Every reader of a user's file turns its bytes into text here, so a file that is not UTF-8
(UTF-16 from a Windows editor, Latin-1, binary, a copy cut short inside a character) is one
line naming the file and the byte, with the error class of the file's kind (ConfigError for a
config or registry, DataError for a data set's files), never a UnicodeDecodeError. A UTF-8
byte-order mark is accepted and dropped: editors write one, and it means UTF-8.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from ddp_cli.errors import ConfigError, DataError, DdpError

ErrorClass = type[DdpError]


def user_path(text: str, where: str, error: ErrorClass = ConfigError) -> str:
    """`text` (a path a user wrote) with `~` expanded; `error` naming `where` when no file can have
    that name (a NUL byte: every os call would raise ValueError). `~nosuchuser` stays as written
    (pathlib's expanduser would raise RuntimeError), so it is reported as a missing file."""
    if "\0" in text:
        raise error(f"{where}: {text!r} holds a NUL byte, which no file name can; fix the path")
    return os.path.expanduser(text)


def decode(data: bytes, where: str, error: ErrorClass = DataError) -> str:
    """`data` as UTF-8 text (a leading BOM dropped); `error` naming `where` and the byte otherwise."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        hint = " (UTF-16?)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise error(f"{where}: not UTF-8 text{hint}: byte 0x{data[e.start]:02x} at offset {e.start}; "
                    "save it as UTF-8") from e


def read_text(path: str | Path, error: ErrorClass = DataError) -> str:
    """The local file at `path` as text; `error` naming it when it cannot be read or decoded."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror or e}); check the path") from e
    return decode(data, str(path), error)


def parse_toml(text: str, where: str, error: ErrorClass = DataError) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{where}: TOML syntax error: {e}") from e


def parse_json(text: str, where: str, error: ErrorClass = DataError) -> Any:
    """JSON, refused by `error` when malformed or nested too deep for the parser (RecursionError)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from e
    except RecursionError as e:
        raise error(f"{where}: not valid JSON (nested too deep)") from e
