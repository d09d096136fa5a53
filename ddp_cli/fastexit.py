"""Leave the process at once: the interpreter's own teardown costs ~1 s once torch is imported.

That second is paid by the launcher and again by every worker of every run
(measured: `python -c "import torch, torchvision"` spends 0.9 s after its
last line, in native destructors). By the time a `ddp` process exits,
everything worth keeping is written: checkpoints and result files are
fsynced, sinks closed, the process group destroyed; what is left is freeing
memory, which the OS does faster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush logs and standard streams, then `os._exit(code)`."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


@contextlib.contextmanager
def exit_if_stuck(code: int, seconds: float) -> Iterator[None]:
    """Exit with `code` if the block has not finished within `seconds` (work already done and saved
    must not be lost to a clean-up that blocks, e.g. a collective library waiting for a peer that left)."""
    timer = threading.Timer(seconds, exit_now, (code,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def run_and_exit(main: Callable[[], object]) -> NoReturn:
    """Run `main` (which ends with sys.exit) and exit with its code, the fast way."""
    try:
        main()
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    exit_now(code)
