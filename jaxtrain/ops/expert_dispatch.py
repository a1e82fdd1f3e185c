"""Dropless mixture-of-experts MLPs: every token-choice through its expert by grouped matmuls, in one program or with
the experts split over devices (expert parallelism), the tokens travelling to their experts by all-to-all.

`dropless_experts` is what an MoE model calls (models/moe.py, `routing=dropless`). Without a mesh, or where the
activation rules leave the `expert` dim whole, it is `grouped_experts`: the token-choices sorted by expert, each
expert's rows one group of `jax.lax.ragged_dot`. Where the rules split `expert` over mesh axes (n devices, E/n experts
each), one `shard_map` over the whole mesh runs on every device:

1. sort its own token-choices (N = its tokens x top_k rows) by expert, and so by the device holding the expert;
2. all-gather how many rows each device routes to each expert ((n, E) integers): from them every device works out
   what it sends and receives, and where each piece goes;
3. send each device the rows for its experts (the exchange, below), into a buffer of n x P rows, P = tokens x
   min(top_k, E/n): the most rows one device's tokens can route to another device's experts, so none is dropped;
4. sort what arrived by its own experts and run them as one grouped matmul;
5. send the outputs back the same way, put them in token order and sum each token's top_k outputs, gate-weighted
   (and over the mesh axes splitting `mlp`, where each device held a slice of every expert's hidden units).

Routing is per token, so which device a token's choices meet their experts on changes nothing in its output.

Exchanges (`exchange=`):
- `ragged`: `jax.lax.ragged_all_to_all`, which sends only the rows routed: N (n-1)/n rows per device and direction
  when the load is balanced. The TPU and GPU compilers take it (tests/test_aot_matrix.py); XLA:CPU does not
  ("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter").
- `padded`: `jax.lax.all_to_all` of (n, P, D) buffers, a device's rows for device j in row j padded to P: n x P rows
  per device and direction whatever the routing. That is never more than capacity routing moves with a capacity
  that cannot drop (capacity_factor = n_experts / top_k), and equal to it when top_k <= E/n.
- `auto`: `ragged` on TPU and GPU, `padded` on CPU.

Gradients: shard_map, both exchanges and ragged_dot have transposes, so the backward pass sends the outputs'
cotangents the way the outputs came and the rows' cotangents the way the rows went.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxtrain.errors import UserInputError
from jaxtrain.sharding.constraints import activation_spec, active_mesh, active_platform, split_ways

EXCHANGES = ("auto", "ragged", "padded")
# The dims of the per-device program's arguments, as the activation rules split them: tokens by batch and sequence
# (their embedding and choices whole), the experts' weights by expert and hidden unit (their embedding whole: FSDP's
# shards are gathered on the way in).
_TOKENS = ("batch", "seq", None)
_W_IN = ("expert", None, "mlp")
_W_DOWN = ("expert", "mlp", None)


class ExpertParallelError(UserInputError):
    """An expert split or exchange that cannot work on this mesh or backend."""


def dropless_experts(
    x: jax.Array, gates: jax.Array, choice: jax.Array, w_in: jax.Array, w_down: jax.Array, *, exchange: str = "auto"
) -> jax.Array:
    """Every token of x (G, S, D) through each of its K chosen experts (`choice` (G, S, K) int), weighted by its
    `gates` (G, S, K): (G, S, D) in x's dtype. Expert e is gelu(x @ w_in[e]) @ w_down[e], w_in (E, D, F) and w_down
    (E, F, D) cast to x's dtype first (so FSDP gathers them in it, as `jaxtrain.ops.projection.project` does).

    Where the active rules split the `expert` dim over devices the tokens reach their experts by `exchange` (one of
    EXCHANGES, see the module docstring); elsewhere this is `grouped_experts`.
    """
    if exchange not in EXCHANGES:
        raise ExpertParallelError(f"expert_exchange='{exchange}' is unknown; choose one of {', '.join(EXCHANGES)}.")
    w_in, w_down = w_in.astype(x.dtype), w_down.astype(x.dtype)
    ways = split_ways("expert")
    if ways == 1:
        return grouped_experts(x, gates, choice, w_in, w_down)
    split = _expert_split(w_in.shape, ways, exchange)
    names = (_TOKENS, _TOKENS, _TOKENS, _W_IN, _W_DOWN)
    args = (x, gates, choice, w_in, w_down)
    return jax.shard_map(
        functools.partial(_per_device, split),
        mesh=active_mesh(),
        in_specs=tuple(activation_spec(n, a.shape) for n, a in zip(names, args, strict=True)),
        out_specs=activation_spec(_TOKENS, x.shape),
    )(*args)


def grouped_experts(x: jax.Array, gates: jax.Array, choice: jax.Array, w_in: jax.Array, w_down: jax.Array) -> jax.Array:
    """`dropless_experts` in one program: the token-choices sorted by expert and each expert's rows one group of a
    grouped matmul (`jax.lax.ragged_dot`: one call for all experts, no capacity, no padding)."""
    experts = functools.partial(_expert_mlp, w_in=w_in, w_down=w_down)
    return _through_experts(x, gates, choice, w_in.shape[0], experts)


_Experts = Callable[[jax.Array, jax.Array], jax.Array]


def _through_experts(x: jax.Array, gates: jax.Array, choice: jax.Array, n_experts: int, experts: _Experts) -> jax.Array:
    """x (G, S, D) -> (G, S, D): its token-choices sorted by expert, (G S K, D), through `experts(rows, counts)` (rows
    per expert, (E,)), back in token order and summed per token, gate-weighted."""
    groups, size, d = x.shape
    k = choice.shape[-1]
    flat = choice.reshape(-1)  # (G S K,): token-choices in token order
    order = jnp.argsort(flat, stable=True)  # grouped by expert
    counts = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    out = experts(x.reshape(groups * size, d)[order // k], counts)  # (G S K, D), in the experts' order
    out = out[_inverse(order)].reshape(groups, size, k, d)  # back in token order
    return jnp.einsum("gskd,gsk->gsd", out, gates.astype(x.dtype))


def _inverse(permutation: jax.Array) -> jax.Array:
    """The permutation that undoes `permutation`. Undoing a sort by this gather rather than by scattering into zeros
    keeps the backward pass free of all-reduces: under shard_map, the scatter's tangent is typed as the same on
    every device and its cotangent gets summed over the mesh (seen in the TPU and GPU programs)."""
    return jnp.zeros_like(permutation).at[permutation].set(jnp.arange(permutation.size, dtype=permutation.dtype))


def _expert_mlp(rows: jax.Array, sizes: jax.Array, w_in: jax.Array, w_down: jax.Array) -> jax.Array:
    """rows (M, D), sorted by expert with `sizes[e]` rows for expert e, each through its expert's MLP: (M, D). Rows
    past sum(sizes) come out zero."""
    hidden = jax.nn.gelu(jax.lax.ragged_dot(rows, w_in, sizes))  # (M, F)
    return jax.lax.ragged_dot(hidden, w_down, sizes)


@dataclasses.dataclass(frozen=True)
class _Split:
    """How the experts are split: the mesh axes and devices along them, the exchange, and the axes splitting `mlp`."""

    axes: tuple[str, ...]
    ways: int
    exchange: str  # "ragged" or "padded"
    mlp_axes: tuple[str, ...]


def _expert_split(w_in_shape: tuple[int, ...], ways: int, exchange: str) -> _Split:
    """The split the active rules make of experts w_in (E, D, F), `ways` ways, checked, with `exchange` resolved."""
    n_experts, _, hidden = w_in_shape
    if n_experts % ways:
        raise ExpertParallelError(
            f"n_experts={n_experts} does not split {ways} ways over the mesh's expert axis (dropless experts, E/n "
            f"on each device): use n_experts divisible by {ways}, or a mesh whose expert axis divides {n_experts}."
        )
    axes = _mesh_axes("expert", n_experts)
    on_cpu = active_platform() == "cpu"
    if exchange == "ragged" and on_cpu:
        raise ExpertParallelError(
            f"expert_exchange=ragged needs jax.lax.ragged_all_to_all, which XLA:CPU cannot compile ({n_experts} "
            f"experts split {ways} ways over mesh axis {'+'.join(axes)}): use expert_exchange=padded (or auto, which "
            "picks it on CPU)."
        )
    if exchange == "auto":
        exchange = "padded" if on_cpu else "ragged"
    return _Split(axes, ways, exchange, _mesh_axes("mlp", hidden))


def _mesh_axes(name: str, size: int) -> tuple[str, ...]:
    """The mesh axes the activation rules split a dim called `name` of `size` over."""
    entry = activation_spec((name,), (size,))[0]
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _per_device(split: _Split, x, gates, choice, w_in, w_down) -> jax.Array:
    """Per device: x (g, s, D), gates and choice (g, s, K), w_in (e, D, f) and w_down (e, f, D) for its e = E/n
    experts and f of their hidden units -> (g, s, D)."""
    local = w_in.shape[0]
    slots = x.shape[0] * x.shape[1] * min(choice.shape[-1], local)  # P: most rows this device sends one device
    exchange = _RAGGED if split.exchange == "ragged" else _PADDED

    def experts(rows: jax.Array, counts: jax.Array) -> jax.Array:  # rows (N, D) sorted by expert; counts (E,)
        routes = _routes(counts, split)
        arrived, starts = exchange.there(rows, routes, split.axes, slots)  # (n P, D); (n,) each sender's first row
        mine = _arrived_experts(routes.received, starts, arrived.shape[0])  # (n P,) local expert, `local` if empty
        by_expert = jnp.argsort(mine, stable=True)
        out = _expert_mlp(arrived[by_expert], jnp.sum(routes.received, axis=0), w_in, w_down)  # (n P, D)
        out = out[_inverse(by_expert)]  # in arrival order
        return exchange.back(out, routes, split.axes, rows.shape[0])  # (N, D), partial sums over f

    y = _through_experts(x, gates, choice, local * split.ways, experts)
    return jax.lax.psum(y, split.mlp_axes) if split.mlp_axes else y


@dataclasses.dataclass(frozen=True)
class _Routes:
    """One device's share of the exchange, among n devices holding e experts each."""

    sent: jax.Array  # (n,) rows it sends each device
    sent_at: jax.Array  # (n,) where those start in its sorted rows
    received: jax.Array  # (n, e) rows it receives from each device for each of its experts
    received_at: jax.Array  # (n,) where each device's rows start in its receive buffer (ragged)
    landing_at: jax.Array  # (n,) where its rows start in each device's receive buffer (ragged)
    returned_at: jax.Array  # (n,) where its rows for each device started in that device's sorted rows (ragged)


