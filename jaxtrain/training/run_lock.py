"""One writer per checkpoint directory: a run holds `jaxtrain.lock` in its `checkpoint.dir` from start to exit
(process 0 of a multi-process job, once for all of them), and a second run is refused at start, naming the holder.

The lock is flock(2) on that file. The kernel drops it when the holder ends, however it ends (kill -9 included), so on
one host a lock can never outlive its process. The file also says who holds it (host, pid, start time, command), for
the message a refused run prints, and the holder removes it when it exits. A file still there when the lock is free
was left by a process that ended without removing it: on this host that process is gone (the free flock proves it),
and its lock is taken over with a warning. A file written on another host is not taken over: flock on a network file
system is only as good as its lock manager (an NFS mount with `nolock` keeps locks local to each host), so a run on
another host may be alive without this one seeing its lock; the message says how to remove the file. O_CREAT|O_EXCL
alone would leave a stale file after every kill -9, to be judged by a pid that may have been reused.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtrain.errors import UserInputError
from jaxtrain.training.checkpoint import CheckpointError, CheckpointWriteError

LOCK_NAME = "jaxtrain.lock"


class RunLockedError(UserInputError):
    """Another run holds the checkpoint directory's lock (or may hold it, from another host)."""


class RunLock:
    """The lock of checkpoint directory `directory`, held by this process once `acquire` returns."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory).absolute() / LOCK_NAME
        self.fd: int | None = None

    def acquire(self, log: Callable[[str], None] = print) -> None:
        """Take the lock, or raise `RunLockedError` naming its holder; `CheckpointWriteError` if the directory cannot
        hold a lock file (it is then no place for checkpoints either)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = self._open_locked()
            left = _read(self.fd)
            if left and left.get("host") != socket.gethostname():
                self._refuse_another_hosts(left)
            if left:
                log(
                    f"warning: taking over the lock of {self.path.parent} from {describe(left)}, which ended without "
                    "releasing it (killed or crashed); the checkpoints it completed are kept, an unfinished save is not"
                )
            _write(
                self.fd, {"host": socket.gethostname(), "pid": os.getpid(), "started": _now(), "command": _command()}
            )
        except OSError as err:
            self.release()
            raise CheckpointWriteError(f"cannot use checkpoint directory {self.path.parent}: {err}.", None) from err

    def _refuse_another_hosts(self, left: dict[str, Any]) -> None:
        os.close(self.fd)  # unlocked, and the file left as it was
        self.fd = None
        raise RunLockedError(
            f"{self.path} says {describe(left)} holds checkpoint directory {self.path.parent}, and a lock taken on "
            "another host cannot be checked from here. If that run has ended (its host is down, or it was killed), "
            f"remove {self.path} and rerun; if it is running, give this run another --checkpoint-dir."
        )

    def _open_locked(self) -> int:
        """A descriptor of the lock file with the flock held. A holder removes the file before unlocking it, so a
        lock won on a file that has since left the path is a lock on nothing: try again on the path's new file."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                locked = _try_flock(fd)
            except OSError:
                os.close(fd)
                raise
            if not locked:
                holder = _read(fd)
                os.close(fd)
                raise RunLockedError(
                    f"checkpoint directory {self.path.parent} is in use: {describe(holder) if holder else 'a run'} "
                    f"holds its lock ({self.path}). One run writes a directory at a time: wait for it to end, stop it, "
                    "or give this run another --checkpoint-dir."
                )
            if _same_file(fd, self.path):
                return fd
            os.close(fd)

    def release(self) -> None:
        """Remove the lock file (if it is still this lock's), then unlock; harmless when not held."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):  # an unwritable directory keeps the file: the next run takes it over
            if _same_file(self.fd, self.path):
                self.path.unlink()
        os.close(self.fd)
        self.fd = None


@contextlib.contextmanager
def holding(directory: str, log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold `directory`'s lock inside (nothing for an empty `directory`). With several processes, process 0 takes it
    and every process learns the outcome, so a refusal stops them all."""
    lock = RunLock(directory) if directory else None
    if lock is None:
        yield
        return
    if lock.path.parent.exists() and not lock.path.parent.is_dir():  # every process sees it: all stop alike
        raise CheckpointError(
            f"checkpoint.dir={directory} is a file, not a directory: give the path of a directory (it is created "
            "if missing)."
        )
    failure: Exception | None = None
    if jax.process_index() == 0:
        try:
            lock.acquire(log)
        except (RunLockedError, CheckpointWriteError) as err:
            failure = err
    if jax.process_count() > 1:
        kinds = (None, RunLockedError, CheckpointWriteError)  # what process 0 says, as an index every process reads
        kind = kinds[
            int(multihost_utils.broadcast_one_to_all(np.int32(kinds.index(type(failure) if failure else None))))
        ]
        if kind and not failure:
            message = f"process 0 could not lock checkpoint directory {directory}: see its error."
            failure = kind(message) if kind is RunLockedError else kind(message, None)
    if failure:
        raise failure
    try:
        yield
    finally:
        lock.release()


def describe(holder: dict[str, Any]) -> str:
    """'pid 123 on host h (started 2026-12-01T09:07:11, command ...)'."""
    command = f", command: {holder['command']}" if holder.get("command") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')} (started {holder.get('started')}{command})"


def _try_flock(fd: int) -> bool:
    """Take an exclusive flock on `fd` if no one holds one; False if someone does."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(
                err.errno,
                f"its file system does not support flock, which the one-writer lock needs ({err.strerror}); mount it "
                "with locking (NFS: without nolock; Lustre: -o flock) or use a local directory",
            ) from None
        raise
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False


def _read(fd: int) -> dict[str, Any]:
    """The holder record in the lock file; {} if empty or unreadable (its holder may be writing it right now)."""
    try:
        record = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write(fd: int, record: dict[str, Any]) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
    os.fsync(fd)


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _command() -> str:
    return " ".join(sys.argv)[:500]
