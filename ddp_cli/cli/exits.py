"""Where a command's outcome goes: its result to stdout, its error to stderr and an exit code.

With --json, stdout's last line is exactly one JSON document, and on failure that document is
the error (`{"error", "exit_code"}`), so a script parses one thing whatever happened. The exit
codes are the contract's (CLI.md, `ddp_cli.errors`).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import typer
from rich.markup import escape

from ddp_cli.cli.render import err
from ddp_cli.data.pipeline.sharedmem import exhausted, ran_out
from ddp_cli.errors import INTERNAL, SIGINT, DdpError, summary
from ddp_cli.io import WRITE_ONLY, write_error

SIGPIPE = 141  # 128 + 13, as a shell reports a process that wrote to a closed pipe


def exits(command: Callable) -> Callable:
    """Map DdpError to its exit code and one line on stderr; anything else is a bug (1).

    Commands say they print JSON by `as_json` (or `fmt == "json"`), which Typer passes by keyword.
    """

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        as_json = kwargs.get("as_json") is True or kwargs.get("fmt") == "json"
        try:
            command(*args, **kwargs)
        except DdpError as e:
            fail(str(e), e.exit_code, as_json)
        except (typer.Exit, typer.Abort):
            raise
        except KeyboardInterrupt:
            fail("interrupted", SIGINT, as_json)
        except Exception as e:
            if ran_out(e):  # a queue or a batch found /dev/shm full: a setting, not a full disk nor a bug
                short = exhausted()
                fail(str(short), short.exit_code, as_json)
            refused = write_error(e, errnos=WRITE_ONLY)  # a write no wrapper named: the file the error names
            if refused is not None:
                fail(str(refused), refused.exit_code, as_json)
            if os.environ.get("DDP_DEBUG") == "1":
                raise
            fail(f"{summary(e)}{traceback_kept(e)}", INTERNAL, as_json, label="internal error (a bug):")

    return wrapper


def traceback_kept(e: BaseException) -> str:
    """`e`'s traceback written to a file of its own (the console gets one line): '; its traceback: PATH',
    or '' where no file can be written."""
    try:
        fd, path = tempfile.mkstemp(prefix="ddp-traceback-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            traceback.print_exception(e, file=log)
    except OSError:
        return ""
    return f"; its traceback: {path}"


def report_error(message: str, code: int, as_json: bool, result: dict[str, Any] | None = None,
                 label: str = "error:") -> None:
    """One line on stderr; with JSON output also `{"error", "exit_code"}` as the last stdout line,
    after the keys of what the command found before failing (`result`), if anything.

    An empty message is a worker's failure that the worker printed itself (under torchrun)."""
    if message:
        err.print(f"[red]{label}[/red] {escape(message)}", highlight=False, soft_wrap=True)
    if as_json:
        text = message or f"a worker failed with exit code {code} (its message is on stderr)"
        text = text if label == "error:" else f"{label} {text}"
        sys.stdout.write(json.dumps({**(result or {}), "error": text, "exit_code": code}) + "\n")


def fail(message: str, code: int, as_json: bool, result: dict[str, Any] | None = None,
         label: str = "error:") -> NoReturn:
    """`report_error`, then exit with `code`."""
    report_error(message, code, as_json, result, label)
    raise typer.Exit(code)


def emit(result: Any, as_json: bool, human: Callable[[], None]) -> None:
    """`result` as one JSON line on stdout, or drawn for a person by `human`."""
    with stdout_may_close():
        if as_json:
            sys.stdout.write(json.dumps(result) + "\n")
        else:
            human()


def stdout_is_devnull() -> bool:
    """Whether stdout is /dev/null (where rich points it when its reader has left)."""
    try:
        return os.path.samestat(os.fstat(sys.stdout.fileno()), os.stat(os.devnull))
    except (OSError, ValueError):  # a stream with no file descriptor (a test's capture)
        return False


@contextmanager
def stdout_may_close() -> Iterator[None]:
    """A reader that leaves early (`ddp config schema | head`) has all it wanted: exit quietly."""
    try:
        yield
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        raise typer.Exit(SIGPIPE) from None
