"""State that belongs to parameters (optimizer moments, factored statistics): which parameter each array belongs to,
and the sharding it inherits from it.

An optimizer's state holds copies of the parameter tree (Adam's `mu` and `nu`, Muon's momentum, Adafactor's
`v_row`/`v_col`/`v`), often beside scalars (step counts) and inside wrappers (`optax.partition`'s masked states). An
array of the state belongs to the parameter whose tree path ends its own path: `[0].mu['blocks']['w_in']` belongs to
`['blocks']['w_in']`. It may have its parameter's shape, or the shape with some dims dropped (Adafactor's factored
second moments); it then keeps the mesh axes of the dims that remain:

>>> spec_for_state((2, 64, 256), PartitionSpec(None, "fsdp", "tensor"), (2, 256))
P(None, 'tensor')

`optax.tree_map_params` does the matching by calling the optimizer's `init` on a placeholder instead of arrays,
which optimizers that read their parameters' shapes when they start (Adafactor, Muon) refuse.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PyTree = Any


def map_like_params(
    f: Callable[..., Any], state: PyTree, params: PyTree, *param_trees: PyTree, other: Callable[[Any], Any]
) -> PyTree:
    """`state` with each array that belongs to a parameter replaced by `f(array, param, *values)`, where `values` are
    that parameter's entries in `param_trees` (trees with the structure of `params`, or a prefix of it: e.g. logical
    names, whose leaves are tuples); every other leaf by `other(leaf)`."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    by_path = {
        tuple(path): (param, *values)
        for (path, param), *values in zip(flat, *(treedef.flatten_up_to(tree) for tree in param_trees))
    }

    def one(path: tuple, leaf: Any) -> Any:
        for start in range(len(path)):  # the longest parameter path that ends this array's path
            if (owner := by_path.get(tuple(path[start:]))) is not None:
                return f(leaf, *owner)
        return other(leaf)

    return jax.tree_util.tree_map_with_path(one, state)


def kept_dims(param_shape: tuple[int, ...], state_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every way `state_shape` is `param_shape` with some dims dropped (none, or the reduced dims of a factored
    statistic), each as the parameter dim of every state dim. Empty where the shapes are unrelated."""
    return [
        dims
        for dims in itertools.combinations(range(len(param_shape)), len(state_shape))
        if all(param_shape[d] == size for d, size in zip(dims, state_shape))
    ]


def spec_for_state(
    param_shape: tuple[int, ...], param_spec: PartitionSpec, state_shape: tuple[int, ...]
) -> PartitionSpec:
    """The spec of a state array of `state_shape` that belongs to a parameter of `param_shape` sharded as
    `param_spec`: each dim keeps its parameter dim's mesh axes. A dim whose parameter dim is ambiguous (a square
    matrix's row or column statistic) is replicated unless every reading gives it the same axes; an array of a shape
    unrelated to its parameter's (a placeholder such as Adafactor's unused `(1,)`) is replicated whole."""
    spec = tuple(param_spec) + (None,) * (len(param_shape) - len(param_spec))
    readings = kept_dims(param_shape, state_shape)
    if not readings:
        return PartitionSpec()
    per_dim = [{spec[dims[i]] for dims in readings} for i in range(len(state_shape))]
    return PartitionSpec(*(next(iter(axes)) if len(axes) == 1 else None for axes in per_dim))


def shardings_like_params(state: PyTree, params: PyTree, param_shardings: PyTree, mesh: Mesh) -> PyTree:
    """A `NamedSharding` for every leaf of `state` (abstract or concrete): an array that belongs to a parameter is
    sharded like it (`spec_for_state`), everything else (counts, coefficients) is replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return map_like_params(
        lambda x, param, sharding: NamedSharding(mesh, spec_for_state(param.shape, sharding.spec, x.shape)),
        state,
        params,
        param_shardings,
        other=lambda _: replicated,
    )