def _routes(counts: jax.Array, split: _Split) -> _Routes:
    """Every device's share of the exchange from the rows it routes to each expert, counts (E,)."""
    n = split.ways
    routed = jax.lax.all_gather(counts, split.axes).reshape(n, n, -1)  # (from, to, the receiver's expert)
    me = jax.lax.axis_index(split.axes)
    sizes = jnp.sum(routed, axis=-1)  # (n, n): rows device i sends device j
    starts = jnp.cumsum(sizes, axis=1) - sizes  # where i's rows for j start in i's sorted rows
    landing = jnp.cumsum(sizes, axis=0) - sizes  # where i's rows start in j's receive buffer (ragged)
    return _Routes(sizes[me], starts[me], routed[:, me], landing[:, me], landing[me], starts[:, me])


def _arrived_experts(received: jax.Array, starts: jax.Array, rows: int) -> jax.Array:
    """Which local expert each of the receive buffer's `rows` is for, `e` for empty rows, given the rows from each
    device for each expert, received (n, e), and where each device's rows start, `starts` (n,)."""
    row = jnp.arange(rows)
    sender = jnp.searchsorted(starts, row, side="right") - 1  # the last sender starting at or before the row
    ends = jnp.cumsum(received, axis=1)[sender]  # (rows, e): where the sender's rows for each expert end
    return jnp.sum(row[:, None] - starts[sender][:, None] >= ends, axis=1)


