"""The optimizer: AdamW or SGD, warmup + cosine learning-rate schedule, global-norm gradient clipping."""

from __future__ import annotations

import optax

from jaxtrain.run_config import ConfigError, OptimizerConfig


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then cosine decay to `min_lr_ratio * learning_rate` at `total_steps`."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = make_schedule(cfg, total_steps)
    if cfg.name == "adamw":
        update = optax.adamw(schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay)
    elif cfg.name == "sgd":  # plain SGD with decoupled weight decay: linear in the gradient, as FedAvg analyses assume
        update = optax.chain(optax.add_decayed_weights(cfg.weight_decay), optax.sgd(schedule))
    else:
        raise ConfigError(f"optimizer.name='{cfg.name}': use adamw or sgd.")
    clip = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    return optax.chain(*clip, update), schedule
