"""The output head's cross-entropy, computed a chunk of the sequence at a time so no (B, T, V) array is ever held.

At a real vocabulary a language model's loss is dominated by its logits: for Llama 3.2 1B's 128,256 tokens at
4 x 2048 tokens a device the float32 logits alone take 4.2 GB, and the plain path (logits, then a softmax
cross-entropy) keeps them and their one-hot targets for the backward. Here the head's matmul, the softmax and the
label pick run on `chunk_len` positions of every row at a time inside `lax.scan`, and a custom VJP computes each
chunk's gradients in the same pass (Liger's fused linear cross-entropy, MaxText's vocab tiling): what the backward
keeps is d(hidden) and d(head), the sizes of hidden and head. Per chunk the head's matmul runs three times (logits,
d(hidden), d(head)), as in the plain path, where remat of each chunk would run it four.

    >>> loss_sum, weight_sum = output_cross_entropy(hidden, head, targets, weights=mask)  # doctest: +SKIP
    >>> loss = loss_sum / jnp.maximum(weight_sum, 1.0)  # mean nats per counted token (a batch may count none)

Under tensor parallelism each chunk's logits are constrained to ("batch", "seq", "vocab"), so the vocabulary stays
split: XLA reduces the softmax's max and sum over the tensor axis (a vocab-parallel softmax). The label's logit is
picked by a masked sum over the vocabulary, not a gather: with the vocabulary split over devices a gather cannot
be partitioned inside the pipeline's partly manual `shard_map`, a masked sum can.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import optax

from jaxtrain.sharding.constraints import constrain, split_ways

HeadLayout = Literal["dv", "vd"]
# "dv": an untied head (D, V); "vd": a tied embedding table (V, D) used as the head.
_HEAD_NAMES = {"dv": ("embed", "vocab"), "vd": ("vocab", "embed")}
_LOGITS = {"dv": "bcd,dv->bcv", "vd": "bcd,vd->bcv"}
_HIDDEN_GRAD = {"dv": "bcv,dv->bcd", "vd": "bcv,vd->bcd"}
_HEAD_GRAD = {"dv": "sbcd,sbcv->sdv", "vd": "sbcd,sbcv->svd"}
# A default chunk holds at most this many logits per device (64 MiB of float32): 128 positions of one row at Llama's
# 128,256-token vocabulary, 32 of four rows; the fastest size on CPU (docs/benchmarks.md, "The chunked loss").
CHUNK_LOGITS = 2**24


def output_cross_entropy(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    *,
    weights: jax.Array | None = None,
    head_layout: HeadLayout = "dv",
    chunk_len: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(sum over tokens of weight * cross-entropy, sum of the weights), both float32 scalars.

    The loss of token (b, t) is -log softmax(hidden[b, t] @ head)[targets[b, t]], with the head cast to hidden's
    dtype for the matmul and the logits in float32: the value and gradients of today's path (logits, one-hot,
    softmax cross-entropy), with a fraction of its memory.

    hidden: (B, T, D), the final-normed activations in the compute dtype (float32 or bfloat16).
    head: (D, V) for head_layout="dv", or a tied embedding table (V, D) for "vd"; usually float32 params.
    targets: (B, T) integer token ids in [0, V); an id outside it counts as a logit of 0.
    weights: (B, T) per-token weights (e.g. 0 where packing left padding), default 1 everywhere.
    chunk_len: positions of the sequence per chunk (every row of the batch at once). Default: the largest power
        of two whose chunk holds at most CHUNK_LOGITS logits per device (`default_chunk_len`). A sequence no longer
        than one chunk is computed without a loop; a longer one is padded to a multiple with weight 0.
    """
    vocab_size = _check_inputs(hidden, head, targets, weights, head_layout, chunk_len)
    weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    targets = targets.astype(jnp.int32)  # compared with an iota over the vocabulary, which uint8 ids would wrap
    if chunk_len is None:  # sized by what each device holds
        chunk_len = default_chunk_len(_per_device(hidden.shape[0], "batch"), _per_device(vocab_size, "vocab"))
    chunk_len = min(chunk_len, hidden.shape[1])
    # One chunk: autodiff's gradient of the plain computation is the same loop-free program, and reduces the head's
    # gradient as any weight's (over the data axes, reduce-scattered over fsdp).
    if chunk_len == hidden.shape[1]:
        return jnp.sum(weights * _whole_sequence_losses(hidden, head, targets, head_layout)), jnp.sum(weights)
    hidden, head, targets, weights = _varying_together(hidden, head, targets, weights)
    hidden_chunks, target_chunks, weight_chunks = (_as_chunks(x, chunk_len) for x in (hidden, targets, weights))
    return _loss_sum(hidden_chunks, head, target_chunks, weight_chunks, head_layout), jnp.sum(weights)


