"""How many bytes each device sends per step, per mesh axis and collective kind, read from the compiled program
before anything runs: its collectives, their shapes, device groups and loop trip counts (see `jaxtrain.analysis.hlo`).

Bytes follow the bandwidth-optimal algorithm for each kind, with N devices in a group and B the array's bytes on one
device: all-reduce 2(N-1)/N·B (ring: reduce-scatter, then all-gather), all-gather (N-1)/N·result, reduce-scatter
(N-1)·result, all-to-all (N-1)/N·B. A collective-permute sends its operand from each source device only, so
per-device traffic can be uneven (a parameter server's hot spot); the report shows the busiest device. A windowed
einsum's gather or reduce-scatter counts what its permutes send; a send between TPU slices (DCN), its operand, which
the megascale runtime moves by an algorithm the program does not show.

    >>> report = communication_report(run.train_step, run.shardings.mesh)           # doctest: +SKIP
    >>> print(report.format([Expected("ring all-reduce of f32 gradients", 2 * 7 / 8 * param_bytes)]))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxtrain.analysis.hlo import DCN, Collective, collectives, devices_per_program
from jaxtrain.formatting import fmt_bytes, format_table

# Fraction of B (all-reduce, all-to-all) or of the result (all-gather, reduce-scatter) each member of an N-device
# group sends.
SEND_SHARE: dict[str, Callable[[int], float]] = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,
    "all-to-all": lambda n: (n - 1) / n,
}
# The busiest device is reported when it sends this much more than the mean.
_UNEVEN = 1.1


@dataclasses.dataclass(frozen=True)
class Traffic:
    """The collectives of one kind over one set of mesh axes: instructions in the program, their executions per
    step, and the bytes each device sends per step (indexed by position in `mesh.devices.flat`)."""

    axes: tuple[str, ...]
    kind: str
    ops: int
    executions: int
    sent: np.ndarray
    via: tuple[str, ...] = ()  # how the program does some of them when not as `kind` ops ("windowed einsum")

    @property
    def mean(self) -> float:
        return float(self.sent.mean())

    @property
    def max(self) -> float:
        return float(self.sent.max())


@dataclasses.dataclass(frozen=True)
class Expected:
    """An analytic expectation to print beside the measurement: `bytes` each device sends per step in the
    collectives over exactly `axes` (any axes when None) of `kinds` (any kind when empty)."""

    label: str
    bytes: float
    axes: tuple[str, ...] | None = None
    kinds: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class CommReport:
    """Bytes sent per device per step, one `Traffic` row per (mesh axes, collective kind)."""

    mesh: Mesh
    rows: tuple[Traffic, ...]
    uncounted: int = 0  # collectives in loops whose trip count the program does not say, counted once

    @property
    def per_device(self) -> np.ndarray:
        """Bytes each device (by mesh position) sends per step, over all collectives."""
        return sum((row.sent for row in self.rows), np.zeros(self.mesh.size))

    def measured(self, axes: Sequence[str] | None = None, kinds: Sequence[str] = ()) -> float:
        """Mean bytes per device per step of the collectives over exactly `axes` (any when None) of `kinds` (any
        when empty)."""
        return sum(row.mean for row in self.rows if _selects(row, axes, kinds))

    def format(self, expected: Sequence[Expected] = ()) -> str:
        """A table of ops, executions and bytes sent per device (mean and max) per axes x kind, a line naming the
        busiest device when it sends over 10% more than the mean, and each expectation beside its measurement."""
        title = "communication per step: bytes each device sends (bandwidth-optimal algorithms, from the compiled HLO)"
        if not self.rows:
            return f"{title}\n  none: the compiled program has no collectives"
        table = [("axes", "collective", "ops", "runs/step", "mean/device", "max/device")]
        table += [
            (" ".join(r.axes) or "-", _kind(r), str(r.ops), str(r.executions), fmt_bytes(r.mean), fmt_bytes(r.max))
            for r in self.rows
        ]
        total = self.per_device
        ops, runs = sum(r.ops for r in self.rows), sum(r.executions for r in self.rows)
        table.append(("total", "", str(ops), str(runs), fmt_bytes(total.mean()), fmt_bytes(total.max())))
        lines = [title, *(line.rstrip() for line in format_table(table))]
        if self.uncounted:
            lines.append(
                f"{self.uncounted} collectives run in loops whose trip count the program does not give: each is "
                "counted once per step, so these figures are a lower bound"
            )
        busiest = int(total.argmax())
        if total[busiest] > _UNEVEN * total.mean():
            lines.append(
                f"busiest device: {self._describe(busiest)} sends {fmt_bytes(total[busiest])}, "
                f"{total[busiest] / total.mean():.2f}x the mean"
            )
        for e in expected:
            got = self.measured(e.axes, e.kinds)
            axes = "any axes" if e.axes is None else " ".join(e.axes) or "-"
            where = f"{axes}, {'/'.join(e.kinds) or 'any collective'}"
            ratio = f"{got / e.bytes:.3f}" if e.bytes else "-"
            lines.append(
                f"expected {e.label}: {fmt_bytes(e.bytes)}; measured ({where}) {fmt_bytes(got)}; ratio {ratio}"
            )
        return "\n".join(lines)

    def _describe(self, position: int) -> str:
        """'id 3 (data=1 fsdp=0)': a device's id and its coordinates on the mesh axes larger than 1."""
        coords = np.unravel_index(position, self.mesh.devices.shape)
        live = [f"{a}={int(c)}" for a, c, n in zip(self.mesh.axis_names, coords, self.mesh.devices.shape) if n > 1]
        return f"id {self.mesh.devices.flat[position].id} ({' '.join(live)})"


