"""Pure training and evaluation steps.

The pieces `training/setup.py:compose_step` puts together: the gradient of the trained params (`value_and_grad_of`),
gradient accumulation and the replicas' gradient mean (wrappers around a `GradFn`), `apply_update`, the update core
of every update policy's step, of which `train_step` is the synchronous one, and `train_part`, which runs a step on
the part of the params that trains (adapters) while the rest stays frozen. None reads the run config or does I/O:
choices are bound with `functools.partial` by the caller. State is a plain dict: `{"params": ..., "opt_state": ...,
"step": int32}`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from jaxtrain.sharding.constraints import constrain

PyTree = Any
LossFn = Callable[[PyTree, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]
GradFn = Callable[[PyTree, dict[str, jax.Array]], tuple[tuple[jax.Array, dict], PyTree]]
CountFn = Callable[[dict[str, jax.Array]], jax.Array]  # a batch -> how many targets its loss is the mean over


def trained_leaves(treedef: Any, trainable: Callable[[PyTree], PyTree]) -> list[int]:
    """The positions, among the leaves of params with `treedef`, of those `trainable` picks, in the picked tree's
    leaf order (e.g. `ModelParts.trainable`, which picks by structure alone)."""
    return jax.tree.leaves(trainable(jax.tree.unflatten(treedef, range(treedef.num_leaves))))


def value_and_grad_of(loss_fn: LossFn, trainable: Callable[[PyTree], PyTree] | None = None) -> GradFn:
    """`jax.value_and_grad(loss_fn, has_aux=True)` at the params, of the part of them `trainable` picks (all of them
    when None). The gradient has that part's structure; the other params are constants to autodiff, so no gradient
    of theirs is formed."""
    if trainable is None:
        return jax.value_and_grad(loss_fn, has_aux=True)

    def grad_fn(params: PyTree, batch: dict[str, jax.Array]):
        leaves, treedef = jax.tree.flatten(params)
        picked = trained_leaves(treedef, trainable)

        def loss_of_picked(values: list) -> tuple[jax.Array, dict]:
            full = list(leaves)
            for i, value in zip(picked, values):
                full[i] = value
            return loss_fn(jax.tree.unflatten(treedef, full), batch)

        value, grads = jax.value_and_grad(loss_of_picked, has_aux=True)([leaves[i] for i in picked])
        return value, jax.tree.unflatten(jax.tree.structure(trainable(params)), grads)

    return grad_fn


def split_microbatches(x: jax.Array, pieces: int) -> jax.Array:
    """(B, ...) -> (M, B/M, ...) where microbatch m takes rows m, m+M, m+2M, ...

    Each data-parallel device already holds rows of every microbatch, so the split moves no data.
    """
    split_rows = x.reshape(x.shape[0] // pieces, pieces, *x.shape[1:]).swapaxes(0, 1)
    return constrain(split_rows, (None, "batch") + (None,) * (x.ndim - 1))


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`: (M, B/M, ...) -> (B, ...)."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def accumulate_gradients(grad_fn: GradFn, pieces: int, count: CountFn | None = None) -> GradFn:
    """Split the batch into `pieces` microbatches, run them one after another with `lax.scan`, and average their
    losses, metrics and gradients, each piece weighted by its share of the batch's targets (`count`: how many targets
    a piece's loss is the mean over; equal pieces where None).

    Equals one step on the whole batch when the loss is a mean over the targets `count` counts: also where pieces hold
    different numbers of them (packed documents, chat data's assistant tokens), which a plain mean of the pieces'
    means would weigh wrongly.
    """
    if pieces == 1:
        return grad_fn

    def accumulated(params: PyTree, batch: dict[str, jax.Array]):
        def add_one(total, piece):
            micro, share = piece
            return jax.tree.map(jnp.add, total, scaled(grad_fn(params, micro), share)), None

        micro = jax.tree.map(lambda x: split_microbatches(x, pieces), batch)
        shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        total, _ = jax.lax.scan(add_one, zeros, (micro, microbatch_shares(micro, count)))
        return total

    return accumulated


def microbatch_shares(micro: dict[str, jax.Array], count: CountFn | None) -> jax.Array:
    """Each microbatch's share of the targets (`count`: a batch's; None: each the same share), (M,) float32, for
    `micro` (M, rows, ...): the weights that make the mean of their means the mean over the whole batch."""
    pieces = jax.tree.leaves(micro)[0].shape[0]
    if count is None:
        return jnp.full((pieces,), 1.0 / pieces, jnp.float32)
    counts = jax.vmap(count)(micro)
    return counts / jnp.maximum(jnp.sum(counts), 1.0)  # no targets at all: every loss is 0, and so is every share


def replica_gradients(
    grad_fn: GradFn,
    mesh: Mesh,
    batch_axes: tuple[str, ...],
    mean_gradients: Callable[[PyTree], PyTree] | None = None,
    count: CountFn | None = None,
) -> GradFn:
    """Pure data parallel: each replica computes loss and gradient on its own rows, then they are averaged: by
    `mean_gradients` (an explicit algorithm, run inside the shard_map) with a pmean of loss and metrics, or by
    default with one all-reduce of loss, metrics and the whole gradient together.

    Left to itself XLA reduces the gradient of every scanned layer inside the backward loop (one collective per
    layer); here the program has a single fused all-reduce per step, after gradient accumulation too. Only valid
    when every parameter is replicated, which the caller checks. `check_vma=False`: with it, JAX would psum each
    parameter's cotangent where it is used, which is the per-layer pattern again (and explicit algorithms' results
    are equal on every replica by construction, which the type system cannot see through dynamic indexing).
    """

    # With `count`, each replica's results are weighted by its share of the targets, so that their mean is the
    # batch's.
    def per_replica(params: PyTree, batch: dict[str, jax.Array]):
        result = grad_fn(params, batch)
        local = None if count is None else count(batch)
        if mean_gradients is None and local is None:
            return jax.lax.pmean(result, batch_axes)
        if mean_gradients is None:  # still one all-reduce: the weighted sums and the weights together
            summed, total = jax.lax.psum((scaled(result, local), local), batch_axes)
            return scaled(summed, 1.0 / jnp.maximum(total, 1.0))
        if local is not None:  # a share around 1 a replica: the algorithm averages
            total = jnp.maximum(jax.lax.psum(local, batch_axes), 1.0)
            result = scaled(result, local * jax.lax.psum(1, batch_axes) / total)
        (loss, metrics), grads = result
        return jax.lax.pmean((loss, metrics), batch_axes), mean_gradients(grads)

    return jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(batch_axes)),
        out_specs=PartitionSpec(),
        check_vma=False,
    )


def scaled(tree: PyTree, factor: jax.Array) -> PyTree:
    """Every array of `tree` times `factor`, each in its own dtype."""
    return jax.tree.map(lambda x: (factor * x).astype(x.dtype), tree)


def train_step(
    state: dict[str, PyTree],
    batch: dict[str, jax.Array],
    *,
    grad_fn: GradFn,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
) -> tuple[dict[str, PyTree], dict[str, jax.Array]]:
    """The synchronous policy's step: one optimizer update with this batch's gradient, skipped where the loss or
    gradient is not finite. Metrics: loss, grad_norm, learning_rate, nonfinite, and the loss's own (`apply_update`)."""
    new_state, metrics, _ = apply_update(state, grad_fn(state["params"], batch), optimizer=optimizer, schedule=schedule)
    return new_state, metrics


