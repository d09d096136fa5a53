"""The rule every fuzzed reader must keep: return, or raise a user error (exit 2 or 3) in one line
naming the file; anything else (exit 1, "internal error") fails the test."""

from __future__ import annotations

from collections.abc import Callable

from ddp_cli.errors import DATA, USAGE, DdpError


def user_error_or_none(call: Callable[[], object], names: str) -> DdpError | None:
    """Run `call`; the DdpError it raised (checked), or None when it returned."""
    try:
        call()
    except DdpError as e:
        message = str(e)
        assert e.exit_code in (USAGE, DATA), f"exit {e.exit_code}: {message}"
        assert "\n" not in message and "\r" not in message, f"more than one line: {message!r}"
        assert names in message, f"does not name {names}: {message}"
        return e
    return None
