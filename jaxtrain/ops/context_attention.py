"""Causal attention over a sequence split across devices (context parallelism): `ring` and `allgather`.

`attention` comes here when the activation rules split the `seq` dim (the `context` mesh axis, C devices). Each
device holds T/C positions of every sequence, in the zig-zag layout of `jaxtrain.ops.sequence` (chunks r and
2C-1-r), and keeps its queries; the algorithms differ in how keys and values reach them:

- `ring`: C steps. At each, a device attends its queries to the key/value block it holds, while that block moves on
  to the next device (`ppermute`; the transfer is issued before the block's compute, so the two can overlap). The
  backward sends the blocks round again with their dK and dV, which arrive home after the last step. Memory: one
  extra block; bytes per device and layer: (C-1)/C of K and V forward, K, V, dK and dV backward.
- `allgather`: gather K and V over the axis, attend the local queries to all of them; the backward reduce-scatters
  dK and dV. Simpler, and at moderate lengths as fast: one collective instead of C-1 dependent steps.

Both compute with the blockwise online softmax of the `chunked` kernel (`jaxtrain.ops.attention`), on blocks of at
most 512 positions inside the zig-zag chunks, and skip a block pair no query of which may see any key: per device
the causal work is then what the layout assigns it (balanced by zig-zag). The mask is built from each slot's position
in the natural sequence, so it holds for any layout; segment ids and a sliding window apply as in `attention`.
Every query sees at least itself, so no row is empty after all steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.ops.attention import (
    CHUNK,
    CONTEXT_PARALLEL,
    AttentionError,
    block_gradients,
    empty_softmax_state,
    finish_softmax,
    from_blocks,
    kv_split_like_q,
    online_softmax_step,
    output_dot,
    to_blocks,
)
from jaxtrain.ops.sequence import sequence_order
from jaxtrain.sharding.constraints import activation_spec, per_device, split_ways

# The implementations a model may ask for under context parallelism: the algorithms compute attention blockwise
# themselves, with `chunked`'s math; `auto` picks them.
RUNS_SPLIT = ("auto", "chunked")
_Q = ("batch", "seq", "heads", None)
_SEGMENTS = ("batch", "seq")


def sequence_axes(seq_len: int) -> tuple[str, ...]:
    """The mesh axes the active rules split the sequence over (none without a mesh, or where it stays whole)."""
    spec = activation_spec(("seq",), (seq_len,))
    entry = None if spec is None else spec[0]
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def context_attention(q, k, v, segment_ids, window, *, algorithm: str, implementation: str) -> jax.Array:
    """Causal attention of q (B, T, H, K) over k, v (B, T, G, K) whose `seq` dim the active rules split, in the
    sequence layout of `jaxtrain.ops.sequence`, by `algorithm` (one of CONTEXT_PARALLEL)."""
    seq_len = q.shape[1]
    axes, ways = sequence_axes(seq_len), split_ways("seq")
    _check(algorithm, implementation, axes, ways)
    positions = jnp.asarray(sequence_order(seq_len))  # (T,) each slot's position in the natural sequence
    if segment_ids is None:
        segment_ids = jnp.zeros(q.shape[:2], jnp.int32)
    k, v, kv_names = kv_split_like_q(q, k, v, seq="seq")
    run = {"ring": _ring, "allgather": _allgather}[algorithm]
    kernel = functools.partial(run, axes=axes, ways=ways, window=window)
    return per_device(kernel, [_Q, kv_names, kv_names, ("seq",), _SEGMENTS], _Q)(q, k, v, positions, segment_ids)


def _check(algorithm: str, implementation: str, axes: tuple[str, ...], ways: int) -> None:
    where = f"the sequence is split {ways} ways over mesh axis {'+'.join(axes)}"
    if algorithm not in CONTEXT_PARALLEL:
        raise AttentionError(
            f"context_parallel='{algorithm}' is unknown ({where}); choose one of {', '.join(CONTEXT_PARALLEL)}."
        )
    if implementation not in RUNS_SPLIT:
        raise AttentionError(
            f"attention implementation '{implementation}' cannot run under context parallelism ({where}): "
            f"context_parallel={algorithm} computes attention blockwise itself. Use attention=auto or chunked, or "
            f"a mesh without a context axis."
        )


def block_len(local_len: int) -> int:
    """The block length on a device holding `local_len` positions: the longest one, at most CHUNK, that divides
    its zig-zag chunks (local_len / 2), so that a block never straddles two chunks and whole blocks are skipped."""
    chunk = local_len // 2
    return max(b for b in range(1, min(chunk, CHUNK) + 1) if chunk % b == 0)


def _query_blocks(q, groups, positions, segments, block):
    """Per device: q (b, t, H, K) -> (n, b, G, J, s, K) with G = H / J key/value heads; positions (t,) -> (n, s);
    segments (b, t) -> (n, b, s): blocks of s positions."""
    batch, local, heads, head_dim = q.shape
    return to_blocks(q.reshape(batch, local, groups, heads // groups, head_dim), block), *_position_blocks(
        positions, segments, block
    )


def _key_blocks(k, v, positions, segments, block):
    """Per device: k, v (b, t, G, K) -> (n, b, G, s, K), positions and segments as `_query_blocks`'."""
    return to_blocks(k, block), to_blocks(v, block), *_position_blocks(positions, segments, block)


def _position_blocks(positions, segments, block):
    return positions.reshape(-1, block), to_blocks(segments, block)


