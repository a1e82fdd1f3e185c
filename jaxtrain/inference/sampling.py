"""Choosing the next token from a row of logits: greedy, temperature, top-k and top-p (nucleus), under `jit`.

Every function is pure and works on one batch of rows at once; each row has its own PRNG key and its own settings
(arrays of shape (B,)), so a batch of prompts can sample differently without recompiling. The order is the usual one
(Hugging Face's, vLLM's): scale by the temperature, keep the `top_k` most likely tokens, then keep the fewest of
those whose probability reaches `top_p`, renormalise and draw. Temperature 0 is greedy: the argmax, whatever
`top_k` and `top_p` say. `token_log_probs` gives the model's own log-probability of each chosen token, for
reinforcement learning's importance ratios.

    >>> import jax, jax.numpy as jnp
    >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
    >>> settings = Sampling(temperature=1.0, top_k=2).per_row(1)
    >>> keys = jax.random.split(jax.random.key(0), 1)
    >>> int(sample(logits, keys, *settings)[0]) in (0, 1)
    True
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxtrain.settings import Settings, setting


@dataclasses.dataclass(frozen=True)
class Sampling(Settings):
    """How the next token is chosen; a value out of range is a `ConfigError` naming it when this is made."""

    temperature: float = setting(0.0, "softmax temperature; 0 is greedy (the most likely token)", at_least=0)
    top_k: int = setting(0, "sample among the k most likely tokens; 0 keeps them all", at_least=0)
    top_p: float = setting(
        1.0, "sample among the fewest likeliest tokens whose probability reaches p; 1 keeps all", above=0, at_most=1
    )

    def per_row(self, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(temperature, top_k, top_p) as arrays of shape (rows,), the form `sample` takes."""
        return (
            jnp.full((rows,), self.temperature, jnp.float32),
            jnp.full((rows,), self.top_k, jnp.int32),
            jnp.full((rows,), self.top_p, jnp.float32),
        )


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The next token of each row: logits (B, V) float32, keys (B,) PRNG keys, settings (B,) each -> (B,) int32."""
    return jax.vmap(_sample_row)(logits, keys, temperature, top_k, top_p)


def _sample_row(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array):
    greedy = jnp.argmax(logits).astype(jnp.int32)
    # Dividing by 1 where the row is greedy keeps its (unused) draw finite.
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    drawn = jax.random.categorical(key, filtered_logits(scaled, top_k, top_p)).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def filtered_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`logits` (V,) with every token outside the top-k and the top-p nucleus set to -inf. Ties rank by token id
    (a stable sort), so top-k keeps exactly k tokens; the most likely token is always kept."""
    vocab = logits.shape[-1]
    order = jnp.argsort(-logits, stable=True)  # most likely first
    ranked = logits[order]  # (V,)
    rank = jnp.arange(vocab)
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf))
    # A token is in the nucleus if the more likely ones before it do not yet reach top_p.
    # top_p = 1 keeps every token, even where rounding brings the running sum to 1 before the last.
    keep &= ((jnp.cumsum(probs) - probs) < top_p) | (top_p >= 1)
    return jnp.full_like(logits, -jnp.inf).at[order].set(jnp.where(keep, ranked, -jnp.inf))


def token_log_probs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log softmax(logits)[token] of each row: logits (B, V) float32, tokens (B,) -> (B,) float32.

    The model's log-probability at temperature 1, before top-k and top-p: what reinforcement learning's importance
    ratio compares with the trainer's recomputed log-probability, whatever settings the token was drawn with (those
    change which tokens are drawn, not the policy the trainer scores). Computed by the trainer's formula
    (`jaxtrain.ops.cross_entropy.target_log_probs`: logsumexp, less the picked logit), so the two differ by no more
    than the rounding of their logits and of XLA's reductions; `jax.nn.log_softmax` subtracts the max first and rounds
    otherwise.
    """
    picked = jnp.take_along_axis(logits, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)
