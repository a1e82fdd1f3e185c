"""Who computes which batch on which params, and when: the asynchronous engine's bookkeeping, without Ray.

The server's version is the number of updates it has applied. A worker holds params of some version; a job is one
batch (a global batch index: rows are a pure function of (seed, split, index), as in SPMD training) computed on the
params the worker holds, or on fresh ones it pulls first. A gradient read at version v and applied when the server is
at version V has staleness V - v.

- `async`: every gradient is one update, applied on arrival. Batches go to whichever worker asks next, so a fast
  worker takes more of them (load balancing). With `max_staleness` = s >= 0 a worker waits instead of starting a
  job that could make some gradient, its own or one in flight, older than s when applied: each in-flight job may land
  before any other, so a job read at v stays within the bound while (V - v) + (jobs in flight besides it) <= s.
- `sync`: each update is the mean of one gradient from every worker, all read at the same version (the lockstep
  baseline, on the same processes).

Every applied gradient is a row of the batch log (`Applied`): which update, which batch, which worker, read at which
version. The data order of a run is that log: replaying its rows in order reproduces the updates.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class Job:
    worker: int
    batch: int
    read_version: int  # the version of the params the gradient is computed on
    pull: bool  # fetch the newest params first (else the worker's own are of read_version already)


@dataclasses.dataclass(frozen=True)
class Applied:
    """A row of the batch log: the gradient of `batch`, computed by `worker` on params of `read_version`, went into
    update `update` (the server's version after it, from 1)."""

    update: int
    batch: int
    worker: int
    read_version: int

    @property
    def staleness(self) -> int:
        return self.update - 1 - self.read_version


class Dispatcher:
    """Hands out jobs and records what was applied. `version`, `next_batch` and `requeued` restore a checkpoint's
    position: batches handed out but never applied (in flight at the save, or a dead worker's) go out again first."""

    def __init__(
        self,
        workers: int,
        mode: str = "async",
        max_staleness: int = -1,
        pull_every: int = 1,
        version: int = 0,
        next_batch: int = 0,
        requeued: Iterable[int] = (),
    ):
        self.workers, self.mode, self.max_staleness, self.pull_every = workers, mode, max_staleness, pull_every
        self.version, self.next_batch = version, next_batch
        self.requeued = collections.deque(requeued)
        self.in_flight: dict[int, Job] = {}
        self.held: dict[int, int | None] = dict.fromkeys(range(workers))  # the version of each worker's params
        self.since_pull = dict.fromkeys(range(workers), 0)
        self.round: list[Job] = []  # sync: the jobs of the update being gathered, done
        self.log: list[Applied] = []

    def assign(self, worker: int) -> Job | None:
        """The next job of idle `worker`, or None if it must wait (bounded staleness; sync: the round's others)."""
        if worker in self.in_flight:
            raise ValueError(f"worker {worker} already has a job: {self.in_flight[worker]}")
        pull = self.held[worker] is None or self.since_pull[worker] >= self.pull_every
        if self.mode == "sync":
            if any(job.worker == worker for job in self.round):
                return None
            pull = True  # every worker of a round computes on the same params
        elif self.max_staleness >= 0:
            if not pull and self.version - self.held[worker] + len(self.in_flight) > self.max_staleness:
                pull = True  # its own params are too old for the bound: fresh ones may fit it
            if not self._within_bound(0 if pull else self.version - self.held[worker]):
                return None
        read = self.version if pull else self.held[worker]
        batch = self.requeued.popleft() if self.requeued else self._new_batch()
        job = self.in_flight[worker] = Job(worker, batch, read, pull)
        self.held[worker] = read
        self.since_pull[worker] = 1 if pull else self.since_pull[worker] + 1
        return job

    def _within_bound(self, new_age: int) -> bool:
        """Whether a new job whose params are `new_age` updates old keeps every job within `max_staleness`."""
        others = len(self.in_flight)  # each may be applied before the new job, and the new job before each
        if new_age + others > self.max_staleness:
            return False
        return all(self.version - job.read_version + others <= self.max_staleness for job in self.in_flight.values())

    def _new_batch(self) -> int:
        self.next_batch += 1
        return self.next_batch - 1

    def complete(self, worker: int) -> list[Applied]:
        """`worker`'s gradient arrived. Returns the rows of the update it completes, to apply now as one update (the
        mean of their gradients): async one row; sync every worker's once the last arrives, else none yet."""
        job = self.in_flight.pop(worker)
        if self.mode == "sync":
            self.round.append(job)
            if len(self.round) < self.workers:
                return []
            jobs, self.round = sorted(self.round, key=lambda j: j.batch), []
        else:
            jobs = [job]
        self.version += 1
        rows = [Applied(self.version, j.batch, j.worker, j.read_version) for j in jobs]
        self.log.extend(rows)
        return rows

    def drop(self, worker: int) -> Job | None:
        """`worker` died: its job's batch goes out again first, and its replacement starts with no params. In sync,
        its gradient of the round is lost too: the round waits for the replacement's."""
        job = self.in_flight.pop(worker, None)
        self.round = [j for j in self.round if j.worker != worker]
        lost = [job.batch] if job else []
        self.requeued.extendleft(sorted(lost, reverse=True))
        self.held[worker], self.since_pull[worker] = None, 0
        return job

    def unapplied(self) -> list[int]:
        """Batches handed out and not yet applied (in flight, gathered in a sync round, or waiting to go out again),
        in batch order: what a checkpoint taken now must hand out again on resume."""
        return sorted([*self.requeued, *(j.batch for j in self.in_flight.values()), *(j.batch for j in self.round)])


def staleness_report(rows: list[Applied], workers: int) -> dict[str, object]:
    """Staleness of the applied gradients (mean, max, a histogram) and the updates each worker contributed."""
    ages = [row.staleness for row in rows]
    per_worker = collections.Counter(row.worker for row in rows)
    return {
        "staleness_mean": sum(ages) / len(ages) if ages else 0.0,
        "staleness_max": max(ages, default=0),
        "staleness_histogram": dict(sorted(collections.Counter(ages).items())),
        "gradients_per_worker": [per_worker[w] for w in range(workers)],
    }
