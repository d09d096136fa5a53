"""Files that survive a kill: atomic writes, fsync, sha256, and loads that run no pickled code.

The lowest layer: checkpoints, the job folder and manifests all write through
`atomic_write`, and every `torch.load` goes through `load_plain`. It is also the one place that
turns a write the storage refused (disk full, over quota, read-only, no permission, an I/O
error) into a `WriteError`: one line naming the path and the cause in words (`writing`,
`write_error`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import pwd
import secrets
import shutil
import stat
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from ddp_cli.errors import DataError, WriteError

CHECKPOINT_FORMAT = 1  # the marker a ddp checkpoint carries as its "format" key
ZIP_MAGIC, PICKLE_MAGIC = b"PK\x03\x04", b"\x80"  # how torch.save's files begin (zip; legacy pickle)


class HashingFile:
    """A write-only file that hashes and counts what passes through it (no second read of the file)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.digest, self.size = file, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any], needed: int | None = None
                 ) -> tuple[str, int]:
    """Call `write(file)` on a temp file beside `path`, then rename it into place; (sha256, bytes).

    A kill at any instant leaves either the old file or the new one, never half of one; a write the
    storage refuses removes its temp file and is a `WriteError` (`needed`: the bytes it would take,
    where the caller knows them). The file gets the mode `open` gives a new file (0666 less the
    umask, and a folder's default ACL), so a team or a serving process can read what a run wrote.
    """
    with writing(path, needed):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = create_beside(path)
        try:
            with os.fdopen(fd, "wb") as f:
                hashing = HashingFile(f)
                write(hashing)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with suppress(OSError):  # on a failing device the unlink may fail too: the first error counts
                Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
    return hashing.digest.hexdigest(), hashing.size


def create_beside(path: Path) -> tuple[int, Path]:
    """A new hidden temp file beside `path`, open for writing: (fd, its path). Made as `open` makes a
    file, not as `tempfile.mkstemp` does (always 0600, which no teammate can read)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    while True:  # 64 random bits: a name taken by another writer is all but impossible, but is retried
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        with suppress(FileExistsError):
            return os.open(tmp, flags, 0o666), tmp


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


# The errnos of a write the storage refused, each with the cause in words (what `write_error` says).
REFUSALS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted", errno.EIO: "I/O error from the device",
            errno.EFBIG: "file too large for the file system"}
# Those that only a write can meet: a failure with one of these anywhere is a refused write.
WRITE_ONLY = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})


@contextmanager
def writing(path: str | Path, needed: int | None = None) -> Iterator[None]:
    """Writes to `path` inside this block that the storage refuses become one `WriteError`."""
    try:
        yield
    except (OSError, RuntimeError) as e:  # torch's zip writer wraps the OSError in a RuntimeError
        error = write_error(e, path, needed)
        if error is None:
            raise
        raise error from e


def write_error(e: BaseException, path: str | Path | None = None, needed: int | None = None,
                errnos: frozenset[int] | None = None) -> WriteError | None:
    """The `WriteError` for `e` if it (or an error it was raised from or during) is a refused write
    (one of `errnos`, by default any of `REFUSALS`), else None. `path` is what was being written,
    else the file the error names; `needed` the bytes the write would take, where known."""
    fault = refusal(e, errnos or frozenset(REFUSALS))
    if fault is None:
        return None
    code, oserror = fault
    where = str(path or oserror.filename or "")
    try:
        words = cause(code, where, oserror, needed)
    except OSError:  # the failing device refuses even a stat: the cause alone
        words = REFUSALS[code]
    return WriteError(f"could not write {where or 'a file'}: {words}")


def refusal(e: BaseException | None, errnos: frozenset[int]) -> tuple[int, OSError] | None:
    """(errno, the OSError) of the first refused write in `e`'s chain; a PermissionError without an
    errno (object storage's "access denied") counts as EACCES."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            code = e.errno if e.errno is not None or not isinstance(e, PermissionError) else errno.EACCES
            if code in errnos:
                return code, e
        e = e.__cause__ or e.__context__
    return None


def cause(code: int, where: str, e: OSError, needed: int | None) -> str:
    """The cause in words, with what a person needs to act on it: the free space, the folder's owner."""
    words = REFUSALS[code]
    named = str(e.filename) if e.filename else where  # "" for a stream: no folder to name
    local = existing_ancestor(Path(named)) if named and "://" not in named else None
    if local is None:
        return f"{words} ({e})" if e.strerror is None else words  # object storage's own words
    if code == errno.ENOSPC:
        folder = local if local.is_dir() else local.parent
        free = f"{size_words(shutil.disk_usage(folder).free)} free"
        return f"{words} holding {folder}: " + (f"{size_words(needed)} needed, {free}" if needed else free)
    if code in (errno.EACCES, errno.EPERM):
        info = local.stat()
        return f"{words} ({local}: owner {owner(info.st_uid)}, mode {stat.S_IMODE(info.st_mode):04o})"
    return f"{words} holding {local}" if code == errno.EIO else words


def existing_ancestor(path: Path) -> Path | None:
    """`path` itself if it exists, else its nearest existing folder."""
    for candidate in (path, *path.absolute().parents):
        with suppress(OSError):
            if candidate.exists():
                return candidate
    return None


def owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def size_words(size: int) -> str:
    """Bytes as a person reads them: 3.1 MB, 12.0 kB, 870 B (decimal units, as `df -H`)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def fsync_dir(folder: Path) -> None:
    """Make renames in `folder` durable (a crash after this cannot undo them)."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_plain(path: Path) -> Any:
    """Load with `weights_only=True`: tensors, numbers, strings and containers, nothing else.

    torch is imported here, not at the top: the index build reads and writes files through this
    module in a process that must not import torch (`index_build.IndexBuild`)."""
    import torch

    with open(path, "rb") as f:
        head = f.read(len(ZIP_MAGIC))
    if head and not head.startswith((ZIP_MAGIC, PICKLE_MAGIC)):  # a text file, an image: not torch's at all
        raise DataError(f"{path}: not a checkpoint (a torch.save file begins with a zip or pickle "
                        f"header, this one with {head!r}); give a file torch.save wrote (a ddp .pt)")
    try:
        with warnings.catch_warnings():  # an altered byte reads as an odd pickle protocol: the error says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise DataError(f"{path}: refused, it holds more than plain data (weights_only load): "
                        f"{_unpickler_reason(e)}") from e
    except Exception as e:  # a cut-short or altered file trips torch's zip reader or unpickler anywhere
        raise DataError(f"{path}: unreadable or truncated checkpoint ({_first_line(e)})") from e


def _unpickler_reason(e: Exception) -> str:
    """What torch's weights-only unpickler refused ("Unsupported global: GLOBAL x.Y ..."), without the
    advice around it: retrying with `weights_only=False` runs whatever code the file carries."""
    _, found, reason = str(e).partition("WeightsUnpickler error:")
    reason = next((line.strip() for line in reason.splitlines() if line.strip()), "")
    return reason.split(" Please use")[0] if found and reason else "not plain data"


def _first_line(e: Exception) -> str:
    """The first line of `e`'s message, or its class where it has none (an empty file: EOFError())."""
    return next(iter(str(e).splitlines()), type(e).__name__)


def is_checkpoint(state: Any) -> bool:
    return isinstance(state, dict) and state.get("format") == CHECKPOINT_FORMAT
