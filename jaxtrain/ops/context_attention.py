"""Attention over a sequence split across devices (context parallelism): `ring` and `allgather`.

`attention` comes here when the activation rules split the `seq` dim (the `context` mesh axis, C devices). Each
device holds T/C positions of every sequence, in the zig-zag layout of `jaxtrain.ops.sequence` (chunks r and
2C-1-r), and keeps its queries; the algorithms differ in how keys and values reach them:

- `ring`: C steps. At each, a device attends its queries to the key/value block it holds, while that block moves on
  to the next device (`ppermute`; the transfer is issued before the block's compute, so the two can overlap). The
  backward sends the blocks round again with their dK and dV, which arrive home after the last step. Memory: one
  block in flight. Bytes per device and layer: C-1 blocks of K and V forward; as many backward, and C of dK, dV.
- `allgather`: gather K and V over the axis and attend the local queries to all of them; the backward gathers them
  again (only the device's own are kept) and reduce-scatters dK and dV. Simpler, and at moderate lengths as fast:
  one collective instead of C-1 dependent steps.

The custom VJP wraps the per-device programs (`per_device`), so the forward and the backward are each one
`shard_map`; `jaxtrain.planner.context` models the bytes they send.

Both compute with the blockwise online softmax of the `chunked` kernel (`jaxtrain.ops.attention`), on blocks of at
most 512 positions inside the zig-zag chunks, and under a causal mask skip a block pair no query of which may see any
key: per device the causal work is then what the layout assigns it (balanced by zig-zag). Bidirectional attention
(`causal=False`) computes every block pair, the same work on every device in any layout. The mask is built from each
slot's position in the natural sequence, so it holds for any layout; segment ids and a sliding window apply as in
`attention`. Every query sees at least itself, so no row is empty after all steps.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxtrain.errors import UserInputError
from jaxtrain.ops.blockwise import (
    CHUNK,
    Visibility,
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
from jaxtrain.sharding.constraints import (
    activation_sharding,
    activation_spec,
    active_placement,
    per_device,
    split_ways,
)

CONTEXT_PARALLEL = ("ring", "allgather")
# The implementations a model may ask for under context parallelism: the algorithms compute attention blockwise
# themselves, with `chunked`'s math; `auto` picks them.
RUNS_SPLIT = ("auto", "chunked")
_Q = ("batch", "seq", "heads", None)
_SEGMENTS = ("batch", "seq")
_LSE = ("batch", "seq", "heads")


class ContextParallelError(UserInputError):
    """An algorithm or attention implementation that cannot run on a sequence split over devices."""


def sequence_axes(seq_len: int) -> tuple[str, ...]:
    """The mesh axes the active rules split the sequence over (none without a mesh, or where it stays whole)."""
    spec = activation_spec(("seq",), (seq_len,))
    entry = None if spec is None else spec[0]
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def context_attention(
    q, k, v, segment_ids, visibility: Visibility, *, algorithm: str, implementation: str
) -> jax.Array:
    """Attention of q (B, T, H, K) over k, v (B, T, G, K) whose `seq` dim the active rules split, in the sequence
    layout of `jaxtrain.ops.sequence`, by `algorithm` (one of CONTEXT_PARALLEL); `visibility`: which keys of its
    segment a query sees."""
    seq_len = q.shape[1]
    axes, ways = sequence_axes(seq_len), split_ways("seq")
    _check(algorithm, implementation, axes, ways)
    positions = jnp.asarray(sequence_order(seq_len))  # (T,) each slot's position in the natural sequence
    if segment_ids is None:
        segment_ids = jnp.zeros(q.shape[:2], jnp.int32)
    k, v, kv_names = kv_split_like_q(q, k, v, seq="seq")
    names = (_Q, kv_names, kv_names, ("seq",), _SEGMENTS)
    split = _Split(algorithm, axes, ways, visibility, names, active_placement())
    return _split_attention(split, q, k, v, positions, segment_ids)


def _check(algorithm: str, implementation: str, axes: tuple[str, ...], ways: int) -> None:
    where = f"the sequence is split {ways} ways over mesh axis {'+'.join(axes)}"
    if algorithm not in CONTEXT_PARALLEL:
        raise ContextParallelError(
            f"context_parallel='{algorithm}' is unknown ({where}); choose one of {', '.join(CONTEXT_PARALLEL)}."
        )
    if implementation not in RUNS_SPLIT:
        raise ContextParallelError(
            f"attention implementation '{implementation}' cannot run under context parallelism ({where}): "
            f"context_parallel={algorithm} computes attention blockwise itself. Use attention=auto or chunked, or "
            f"a mesh without a context axis."
        )


def block_len(local_len: int) -> int:
    """The block length on a device holding `local_len` positions: the longest one, at most CHUNK, that divides
    its zig-zag chunks (local_len / 2), so that a block never straddles two chunks and whole blocks are skipped."""
    chunk = local_len // 2
    return max(b for b in range(1, min(chunk, CHUNK) + 1) if chunk % b == 0)


@dataclasses.dataclass(frozen=True)
class _Split:
    """How a split sequence's attention runs: the algorithm, the mesh axes and ways it is split over, which keys a
    query sees, and the dim names of the arguments (q, k, v, positions, segments)."""

    algorithm: str
    axes: tuple[str, ...]
    ways: int
    visibility: Visibility
    in_names: tuple
    placement: tuple = dataclasses.field(compare=False)  # the forward's mesh and rules, for the backward

    @property
    def kv_names(self) -> tuple:
        return self.in_names[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _split_attention(split: _Split, q, k, v, positions, segments) -> jax.Array:
    return _split_forward(split, q, k, v, positions, segments)[0]


def _split_forward(split: _Split, *args) -> tuple[jax.Array, jax.Array]:
    """(output (B, T, H, K), log-sum-exp (B, T, H) float32)."""
    return per_device(functools.partial(_forward, split), split.in_names, [_Q, _LSE])(*args)


def _split_fwd(split: _Split, *args):
    out, lse = _split_forward(split, *args)
    return out, (args, out, lse)


def _split_bwd(split: _Split, residuals, d_out):
    args, out, lse = residuals
    kernel = functools.partial(_backward, split)
    with activation_sharding(*split.placement):  # the backward may be traced after the forward's block has closed
        dq, dk, dv = per_device(kernel, [*split.in_names, _Q, _LSE, _Q], [_Q, split.kv_names, split.kv_names])(
            *args, out, lse, d_out
        )
    return dq, dk, dv, None, None


_split_attention.defvjp(_split_fwd, _split_bwd)


def _forward(split: _Split, q, k, v, positions, segments) -> tuple[jax.Array, jax.Array]:
    """Per device: q (b, t, H, K), k, v (b, t, G, K), positions (t,), segments (b, t) -> the output (b, t, H, K)
    and log-sum-exp (b, t, H)."""
    queries, keys, steps = _blocks(split, q, k, v, positions, segments)
    out, lse = _ring_forward(split.axes, steps, split.visibility, queries, keys)
    return from_blocks(out), _lse_from_blocks(lse)


def _backward(split: _Split, q, k, v, positions, segments, out, lse, d_out):
    """Per device: dq, dk, dv of `_forward`'s arguments from its output, log-sum-exp and the output's cotangent."""
    queries, keys, steps = _blocks(split, q, k, v, positions, segments)
    rows = (_lse_to_blocks(lse, queries[0].shape), _query_blocks(out, queries[0]), _query_blocks(d_out, queries[0]))
    dq, dk, dv = _ring_backward(split.axes, steps, split.visibility, queries, keys, rows)
    dk, dv = from_blocks(dk), from_blocks(dv)
    if split.algorithm == "allgather":  # each device's share of the gathered keys' gradients, summed in float32
        dk, dv = (jax.lax.psum_scatter(x, split.axes, scatter_dimension=1, tiled=True) for x in (dk, dv))
    return from_blocks(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _blocks(split: _Split, q, k, v, positions, segments):
    """Per device: (queries, keys, ring steps) in blocks. queries: q (n, b, G, J, s, K), positions (n, s) and
    segments (n, b, s); keys: k, v (m, b, G, s, K), positions (m, s), segments (m, b, s). `allgather` gathers every
    device's keys first and attends to them in one step; `ring` starts from its own and takes `ways` steps."""
    block = block_len(q.shape[1])
    batch, local, heads, head_dim = q.shape
    groups = k.shape[2]
    q = to_blocks(q.reshape(batch, local, groups, heads // groups, head_dim), block)
    queries = (q, *_position_blocks(positions, segments, block))
    if split.algorithm == "allgather":
        k, v, positions, segments = (_gather(x, split.axes) for x in (k, v, positions, segments))
    keys = (to_blocks(k, block), to_blocks(v, block), *_position_blocks(positions, segments, block))
    return queries, keys, 1 if split.algorithm == "allgather" else split.ways


def _gather(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Every device's x, along the sequence (dim 1, or 0 for positions), in device order."""
    return jax.lax.all_gather(x, axes, axis=min(x.ndim - 1, 1), tiled=True)


def _position_blocks(positions, segments, block):
    return positions.reshape(-1, block), to_blocks(segments, block)


def _query_blocks(x: jax.Array, like: jax.Array) -> jax.Array:
    """x (b, t, H, K) as blocks shaped `like` the query blocks (n, b, G, J, s, K)."""
    count, batch, groups, per_group, block, head_dim = like.shape
    return to_blocks(x.reshape(batch, count * block, groups, per_group, head_dim), block)


def _lse_from_blocks(lse: jax.Array) -> jax.Array:
    """(n, b, G, J, s) -> (b, n x s, G x J)."""
    count, batch, groups, per_group, block = lse.shape
    return lse.transpose(1, 0, 4, 2, 3).reshape(batch, count * block, groups * per_group)


def _lse_to_blocks(lse: jax.Array, q_blocks_shape: tuple[int, ...]) -> jax.Array:
    """The inverse of `_lse_from_blocks`, for query blocks of `q_blocks_shape` (n, b, G, J, s, K)."""
    count, batch, groups, per_group, block, _ = q_blocks_shape
    return lse.reshape(batch, count, block, groups, per_group).transpose(1, 0, 3, 4, 2)


def _ring_forward(axes, steps, visibility, queries, keys) -> tuple[jax.Array, jax.Array]:
    """(output, log-sum-exp) of the query blocks over the keys of `steps` devices round the ring (1: the keys
    here only)."""
    q = queries[0]
    state = empty_softmax_state(q.shape)
    for step in range(steps):
        arriving = _pass_on(keys, axes, steps) if step < steps - 1 else None  # issued first: overlaps the compute
        state = _attend(visibility, state, queries, keys)
        keys = arriving
    return finish_softmax(state, q.dtype)


def _ring_backward(axes, steps, visibility, queries, keys, rows):
    """dq, dk, dv (float32 blocks) of `_ring_forward`; `rows`: the query rows' (lse, out, d_out). The keys go round
    again, each with its dK and dV, which every device adds to and which reach their own device one step after the
    last; dQ stays."""
    q, k, v = queries[0], keys[0], keys[1]
    lse, out, d_out = rows
    rows = (lse, output_dot(out, d_out), d_out)
    dq, dk, dv = jnp.zeros(q.shape), jnp.zeros(k.shape), jnp.zeros(v.shape)
    for step in range(steps):
        arriving = _pass_on(keys, axes, steps) if step < steps - 1 else None
        dq, dk, dv = _attend_backward(visibility, queries, keys, rows, dq, dk, dv)
        dk, dv = _pass_on((dk, dv), axes, steps)
        keys = arriving
    return dq, dk, dv


def _pass_on(arrays, axes: tuple[str, ...], ways: int):
    """Each device's `arrays` sent to the next device along `axes` (the last to the first)."""
    if ways == 1:
        return arrays
    ring = [(i, (i + 1) % ways) for i in range(ways)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axes, ring), arrays)


def _attend(visibility, state, queries, keys):
    """The online softmax `state` of every query block after it has also seen `keys`."""
    k, v, k_positions, k_segments = keys

    def query_block(args):
        q_i, positions_i, segments_i, state_i = args

        def visit(carry):
            j, state_i = carry

            def step(state_i):
                pairs = (segments_i, k_segments[j]), (positions_i, k_positions[j])
                return online_softmax_step(visibility, state_i, q_i, k[j], v[j], *pairs)

            return j + 1, jax.lax.cond(visible(visibility, positions_i, k_positions[j]), step, lambda s: s, state_i)

        # A while loop, not a fori_loop of static length (a scan): linearizing the layers' scan, JAX kept a scan's
        # scores and masks of every block pair as residuals, though this runs under a custom VJP (750 MB at
        # T=8192 on context=4, where the kernel needs 27 MB); a while loop has none to keep.
        return jax.lax.while_loop(lambda carry: carry[0] < k.shape[0], visit, (0, state_i))[1]

    return jax.lax.map(query_block, (*queries, state))


def _attend_backward(visibility, queries, keys, rows, dq, dk, dv):
    """dq, dk and dv with the contributions of every visible (query block, key block) pair added; `rows`: the
    query rows' (lse, delta, d_out)."""
    q, q_positions, q_segments = queries
    k, v, k_positions, k_segments = keys

    def key_block(dq, j):
        def visit(i, carry):
            def add(carry):
                dk_j, dv_j, dq = carry
                pairs = (q_segments[i], k_segments[j]), (q_positions[i], k_positions[j])
                dq_i, dk_c, dv_c = block_gradients(visibility, q[i], k[j], v[j], *pairs, tuple(r[i] for r in rows))
                return dk_j + dk_c, dv_j + dv_c, dq.at[i].add(dq_i)

            return jax.lax.cond(visible(visibility, q_positions[i], k_positions[j]), add, lambda c: c, carry)

        dk_j, dv_j, dq = jax.lax.fori_loop(0, q.shape[0], visit, (dk[j], dv[j], dq))
        return dq, (dk_j, dv_j)

    dq, (dk, dv) = jax.lax.scan(key_block, dq, jnp.arange(k.shape[0]))
    return dq, dk, dv


def visible(visibility: Visibility, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """Whether any query at `q_positions` may see any key at `k_positions` as `visibility` says (causal: at or
    before it, within the window; else always): the block pairs the kernels compute; the others they skip."""
    if not visibility.causal:
        return jnp.bool_(True)
    seen = q_positions.max() >= k_positions.min()
    window = visibility.window
    return seen if window is None else seen & (q_positions.min() - k_positions.max() < window)
