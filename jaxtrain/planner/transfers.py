"""The collectives of a planned step: what each device sends per step, per kind and set of mesh axes.

An estimate describes the accelerator's compiler (TPU, GPU). XLA:CPU, on which an estimate can be checked with
simulated devices, moves some of the same data differently; each transfer says how where it differs, and `on_cpu`
gives that version.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One kind of collective over one set of mesh axes: `bytes` each device sends per step, and why; `cpu`: (kind,
    bytes) as XLA:CPU moves the same data where that differs, None where it is the same or the generic rule of
    `on_cpu` applies."""

    axes: tuple[str, ...]
    kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    bytes: float
    what: str
    cpu: tuple[str, float] | None = None

    def on_cpu(self) -> Transfer:
        """As XLA:CPU does it: `cpu` where given (it casts no weights to the compute dtype before gathering them or
        reducing their gradients); otherwise, having no reduce-scatter, it all-reduces the whole array (twice the
        bytes of a reduce-scatter: 2(N-1)/N of N shards instead of (N-1) shards) and each device keeps its shard."""
        if self.cpu is not None:
            kind, sent = self.cpu
            return dataclasses.replace(self, kind=kind, bytes=sent, cpu=None)
        if self.kind != "reduce-scatter":
            return self
        return dataclasses.replace(self, kind="all-reduce", bytes=2 * self.bytes)


def merge_transfers(transfers: Sequence[Transfer]) -> tuple[Transfer, ...]:
    """One row per (axes, kind, what, kind on CPU), largest first; rows that send nothing anywhere are dropped."""
    total: dict[tuple, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for t in transfers:
        cpu = t.on_cpu()
        sums = total[(t.axes, t.kind, t.what, cpu.kind if t.cpu else None)]
        sums[0] += t.bytes
        sums[1] += cpu.bytes
    rows = [
        Transfer(axes, kind, sent, what, (cpu_kind, on_cpu) if cpu_kind else None)
        for (axes, kind, what, cpu_kind), (sent, on_cpu) in total.items()
        if sent > 0 or on_cpu > 0
    ]
    return tuple(sorted(rows, key=lambda t: -t.bytes))


def comm_by_axes(transfers: Sequence[Transfer]) -> dict[tuple[str, ...], float]:
    """Bytes each device sends per step, summed over collective kinds, per exact set of mesh axes."""
    out: dict[tuple[str, ...], float] = collections.defaultdict(float)
    for t in transfers:
        out[t.axes] += t.bytes
    return dict(out)