@dataclasses.dataclass(frozen=True)
class _Exchange:
    """Rows there (sorted by expert, to the devices holding their experts) and their outputs back."""

    there: Callable[..., tuple[jax.Array, jax.Array]]
    back: Callable[..., jax.Array]


def _ragged_there(rows, routes: _Routes, axes, slots) -> tuple[jax.Array, jax.Array]:
    """Each device's rows for this device's experts, one after another; then empty rows."""
    buffer = jnp.zeros_like(rows, shape=(routes.sent.shape[0] * slots, rows.shape[1]))  # (n P, D)
    received = jnp.sum(routes.received, axis=1)
    arrived = jax.lax.ragged_all_to_all(
        rows, buffer, routes.sent_at, routes.sent, routes.landing_at, received, axis_name=axes
    )
    return arrived, routes.received_at


def _ragged_back(out, routes: _Routes, axes, rows) -> jax.Array:
    """The outputs of each device's rows back to it, where they were in its sorted rows."""
    buffer = jnp.zeros_like(out, shape=(rows, out.shape[1]))
    received = jnp.sum(routes.received, axis=1)
    return jax.lax.ragged_all_to_all(
        out, buffer, routes.received_at, received, routes.returned_at, routes.sent, axis_name=axes
    )


def _padded_there(rows, routes: _Routes, axes, slots) -> tuple[jax.Array, jax.Array]:
    """Device i's rows for this device's experts in rows [i P, i P + its count); the rest empty."""
    n, d = routes.sent.shape[0], rows.shape[1]
    slot = jnp.arange(slots)
    filled = slot < routes.sent[:, None]  # (n, P)
    buffer = jnp.where(filled[..., None], rows[(routes.sent_at[:, None] + slot) % rows.shape[0]], 0)  # (n, P, D)
    arrived = jax.lax.all_to_all(buffer, axes, 0, 0, tiled=True)  # (n, P, D): row i from device i
    return arrived.reshape(n * slots, d), jnp.arange(n) * slots


def _padded_back(out, routes: _Routes, axes, rows) -> jax.Array:
    """The outputs of each device's rows back to it, then out of the padded buffers into its sorted rows' order."""
    n = routes.sent.shape[0]
    back = jax.lax.all_to_all(out.reshape(n, -1, out.shape[1]), axes, 0, 0, tiled=True)  # (n, P, D) from each
    row = jnp.arange(rows)
    to = jnp.repeat(jnp.arange(n), routes.sent, total_repeat_length=rows)  # the device each sorted row went to
    return back[to, row - routes.sent_at[to]]


_RAGGED = _Exchange(_ragged_there, _ragged_back)
_PADDED = _Exchange(_padded_there, _padded_back)
