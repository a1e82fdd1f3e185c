"""Causal attention (placeholder until the implementations land: reference only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q (B, Tq, H, K), k/v (B, Tk, G, K), mask (B, Tq, Tk) bool -> (B, Tq, H, K)."""
    b, tq, h, d = q.shape
    g = k.shape[2]
    qg = q.reshape(b, tq, g, h // g, d)
    scores = jnp.einsum("btgrk,bsgk->bgrts", qg, k).astype(jnp.float32) / d**0.5
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bgrts,bsgk->btgrk", probs, v).reshape(b, tq, h, d)


def attention(q, k, v, *, implementation="auto", segment_ids=None, sliding_window=None):
    t = q.shape[1]
    pos = jnp.arange(t)
    mask = pos[:, None] >= pos[None, :]
    if sliding_window:
        mask &= pos[:, None] - pos[None, :] < sliding_window
    mask = jnp.broadcast_to(mask, (q.shape[0], t, t))
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return masked_attention(q, k, v, mask)


IMPLEMENTATIONS = ("auto", "reference", "xla", "cudnn", "splash", "chunked")