def target_log_probs(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    *,
    head_layout: HeadLayout = "dv",
    chunk_len: int | None = None,
) -> jax.Array:
    """log softmax(hidden[b, t] @ head)[targets[b, t]] for every token, (B, T) float32: what a preference or
    reinforcement-learning loss weighs per token, where `output_cross_entropy` gives only the weighted sum.

    Arguments as `output_cross_entropy`'s. Computed a chunk of positions at a time as it is, each chunk recomputed in
    the backward (`jax.checkpoint`), so neither pass holds the (B, T, V) logits; one chunk is the plain program.
    Equal to `-output_cross_entropy`'s per-token losses, and to the log-softmax of `unembed`'s logits, up to rounding.
    """
    vocab_size = _check_inputs(hidden, head, targets, None, head_layout, chunk_len)
    targets = targets.astype(jnp.int32)
    if chunk_len is None:
        chunk_len = default_chunk_len(_per_device(hidden.shape[0], "batch"), _per_device(vocab_size, "vocab"))
    seq_len = hidden.shape[1]
    if min(chunk_len, seq_len) == seq_len:
        # The chunks' formula (logsumexp less the picked logit), not optax's log-softmax, which rounds otherwise: both
        # paths and a sampler's log-probs (`jaxtrain.inference.sampling.token_log_probs`) compute the same thing.
        return -_chunk_losses(hidden, head.astype(hidden.dtype), targets, head_layout)[0]
    head_c = _compute_head(head, hidden.dtype, head_layout)

    @jax.checkpoint
    def chunk(xs):  # h (B, C, D), t (B, C)
        return -_chunk_losses(xs[0], head_c, xs[1], head_layout)[0]

    chunks = jax.lax.map(chunk, (_as_chunks(hidden, chunk_len), _as_chunks(targets, chunk_len)))  # (N, B, C)
    return jnp.swapaxes(chunks, 0, 1).reshape(hidden.shape[0], -1)[:, :seq_len]


def _whole_sequence_losses(hidden, head, targets, head_layout) -> jax.Array:
    """Per-token cross-entropy (B, T) of one matmul's logits, with autodiff's gradient: the program for sequences
    that fit one chunk, and what the planner reads. The head is used as any weight (a layout constraint on it would
    make its gradient one all-reduce over every data axis, not the reduce-scatter over fsdp other weights get), and
    the labels a one-hot, the program the planner's memory model was fitted to. (The chunks' iota comparison needs
    less on XLA:GPU: 108 against 163 MB peak for tests/test_planner_aot.py's wide gpt-tiny on h100:8, which the
    planner would overestimate by half.)"""
    logits = jnp.einsum(_LOGITS[head_layout], hidden, head.astype(hidden.dtype)).astype(jnp.float32)
    logits = constrain(logits, ("batch", "seq", "vocab"))
    one_hot = constrain(jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), ("batch", "seq", "vocab"))
    return optax.softmax_cross_entropy(logits, one_hot)


