"""Embedding lookup for the compilers: the table's rows looked up in the compute dtype, their gradient summed in
float32.

`jnp.take(table, tokens).astype(dtype)` looks rows up in the table's own dtype (float32 parameters) and casts them
afterwards, so where the table is split over devices (an FSDP `embed` dim) the rows travel in float32: XLA moves them
before the cast. `lookup` casts the table first, so the rows found, and the all-to-all that hands them to their
rows' devices, are in the compute dtype; their cotangents come back in it too. The gradient is autodiff's, a
scatter-add of the rows' cotangents into a float32 table of zeros, so repeated tokens sum in float32 as before.

>>> import jax.numpy as jnp
>>> from jaxtrain.ops.embedding import lookup
>>> lookup(jnp.arange(6.0).reshape(3, 2), jnp.array([[2, 0]]), jnp.bfloat16)
Array([[[4, 5],
        [0, 1]]], dtype=bfloat16)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def lookup(table: jax.Array, tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`jnp.take(table, tokens, axis=0).astype(dtype)`: (V, D) table, integer tokens of any shape -> (*tokens, D) in
    `dtype`, with the table's gradient formed in its own dtype (module docstring)."""
    return _lookup(jnp.dtype(dtype), table, tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(dtype: jnp.dtype, table: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take(table.astype(dtype), tokens, axis=0)


def _forward(dtype: jnp.dtype, table: jax.Array, tokens: jax.Array) -> tuple[jax.Array, tuple]:
    # The residuals: the tokens, and a zero-size stand-in for the table's shape and dtype (nothing of it is kept).
    return _lookup(dtype, table, tokens), (tokens, jnp.zeros((0, *table.shape), table.dtype))


def _backward(dtype: jnp.dtype, residuals: tuple, rows_grad: jax.Array) -> tuple[jax.Array, None]:
    tokens, like = residuals
    table_grad = jnp.zeros(like.shape[1:], like.dtype).at[tokens].add(rows_grad.astype(like.dtype))
    return table_grad, None


_lookup.defvjp(_forward, _backward)
