"""Stragglers in synchronous SPMD runs: each process times its own work per step (building its part of the batch,
dispatching the step, and a simulated slowdown), and at every logged step the processes compare: one far above
the others is named in the log. In lockstep the step time is the slowest process's for everyone, so the step time
alone cannot say who is slow; each process's own share of it can.

A slower node is simulated with `engine.slow_workers=I:FACTOR` (`--slow-worker`): process I waits after each step
until the step took FACTOR times as long as its own device work did, without taking the machine's cores.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtrain.errors import UserInputError

# A process is named when its own time per step is this many times the median of the others', and at least this much
# longer: a few milliseconds of difference is noise.
STRAGGLER_RATIO = 1.5
STRAGGLER_MIN_S = 0.005


class StepTimes:
    """This process's own time per step, since the last logged step, and the check across processes."""

    def __init__(self, slowdowns: dict[int, float], log: Callable[[str], None]):
        index, count = jax.process_index(), jax.process_count()
        beyond = sorted(i for i in slowdowns if i >= count)
        if beyond:
            raise UserInputError(
                f"engine.slow_workers names process {beyond[0]}, but the job has {count} process"
                f"{'es' if count > 1 else ''} (0..{count - 1}): slow one of those."
            )
        self.slowdown, self.log = slowdowns.get(index, 1.0), log
        self.own_s, self.steps = 0.0, 0

    @contextlib.contextmanager
    def own(self) -> Iterator[None]:
        """Inside: work of this process alone (counted)."""
        start = time.perf_counter()
        yield
        self.own_s += time.perf_counter() - start

    def stepped(self, metrics: Any) -> None:
        """A step was dispatched. A slowed process waits for it, then FACTOR - 1 times as long again."""
        self.steps += 1
        if self.slowdown > 1:
            with self.own():
                start = time.perf_counter()
                jax.block_until_ready(metrics)
                time.sleep((self.slowdown - 1) * (time.perf_counter() - start))

    def check(self, step: int) -> None:
        """Compare the processes' own time per step since the last check (a collective: every process calls it at the
        same steps) and name a straggler in the log."""
        if jax.process_count() == 1 or not self.steps:
            return
        mine = np.array([self.own_s / self.steps])
        per_process = [float(t) for t in np.ravel(multihost_utils.process_allgather(mine))]
        self.own_s, self.steps = 0.0, 0
        slowest = int(np.argmax(per_process))
        others = statistics.median(t for i, t in enumerate(per_process) if i != slowest)
        if per_process[slowest] > STRAGGLER_RATIO * others and per_process[slowest] - others > STRAGGLER_MIN_S:
            self.log(
                f"straggler at step {step}: process {slowest} takes {per_process[slowest] * 1e3:.0f} ms of its own per "
                f"step, the others {others * 1e3:.0f} ms (median); every step waits for it"
            )
