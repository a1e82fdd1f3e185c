"""A local Ray session's processes die with the driver that started them, however the driver ends.

`ray.init` makes the GCS and the raylet die with the driver (on Linux), and the actors die with the raylet, but the
raylet's agents (DashboardAgent, RuntimeEnvAgent) outlive a driver killed with SIGKILL by a minute or two: they see
the raylet gone at once, then spend 60 s (a fixed timeout in Ray) trying to report it to the dead GCS. A restarting
launcher would start the next attempt beside them.

`watching(roots)` starts this file as a small process of its own (no JAX, no Ray; in a session of its own, so a
terminal's Ctrl-C does not reach it). While the driver lives, it records `roots` (the session's processes the driver
started) and every descendant they start, each twice a second; when its stdin, a pipe from the driver, closes (the
driver exited, crashed or was killed), it kills every recorded process still running. psutil never signals a pid
reused by another process (it compares creation times).
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
from collections.abc import Iterator

import psutil

POLL_S = 0.5


@contextlib.contextmanager
def watching(roots: list[int]) -> Iterator[None]:
    """Inside: `roots` and their descendants are killed if this process dies. On leaving (this process ends the
    session itself), what is left of them is killed too."""
    watchdog = subprocess.Popen([sys.executable, __file__, *map(str, roots)], stdin=subprocess.PIPE,
                                start_new_session=True)  # fmt: skip
    try:
        yield
    finally:
        watchdog.stdin.close()
        watchdog.wait(timeout=30)


def children() -> set[int]:
    """The pids of this process's children."""
    return {child.pid for child in psutil.Process().children()}


def watch(roots: list[int]) -> None:
    """Record `roots` and their descendants until stdin closes, then kill those still running."""
    tracked = {pid: process for pid in roots if (process := _process(pid))}
    while not _closed(sys.stdin, POLL_S):
        for process in list(tracked.values()):
            try:
                tracked.update((child.pid, child) for child in process.children(recursive=True))
            except psutil.NoSuchProcess:
                del tracked[process.pid]
    for process in tracked.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _closed(stream, timeout: float) -> bool:
    """Whether `stream`, a pipe nobody writes to, has closed (it becomes readable only then)."""
    readable, _, _ = select.select([stream], [], [], timeout)
    return bool(readable)


if __name__ == "__main__":
    watch([int(pid) for pid in sys.argv[1:]])
