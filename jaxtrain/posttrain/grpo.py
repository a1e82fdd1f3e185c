"""GRPO's loss (Shao et al. 2024, DeepSeekMath) with DAPO's (Yu et al. 2025) and Dr. GRPO's (Liu et al. 2025)
changes to it, as pure functions of per-token log-probs: the mathematics of a GRPO step, nothing of the rollouts.

A batch holds B = prompts x G completions, each prompt's G completions consecutive (rows pG .. pG + G - 1), one
scalar reward per completion, and for each completion token the log-prob of the sampled token under three policies:

    log_probs            (B, T) float32   π_θ, the policy being trained (the only input with a gradient)
    old_log_probs        (B, T) float32   π_old, the policy that sampled the completions
    reference_log_probs  (B, T) float32   π_ref, the frozen reference of the KL term (None when β = 0)
    mask                 (B, T)           1 on a completion's tokens, 0 on padding after it

Advantages (`group_advantages`): each reward less its group's mean, over its group's standard deviation (Bessel's
correction, + 1e-4), or not divided (Dr. GRPO). Then per token, as TRL 1.16's `GRPOTrainer._compute_loss`:

    ρ  = exp(log π_θ - log π_old)                                          importance ratio
    ℓ  = -min(ρ A, clip(ρ, 1 - ε_low, 1 + ε_high) A) + β ρ k3              clipped surrogate + KL penalty
    k3 = exp(log π_ref - log π_θ) - (log π_ref - log π_θ) - 1              Schulman's unbiased, positive KL estimate

(the KL term's ρ is TRL's `use_bias_correction_kl`, on by default there; `kl_ratio_weighted=False` drops it, as
DeepSeekMath wrote it), and the token losses make one number by `aggregation` (m the mask, L max_completion_length):

    grpo     mean_i (Σ_t ℓ m / Σ_t m)     DeepSeekMath: each completion's token mean, then the mean over completions
    dapo     Σ ℓ m / Σ m                  DAPO: one token mean over the batch (long completions weigh more)
    dr_grpo  Σ ℓ m / (B L)                Dr. GRPO: a constant divisor, so no length bias either way

The arrays are global: sharded over a mesh (the batch dim split), every sum and mean is over the whole batch, which
is TRL's `dapo` across processes; TRL's `bnpo` (a token mean per process) has no counterpart here.

As a run's objective (`grpo_objective`, in place of the model's loss), the loss reads a batch of rollouts
(`jaxtrain.posttrain.rollouts` makes them), fixed in shape so the train step compiles once:

    tokens               (B, T + 1) int32     prompt + completion, right-padded with 0
    loss_weights         (B, T + 1) float32   1 on the completion's tokens, laid out as the tokens (as SFT's)
    old_log_probs        (B, T)     float32   π_old's log-prob of each target token (the sampler's), 0 elsewhere
    advantages           (B,)       float32
    reference_log_probs  (B, T)     float32   π_ref's, where β > 0 (`jaxtrain.posttrain.grpo_reference` adds them)

The policy's log-probs are the model's `target_log_probs` of the tokens; the reference's come with the batch, computed
once per batch of rollouts (the adapters switched off, or a frozen copy of the starting weights), not in each of its
optimizer steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.errors import UserInputError
from jaxtrain.ops.sequence import target_weights

AGGREGATIONS = {
    "grpo": "DeepSeekMath's per-completion token mean, then the mean over completions",
    "dapo": "DAPO's token mean over the batch",
    "dr_grpo": "Dr. GRPO's sum over tokens / (completions x max_completion_length)",
}
SCALES = {
    "std": "GRPO: over the group's std",
    "batch": "over the whole batch's std (Liu et al. 2025, 'Tricks or Traps', TRL's scale_rewards='batch')",
    "none": "Dr. GRPO: not divided, so easy and hard prompts weigh alike",
}
ROLLOUT_KEYS = ("tokens", "loss_weights", "old_log_probs", "advantages")  # a batch of rollouts, as above
REFERENCE_KEY = "reference_log_probs"  # and with β > 0 the reference's log-probs
STD_EPS = 1e-4  # TRL's: a group whose rewards are all equal gets advantages 0, not 0/0


class GrpoError(UserInputError):
    """A GRPO loss, or a batch of rollouts, that cannot work as given."""


def group_advantages(rewards: jax.Array, group_size: int, scale: str = "std") -> jax.Array:
    """Each completion's advantage, (B,) float32, from its reward (B,): the reward less the mean of its group (the
    `group_size` consecutive completions of one prompt), divided by the group's standard deviation + 1e-4 (`"std"`,
    GRPO), by the whole batch's (`"batch"`), or not divided (`"none"`, Dr. GRPO). Standard deviations are unbiased
    (ddof=1), as TRL's `nanstd`."""
    rewards = jnp.asarray(rewards, jnp.float32)
    _check_groups(rewards.shape, group_size, scale)
    groups = rewards.reshape(-1, group_size)
    centred = (groups - jnp.mean(groups, axis=1, keepdims=True)).reshape(-1)
    if scale == "none":
        return centred
    if scale == "std":
        std = jnp.repeat(jnp.std(groups, axis=1, ddof=1), group_size)
    else:  # batch: the group's mean is still the baseline; only the scale is shared
        std = jnp.std(rewards, ddof=1)
    return centred / (std + STD_EPS)


