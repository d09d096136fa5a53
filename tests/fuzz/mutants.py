"""Mutations of a valid file that a careless user, a cut-short copy or a bad disk make.

`mutants(seed)` is a hypothesis strategy of 1 to 3 stacked mutations of `seed`'s bytes:
truncation anywhere, a flipped byte, bytes inserted or dropped, a line duplicated, dropped or
swapped, a token replaced by an absurd value (NaN, inf, 1e308, negative, a huge string, the
wrong type), the text re-encoded (UTF-16, a BOM, Latin-1), an empty file, random binary.
Derandomized runs (the `make test` profile) draw the same mutants every time.
"""

from __future__ import annotations

import re

from hypothesis import strategies as st

# values of the wrong type or absurd size, as they would be written in TOML, JSON or CSV
ABSURD = (b"nan", b"inf", b"-inf", b"1e308", b"-1e308", b"-1", b"0", b"-0", b"1.5", b"99999999999999999999",
          b"-9223372036854775809", b'"' + b"x" * 5000 + b'"', b"x" * 5000, b'""', b"[]", b"{}", b"[[]]",
          b"true", b"null", b"\x00", b"\xff\xfe", b"..", b"/etc/passwd", b"../../x", b"\xe9", b",", b"\n",
          b'"', b"=", b"[", b"\\")
TOKEN = re.compile(rb"[-+\w.]+")
ENCODINGS = ("utf-16", "utf-8-sig", "utf-16-be", "latin-1", "utf-32")


@st.composite
def _one(draw: st.DrawFn, data: bytes) -> bytes:
    op = draw(st.sampled_from(("truncate", "flip", "insert", "drop", "line", "token", "encode", "empty",
                               "binary")))
    n = len(data)
    if op == "truncate":
        return data[:draw(st.integers(0, n))]
    if op == "flip" and n:
        i = draw(st.integers(0, n - 1))
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    if op == "insert":
        i = draw(st.integers(0, n))
        return data[:i] + draw(st.binary(min_size=1, max_size=8) | st.sampled_from(ABSURD)) + data[i:]
    if op == "drop" and n:
        i = draw(st.integers(0, n - 1))
        return data[:i] + data[i + draw(st.integers(1, 64)):]
    if op == "line":
        return draw(_lines(data))
    if op == "token":
        tokens = list(TOKEN.finditer(data))
        if tokens:
            t = draw(st.sampled_from(tokens))
            return data[:t.start()] + draw(st.sampled_from(ABSURD)) + data[t.end():]
    if op == "encode":
        try:
            return data.decode().encode(draw(st.sampled_from(ENCODINGS)))
        except UnicodeError:
            return b"\xef\xbb\xbf" + data
    if op == "binary":
        return draw(st.binary(max_size=256))
    return b""


@st.composite
def _lines(draw: st.DrawFn, data: bytes) -> bytes:
    """A line duplicated, dropped or moved (all of them duplicated, at most)."""
    lines = data.splitlines(keepends=True)
    if not lines:
        return data
    i = draw(st.integers(0, len(lines) - 1))
    how = draw(st.sampled_from(("duplicate", "drop", "move", "all-twice")))
    if how == "duplicate":
        lines.insert(i, lines[i])
    elif how == "drop":
        del lines[i]
    elif how == "move":
        lines.insert(draw(st.integers(0, len(lines) - 1)), lines.pop(i))
    else:
        lines = lines + lines
    return b"".join(lines)


@st.composite
def mutants(draw: st.DrawFn, seed: bytes) -> bytes:
    """1 to 3 mutations of `seed`, each applied to the last one's result."""
    data = seed
    for _ in range(draw(st.integers(1, 3))):
        data = draw(_one(data))
    return data