def _kind(row: Traffic) -> str:
    """'all-gather', or 'all-gather (windowed einsum)' when the program does some of them another way."""
    return f"{row.kind} ({', '.join(row.via)})" if row.via else row.kind


def _selects(row: Traffic, axes: Sequence[str] | None, kinds: Sequence[str]) -> bool:
    return (axes is None or set(row.axes) == set(axes)) and (not kinds or row.kind in kinds)


def axes_of_group(mesh: Mesh, group: Sequence[int]) -> tuple[str, ...]:
    """The mesh axes along which the devices at positions `group` (indices into `mesh.devices.flat`) differ, in
    mesh order: on data=2,fsdp=4, positions 0-3 differ only in fsdp."""
    coords = np.unravel_index(np.asarray(group, dtype=int), mesh.devices.shape)
    return tuple(a for a, c in zip(mesh.axis_names, coords) if len(np.unique(c)) > 1)


def sent_per_device(collective: Collective, devices: int) -> np.ndarray:
    """Bytes each of `devices` (by device index in the program) sends in one execution of `collective`."""
    sent = np.zeros(devices)
    for source, target in collective.pairs:
        sent[source] += collective.bytes if source != target else 0  # a device's copy to itself crosses no link
    for group in collective.groups:
        # What crosses slices is handed to the megascale runtime whole; its algorithm is not in the program.
        share = 1 if collective.via == DCN else SEND_SHARE[collective.kind](len(group))
        sent[list(group)] += collective.bytes * share
    return sent


def communication_report(compiled: jax.stages.Compiled, mesh: Mesh) -> CommReport:
    """Bytes each device of `mesh` sends per call of `compiled` (a training step), per mesh axes and kind."""
    positions, text = _mesh_positions(compiled, mesh), compiled.as_text()
    found = collectives(text, [d.id for d in program_devices(compiled)])
    per_slice = devices_per_program(text)
    rows: dict[tuple[tuple[str, ...], str], Traffic] = {}
    for c in found:
        c = _in_every_slice(c, per_slice, len(positions) // per_slice) if c.via != DCN else c
        sent = np.zeros(mesh.size)
        sent[positions] = sent_per_device(c, len(positions)) * c.executions
        groups = c.groups or c.pairs
        axes = set().union(*(axes_of_group(mesh, positions[list(g)]) for g in groups))
        key = (tuple(a for a in mesh.axis_names if a in axes), c.kind)
        row = rows.get(key, Traffic(*key, 0, 0, np.zeros(mesh.size)))
        via = tuple(sorted({*row.via, c.via} - {""}))
        rows[key] = Traffic(*key, row.ops + 1, row.executions + c.executions, row.sent + sent, via)
    ordered = tuple(sorted(rows.values(), key=lambda r: (-r.mean, r.axes, r.kind)))
    return CommReport(mesh, ordered, sum(not c.exact for c in found))


def _in_every_slice(c: Collective, per_slice: int, slices: int) -> Collective:
    """A collective of a multi-slice TPU program, which each slice runs on its own devices: its groups and pairs in
    every slice (slice s's devices come after slice s-1's in the program's device order)."""
    if slices <= 1:
        return c
    shifts = [s * per_slice for s in range(slices)]
    groups = tuple(tuple(d + shift for d in g) for shift in shifts for g in c.groups)
    pairs = tuple((a + shift, b + shift) for shift in shifts for a, b in c.pairs)
    return dataclasses.replace(c, groups=groups, pairs=pairs)


def program_devices(compiled: jax.stages.Compiled) -> tuple[jax.Device, ...]:
    """The devices of `compiled` in the order its collectives number them: its device assignment.

    jax.jit compiles for one device assignment, which every sharding of the program's inputs and outputs shares (jit
    refuses shardings that order the same devices differently), so it is read from those. That works alike for CPU,
    GPU and TPU programs, for compile-only devices (whose executables cannot list their devices) and for the
    global devices of a multi-process run."""
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    return max((tuple(s._device_assignment) for s in shardings), key=len, default=())


def _mesh_positions(compiled: jax.stages.Compiled, mesh: Mesh) -> np.ndarray:
    """The mesh position (index into `mesh.devices.flat`) of each device index the program's collectives use."""
    program = program_devices(compiled)
    if len(program) <= 1:  # nothing says otherwise: jit assigns the mesh's devices in order
        return np.arange(mesh.size)
    position = {d.id: i for i, d in enumerate(mesh.devices.flat)}
    if missing := [d.id for d in program if d.id not in position]:
        raise ValueError(f"the compiled program runs on devices {missing}, which are not in the mesh")
    return np.array([position[d.id] for d in program])
