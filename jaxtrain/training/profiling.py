"""Profiler traces of chosen training steps, and a device memory profile when a step runs out of memory.

`tracking.profile_steps = "10:13"` (`--profile-steps 10:13`) traces steps 10, 11 and 12, numbered as the metrics number
them, with `jax.profiler` into `tracking.profile_dir` (`--profile-dir`), each step inside a `StepTraceAnnotation` named
"train" with its number. Open the directory with TensorBoard's profile plugin (`tensorboard --logdir DIR`) or XProf
(`xprof DIR`); `jax.profiler.ProfileData.from_file` reads the `.xplane.pb` it holds. The trace waits for the last
traced step's device work, so the steps' kernels and collectives are in it, not only their dispatch.

A step that runs out of device memory saves `jax.profiler.save_device_memory_profile` (pprof format: `pprof -http
:8080 FILE`) into the profile directory, else the checkpoint directory, else the working directory, and the error
names the file.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import jax

from jaxtrain.errors import ConfigError, UserInputError

T = TypeVar("T")
_STEPS = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


class DeviceMemoryError(UserInputError):
    """A training step needed more device memory than the devices have."""


def parse_profile_steps(text: str) -> range | None:
    """`"START:STOP"` -> the steps START..STOP-1 (1-based, as the metrics count them); "" -> None.

    >>> parse_profile_steps("10:13")
    range(10, 13)
    """
    if not text:
        return None
    match = _STEPS.match(text)
    if not match or not 1 <= int(match[1]) < int(match[2]):
        raise ConfigError(
            f"tracking.profile_steps={text!r}: expected START:STOP with 1 <= START < STOP, the steps START to STOP - 1 "
            "as the metrics number them, e.g. 10:13 for steps 10, 11 and 12."
        )
    return range(int(match[1]), int(match[2]))


def check_profile_settings(profile_steps: str, profile_dir: str) -> range | None:
    """The traced steps, after checking that a trace has somewhere to go."""
    steps = parse_profile_steps(profile_steps)
    if steps is not None and not profile_dir:
        raise ConfigError(
            f"tracking.profile_steps={profile_steps!r} needs tracking.profile_dir (--profile-dir): the directory the "
            "trace is written to."
        )
    return steps


class StepProfiler:
    """Runs each training step, tracing those in `steps` into `directory`."""

    def __init__(self, steps: range | None, directory: str | Path):
        self.steps, self.directory, self.tracing = steps or range(0), Path(directory), False

    def run(self, number: int, step: Callable[[], T]) -> T:
        """`step()`, which runs training step `number`; traced, and annotated, when `number` is one of the steps."""
        if number not in self.steps:
            return step()
        if not self.tracing:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.tracing = True
        with jax.profiler.StepTraceAnnotation("train", step_num=number):
            out = step()
            if number == self.steps[-1]:
                jax.block_until_ready(out)  # the device work of the traced steps belongs in the trace
        if number == self.steps[-1]:
            self.stop()  # after the annotation closes, or the trace would lose the last step's
        return out

    def stop(self) -> None:
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()


@contextlib.contextmanager
def step_profiler(steps: range | None, directory: str) -> Iterator[StepProfiler]:
    """A `StepProfiler` whose trace is written out however the loop ends (a preemption, an error, fewer steps)."""
    profiler = StepProfiler(steps, directory)
    try:
        yield profiler
    finally:
        profiler.stop()


def memory_profile_on_oom(step: int, directory: str | Path) -> Callable[[jax.errors.JaxRuntimeError], None]:
    """A handler for a failed step: if the error is an out-of-memory one, save a device memory profile into
    `directory` and raise `DeviceMemoryError` naming it; otherwise return (the caller re-raises)."""

    def handle(err: jax.errors.JaxRuntimeError) -> None:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if "RESOURCE_EXHAUSTED" not in reason:
            return
        process = f"_process{jax.process_index()}" if jax.process_count() > 1 else ""
        path = Path(directory) / f"device_memory_step{step}{process}.prof"
        path.parent.mkdir(parents=True, exist_ok=True)
        jax.profiler.save_device_memory_profile(str(path))
        raise DeviceMemoryError(
            f"step {step} ran out of device memory ({reason}). The device memory profile is in {path} "
            "(pprof -http :8080 FILE shows what held it). Plan the run first (jaxtrain plan) and try a smaller "
            "batch, grad_accum, remat=full or more fsdp."
        ) from None

    return handle
