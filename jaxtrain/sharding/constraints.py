"""The helpers models may use: hint an activation's layout by logical names, run a kernel per device, and run
their stack of layers.

Outside `activation_sharding(...)` (a plain single-device run, a notebook without a mesh) `constrain` returns its
input untouched, `per_device` calls its kernel on the whole arrays and `scan_layers` is a plain `lax.scan`, so
models stay runnable anywhere. Under pipeline parallelism the framework swaps the layer loop for a pipeline
schedule (`layer_runner`); the model does not change.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxtrain.sharding.rules import ShardingRuleError, ShardingRules, logical_to_spec

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
    placed = _placement(names, x.shape, like_params=like_params)
    if placed is None:
        return x
    mesh, spec, manual = placed
    if manual and all(axes is None for axes in spec):
        return x  # every remaining dim is whole on each device already
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def active_placement() -> tuple[Mesh, ShardingRules] | None:
    """The (mesh, rules) `activation_sharding` made active, or None: for a kernel whose backward pass may be traced
    after the forward's `activation_sharding` block has closed, to lay it out alike."""
    return _ACTIVE.get()


def active_mesh() -> Mesh | None:
    """The mesh `activation_sharding` made active, or None outside it (e.g. to ask which platform it is on)."""
    active = _ACTIVE.get()
    return None if active is None else active[0]


def active_platform() -> str:
    """The platform the program is being built for (cpu, gpu, tpu): the active mesh's devices (maybe compile-only),
    else JAX's. The planner traces on an abstract mesh, which has no devices: there JAX's backend (where the plan
    is made)."""
    mesh = active_mesh()
    platform = mesh.devices.flat[0].platform if isinstance(mesh, Mesh) else jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def activation_spec(names: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec | None:
    """The PartitionSpec the activation rules give an array of `shape` whose dims are `names`; None without a mesh.

    E.g. to ask whether two arrays' dims are split alike before a per-device kernel pairs their slices.
    """
    placed = _placement(names, shape)
    return None if placed is None else placed[1]


def per_device(
    fn: Callable[..., jax.Array],
    in_names: Sequence[Sequence[str | None]],
    out_names: Sequence[str | None] | list[Sequence[str | None]],
) -> Callable[..., Any]:
    """`fn` run on each device's slices, inside `jax.shard_map` over the active mesh: for kernels that need
    per-device shapes (a Pallas or cuDNN attention kernel).

    Argument i is split as its dim names `in_names[i]` map through the activation rules (a dim named None stays
    whole on every device); the result is split as `out_names`, each of which must name a dim of some argument (a
    list of such tuples: `fn` returns a tuple of results, split as each says). Outside `activation_sharding(...)`
    the returned function calls `fn` on the whole arrays.

        >>> kernel = per_device(fn, [("batch", None, "heads", None)], ("batch", None, "heads", None))  # doctest: +SKIP
    """

    def call(*args: jax.Array) -> jax.Array:
        if _ACTIVE.get() is None:
            return fn(*args)
        placed = [_placement(names, x.shape) for names, x in zip(in_names, args, strict=True)]
        by_name = {n: entry for names, (_, spec, _) in zip(in_names, placed) for n, entry in zip(names, spec) if n}
        several = isinstance(out_names, list)
        outputs = out_names if several else [out_names]
        unknown = [n for names in outputs for n in names if n is not None and n not in by_name]
        if unknown:
            raise ShardingRuleError(f"per_device: output dims {unknown} name no dim of the arguments {in_names}.")
        specs = tuple(PartitionSpec(*(by_name[n] if n else None for n in names)) for names in outputs)
        mesh, _, manual = placed[0]
        return jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=tuple(spec for _, spec, _ in placed),
            out_specs=specs if several else specs[0],
            axis_names=set(mesh.axis_names) - manual,
            # Kernels are custom calls (Pallas, cuDNN) whose outputs carry no varying-axes type to check.
            check_vma=False,
        )(*args)

    return call


def _placement(
    names: Sequence[str | None], shape: Sequence[int], *, like_params: bool = False
) -> tuple[Mesh | AbstractMesh, PartitionSpec, set[str]] | None:
    """(mesh, spec, manual axes) for an activation of `shape` whose dims are `names`; None when no mesh is active.

    Inside a shard_map some axes are manual: each device already holds its own slice along them, so the spec
    leaves them out and refers to the shard_map's abstract mesh.
    """
    active = _ACTIVE.get()
    if active is None:
        return None
    mesh, rules = active
    abstract = jax.sharding.get_abstract_mesh()
    manual = _manual_axes()
    rule_table = rules.params if like_params else rules.activations
    table = {name: tuple(a for a in axes if a not in manual) for name, axes in rule_table.items()}
    spec = logical_to_spec(names, shape, table, mesh, f"activation{tuple(names)}")
    return (abstract if manual else mesh), spec, manual


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
