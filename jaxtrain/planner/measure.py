"""The check of an estimate: compile the real train step on devices this process has, or on compile-only devices of
a TPU topology or GPU node (`jaxtrain.aot.targets`), and read the compiled program's memory and collectives."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import jax

from jaxtrain.analysis.comm_report import communication_report
from jaxtrain.errors import UserInputError
from jaxtrain.run_config import RunConfig

if TYPE_CHECKING:
    from jaxtrain.training.setup import Run

CACHE_HIT = "/jax/compilation_cache/cache_hits"  # JAX's event for a program read from its persistent cache


class CompilerRefused(UserInputError):
    """The compiler refused the step for the devices' memory, as XLA:TPU does for a program larger than the chip's
    HBM: the run does not fit as configured (bad input, like a batch too big)."""

    def __init__(self, platform: str, devices: str, seconds: float, reason: str):
        self.platform, self.seconds, self.reason = platform, seconds, reason
        super().__init__(
            f"the {platform.upper()} compiler refused the train step on {devices} after {seconds:.1f} s: {reason}"
        )


@dataclasses.dataclass(frozen=True)
class Measured:
    """Figures of the compiled step, per device, as the compiler's `memory_analysis()` gives them, bytes each device
    sends per step per exact set of mesh axes, and how long the compile took."""

    platform: str
    arguments: float
    outputs: float
    aliased: float  # outputs written into donated arguments' buffers
    temporaries: float
    xla_peak: float  # XLA's own peak estimate (0 where the backend gives none)
    comm: Mapping[tuple[str, ...], float]
    compile_s: float
    cached: bool  # read back from JAX's persistent compilation cache, not compiled
    # In host memory, apart from the figures above (TPU and GPU; on CPU the two memories are one and count there):
    # arguments (an offloaded optimizer state) and temporaries (offloaded activations).
    host_arguments: float = 0.0
    host_temporaries: float = 0.0

    @property
    def peak(self) -> float:
        """The live-bytes bound the fit is judged on: arguments + outputs - aliased + temporaries, all that the
        runtime allocates for one step (the temporaries are one buffer of that size)."""
        return self.arguments + self.outputs - self.aliased + self.temporaries


def measure(cfg: RunConfig, devices: Sequence[jax.Device]) -> Measured:
    """Compile the real train step of `cfg` on `devices` (real, simulated or compile-only) and read its memory and
    communication. Raises CompilerRefused when the compiler refuses it for the devices' memory."""
    from jaxtrain.training.setup import build  # the runtime, only when a check is asked for

    return measure_run(build(cfg, log=lambda *_: None, devices=devices))


def measure_run(run: Run) -> Measured:
    """`measure` of a run already built: compiles its train step (kept on the run) and reads it."""
    seconds, cached = compile_train_step(run)
    compiled = run.train_step
    m = compiled.memory_analysis()
    comm: dict[tuple[str, ...], float] = collections.defaultdict(float)
    for row in communication_report(compiled, run.shardings.mesh).rows:
        comm[row.axes] += row.mean
    return Measured(
        run.shardings.mesh.devices.flat[0].platform,
        arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes,
        aliased=m.alias_size_in_bytes,
        temporaries=m.temp_size_in_bytes,
        xla_peak=getattr(m, "peak_memory_in_bytes", 0),
        comm=dict(comm),
        compile_s=seconds,
        cached=cached,
        host_arguments=getattr(m, "host_argument_size_in_bytes", 0),
        host_temporaries=getattr(m, "host_temp_size_in_bytes", 0),
    )


def compile_train_step(run: Run) -> tuple[float, bool]:
    """Compile `run.train_step` (kept on the run); the seconds it took and whether JAX's persistent compilation
    cache supplied it. Raises CompilerRefused, with the compiler's message, when it runs out of device memory."""
    devices = list(run.shardings.mesh.devices.flat)
    hits = []

    def on_event(event: str, **_) -> None:
        if event == CACHE_HIT:
            hits.append(event)

    jax.monitoring.register_event_listener(on_event)
    start = time.perf_counter()
    try:
        run.train_step  # noqa: B018 - a cached property: this compiles
    except jax.errors.JaxRuntimeError as err:
        reason = str(err).splitlines()[0]
        if "RESOURCE_EXHAUSTED" not in reason or "hbm" not in reason.lower():
            raise
        where = f"{len(devices)} {devices[0].device_kind} devices"
        raise CompilerRefused(devices[0].platform, where, time.perf_counter() - start, reason) from None
    finally:
        jax.monitoring.unregister_event_listener(on_event)
    return time.perf_counter() - start, bool(hits)
