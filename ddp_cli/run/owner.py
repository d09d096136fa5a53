"""One owner per run dir: the lock a run takes on its run dir, so a second run into it stops at once.

Two `ddp train` into one run dir (a job resubmitted while the first still runs, two pods of one
Deployment) would both "resume", append to one metrics.jsonl and write the same checkpoint names. So
the first to start writes `owner.lock` into the run dir (host, pid, start time, a heartbeat renewed
every HEARTBEAT_S by a thread of the owner) before writing anything else; a second run finds it and
stops with exit 2 naming the owner, the first run's files untouched. A lock whose owner is gone is
taken over with one warning: on the same host, when its pid is dead (or now another process's); from
another host, where the pid cannot be seen, when its heartbeat is older than STALE_S.

The lock is created exclusively: O_EXCL on a file system; on object storage (`s3://` run dirs), a PUT
with `If-None-Match: *`, and a take-over or a heartbeat with `If-Match` on the version read, so of two
runs racing for a stale lock one wins. A store that ignores conditional writes (checked once per run
with a probe object) gets a lease instead, with a warning: write, wait LEASE_SETTLE_S, read back; the
last writer owns it, and two runs starting within that time of each other could both believe they do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from ddp_cli.errors import ConfigError, DataError
from ddp_cli.io import write_text, writing
from ddp_cli.run.bucket import LOCK, RunBucket

log = logging.getLogger("ddp")
HEARTBEAT_S = 10.0  # how often the owner renews its heartbeat
STALE_S = 120.0  # another host's owner whose heartbeat is older than this is gone (12 missed renewals)
LEASE_SETTLE_S = 3.0  # a store without conditional writes: how long a lease waits before reading back


@dataclass(frozen=True)
class Owner:
    """What the lock records: who owns the run dir, since when, and that it is still there."""

    host: str
    pid: int
    started: float  # time.time() when it took the run dir
    heartbeat: float  # time.time() of its last renewal
    token: str  # this ownership's own id: tells a renewal from a take-over
    pid_started: int | None = None  # the process's start time (/proc, clock ticks): a reused pid is not it

    @classmethod
    def me(cls) -> Owner:
        now = time.time()
        return cls(socket.gethostname(), os.getpid(), now, now, uuid.uuid4().hex, process_start(os.getpid()))

    def renewed(self) -> Owner:
        return Owner(**{**asdict(self), "heartbeat": time.time()})

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Owner | None:
        """The owner a lock names; None for a lock that cannot be read (half-written by a store without
        atomic writes, or not ours): treated as stale."""
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError):
            return None

    def describe(self) -> str:
        started = datetime.fromtimestamp(self.started, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return (f"host {self.host} pid {self.pid} (started {started}, "
                f"heartbeat {max(0.0, time.time() - self.heartbeat):.0f} s ago)")

    def gone(self) -> str | None:
        """Why this owner is gone, or None while it may be alive."""
        if self.host == socket.gethostname():
            if not pid_alive(self.pid):
                return "its process is gone"
            if self.pid_started is not None and process_start(self.pid) not in (None, self.pid_started):
                return "its pid is now another process's"
            return None
        age = time.time() - self.heartbeat
        return f"its heartbeat is {age:.0f} s old, older than {STALE_S:.0f} s" if age > STALE_S else None


def pid_alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # not Linux: the signal's answer
        return True


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), None elsewhere or when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


class LockStore(Protocol):
    """Where a run dir's lock lives, with the exclusive writes ownership needs. A version is what a
    conditional write checks: the file's content, an object's ETag."""

    where: str  # the lock's path or URL, for messages

    def create(self, data: bytes) -> str | None:
        """Write the lock if there is none: its version; None if there is one."""

    def read(self) -> tuple[bytes, str] | None:
        """The lock's bytes and version, None if there is none."""

    def take_over(self, data: bytes, version: str) -> str | None:
        """Overwrite a stale lock still at `version`: the new version, None if another run changed it
        first (of two runs racing for one stale lock, one wins)."""

    def renew(self, data: bytes, version: str) -> str | None:
        """Overwrite this run's own lock at `version`: the new version, None if it is no longer ours."""

    def remove(self, version: str) -> None:
        """Delete the lock if it is still at `version`."""


