"""The collectives of a planned step: what each device sends per step, per kind and set of mesh axes."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One kind of collective over one set of mesh axes: `bytes` each device sends per step, and why."""

    axes: tuple[str, ...]
    kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    bytes: float
    what: str

    def on_cpu(self) -> Transfer:
        """As XLA:CPU does it: it has no reduce-scatter, so it all-reduces the whole array (twice the bytes of
        a reduce-scatter: 2(N-1)/N of N shards instead of (N-1) shards) and each device keeps its shard."""
        if self.kind != "reduce-scatter":
            return self
        return dataclasses.replace(self, kind="all-reduce", bytes=2 * self.bytes)


def merge_transfers(transfers: Sequence[Transfer]) -> tuple[Transfer, ...]:
    """One row per (axes, kind, what), largest first."""
    total: dict[tuple, float] = collections.defaultdict(float)
    for t in transfers:
        total[(t.axes, t.kind, t.what)] += t.bytes
    rows = [Transfer(axes, kind, b, what) for (axes, kind, what), b in total.items() if b > 0]
    return tuple(sorted(rows, key=lambda t: -t.bytes))


def comm_by_axes(transfers: Sequence[Transfer]) -> dict[tuple[str, ...], float]:
    """Bytes each device sends per step, summed over collective kinds, per exact set of mesh axes."""
    out: dict[tuple[str, ...], float] = collections.defaultdict(float)
    for t in transfers:
        out[t.axes] += t.bytes
    return dict(out)
