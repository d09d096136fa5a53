"""The fuzz suite's two budgets: `make test` (derandomized: the same examples every run, seconds)
and `make fuzz` (DDP_FUZZ=long: a fresh random search, many times the examples, minutes)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

LONG = os.environ.get("DDP_FUZZ") == "long"
SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
            HealthCheck.function_scoped_fixture]


def budget(examples: int) -> settings:
    """`examples` per test in `make test`, fixed; 25 times as many, random, under `make fuzz`. The
    deadline fails an example that takes seconds (a parser that hangs or crawls on a bad file)."""
    if LONG:
        return settings(max_examples=25 * examples, deadline=5000, suppress_health_check=SUPPRESS,
                        print_blob=True)
    return settings(max_examples=examples, deadline=5000, derandomize=True, database=None,
                    suppress_health_check=SUPPRESS)