class FileLock:
    """The lock as a file in a local (or mounted) run dir; its version is its content."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK
        self.where = str(self.path)

    def create(self, data: bytes) -> str | None:
        with writing(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return None
            with os.fdopen(fd, "wb") as lock:
                lock.write(data)
        return data.decode()

    def read(self) -> tuple[bytes, str] | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return data, data.decode(errors="replace")

    def take_over(self, data: bytes, version: str) -> str | None:
        """The stale lock moved aside by a rename (of two runs, one finds it gone), checked, and the new
        one linked in its place (a link, like O_EXCL, fails where a third run created one meanwhile)."""
        aside = self.path.with_name(f".{LOCK}.{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return None
        try:
            if aside.read_bytes().decode(errors="replace") != version:
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self.path)  # not the one judged stale: back, unless replaced already
                return None
            write_text(aside, data.decode())
            try:
                os.link(aside, self.path)
            except FileExistsError:
                return None
        finally:
            aside.unlink(missing_ok=True)
        return data.decode()

    def renew(self, data: bytes, version: str) -> str | None:
        """In place (an atomic replace: the lock never disappears, so no run can create one meanwhile)."""
        found = self.read()
        if found is None or found[1] != version:
            return None
        write_text(self.path, data.decode())
        return data.decode()

    def remove(self, version: str) -> None:
        found = self.read()
        if found and found[1] == version:
            self.path.unlink(missing_ok=True)


class BucketLock:
    """The lock as an object in a run dir in a bucket (a `run.bucket.RunBucket`), written with S3's
    conditional requests; `conditional` is False for a store found to ignore them (then writes are
    plain, and `take` leases)."""

    def __init__(self, bucket: RunBucket) -> None:
        self.bucket = bucket
        self.where = bucket.url_of(LOCK)
        self.conditional = True

    def put(self, data: bytes, **condition: str) -> str:
        key = self.bucket.key(LOCK)
        out = self.bucket.call(lambda: self.bucket.fs.pipe_file(key, data, **condition), LOCK)
        return str((out or {}).get("ETag", ""))

    def create(self, data: bytes) -> str | None:
        try:
            return self.put(data, mode="create") if self.conditional else self.put(data)
        except FileExistsError:
            return None

    def read(self) -> tuple[bytes, str] | None:
        key = self.bucket.key(LOCK)
        try:
            data = self.bucket.read(LOCK)
            info = self.bucket.call(lambda: self.bucket.fs.info(key, refresh=True), LOCK)
        except FileNotFoundError:
            return None
        return data, str(info.get("ETag", ""))

    def take_over(self, data: bytes, version: str) -> str | None:
        try:
            return self.put(data, IfMatch=version) if self.conditional else self.put(data)
        except FileNotFoundError:
            return None
        except DataError as e:
            if precondition_failed(e):
                return None
            raise

    renew = take_over

    def remove(self, version: str) -> None:
        found = self.read()
        if found and found[1] == version:
            self.bucket.remove(LOCK)

    def honours_conditional_writes(self) -> bool:
        """Whether the store refuses a second `If-None-Match: *` PUT of one object (a probe, removed)."""
        probe = f".owner-probe-{uuid.uuid4().hex}"
        key = self.bucket.key(probe)

        def create(data: bytes) -> None:
            self.bucket.call(lambda: self.bucket.fs.pipe_file(key, data, mode="create"), probe)

        try:
            create(b"1")
            try:
                create(b"2")
            except FileExistsError:
                return True
            except DataError:  # refused another way (the header not implemented)
                return False
            return False
        finally:
            self.bucket.remove(probe)


def precondition_failed(e: BaseException | None) -> bool:
    """Whether an error (or one it came from) is the store's 412 to an `If-Match`: the lock changed."""
    while e is not None:
        if "PreconditionFailed" in repr(e):
            return True
        e = e.__cause__ or e.__context__
    return False


