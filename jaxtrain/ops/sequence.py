"""A next-token batch laid out along the sequence as the devices hold it: what a language model's loss reads.

Without context parallelism the layout is the natural order. Where the activation rules split `seq` over C devices
(the `context` mesh axis), the sequence is cut into 2C equal chunks and device r holds chunks r and 2C-1-r
(zig-zag): under a causal mask an early position sees few keys and a late one many, so pairing chunk r with its
mirror gives every device the same attention work (counted in tests/test_context_parallel.py).

The permutation is applied once per step, to the batch, at the start of the model's loss (`next_tokens`): inputs,
targets, target weights, segment ids and positions (RoPE) move together, and the loss, a weighted mean over every
position of the batch, does not depend on their order. The data pipeline, its order and checkpoints never see the
layout, so a checkpoint restores onto any context size. Each device slices its own positions out of the batch,
which every device of the context axis holds whole (token ids are small): the permutation moves no data.

    >>> zigzag_order(8, 2)
    array([0, 1, 6, 7, 2, 3, 4, 5])
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.errors import UserInputError
from jaxtrain.sharding.constraints import constrain, split_ways


class SequenceLayoutError(UserInputError):
    """A sequence that cannot be laid out over the devices that split it."""


class NextTokens(NamedTuple):
    """A batch of next-token examples, every field (B, T) in the devices' sequence layout (`sequence_order`)."""

    inputs: jax.Array  # token ids the model reads
    targets: jax.Array  # the token after each input
    positions: jax.Array  # each input's position in its document, for RoPE; (1, T) when the rows share them
    segment_ids: jax.Array | None = None  # packed documents (0: padding)
    weights: jax.Array | None = None  # which targets count (float32); None: all


def next_tokens(batch: dict[str, jax.Array]) -> NextTokens:
    """Inputs, targets, positions, documents and target weights of a batch {"tokens": (B, T + 1), optional
    "segment_ids": (B, T + 1), optional "loss_weights": (B, T + 1)}, in the sequence layout of the active mesh (the
    natural order without one).

    A target counts where it is in its input's document and not padding (segment id 0), times its token's loss
    weight (chat data: 1 for an assistant's token, 0 for the prompt's); positions restart at each document.
    """
    tokens, segments = batch["tokens"], batch.get("segment_ids")
    order = sequence_order(tokens.shape[1] - 1)
    weights = target_weights(segments, batch.get("loss_weights"))
    if segments is None:  # every row has the same positions: a constant, already in the layout
        positions = jnp.asarray(order)[None]
        fields = (tokens[:, :-1], tokens[:, 1:])
        return NextTokens(*(_laid_out(x, order) for x in fields), positions, None, _maybe_laid_out(weights, order))
    inputs_segments = segments[:, :-1]
    fields = (tokens[:, :-1], tokens[:, 1:], segment_positions(inputs_segments), inputs_segments)
    return NextTokens(*(_laid_out(x, order) for x in (*fields, weights)))


def laid_out(x: jax.Array) -> jax.Array:
    """x (B, T), per position of the natural sequence, in the devices' sequence layout (`sequence_order`): what a
    model whose batch is not next-token pairs (an encoder's) does to each of its (B, T) fields."""
    return _laid_out(x, sequence_order(x.shape[1]))


def _maybe_laid_out(x: jax.Array | None, order: np.ndarray) -> jax.Array | None:
    return None if x is None else _laid_out(x, order)


def _laid_out(x: jax.Array, order: np.ndarray) -> jax.Array:
    """x (B, T) with its positions permuted into `order` and split as the activations' `seq` dim."""
    if np.array_equal(order, np.arange(order.size)):
        return x
    return constrain(jnp.take(x, order, axis=1), ("batch", "seq"))


def natural_order(x: jax.Array) -> jax.Array:
    """x (B, T, ...), per position in the devices' sequence layout (`sequence_order`), back in the natural order: a
    gather of B x T values, small beside the activations."""
    order = sequence_order(x.shape[1])
    if np.array_equal(order, np.arange(order.size)):
        return x
    return jnp.take(x, np.argsort(order), axis=1)


def sequence_order(seq_len: int) -> np.ndarray:
    """(T,) int32: the position of the natural sequence held at each slot of the laid-out one. The natural order
    unless the active rules split `seq`; then the zig-zag order over the ways it is split."""
    ways = split_ways("seq")
    return np.arange(seq_len, dtype=np.int32) if ways == 1 else zigzag_order(seq_len, ways)


def zigzag_order(seq_len: int, ways: int) -> np.ndarray:
    """(T,) int32: the sequence cut into 2 x `ways` chunks, reordered so that slice r of `ways` equal slices holds
    chunks r and 2 x ways - 1 - r."""
    chunks = 2 * ways
    if seq_len % chunks:
        raise SequenceLayoutError(
            f"sequence length {seq_len} does not split into {chunks} equal chunks: context parallelism over {ways} "
            f"devices gives each device chunks i and {chunks - 1}-i (zig-zag, for balanced causal attention). Use "
            f"a sequence length that is a multiple of {chunks} (e.g. {(seq_len // chunks + 1) * chunks})."
        )
    chunk = np.arange(seq_len, dtype=np.int32).reshape(chunks, seq_len // chunks)
    pairs = [(r, chunks - 1 - r) for r in range(ways)]
    return np.concatenate([chunk[i] for pair in pairs for i in pair])


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Each token's position within its document, (B, T): counting restarts where the segment id changes."""
    t = jnp.arange(segment_ids.shape[1])
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


def target_weights(segment_ids: jax.Array | None, loss_weights: jax.Array | None = None) -> jax.Array | None:
    """How much each next-token target counts, (B, T) float32: from a packed row's segment ids (B, T + 1), 1 for a
    target in its input's document and not padding (id 0), else 0; times the target token's loss weight
    (`loss_weights` (B, T + 1), laid out as the tokens). None with neither: every target counts once."""
    weights = None if loss_weights is None else loss_weights[:, 1:].astype(jnp.float32)
    if segment_ids is None:
        return weights
    same = ((segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)).astype(jnp.float32)
    return same if weights is None else same * weights


def counted_targets(batch: dict[str, jax.Array]) -> jax.Array:
    """How many targets of `batch` a loss that is a mean over targets counts, float32: the sum of a language batch's
    target weights (`target_weights`: documents' own targets, chat data's loss-weighted tokens), or every target;
    a masked-LM batch (targets beside the tokens) the positions it predicts; a batch without tokens, or with a label per
    row, counts each of its examples once. Weighs a batch's mean in a mean over several."""
    tokens = batch.get("tokens")
    if tokens is None or "labels" in batch:
        return jnp.float32(next(iter(batch.values())).shape[0])
    if "targets" in batch:
        return jnp.sum(batch["loss_weights"], dtype=jnp.float32)
    weights = target_weights(batch.get("segment_ids"), batch.get("loss_weights"))
    every = tokens.shape[0] * (tokens.shape[1] - 1)
    return jnp.float32(every) if weights is None else jnp.sum(weights, dtype=jnp.float32)
