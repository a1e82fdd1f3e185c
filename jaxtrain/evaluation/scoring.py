"""Log-likelihoods of token continuations, batched on the mesh a `Generator` holds the model on: for each row of token
ids (a context, then a continuation), the model's log-probability of the continuation given what precedes it, and
whether every continuation token is the model's most likely next token (lm-eval's `loglikelihood`).

Rows are bucketed by length: each is right-padded to a power of two (at least `MIN_PROMPT_BUCKET`) and a batch holds
a fixed number of rows (`batch_size` rounded up to a multiple of the data axes; a short batch is padded with rows that
score nothing), so one program is compiled per length bucket and reused by every later call. The program is the
model's forward pass (`model(tokens) -> logits`), the log-softmax at each target and, per row, the sum over its
continuation's positions; padding after a row cannot change it (attention is causal). It reads the generator's params
at each call, so a generator whose params are replaced (the training loop's) scores them without compiling again.

    >>> scorer = Scorer(Generator.restore("runs/x", mesh="data=2,tensor=2"), batch_size=16)    # doctest: +SKIP
    >>> scorer.score([[1, 5, 9, 2]], [2])  # [(log p(9, 2 | 1, 5), both the argmax?)]  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.errors import UserInputError
from jaxtrain.inference.generate import MIN_PROMPT_BUCKET, Generator
from jaxtrain.sharding.constraints import activation_sharding
from jaxtrain.training.distributed import to_host

Score = tuple[float, bool]  # (log-likelihood, greedy)


class ScoringError(UserInputError):
    """Rows, continuations or settings the scoring program cannot take."""


class Scorer:
    """The log-likelihood program of a generator's model, compiled once per (rows, length) shape."""

    def __init__(self, generator: Generator, batch_size: int):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ScoringError(f"batch_size={batch_size!r}: expected an integer >= 1 (rows scored at once).")
        if generator.shardings.mesh.shape["context"] > 1:
            raise ScoringError(
                f"the mesh splits the sequence (context={generator.shardings.mesh.shape['context']}), which scoring "
                "does not lay out: give a mesh without a context axis (e.g. data=2,tensor=2)."
            )
        self.generator = generator
        ways = generator.batch_ways
        self.rows = -(-batch_size // ways) * ways  # every batch holds this many rows: one shape per length bucket
        self._program = jax.jit(self._score, out_shardings=generator.shardings.replicated)

    def score(self, rows: Sequence[Sequence[int]], continuation_lengths: Sequence[int]) -> list[Score]:
        """For each row of token ids and the number of its last tokens that are the continuation: the continuation's
        log-probability given the tokens before it (float), and whether each of its tokens is the argmax (bool)."""
        self._check(rows, continuation_lengths)
        results: list[Score | None] = [None] * len(rows)
        longest_first = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        for width, members in itertools.groupby(longest_first, key=lambda i: bucket(len(rows[i]) - 1)):
            members = list(members)
            for start in range(0, len(members), self.rows):
                chunk = members[start : start + self.rows]
                scores = self._run(width, [rows[i] for i in chunk], [continuation_lengths[i] for i in chunk])
                for i, score in zip(chunk, scores):
                    results[i] = score
        return results

    def _check(self, rows: Sequence[Sequence[int]], continuation_lengths: Sequence[int]) -> None:
        vocab = self.generator.vocab_size
        for number, (row, count) in enumerate(zip(rows, continuation_lengths, strict=True), 1):
            if not 1 <= count < len(row):
                raise ScoringError(
                    f"row {number} has {len(row)} tokens and a continuation of {count}: a continuation needs at "
                    "least one token and a token before it."
                )
            bad = [t for t in row if not 0 <= t < vocab]
            if bad:
                raise ScoringError(f"row {number}: token id {bad[0]} is outside the model's vocabulary 0..{vocab - 1}.")

    def _run(self, width: int, rows: list[Sequence[int]], counts: list[int]) -> list[Score]:
        """Score up to `self.rows` rows whose inputs fit `width` positions, in one call of the program."""
        tokens = np.zeros((self.rows, width + 1), np.int32)
        first, end = np.zeros((self.rows,), np.int32), np.zeros((self.rows,), np.int32)  # padding rows count nothing
        for r, (row, count) in enumerate(zip(rows, counts)):
            tokens[r, : len(row)] = row
            end[r] = len(row) - 1  # targets are the row's tokens after the first: target t is token t + 1
            first[r] = end[r] - count
        batch = self.generator.shardings.batch_sharding
        put = [jax.device_put(x, batch(x.shape)) for x in (tokens, first, end)]
        log_likelihoods, greedy = to_host(self._program(self.generator.params, *put))
        return [(float(log_likelihoods[r]), bool(greedy[r])) for r in range(len(rows))]

    def _score(
        self,
        params,
        tokens: jax.Array,  # (B, T + 1) int32, right-padded
        first: jax.Array,  # (B,) int32: the first target position of each row's continuation
        end: jax.Array,  # (B,) int32: one past its last
    ) -> tuple[jax.Array, jax.Array]:
        """(B,) float32 log-likelihoods of the continuations and (B,) bool: all of their tokens are the argmax."""
        shardings = self.generator.shardings
        with activation_sharding(shardings.mesh, shardings.rules):
            logits = shardings.model.module(params)(tokens[:, :-1])  # (B, T, V) float32
            targets = tokens[:, 1:]  # (B, T)
            # The target's logit by a masked sum, not a gather, as the loss kernels pick it: the vocabulary may be
            # split over devices (jaxtrain.ops.cross_entropy).
            is_target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == targets[..., None]
            picked = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)  # (B, T)
            log_probs = picked - jax.nn.logsumexp(logits, axis=-1)  # (B, T)
            position = jnp.arange(targets.shape[1])[None]  # (1, T)
            counted = (position >= first[:, None]) & (position < end[:, None])  # (B, T)
            greedy = jnp.argmax(logits, axis=-1) == targets  # (B, T): the first maximum, as torch's argmax
            return jnp.sum(jnp.where(counted, log_probs, 0.0), axis=-1), jnp.all(greedy | ~counted, axis=-1)


def bucket(positions: int) -> int:
    """The padded input length of a row of `positions` inputs: the next power of two, at least MIN_PROMPT_BUCKET."""
    return max(MIN_PROMPT_BUCKET, 1 << (positions - 1).bit_length())