class Ownership:
    """This process's hold on a run dir: taken by `take`, renewed by a daemon thread, let go by `release`."""

    def __init__(self, store: LockStore, owner: Owner, version: str) -> None:
        self.store, self.owner, self.version = store, owner, version
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._renew, name="ddp-owner-heartbeat", daemon=True)
        self.thread.start()

    def _renew(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            owner = self.owner.renewed()
            try:
                version = self.store.renew(owner.encode(), self.version)
            except Exception as e:  # a store failing now and then: the next renewal tries again
                log.warning("warning: could not renew the heartbeat of %s: %s", self.store.where, e)
                continue
            if version is None:  # changed: by a take-over, or by this renewal retried after a lost answer
                found = self.store.read()
                mine = Owner.decode(found[0]) if found else None
                if mine is None or mine.token != owner.token:
                    log.warning("warning: %s is no longer this run's: another run took it over",
                                self.store.where)
                    return
                owner, version = mine, found[1]
            self.owner, self.version = owner, version

    def release(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=HEARTBEAT_S)
        with contextlib.suppress(Exception):  # the run's own outcome is what matters now
            self.store.remove(self.version)


def take(store: LockStore, flag: str, lease: bool = False) -> Ownership:
    """Own the run dir of `store`, or raise ConfigError (exit 2) naming its live owner. `flag` names the
    run dir as the user gave it (`--run-dir DIR`). With `lease` (a store without conditional writes),
    each write is read back after LEASE_SETTLE_S: the last writer owns it."""
    me = Owner.me()
    for _ in range(5):  # each round owns, refuses, or saw the lock change under it and looks again
        found = store.read() if lease else None  # a lease looks before it writes
        if found is None:
            version = store.create(me.encode())
            if version is not None:
                return settled(store, me, flag) if lease else Ownership(store, me, version)
            found = store.read()
            if found is None:
                continue  # removed since create() saw it
        owner = Owner.decode(found[0])
        if owner and owner.token == me.token:  # this run's own create, retried after its answer was lost
            return Ownership(store, me, found[1])
        why = owner.gone() if owner else "its lock cannot be read"
        if why is None:
            raise ConfigError(f"{flag}: owned by a live run, {owner.describe()}: two runs would write "
                              "the same checkpoints and metrics; wait for it to end or stop it, or choose "
                              f"another run dir (from another host, a lock counts as gone {STALE_S:.0f} s "
                              "after its last heartbeat)")
        version = store.take_over(me.encode(), found[1])
        if version is not None:
            log.warning("warning: %s was owned by %s, and %s: taken over by this run", flag,
                        owner.describe() if owner else store.where, why)
            return settled(store, me, flag) if lease else Ownership(store, me, version)
    raise ConfigError(f"{flag}: its lock {store.where} kept changing while this run tried to take it; "
                      "is another run starting into it? try again")


def settled(store: LockStore, me: Owner, flag: str) -> Ownership:
    """A lease's read-back: this run's if its write is still there after LEASE_SETTLE_S."""
    time.sleep(LEASE_SETTLE_S)
    found = store.read()
    winner = Owner.decode(found[0]) if found else None
    if winner is None or winner.token != me.token:
        named = winner.describe() if winner else "another run"
        raise ConfigError(f"{flag}: owned by a live run, {named}, which wrote its lease at the same time; "
                          "wait for it to end or stop it, or choose another run dir")
    return Ownership(store, me, found[1])


@contextlib.contextmanager
def owning(run_dir: Path | str, flag: str = "--run-dir") -> Iterator[Ownership]:
    """Hold the run dir (a folder or an s3:// URL) for the block's time."""
    ownership = take_run_dir(run_dir, flag)
    try:
        yield ownership
    finally:
        ownership.release()


def take_run_dir(run_dir: Path | str, flag: str) -> Ownership:
    if isinstance(run_dir, str) and run_dir.startswith("s3://"):
        store = BucketLock(RunBucket(run_dir))
        if not store.honours_conditional_writes():
            log.warning("warning: the object store of %s ignores conditional writes (If-None-Match): this "
                        "run owns it by a lease instead (two runs starting within %.0f s of each other could "
                        "both own it)", run_dir, LEASE_SETTLE_S)
            store.conditional = False
            return take(store, f"{flag} {run_dir}", lease=True)
        return take(store, f"{flag} {run_dir}")
    return take(FileLock(Path(run_dir)), f"{flag} {run_dir}")