def default_chunk_len(rows: int, vocab_size: int) -> int:
    """Positions per chunk: the largest power of two whose logits for `rows` rows of the batch and `vocab_size`
    entries (both per device) number at most CHUNK_LOGITS, or 1."""
    return 2 ** max(0, int(math.log2(max(1, CHUNK_LOGITS // (rows * vocab_size)))))


def _per_device(size: int, name: str) -> int:
    return max(1, size // split_ways(name))


def _check_inputs(hidden, head, targets, weights, head_layout, chunk_len) -> int:
    """The vocabulary size, after checking that the shapes fit together."""
    if head_layout not in _HEAD_NAMES:
        raise ValueError(f"head_layout={head_layout!r}: expected 'dv' (head (D, V)) or 'vd' (tied embedding (V, D)).")
    if hidden.ndim != 3 or head.ndim != 2:
        raise ValueError(f"expected hidden (B, T, D) and head 2-D; got shapes {hidden.shape} and {head.shape}.")
    d_model, vocab_size = head.shape if head_layout == "dv" else head.shape[::-1]
    if d_model != hidden.shape[2]:
        raise ValueError(
            f"head {head.shape} (layout {head_layout!r}) has d_model {d_model} but hidden {hidden.shape} has "
            f"{hidden.shape[2]}; pass head_layout='vd' for a (V, D) tied embedding."
        )
    if targets.shape != hidden.shape[:2] or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(
            f"targets: expected integer ids of shape {hidden.shape[:2]}, got {targets.dtype}{targets.shape}."
        )
    if weights is not None and weights.shape != targets.shape:
        raise ValueError(f"weights: expected shape {targets.shape} (one per target), got {weights.shape}.")
    if chunk_len is not None and chunk_len < 1:
        raise ValueError(f"chunk_len={chunk_len}: expected a positive number of positions per chunk, or None.")
    return vocab_size


def _as_chunks(x: jax.Array, chunk_len: int) -> jax.Array:
    """(B, T, ...) -> (T / chunk_len, B, chunk_len, ...), padding T with zeros (weight 0) to a multiple."""
    batch, seq_len = x.shape[:2]
    pad = -seq_len % chunk_len
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.swapaxes(x.reshape(batch, (seq_len + pad) // chunk_len, chunk_len, *x.shape[2:]), 0, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _loss_sum(hidden, head, targets, weights, head_layout):  # hidden (N, B, C, D), targets and weights (N, B, C)
    head_c = _compute_head(head, hidden.dtype, head_layout)

    def chunk(_, xs):
        return None, _chunk_losses(xs[0], head_c, xs[1], head_layout)[0]

    return jnp.sum(weights * jax.lax.scan(chunk, None, (hidden, targets))[1])


def _loss_sum_fwd(hidden, head, targets, weights, head_layout):
    head_c = _compute_head(head, hidden.dtype, head_layout)
    # The head's gradient sums over the batch, which is split over the data axes. One partial sum per batch shard,
    # added up after the loop, costs one all-reduce of the head's size; a single accumulator costs one per chunk.
    shards = split_ways("batch")
    head_grad = _per_shard_head_grad(jnp.zeros((shards, *head.shape), jnp.float32), head_layout)
    head_grad = _varying_together(head_grad, hidden)[0]

    def chunk(head_grad, xs):  # h (B, C, D), t and w (B, C)
        h, t, w = xs
        losses, probs, is_target = _chunk_losses(h, head_c, t, head_layout)
        logits_grad = ((probs - is_target) * w[..., None]).astype(h.dtype)  # (B, C, V)
        hidden_grad = jnp.einsum(_HIDDEN_GRAD[head_layout], logits_grad, head_c)  # (B, C, D)
        by_shard = [x.reshape(shards, -1, *x.shape[1:]) for x in (h, logits_grad)]  # (S, B / S, C, D or V)
        # Summed in float32 over chunks (the plain path rounds its one matmul's sum to hidden's dtype once).
        chunk_grad = jnp.einsum(_HEAD_GRAD[head_layout], *by_shard, preferred_element_type=jnp.float32)
        return head_grad + _per_shard_head_grad(chunk_grad, head_layout), (losses, hidden_grad)

    head_grad, (losses, hidden_grad) = jax.lax.scan(chunk, head_grad, (hidden, targets, weights))
    head_grad = _sum_over_shards(head_grad, head_c.dtype, head, head_layout)
    return jnp.sum(weights * losses), (hidden_grad, head_grad, losses)


def _sum_over_shards(head_grad: jax.Array, dtype: jnp.dtype, head: jax.Array, head_layout: HeadLayout) -> jax.Array:
    """The batch shards' partial head gradients (S, ...) summed in the compute dtype, as the layers' weight gradients
    are (their matmuls' results), into the head's own layout: half the bytes of summing them in float32
    (docs/benchmarks.md, "Compiled step against MaxText's")."""
    summed = jnp.sum(head_grad.astype(dtype), axis=0, dtype=dtype)  # jnp.sum would sum bfloat16 in float32
    return constrain(summed, _HEAD_NAMES[head_layout], like_params=True).astype(head.dtype)


def _compute_head(head: jax.Array, dtype: jnp.dtype, head_layout: HeadLayout) -> jax.Array:
    """The head cast once for every chunk (as the plain path casts once for its matmul), gathered whole over the
    FSDP axes once, before the loop: the TPU compiler otherwise gathers it in every chunk (v5p:2x2x2, fsdp=8,
    D 2048, V 128,256: 64 all-gathers of the bfloat16 head per step), where XLA:CPU hoists the gather itself."""
    return constrain(head.astype(dtype), _HEAD_NAMES[head_layout])


def _varying_together(*arrays: jax.Array) -> list[jax.Array]:
    """`arrays`, each marked as varying over every manual shard_map axis any of them varies over (inside a pipeline
    stage the microbatch does, the head does not). Then the custom VJP's cotangents have its inputs' types, and the
    gradient of a head shared by every stage is summed over them by JAX's transpose of the mark."""
    varying = [jax.typeof(x).manual_axis_type.varying for x in arrays]
    axes = set().union(*varying)
    return [jax.lax.pcast(x, tuple(sorted(axes - v)), to="varying") if axes - v else x for x, v in zip(arrays, varying)]


def _per_shard_head_grad(grad: jax.Array, head_layout: HeadLayout) -> jax.Array:
    """grad (S, D, V) or (S, V, D), one partial sum per batch shard: each device keeps its own shard's."""
    return constrain(grad, ("batch", *_HEAD_NAMES[head_layout]))


def _loss_sum_bwd(head_layout, residuals, grad):
    hidden_grad, head_grad, losses = residuals
    return (grad * hidden_grad).astype(hidden_grad.dtype), grad * head_grad, None, grad * losses


_loss_sum.defvjp(_loss_sum_fwd, _loss_sum_bwd)


def _chunk_losses(hidden, head, targets, head_layout):  # hidden (B, C, D), head cast to hidden's dtype, targets (B, C)
    """Per-token cross-entropy (B, C) float32, with the softmax (B, C, V) and the one-hot of the targets."""
    # Hidden split over the batch only: one whose embed dim came split over fsdp (e.g. straight from an FSDP
    # embedding table) made XLA all-reduce every chunk's logits over fsdp.
    hidden = constrain(hidden, ("batch", "seq", "embed"))
    logits = jnp.einsum(_LOGITS[head_layout], hidden, head).astype(jnp.float32)
    logits = constrain(logits, ("batch", "seq", "vocab"))  # (B, C, V), vocabulary split over tensor
    log_norm = jax.nn.logsumexp(logits, axis=-1)  # (B, C)
    is_target = jax.lax.broadcasted_iota(targets.dtype, logits.shape, 2) == targets[..., None]
    picked = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)  # a masked sum, not a gather (see above)
    return log_norm - picked, jnp.exp(logits - log_norm[..., None]), is_target.astype(jnp.float32)
