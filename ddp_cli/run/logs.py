"""Each worker's stdout and stderr, kept in the job folder: `logs/rank<N>.stdout.log`, `.stderr.log`.

So a failure on rank 5 of 16 can be read after the fact (the console shows every rank's lines
interleaved, and only while it lasts). torch's elastic agent does the teeing: it points each
worker's streams at a file, forked or spawned alike, and copies new lines on to this process's
console as they come, so the console reads as before. Files are named by global rank (unique
across nodes sharing a run dir); an elastic restart's are `rank<N>.restart<K>.*`; a later launch
into the same run dir (a resume) moves the earlier files aside as `rank<N>.stderr.1.log`, `.2`, ...
(oldest first), so `rank<N>.stderr.log` is always the latest. One exception: on a terminal, rank 0's
stderr stays on it (no file) so its live progress table still draws; rank 0's failures are printed
by the launcher and kept in `errors/` anyway.

A rank's internal error (a bug) is one line on the console naming `rank<N>.traceback.log`, which
holds its traceback (`write_traceback`): in the stderr log it would be teed to the console too.
"""

from __future__ import annotations

import itertools
import os
import traceback
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std

from ddp_cli.io import writing


class RankLogs(LogsSpecs):
    """torch's LogsSpecs, laid out flat in `folder` by global rank, every stream teed."""

    def __init__(self, folder: Path, live_console: bool = False) -> None:
        super().__init__(log_dir=str(folder), tee=Std.ALL)
        self.folder, self.live_console = folder, live_console
        self.stderr_files: dict[int, Path] = {}  # by global rank, of the latest start (not the console)

    @property
    def root_log_dir(self) -> str:
        return str(self.folder)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """The files of this start of the workers (the agent calls it again on each restart)."""
        with writing(self.folder):
            self.folder.mkdir(parents=True, exist_ok=True)
        dest = LogsDest()
        for local_rank, env in envs.items():
            restart = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
            stem = rank_stem(int(env["RANK"]), restart)
            stdout, stderr, error, trace = (self.folder / f"{stem}.{kind}" for kind in
                                            ("stdout.log", "stderr.log", "error.json", "traceback.log"))
            for path in (stdout, stderr, error, trace):
                keep_aside(path)
            dest.stdouts[local_rank] = dest.tee_stdouts[local_rank] = str(stdout)
            if self.live_console and env["RANK"] == "0":
                dest.stderrs[local_rank] = ""  # the terminal itself: rank 0's live progress
            else:
                dest.stderrs[local_rank] = dest.tee_stderrs[local_rank] = str(stderr)
                self.stderr_files[int(env["RANK"])] = stderr
            dest.error_files[local_rank] = str(error)  # torch's own record of an uncaught exception
            env["TORCHELASTIC_ERROR_FILE"] = str(error)
        return dest


def rank_stem(rank: int, restart: int) -> str:
    return f"rank{rank}" + (f".restart{restart}" if restart else "")


def write_traceback(folder: Path, rank: int, error: BaseException) -> Path | None:
    """`error`'s traceback in `folder/logs/rank<N>[.restart<K>].traceback.log`, appended; its path, or
    None where it cannot be written (the disk that failed the run): the one-line message still goes."""
    path = folder / "logs" / f"{rank_stem(rank, int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)))}" \
                             ".traceback.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as log:
            traceback.print_exception(error, file=log)
    except OSError:
        return None
    return path


def keep_aside(path: Path) -> None:
    """Move an earlier launch's `path` to the first free `<stem>.<k><suffix>`: never overwritten, and
    never read back as this launch's (torch reads a failed rank's error file)."""
    if path.exists():
        older = (path.with_name(f"{path.stem}.{k}{path.suffix}") for k in itertools.count(1))
        with writing(path):
            path.rename(next(p for p in older if not p.exists()))
