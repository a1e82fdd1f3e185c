"""The check of an estimate: compile the real train step on devices this process has and read the compiled
program's memory and collectives."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

import jax

from jaxtrain.analysis.comm_report import communication_report
from jaxtrain.run_config import RunConfig


@dataclasses.dataclass(frozen=True)
class Measured:
    """Figures of the compiled step: per-device argument bytes, the live-bytes bound (arguments + outputs - aliased
    + temporaries) and bytes each device sends per step per exact set of mesh axes."""

    platform: str
    arguments: float
    peak: float
    comm: Mapping[tuple[str, ...], float]


def measure(cfg: RunConfig, devices: Sequence[jax.Device]) -> Measured:
    """Compile the real train step of `cfg` on `devices` and read its memory and communication."""
    from jaxtrain.training.setup import build  # the runtime, only when a check is asked for

    run = build(cfg, log=lambda *_: None, devices=devices)
    compiled = run.train_step
    m = compiled.memory_analysis()
    comm: dict[tuple[str, ...], float] = collections.defaultdict(float)
    for row in communication_report(compiled, run.plan.mesh).rows:
        comm[row.axes] += row.mean
    live = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return Measured(devices[0].platform, m.argument_size_in_bytes, live, dict(comm))