class Partition(Protocol):
    """Params in two parts, one that trains and one frozen (a model with adapters, `jaxtrain.posttrain.adapters`)."""

    def split(self, params: PyTree) -> tuple[PyTree, PyTree]: ...  # (trainable, frozen)

    def join(self, trainable: PyTree, frozen: PyTree) -> PyTree: ...

    def for_step(self, frozen: PyTree, step: jax.Array) -> PyTree: ...  # what the step varies (dropout seeds)


def train_part(
    state: dict[str, PyTree],
    batch: dict[str, jax.Array],
    *,
    step: Callable[..., tuple[dict[str, PyTree], dict[str, jax.Array]]],
    grad_fn: GradFn,
    part: Partition,
) -> tuple[dict[str, PyTree], dict[str, jax.Array]]:
    """`step` (a step taking `grad_fn`, e.g. `train_step` with its optimizer bound) on the trainable part of the
    params, whose optimizer state is all `opt_state` holds; the frozen part passes through, its output buffers the
    donated inputs', bit for bit. `grad_fn` takes the whole params and differentiates the trainable part
    (`value_and_grad_of`); it sees the frozen part as `part.for_step` makes it for this step."""
    trainable, frozen = part.split(state["params"])
    frozen_now = part.for_step(frozen, state["step"])

    def trainable_grad_fn(params: PyTree, rows: dict[str, jax.Array]):
        return grad_fn(part.join(params, frozen_now), rows)

    new_state, metrics = step({**state, "params": trainable}, batch, grad_fn=trainable_grad_fn)
    return {**new_state, "params": part.join(new_state["params"], frozen)}, metrics


