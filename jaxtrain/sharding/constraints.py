"""The helpers models may use: hint an activation's layout by logical names, and run their stack of layers.

Outside `activation_sharding(...)` (a plain single-device run, a notebook without a mesh) `constrain` returns its
input untouched and `scan_layers` is a plain `lax.scan`, so models stay runnable anywhere. Under pipeline
parallelism the framework swaps the layer loop for a pipeline schedule (`layer_runner`); the model does not change.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from jaxtrain.sharding.rules import ShardingRules, logical_to_spec

_ACTIVE: contextvars.ContextVar[tuple[Mesh, ShardingRules] | None] = contextvars.ContextVar(
    "jaxtrain_rules", default=None
)


LayerFn = Callable[[jax.Array, Any], jax.Array]
LayerRunner = Callable[[LayerFn, jax.Array, Any], jax.Array]
_RUNNER: contextvars.ContextVar[LayerRunner | None] = contextvars.ContextVar("jaxtrain_layer_runner", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: ShardingRules) -> Iterator[None]:
    """Make `constrain` map logical names through `rules.activations` onto `mesh` while tracing inside."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, names: Sequence[str | None], *, like_params: bool = False) -> jax.Array:
    """Constrain activation `x`, whose dims are called `names` (e.g. ("batch", "seq", "embed")), to the rules.

    `like_params`: lay `x` out as a parameter with these dim names would be (e.g. a gradient).
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    abstract = jax.sharding.get_abstract_mesh()
    manual = _manual_axes()
    rule_table = rules.params if like_params else rules.activations
    table = {name: tuple(a for a in axes if a not in manual) for name, axes in rule_table.items()}
    spec = logical_to_spec(names, x.shape, table, mesh, f"activation{tuple(names)}")
    if manual and all(axes is None for axes in spec):
        return x  # every remaining dim is whole on each device already
    return jax.lax.with_sharding_constraint(x, NamedSharding(abstract if manual else mesh, spec))


def split_ways(name: str) -> int:
    """How many ways `constrain` splits an activation dim called `name` (1 outside `activation_sharding`): for
    kernels that keep one partial result per shard, e.g. a gradient summed over the batch only once at the end."""
    active = _ACTIVE.get()
    if active is None:
        return 1
    mesh, rules = active
    manual = _manual_axes()
    return math.prod(mesh.shape[axis] for axis in rules.activations.get(name, ()) if axis not in manual)


def _manual_axes() -> set[str]:
    """Inside a shard_map some axes are manual: each device already holds its own slice along them."""
    abstract = jax.sharding.get_abstract_mesh()
    return set() if abstract.empty else set(abstract.manual_axes)


@contextlib.contextmanager
def layer_runner(runner: LayerRunner | None) -> Iterator[None]:
    """Make `scan_layers` run layer stacks with `runner` (e.g. a pipeline schedule) while tracing inside."""
    token = _RUNNER.set(runner)
    try:
        yield
    finally:
        _RUNNER.reset(token)


def scan_layers(layer: LayerFn, x: jax.Array, stacked_params: Any) -> jax.Array:
    """x -> layer(x, params[0]) -> layer(., params[1]) ...: one layer per slice of the leading `layers` dim.

    Under pipeline parallelism the framework runs `layer` itself, on microbatches (rows of `x`, whose leading dim
    is the batch) and on each stage's slices of `stacked_params`. So pass the stacked params as they came from the
    module, and let `layer` close over constants only (e.g. rotary tables), never over batch-dependent values.
    """
    runner = _RUNNER.get()
    if runner is not None:
        return runner(layer, x, stacked_params)
    return jax.lax.scan(lambda h, params: (layer(h, params), None), x, stacked_params)[0]
