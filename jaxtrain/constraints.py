"""The one sharding helper models may use: hint an activation's layout by logical names.

Outside `activation_sharding(...)` (a plain single-device run, a notebook without a mesh) `constrain` returns its
input untouched, so models stay runnable anywhere.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from jaxtrain.rules import ShardingRules, logical_to_spec

_ACTIVE: contextvars.ContextVar[tuple[Mesh, ShardingRules] | None] = contextvars.ContextVar(
    "jaxtrain_rules", default=None
)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: ShardingRules) -> Iterator[None]:
    """Make `constrain` map logical names through `rules.activations` onto `mesh` while tracing inside."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrain activation `x`, whose dims are called `names` (e.g. ("batch", "seq", "embed")), to the rules."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    # Inside a shard_map some axes are manual: each device already holds its own slice along them.
    abstract = jax.sharding.get_abstract_mesh()
    manual = set() if abstract.empty else set(abstract.manual_axes)
    table = {name: tuple(a for a in axes if a not in manual) for name, axes in rules.activations.items()}
    spec = logical_to_spec(names, x.shape, table, mesh, f"activation{tuple(names)}")
    if manual and all(axes is None for axes in spec):
        return x  # every remaining dim is whole on each device already
    return jax.lax.with_sharding_constraint(x, NamedSharding(abstract if manual else mesh, spec))
