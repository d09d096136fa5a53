"""The fuzz suite's rule and budgets.

The rule every fuzzed reader must keep: return, or raise a user error (exit 2 or 3) in one line
naming the file; anything else (exit 1, "internal error") fails the test. The budgets: `make test`
(derandomized: the same examples every run, seconds) and `make fuzz` (DDP_FUZZ=long: a fresh random
search, 25 times the examples, minutes).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from hypothesis import HealthCheck, settings

from ddp_cli.errors import DATA, USAGE, DdpError

LONG = os.environ.get("DDP_FUZZ") == "long"
SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
            HealthCheck.function_scoped_fixture]


def budget(examples: int) -> settings:
    """`examples` per test in `make test`, fixed; 25 times as many, random, under `make fuzz`. The
    deadline fails an example that takes seconds (a parser that crawls on a bad file); pytest-timeout
    stops one that hangs."""
    if LONG:
        return settings(max_examples=25 * examples, deadline=5000, suppress_health_check=SUPPRESS,
                        print_blob=True)
    return settings(max_examples=examples, deadline=5000, derandomize=True, database=None,
                    suppress_health_check=SUPPRESS)


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
