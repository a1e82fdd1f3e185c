"""The pieces of blockwise attention that the `chunked` kernel (`jaxtrain.ops.attention`) and context parallelism
(`jaxtrain.ops.context_attention`) share: which keys a query sees (`Visibility`), the sequence in blocks, one block
pair's masked scores, the online softmax's step over a key block, and one block pair's share of the FlashAttention-2
backward; and how k and v are split for a per-device kernel.

Shapes: q blocks (B, G, J, b, K) with J = H/G query heads per kv head; k and v blocks (B, G, s, K); a block's
segment ids (B, b) and positions in the natural sequence (b,), which the mask is built from.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxtrain.sharding.constraints import activation_spec

CHUNK = 512  # the blocks' length (at most): (B, H, 512, 512) float32 scores per block pair
MASKED = -1e30  # finite, so a fully masked row gives zeros, not NaN, in the online softmax and its gradient
# Products accumulate in float32 whatever the inputs' dtype (the softmax statistics are float32).
einsum32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Visibility:
    """Which keys of its segment a query sees: with `causal`, those at or before it, and of those the last `window`
    (None: all); without, every key. Static and hashable: it decides which block pairs a kernel computes, so it is
    part of the compiled program, as the kernels' nondiff arguments are."""

    causal: bool = True
    window: int | None = None


def attends(q_pos: jax.Array, k_pos: jax.Array, same_segment: jax.Array | None, visibility: Visibility) -> jax.Array:
    """(..., Tq, Tk) bool from query and key positions: within the segment, and as `visibility` says."""
    if visibility.causal:
        ok = q_pos[:, None] >= k_pos[None, :]
        if visibility.window is not None:
            ok &= q_pos[:, None] - k_pos[None, :] < visibility.window
    else:
        ok = jnp.ones((q_pos.shape[0], k_pos.shape[0]), bool)
    return ok if same_segment is None else ok & same_segment


def kv_split_like_q(q, k, v, seq: str | None = None) -> tuple[jax.Array, jax.Array, tuple]:
    """k, v and the dim names to split them by for a per-device kernel: each device must hold the kv heads of its
    own query heads. Where the rules split query heads but not kv heads (tensor does not divide G), k and v are
    repeated to H heads and split like the queries. `seq`: the name their sequence dim goes by (None: whole)."""
    if activation_spec(("heads",), (q.shape[2],)) == activation_spec(("kv_heads",), (k.shape[2],)):
        return k, v, ("batch", seq, "kv_heads", None)
    repeats = q.shape[2] // k.shape[2]
    return jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2), ("batch", seq, "heads", None)


def pad_seq(x: jax.Array, length: int, value: int = 0) -> jax.Array:
    """x (B, T, ...) padded at the end of T to `length`."""
    widths = [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, widths, constant_values=value)