def apply_update(
    state: dict[str, PyTree],
    gradient: tuple[tuple[jax.Array, dict[str, jax.Array]], PyTree],
    *,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    applied: PyTree | None = None,
    ready: jax.Array | None = None,
    update_scale: jax.Array | None = None,
) -> tuple[dict[str, PyTree], dict[str, jax.Array], jax.Array]:
    """The update core every step shares. From `gradient`, what a `GradFn` returns at `state["params"]`
    (((loss, metrics), grads)): the gradient's norm, whether it and the loss are finite, one optimizer update of
    params and opt_state, the step counter advanced. Returns (state, metrics, finite); metrics are the loss's own,
    then loss, grad_norm (before clipping), learning_rate and nonfinite.

    A non-finite loss or gradient leaves params and optimizer state as they were (`nonfinite` is 1): one bad batch
    or one overflow must not poison the run. The step counter, which is also the data position, still advances.
    `applied`: the gradient to apply instead of this one (the stale policy applies an older one; `finite` and the
    metrics still describe this one); `ready`: apply only where it is true too; `update_scale`: multiplies the
    optimizer's update (an asynchronous server's staleness-aware learning rate, `jaxtrain.asynchronous.server`).
    """
    (loss, metrics), grads = gradient
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    params, opt_state = state["params"], state["opt_state"]

    # Each branch brings an optimizer state kept in host memory into device memory itself, so that the copies wait
    # for the gradient: copied in before the cond, XLA:TPU starts them during the forward pass and the state takes
    # device memory beside the activations (llama-1b on v5p:2x2x2, fsdp=8: 1.4 GiB more temporaries).
    def update():
        gradient = grads if applied is None else applied
        updates, new_opt_state = optimizer.update(gradient, in_device_memory(opt_state), params)
        if update_scale is not None:
            updates = jax.tree.map(lambda u: u * update_scale.astype(u.dtype), updates)
        return optax.apply_updates(params, updates), new_opt_state

    def skip():
        return params, in_device_memory(opt_state)

    # A cond rather than a select per array: the skipped branch costs nothing and the taken one no extra pass.
    params, opt_state = jax.lax.cond(finite if ready is None else finite & ready, update, skip)
    new_state = {**state, "params": params, "opt_state": opt_state, "step": state["step"] + 1}
    learning_rate, nonfinite = schedule(state["step"]), (~finite).astype(jnp.int32)
    metrics = {**metrics, "loss": loss, "grad_norm": grad_norm, "learning_rate": learning_rate, "nonfinite": nonfinite}
    return new_state, metrics, finite


def in_device_memory(tree: PyTree) -> PyTree:
    """`tree` in device memory, where the update computes: an optimizer state kept in host memory between steps
    (`optimizer.offload=state`) is copied in, and the compiled step's output shardings send the new one back. A tree
    already in device memory is returned as it is."""
    if all(jax.typeof(x).memory_space != jax.memory.Space.Host for x in jax.tree.leaves(tree)):
        return tree
    return jax.device_put(tree, jax.memory.Space.Device)


def eval_step(params: PyTree, batch: dict[str, jax.Array], *, loss_fn: LossFn) -> dict[str, jax.Array]:
    loss, metrics = loss_fn(params, batch)
    return {**metrics, "loss": loss}