def k3_kl(log_probs: jax.Array, reference_log_probs: jax.Array) -> jax.Array:
    """Per-token estimate of KL(π_θ || π_ref) from the sampled tokens' log-probs (Schulman's k3): exp(d) - d - 1 with
    d = log π_ref - log π_θ, never negative, and unbiased for tokens sampled from π_θ."""
    d = reference_log_probs - log_probs
    # expm1: near π_ref = π_θ the estimate is ~d²/2, which exp(d) - 1 in float32 would round away
    return jnp.expm1(d) - d


@dataclasses.dataclass(frozen=True)
class GrpoLoss:
    """The clipped policy-gradient loss of GRPO and its variants; defaults are TRL 1.16's `GRPOConfig`'s."""

    epsilon_low: float = 0.2  # the ratio's lower clip is 1 - epsilon_low
    epsilon_high: float = 0.2  # its upper clip is 1 + epsilon_high; DAPO's clip-higher uses 0.28
    beta: float = 0.0  # KL coefficient; TRL's default 0 loads no reference (DeepSeekMath used 0.04, DeepSeek-R1 0.001)
    aggregation: str = "dapo"  # TRL's default loss_type; see AGGREGATIONS
    max_completion_length: int | None = None  # dr_grpo's divisor: the generation budget, not the padded length
    kl_ratio_weighted: bool = True  # TRL's use_bias_correction_kl: β ρ k3, whose gradient is the reverse KL's

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            choices = "; ".join(f"{name} ({what})" for name, what in AGGREGATIONS.items())
            raise GrpoError(f"aggregation={self.aggregation!r} is not one of: {choices}")
        if not 0.0 < self.epsilon_low < 1.0:
            raise GrpoError(
                f"epsilon_low={self.epsilon_low} is out of range: the ratio's lower clip 1 - epsilon_low must lie in "
                "(0, 1); use 0 < epsilon_low < 1 (GRPO uses 0.2)"
            )
        if not self.epsilon_high > 0.0:
            raise GrpoError(
                f"epsilon_high={self.epsilon_high} is out of range: use epsilon_high > 0 (GRPO uses 0.2, DAPO's "
                "clip-higher 0.28)"
            )
        if not self.beta >= 0.0:
            raise GrpoError(
                f"beta={self.beta} would reward moving away from the reference; use beta >= 0 (0 drops the KL term)"
            )
        if self.aggregation == "dr_grpo" and not (self.max_completion_length or 0) > 0:
            raise GrpoError(
                f"aggregation='dr_grpo' divides by max_completion_length, which is {self.max_completion_length}: "
                "set it to the generation budget (the most tokens a completion may have), e.g. 512"
            )

    def token_losses(
        self,
        log_probs: jax.Array,
        old_log_probs: jax.Array,
        reference_log_probs: jax.Array | None,
        advantages: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Per-token (loss ℓ, ratio ρ, KL term ρ k3 or k3, None without a reference), each (B, T), padding included.
        Old and reference log-probs and the advantages are constants: passing `log_probs` itself as
        `old_log_probs` is the first update on fresh rollouts, ρ = 1 with the plain policy gradient."""
        old_log_probs, advantages = jax.lax.stop_gradient((old_log_probs, advantages))
        ratio = jnp.exp(log_probs - old_log_probs)
        a = advantages[:, None]
        clipped = jnp.clip(ratio, 1.0 - self.epsilon_low, 1.0 + self.epsilon_high)
        losses = -jnp.minimum(ratio * a, clipped * a)  # the pessimistic bound: clipping only ever removes gradient
        if reference_log_probs is None:
            return losses, ratio, None
        kl = k3_kl(log_probs, jax.lax.stop_gradient(reference_log_probs))
        if self.kl_ratio_weighted:
            kl = ratio * kl
        if self.beta:
            losses = losses + self.beta * kl
        return losses, ratio, kl

    def aggregate(self, losses: jax.Array, mask: jax.Array) -> jax.Array:
        """The token losses (B, T) over the mask's tokens as one number, by `aggregation` (TRL's normalisations)."""
        total = losses * mask
        if self.aggregation == "grpo":
            return jnp.mean(jnp.sum(total, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0))
        if self.aggregation == "dapo":
            return jnp.sum(total) / jnp.maximum(jnp.sum(mask), 1.0)
        return jnp.sum(total) / (losses.shape[0] * self.max_completion_length)

    def __call__(
        self,
        log_probs: jax.Array,
        old_log_probs: jax.Array,
        reference_log_probs: jax.Array | None,
        advantages: jax.Array,
        mask: jax.Array,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(loss, metrics) of a batch: per-token log-probs (B, T) of the policy, the sampling policy and the reference
        (None when beta = 0), each completion's advantage (B,) and the completion tokens' mask (B, T). Metrics are
        token means over the batch, as TRL logs them: the fractions of tokens whose clipped term wins below
        (`clip_fraction_low`), above (`clip_fraction_high`) or either, the ratio, the KL term (with a reference), and
        the mean advantage."""
        self._check_batch(log_probs, old_log_probs, reference_log_probs, advantages, mask)
        mask = mask.astype(log_probs.dtype)
        losses, ratio, kl = self.token_losses(log_probs, old_log_probs, reference_log_probs, advantages)
        a = advantages[:, None]
        # Where the clipped term wins, the token has no gradient: ρ < 1 - ε_low with A < 0, ρ > 1 + ε_high with A > 0
        low = (ratio < 1.0 - self.epsilon_low) & (a < 0)
        high = (ratio > 1.0 + self.epsilon_high) & (a > 0)
        count = jnp.maximum(jnp.sum(mask), 1.0)

        def token_mean(x: jax.Array) -> jax.Array:
            return jax.lax.stop_gradient(jnp.sum(x * mask) / count)

        metrics = {
            "clip_fraction_low": token_mean(low),
            "clip_fraction_high": token_mean(high),
            "clip_fraction": token_mean(low | high),
            "ratio": token_mean(ratio),
            "advantage": jnp.mean(advantages),
        }
        if kl is not None:
            metrics["kl"] = token_mean(kl)
        return self.aggregate(losses, mask), metrics

    def _check_batch(
        self,
        log_probs: jax.Array,
        old_log_probs: jax.Array,
        reference_log_probs: jax.Array | None,
        advantages: jax.Array,
        mask: jax.Array,
    ) -> None:
        """Shapes only, so the checks hold under jit."""
        if log_probs.ndim != 2:
            raise GrpoError(f"log_probs have shape {log_probs.shape}; give one per completion token, shape (B, T)")
        shape = log_probs.shape
        named = {"old_log_probs": old_log_probs, "mask": mask, "reference_log_probs": reference_log_probs}
        for name, array in named.items():
            if array is not None and array.shape != shape:
                raise GrpoError(f"{name} have shape {array.shape}, log_probs {shape}: give both per token, (B, T)")
        if advantages.shape != shape[:1]:
            raise GrpoError(
                f"advantages have shape {advantages.shape} for log_probs {shape}: give one per completion, "
                f"({shape[0]},)"
            )
        if reference_log_probs is None and self.beta:
            raise GrpoError(
                f"beta={self.beta} weighs a KL to the reference, but reference_log_probs is None: pass them, or "
                "use beta=0"
            )
        if self.aggregation == "dr_grpo" and shape[1] > self.max_completion_length:
            raise GrpoError(
                f"completions have T = {shape[1]} tokens, more than max_completion_length={self.max_completion_length}"
                ": set max_completion_length to the generation budget (>= T)"
            )