def to_blocks(x: jax.Array, block: int, padded: int | None = None, value: int = 0) -> jax.Array:
    """x (B, T, *rest), padded at its end to `padded` positions, as blocks of `block` positions along a new leading
    dim, the block's positions second to last: (n, B, *rest[:-1], block, rest[-1]), or (n, B, block) for rest = ()."""
    batch, seq_len = x.shape[:2]
    padded = padded or seq_len
    x = pad_seq(x, padded, value).reshape(batch, padded // block, block, *x.shape[2:])
    return jnp.moveaxis(x, (1, 2), (0, -2 if x.ndim > 3 else -1))


def from_blocks(x: jax.Array) -> jax.Array:
    """The inverse of `to_blocks` for query-shaped (n, B, G, J, b, K) -> (B, n x b, G x J, K) and key-shaped
    (n, B, G, b, K) -> (B, n x b, G, K) blocks."""
    count, batch, block, head_dim = x.shape[0], x.shape[1], x.shape[-2], x.shape[-1]
    return jnp.moveaxis(x, (0, -2), (1, 2)).reshape(batch, count * block, -1, head_dim)


# The running state of a block of query rows in the online softmax: (max, sum of exp, exp-weighted values), float32,
# shapes (B, G, J, b), (B, G, J, b), (B, G, J, b, K).
SoftmaxState = tuple[jax.Array, jax.Array, jax.Array]


def block_positions(count: int, block: int) -> jax.Array:
    """(n, b): the positions of `count` contiguous blocks of `block` positions."""
    return jnp.arange(count * block).reshape(count, block)


def empty_softmax_state(q_block_shape: tuple[int, ...]) -> SoftmaxState:
    """The online softmax's state of query rows that have seen no key yet; q_block_shape (B, G, J, b, K)."""
    rows = q_block_shape[:-1]
    return jnp.full(rows, MASKED), jnp.zeros(rows), jnp.zeros(q_block_shape)


def online_softmax_step(visibility, state, q_block, k_block, v_block, segments, positions) -> SoftmaxState:
    """`state` after the query rows of q_block (B, G, J, b, K) have also seen the keys of k_block, v_block
    (B, G, s, K); `segments` and `positions` are (query, key) pairs of (B, b) and (b,) arrays."""
    top, total, acc = state  # running max, sum of exp and weighted values of this block's rows
    scores, allowed = block_scores(visibility, q_block, k_block, *segments, *positions)
    new_top = jnp.maximum(top, scores.max(axis=-1))
    probs = jnp.where(allowed, jnp.exp(scores - new_top[..., None]), 0.0)
    rescale = jnp.exp(top - new_top)
    total = total * rescale + probs.sum(axis=-1)
    values = einsum32("bgjqs,bgsk->bgjqk", probs.astype(v_block.dtype), v_block)
    return new_top, total, acc * rescale[..., None] + values


def finish_softmax(state: SoftmaxState, dtype) -> tuple[jax.Array, jax.Array]:
    """(output in `dtype`, log-sum-exp) of rows that have seen every key they attend to (at least one each)."""
    top, total, acc = state
    return (acc / total[..., None]).astype(dtype), top + jnp.log(total)


def output_dot(out: jax.Array, d_out: jax.Array) -> jax.Array:
    """FlashAttention-2's delta, each row's d_out . out (..., b) float32, of query-shaped (..., b, K) arrays."""
    return jnp.einsum("...qk,...qk->...q", d_out.astype(jnp.float32), out.astype(jnp.float32))


def block_gradients(visibility, q_block, k_block, v_block, segments, positions, residuals):
    """(dq of q_block, dk and dv of k_block and v_block), float32, from one query block against one key block: the
    probabilities recomputed from the rows' log-sum-exp. `residuals`: the query rows' (lse, delta, d_out)."""
    lse, delta, d_out = residuals
    scores, allowed = block_scores(visibility, q_block, k_block, *segments, *positions)
    probs = jnp.where(allowed, jnp.exp(scores - lse[..., None]), 0.0)  # (B, G, J, b, s)
    dv = einsum32("bgjqs,bgjqk->bgsk", probs.astype(d_out.dtype), d_out)
    d_probs = einsum32("bgjqk,bgsk->bgjqs", d_out, v_block)
    scale = 1 / math.sqrt(q_block.shape[-1])
    d_scores = (probs * (d_probs - delta[..., None]) * scale).astype(q_block.dtype)  # w.r.t. q.k, scale in
    dk = einsum32("bgjqs,bgjqk->bgsk", d_scores, q_block)
    return einsum32("bgjqs,bgsk->bgjqk", d_scores, k_block), dk, dv


def block_scores(visibility, q_block, k_block, q_segments, k_segments, q_pos, k_pos) -> tuple[jax.Array, jax.Array]:
    """Scaled scores (B, G, J, b, s) float32 of a query block against a key block whose positions in the sequence
    are q_pos (b,) and k_pos (s,), masked, and the mask."""
    scores = einsum32("bgjqk,bgsk->bgjqs", q_block, k_block)
    scores = scores / math.sqrt(q_block.shape[-1])
    same_segment = (q_segments[:, :, None] == k_segments[:, None, :])[:, None, None]  # (B, 1, 1, b, s)
    allowed = attends(q_pos, k_pos, same_segment, visibility)
    return jnp.where(allowed, scores, MASKED), allowed
