"""Preference optimisation: DPO (Rafailov et al. 2023) and SimPO (Meng et al. 2024), as a loss on pairs of replies.

A batch holds pairs (`jaxtrain.data.pairs`): for each prompt a chosen and a rejected reply, each rendered with its
prompt into one row of tokens, and loss weights that are 1 on the reply's tokens only (as SFT's):

    pair_tokens   (B, 2, T + 1) int32     [:, 0] prompt + chosen, [:, 1] prompt + rejected
    pair_weights  (B, 2, T + 1) float32   1 where a token is the reply's (counted as a target), else 0

A reply's log-probability is the sum of its tokens' (`sequence_log_probs`). With the reference model's, r = log π(y|x)
- log π_ref(y|x) is the implicit reward, and

    dpo     loss = -log σ(β (r_chosen - r_rejected))                      (TRL's loss_type="sigmoid")
    simpo   loss = -log σ(β (ℓ_chosen - ℓ_rejected) - γ)                  reference-free; ℓ = log π / reply tokens

Chosen and rejected rows run through the model together, one forward pass of 2B rows.

The reference (`Reference`): with adapters, the same weights with the adapters switched off (no second copy); without,
log-probs computed once per pair with the starting weights (`batch["reference_log_probs"]` (B, 2)).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.data.pairs import PAIR_KEYS, REFERENCE_KEY
from jaxtrain.errors import UserInputError
from jaxtrain.ops.sequence import target_weights

NEEDS_REFERENCE = {"dpo": True, "simpo": False}


class PreferenceError(UserInputError):
    """A preference run that cannot be built as asked."""


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
    """The loss of `jaxtrain.run_config.PreferenceConfig`: which one, β, and SimPO's γ."""

    loss: str = "dpo"
    beta: float = 0.1
    gamma: float = 0.5  # SimPO's target reward margin (TRL's simpo_gamma)

    def __call__(
        self, policy: jax.Array, reference: jax.Array | None, counts: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(mean loss over pairs, metrics) from the policy's and the reference's log-probs (B, 2) of each pair's
        chosen [:, 0] and rejected [:, 1] reply, and each reply's counted tokens (B, 2)."""
        if self.loss == "dpo":
            rewards = self.beta * (policy - reference)
            margin = rewards[:, 0] - rewards[:, 1]
        else:  # simpo: the length-normalised log-probs are the rewards, shifted by the target margin gamma
            rewards = self.beta * policy / jnp.maximum(counts, 1.0)
            margin = rewards[:, 0] - rewards[:, 1] - self.gamma
        losses = -jax.nn.log_sigmoid(margin)
        metrics = {
            "rewards_chosen": jnp.mean(rewards[:, 0]),
            "rewards_rejected": jnp.mean(rewards[:, 1]),
            "reward_margin": jnp.mean(rewards[:, 0] - rewards[:, 1]),
            "preference_accuracy": jnp.mean((rewards[:, 0] > rewards[:, 1]).astype(jnp.float32)),
            "logps_chosen": jnp.mean(policy[:, 0]),
            "logps_rejected": jnp.mean(policy[:, 1]),
        }
        return jnp.mean(losses), metrics


def sequence_log_probs(target_log_probs: Callable[[dict], jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """Each pair's chosen and rejected reply's log-probability, (B, 2) float32: the weighted sum of its tokens' by
    `target_log_probs` (a model's: tokens (N, T + 1) -> (N, T)), chosen and rejected rows in one call."""
    tokens, weights = _rows(batch)
    log_probs = target_log_probs({"tokens": tokens}) * target_weights(None, weights)
    return jnp.sum(log_probs, axis=-1).reshape(-1, 2)


def reply_lengths(batch: dict[str, jax.Array]) -> jax.Array:
    """Each reply's counted tokens, (B, 2) float32."""
    return jnp.sum(batch["pair_weights"][..., 1:].astype(jnp.float32), axis=-1)


def _rows(batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(2B, T + 1) tokens and weights: pair b's chosen row at 2b, its rejected at 2b + 1. A split batch dim stays
    split: each device's pairs become its rows."""
    tokens, weights = batch["pair_tokens"], batch["pair_weights"]
    return tokens.reshape(-1, tokens.shape[-1]), weights.reshape(-1, weights.shape[-1])


def preference_objective(
    loss: PreferenceLoss,
) -> Callable[[Any, Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]:
    """The objective a model's loss is replaced with: (policy module, reference module or None, batch) -> (loss,
    metrics). Without a reference module the batch carries the reference log-probs (`REFERENCE_KEY`)."""

    def objective(policy: Any, reference: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        policy_log_probs = sequence_log_probs(policy.target_log_probs, batch)
        reference_log_probs = None
        if NEEDS_REFERENCE[loss.loss]:
            if reference is not None:
                reference_log_probs = jax.lax.stop_gradient(sequence_log_probs(reference.target_log_probs, batch))
            else:
                reference_log_probs = batch[REFERENCE_KEY]
        return loss(policy_log_probs, reference_log_probs, reply_lengths(batch))

    return objective


def check_model(module: Any, model_name: str) -> None:
    """A model the preference losses can train: one whose module gives per-token log-probs."""
    if not callable(getattr(module, "target_log_probs", None)):
        raise PreferenceError(
            f"model '{model_name}' gives no per-token log-probs (a `target_log_probs(batch)` method), which "
            "preference losses weigh: use a decoder (gpt, llama, qwen), or preference.loss=none."
        )


def model_batch(shapes: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of the batch the model itself reads when a batch of `shapes` holds pairs: their 2B rows of tokens
    (what tracing the model's own loss takes, e.g. to fit adapters); other batches as they are."""
    if PAIR_KEYS[0] not in shapes:
        return shapes
    pairs = shapes[PAIR_KEYS[0]]
    return {"tokens": jax.ShapeDtypeStruct((2 * pairs.shape[0], pairs.shape[-1]), pairs.dtype)}
