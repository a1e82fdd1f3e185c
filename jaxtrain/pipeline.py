"""Pipeline parallelism: the layer stack split into stages along the `pipeline` mesh axis, fed microbatches.

The `layers` dim of the stacked weights is sharded over `pipeline` (rule `layers -> pipeline`), so stage s holds
layers [s*L/P, (s+1)*L/P). The schedule runs inside a `shard_map` that is manual over `pipeline` only: the other
axes (data, fsdp, tensor) still shard the work inside each stage, placed by the compiler.

GPipe: M microbatches flow through P stages in M + P - 1 ticks. At tick t stage s runs microbatch t - s and hands
its output to stage s + 1 with one `ppermute`; the backward pass is the autodiff transpose of the same loop
(all forwards, then all backwards). Bubble fraction: (P - 1) / (M + P - 1).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxtrain.constraints import LayerFn, LayerRunner
from jaxtrain.errors import UserInputError
from jaxtrain.rules import is_logical_names
from jaxtrain.step import merge_microbatches, split_microbatches

SCHEDULES = ("gpipe",)


class PipelineError(UserInputError):
    """A pipeline configuration that cannot run: too few layers, an incompatible microbatch count, ..."""


def gpipe(mesh: Mesh, microbatches: int) -> LayerRunner:
    """A `scan_layers` replacement that runs the layer stack as a GPipe schedule over the `pipeline` axis."""
    stages = mesh.shape["pipeline"]

    def run(layer: LayerFn, x: jax.Array, stacked_params: Any) -> jax.Array:
        check_layers(jax.tree.leaves(stacked_params)[0].shape[0], stages)
        if x.shape[0] % microbatches:
            raise PipelineError(
                f"a batch of {x.shape[0]} rows does not split into {microbatches} pipeline microbatches; "
                "use a batch size divisible by train.microbatches."
            )
        micro = split_microbatches(x, microbatches)  # (M, B/M, ...)
        stage_loop = jax.shard_map(
            functools.partial(_gpipe_ticks, layer, microbatches, stages),
            mesh=mesh,
            in_specs=(PartitionSpec("pipeline"), PartitionSpec()),
            out_specs=PartitionSpec(),
            axis_names={"pipeline"},
            # The outputs are made identical on every stage by the final psum; loop carries differ per stage.
            check_vma=False,
        )
        return merge_microbatches(stage_loop(stacked_params, micro))

    return run


def check_layers(n_layers: int, stages: int) -> None:
    if n_layers < stages or n_layers % stages:
        raise PipelineError(
            f"{n_layers} layers cannot be split evenly into {stages} pipeline stages: use a layer count that "
            f"is a multiple of {stages}, or a smaller pipeline axis."
        )


def stacked_layer_count(logical_names: Any, abstract_params: Any) -> int:
    """The length of the model's stacked `layers` dim; an error if the model has no layer stack to pipeline."""
    counts = {
        p.shape[0]
        for names, p in zip(jax.tree.leaves(logical_names, is_leaf=is_logical_names), jax.tree.leaves(abstract_params))
        if names and names[0] == "layers"
    }
    if not counts:
        raise PipelineError("the mesh has a pipeline axis, but the model has no stacked `layers` dim to split.")
    return counts.pop()


def _gpipe_ticks(layer: LayerFn, microbatches: int, stages: int, params: Any, micro: jax.Array) -> jax.Array:
    """Per stage: params (L/P, ...) of this stage's layers; micro (M, B/M, ...) every microbatch's input."""
    stage = jax.lax.axis_index("pipeline")
    shift = [(s, (s + 1) % stages) for s in range(stages)]

    def tick(carry, t):
        incoming, outputs = carry  # incoming: (B/M, ...) what the previous stage sent last tick
        first_input = jax.lax.dynamic_index_in_dim(micro, jnp.minimum(t, microbatches - 1), keepdims=False)
        h = jnp.where(stage == 0, first_input, incoming)
        h = jax.lax.scan(lambda a, p: (layer(a, p), None), h, params)[0]
        done = t - (stages - 1)  # the microbatch the last stage finishes at this tick
        keep = (stage == stages - 1) & (done >= 0)
        updated = jax.lax.dynamic_update_index_in_dim(outputs, h, jnp.maximum(done, 0), 0)
        outputs = jnp.where(keep, updated, outputs)
        return (jax.lax.ppermute(h, "pipeline", shift), outputs), None

    start = (jnp.zeros_like(micro[0]), jnp.zeros_like(micro))
    (_, outputs), _ = jax.lax.scan(tick, start, jnp.arange(microbatches + stages - 1))
    # Only the last stage holds the results; the sum over stages hands them to every stage.
    return jax.lax.psum(jnp.where(stage == stages - 1, outputs, jnp.zeros_like(outputs)), "pipeline")


def make_layer_runner(mesh: Mesh, schedule: str, microbatches: int) -> LayerRunner:
    """The named pipeline schedule over `mesh`'s pipeline axis, as a `scan_layers` replacement."""
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule '{schedule}'; available: {', '.join(SCHEDULES)}.")
    if microbatches < 1:
        raise PipelineError(f"train.microbatches={microbatches}: a pipeline needs at least 1 microbatch.")
    return gpipe(mesh, microbatches)
