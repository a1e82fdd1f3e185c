"""A model split for functional use: its graph, abstract params and each parameter's logical dimension names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxtrain.errors import UserInputError

PyTree = Any
Objective = Callable[[nnx.Module, "nnx.Module | None", dict[str, jax.Array]], tuple[jax.Array, dict]]


class PlacementError(UserInputError):
    """A model, batch or rule set that cannot be laid out on the mesh."""


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """A model split for functional use: its graph, abstract params and each param's logical dim names."""

    graphdef: Any
    abstract_params: PyTree  # pure dict of jax.ShapeDtypeStruct
    logical_names: PyTree  # same structure, tuples of names
    build: Callable[[nnx.Rngs], nnx.Module]
    # What the run trains the model for, in place of its own `loss`: (module, reference module or None, batch) ->
    # (loss, metrics), e.g. a preference loss (`jaxtrain.posttrain.preference`). None: the model's loss.
    objective: Objective | None = None
    # Low-precision matmuls on chosen weights (`jaxtrain.placement.precision.Precision`); None: as the model has them.
    precision: Any = None

    def module(self, params: PyTree) -> nnx.Module:
        """The model with `params` (e.g. to call it for logits, or to generate)."""
        return nnx.merge(self.graphdef, self.reading(params))

    def reading(self, params: PyTree) -> PyTree:
        """`params` as the model reads them: with low-precision matmuls, each chosen weight stands in a
        `jaxtrain.placement.precision.LowPrecision`."""
        return params if self.precision is None else self.precision.reading(params)

    def reference_module(self, params: PyTree) -> nnx.Module | None:
        """The frozen model an objective compares the trained one with, from the same `params`: a model with
        adapters has it (the adapters switched off); here None, and the batch carries the reference's outputs."""
        return None

    def loss_fn(self, params: PyTree, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        return self._loss(self.module(params), params, batch)

    def training_loss_fn(self, params: PyTree, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        """The loss a train step differentiates: `loss_fn`, unless the params train with dropout (adapters')."""
        return self.loss_fn(params, batch)

    def _loss(self, module: nnx.Module, params: PyTree, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        if self.objective is None:
            return module.loss(batch)
        return self.objective(module, self.reference_module(params), batch)

    def init_params(self, seed: int, base: PyTree | None = None) -> PyTree:
        """The params at initialisation with `seed`; `base`: the model's own params to start from instead (a
        checkpoint's, to fine-tune), which a model with adapters wraps (`jaxtrain.posttrain.adapters`)."""
        if base is not None:
            return base
        with nnx.use_eager_sharding(False):  # shardings come from `Shardings`, not from Flax's eager annotation
            return nnx.to_pure_dict(nnx.state(self.build(nnx.Rngs(seed)), nnx.Param))

    @property
    def freezes(self) -> bool:
        """Whether some params are frozen (no gradient, no optimizer state): see `trainable`."""
        return False

    def trainable(self, params: PyTree) -> PyTree:
        """The part of `params` (or of any tree shaped like them: names, shardings) that trains, which gradients and
        the optimizer state cover: all of it here; a model with adapters picks the adapters."""
        return params

    def base_params(self, params: PyTree) -> PyTree:
        """`params` as the model without adapters has them (what a checkpoint to fine-tune from holds)."""
        return params


def split_model(build: Callable[[nnx.Rngs], nnx.Module], replicate_unnamed: bool = False) -> ModelParts:
    """Trace `build` abstractly (no memory) and read each parameter's logical names from its metadata.

    A parameter without names is a `PlacementError` naming it, unless `replicate_unnamed`: then every device keeps the
    whole of it (its dims are named None)."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract, nnx.Param)
    names: dict = {}
    unnamed = []
    for path, variable in nnx.to_flat_state(state):
        logical = variable.get_metadata().get("out_sharding")
        if logical is None:
            unnamed.append(f"'{path_str(path)}' {tuple(variable.shape)}")
            logical = (None,) * len(variable.shape)
        _set_path(names, path, tuple(logical))
    if unnamed and not replicate_unnamed:
        raise PlacementError(_unnamed_message(unnamed))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
    return ModelParts(graphdef, params, names, build)


def _unnamed_message(unnamed: list[str]) -> str:
    shown = ", ".join(unnamed[:5]) + (f" and {len(unnamed) - 5} more" if len(unnamed) > 5 else "")
    return (
        f"{len(unnamed)} parameter{'s' if len(unnamed) > 1 else ''} without logical axis names, which the sharding "
        f"rules need to place them: {shown}. Name each dimension where the parameter is created: "
        "nnx.Param(value, out_sharding=('embed', 'mlp')), or for a Flax layer e.g. nnx.Linear(..., "
        "kernel_init=nnx.with_partitioning(init, ('embed', 'mlp'))); or register the model with "
        "replicate_unnamed=True to keep every unnamed parameter whole on each device."
    )


def _set_path(tree: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def path_str(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