def grpo_objective(
    loss: GrpoLoss,
) -> Callable[[Any, Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]:
    """The objective a model's loss is replaced with: (policy module, reference module or None, batch of rollouts) ->
    (loss, metrics). The reference's log-probs are the batch's (`REFERENCE_KEY`), read where `loss.beta` weighs
    them: the reference module itself is not run."""

    def objective(policy: Any, reference: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        log_probs = policy.target_log_probs({"tokens": batch["tokens"]})  # (B, T)
        reference_log_probs = batch[REFERENCE_KEY] if loss.beta else None
        mask = target_weights(None, batch["loss_weights"])  # (B, T): the completion's targets
        value, metrics = loss(log_probs, batch["old_log_probs"], reference_log_probs, batch["advantages"], mask)
        return value, {**metrics, "completion_tokens": jnp.sum(mask)}

    return objective


def _check_groups(shape: tuple[int, ...], group_size: int, scale: str) -> None:
    """Rewards that form groups of `group_size` completions with a spread to learn from."""
    if scale not in SCALES:
        choices = "; ".join(f"{name} ({what})" for name, what in SCALES.items())
        raise GrpoError(f"scale={scale!r} is not one of: {choices}")
    if len(shape) != 1:
        raise GrpoError(f"rewards have shape {shape}; give one per completion, shape (B,) with B = prompts x G")
    if group_size == 1:
        raise GrpoError(
            "G = 1: every advantage is 0 (each reward is its own group's mean), so nothing is learned; use G >= 2 "
            "completions per prompt (TRL's default is 8)"
        )
    if group_size < 1:
        raise GrpoError(f"group_size={group_size} is not a number of completions per prompt; use G >= 2")
    if shape[0] % group_size:
        raise GrpoError(
            f"B = {shape[0]} rewards do not split into groups of G = {group_size}: give prompts x G rewards, each "
            "prompt's G completions consecutive"
        )
