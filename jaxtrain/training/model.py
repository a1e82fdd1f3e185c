"""A model split for functional use: its graph, abstract params and each parameter's logical dimension names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxtrain.errors import UserInputError

PyTree = Any


class PlanError(UserInputError):
    """A model, batch or rule set that cannot be laid out on the mesh."""


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """A model split for functional use: its graph, abstract params and each param's logical dim names."""

    graphdef: Any
    abstract_params: PyTree  # pure dict of jax.ShapeDtypeStruct
    logical_names: PyTree  # same structure, tuples of names
    build: Callable[[nnx.Rngs], nnx.Module]

    def loss_fn(self, params: PyTree, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        return nnx.merge(self.graphdef, params).loss(batch)

    def init_params(self, seed: int) -> PyTree:
        with nnx.use_eager_sharding(False):  # shardings come from the plan, not from Flax's eager annotation
            return nnx.to_pure_dict(nnx.state(self.build(nnx.Rngs(seed)), nnx.Param))


def split_model(build: Callable[[nnx.Rngs], nnx.Module]) -> ModelParts:
    """Trace `build` abstractly (no memory) and read each parameter's logical names from its metadata."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract, nnx.Param)
    names: dict = {}
    for path, variable in nnx.to_flat_state(state):
        logical = variable.get_metadata().get("out_sharding")
        if logical is None:
            raise PlanError(
                f"parameter '{path_str(path)}' has no logical axis names. Create it with "
                "nnx.Param(value, out_sharding=(...)) so the rules can place it."
            )
        _set_path(names, path, tuple(logical))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
    return ModelParts(graphdef, params, names, build)


def _set_path(tree: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def path_str(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