def _ring(q, k, v, positions, segments, *, axes, ways, window) -> jax.Array:
    """Per device: q (b, t, H, K), k, v (b, t, G, K), positions (t,), segments (b, t) -> (b, t, H, K)."""
    block = block_len(q.shape[1])
    queries = _query_blocks(q, k.shape[2], positions, segments, block)
    keys = _key_blocks(k, v, positions, segments, block)
    return from_blocks(_ring_flash(axes, ways, window, queries, keys))


def _allgather(q, k, v, positions, segments, *, axes, ways, window) -> jax.Array:
    """As `_ring`, with every device's keys and values gathered first: one step over all of them. The gather's
    transpose, a reduce-scatter, hands each device its share of dK and dV."""
    block = block_len(q.shape[1])
    queries = _query_blocks(q, k.shape[2], positions, segments, block)
    gathered = (jax.lax.all_gather(x, axes, axis=1 if x.ndim > 1 else 0, tiled=True) for x in (k, v, positions, segments))
    return from_blocks(_ring_flash(axes, 1, window, queries, _key_blocks(*gathered, block)))


# The ring's kernel on blocks, per device: queries (q (n, b, G, J, s, K), positions (n, s), segments (n, b, s)) and
# keys (k, v (m, b, G, s, K), positions (m, s), segments (m, b, s)); the keys go round `ways` devices.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring_flash(axes, ways, window, queries, keys) -> jax.Array:
    return _ring_forward(axes, ways, window, queries, keys)[0]


def _ring_forward(axes, ways, window, queries, keys) -> tuple[jax.Array, jax.Array]:
    """(output, log-sum-exp) of the queries over the keys of all `ways` devices."""
    q = queries[0]
    state = empty_softmax_state(q.shape)
    for step in range(ways):
        arriving = _pass_on(keys, axes, ways) if step < ways - 1 else None  # issued first: overlaps the compute
        state = _attend(window, state, queries, keys)
        keys = arriving
    return finish_softmax(state, q.dtype)


def _ring_fwd(axes, ways, window, queries, keys):
    out, lse = _ring_forward(axes, ways, window, queries, keys)
    return out, (queries, keys, out, lse)


def _ring_bwd(axes, ways, window, residuals, d_out):
    """The keys go round again, each with its dK and dV, which every device adds to and which reach their own
    device one step after the last; dQ stays."""
    queries, keys, out, lse = residuals
    q, k, v = queries[0], keys[0], keys[1]
    rows = (lse, output_dot(out, d_out), d_out)
    dq, dk, dv = jnp.zeros(q.shape), jnp.zeros(k.shape), jnp.zeros(v.shape)
    for step in range(ways):
        arriving = _pass_on(keys, axes, ways) if step < ways - 1 else None
        dq, dk, dv = _attend_backward(window, queries, keys, rows, dq, dk, dv)
        dk, dv = _pass_on((dk, dv), axes, ways)
        keys = arriving
    return (dq.astype(q.dtype), None, None), (dk.astype(k.dtype), dv.astype(v.dtype), None, None)


_ring_flash.defvjp(_ring_fwd, _ring_bwd)


def _pass_on(arrays, axes: tuple[str, ...], ways: int):
    """Each device's `arrays` sent to the next device along `axes` (the last to the first)."""
    if ways == 1:
        return arrays
    ring = [(i, (i + 1) % ways) for i in range(ways)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axes, ring), arrays)


def _attend(window, state, queries, keys):
    """The online softmax `state` of every query block after it has also seen `keys`."""
    k, v, k_positions, k_segments = keys

    def query_block(args):
        q_i, positions_i, segments_i, state_i = args

        def visit(j, state_i):
            def step(state_i):
                pairs = (segments_i, k_segments[j]), (positions_i, k_positions[j])
                return online_softmax_step(window, state_i, q_i, k[j], v[j], *pairs)

            return jax.lax.cond(visible(window, positions_i, k_positions[j]), step, lambda s: s, state_i)

        return jax.lax.fori_loop(0, k.shape[0], visit, state_i)

    return jax.lax.map(query_block, (*queries, state))


def _attend_backward(window, queries, keys, rows, dq, dk, dv):
    """dq, dk and dv with the contributions of every visible (query block, key block) pair added; `rows`: the
    query rows' (lse, delta, d_out)."""
    q, q_positions, q_segments = queries
    k, v, k_positions, k_segments = keys

    def key_block(dq, j):
        def visit(i, carry):
            def add(carry):
                dk_j, dv_j, dq = carry
                pairs = (q_segments[i], k_segments[j]), (q_positions[i], k_positions[j])
                dq_i, dk_c, dv_c = block_gradients(window, q[i], k[j], v[j], *pairs, tuple(r[i] for r in rows))
                return dk_j + dk_c, dv_j + dv_c, dq.at[i].add(dq_i)

            return jax.lax.cond(visible(window, q_positions[i], k_positions[j]), add, lambda c: c, carry)

        dk_j, dv_j, dq = jax.lax.fori_loop(0, q.shape[0], visit, (dk[j], dv[j], dq))
        return dq, (dk_j, dv_j)

    dq, (dk, dv) = jax.lax.scan(key_block, dq, jnp.arange(k.shape[0]))
    return dq, dk, dv


def visible(window: int | None, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """Whether any query at `q_positions` may see any key at `k_positions` (causal, within the window): the block
    pairs the kernels compute; the others they skip."""
    seen = q_positions.max() >= k_positions.min()
    return seen if window is None else seen & (q_positions.min() - k_positions.max() < window)
