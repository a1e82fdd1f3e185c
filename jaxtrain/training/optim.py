"""The optimizer (optax's AdamW, SGD, Adafactor, Lion or Muon), with a linear warmup + cosine learning-rate schedule,
decoupled weight decay and global-norm gradient clipping, the same for each.

Muon orthogonalises the update of each weight matrix and leaves every other parameter to AdamW. Which dims of a
parameter form its matrix comes from the parameter's logical dim names, never from its shape or path
(`muon_dimensions`):

>>> muon_dimensions(("layers", "embed", "heads", "kv"))  # a query projection: a (embed, heads * kv) matrix per layer
MuonDimensionNumbers(reduction_axis=1, output_axis=(2, 3))
>>> muon_dimensions(("layers", "mlp", "embed"))  # the MLP's down projection
MuonDimensionNumbers(reduction_axis=(1,), output_axis=2)
>>> muon_dimensions(("vocab", "embed")) is None  # the embedding goes to AdamW
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from jaxtrain.run_config import ConfigError, OptimizerConfig
from jaxtrain.sharding.rules import is_layer_stack, is_logical_names

PyTree = Any

# Dims that index separate matrices, orthogonalised one by one: stacked layers, the q/k/v (or k/v) parts of a fused
# projection (Muon's authors orthogonalise q, k and v apart), the experts of a mixture.
MATRIX_BATCH_DIMS = frozenset({"layers", "qkv", "expert"})
# A parameter with one of these dims is a lookup table or an output head over classes, which Muon's authors (and
# optax's docs) leave to AdamW: its rows are looked up one at a time, or its outputs are logits, not features.
TABLE_DIMS = frozenset({"vocab", "classes", "table_rows"})
# Dims that only index a projection's outputs: a parameter with no other matrix dims is a vector per head (a q/k/v
# bias), not a map from one space to another.
OUTPUT_ONLY_DIMS = frozenset({"heads", "kv_heads", "kv"})
# A matrix whose first dim is one of these reads it: the residual stream, or an adapter's rank (a LoRA B factor).
INPUT_FIRST_DIMS = frozenset({"embed", "lora_rank"})


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


def make_optimizer(
    cfg: OptimizerConfig, total_steps: int, logical_names: PyTree
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer `cfg.name` over params whose dims are called `logical_names` (a tree of name tuples, as
    `ModelParts.logical_names`), and its learning-rate schedule."""
    schedule = make_schedule(cfg, total_steps)
    update = BUILDERS[cfg.name](cfg, schedule, logical_names, total_steps)  # cfg.name is one of them: checked
    clip = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    return optax.chain(*clip, update), schedule


def muon_dimensions(names: Sequence[str | None]) -> MuonDimensionNumbers | None:
    """How Muon sees a parameter whose dims are called `names`: its matrix's reduction (input) and output dims, the
    other dims indexing separate matrices (`MATRIX_BATCH_DIMS`); None for a parameter AdamW takes instead.

    AdamW takes a parameter with fewer than two matrix dims (norms, biases, scalars), one with a table dim
    (`TABLE_DIMS`: embeddings, the head) and one whose matrix dims only index heads (`OUTPUT_ONLY_DIMS`). A matrix
    whose first dim is `embed` reads the residual stream: `embed` is its input, the rest its output (q/k/v, the
    MLP's input and gate); so does one whose first dim is an adapter's rank (`lora_rank`: a LoRA B factor reads
    its A's output). Any other matrix writes its last dim from the rest, as `x @ w` does (the attention output
    and MLP down projections into `embed`, a convolution's `conv_out` from its window and `conv_in`, a LoRA A
    factor's rank)."""
    matrix = [dim for dim, name in enumerate(names) if name not in MATRIX_BATCH_DIMS]
    matrix_names = {names[dim] for dim in matrix}
    if len(matrix) < 2 or TABLE_DIMS & set(names) or matrix_names <= OUTPUT_ONLY_DIMS:
        return None
    if names[matrix[0]] in INPUT_FIRST_DIMS:
        return MuonDimensionNumbers(reduction_axis=matrix[0], output_axis=tuple(matrix[1:]))
    return MuonDimensionNumbers(reduction_axis=tuple(matrix[:-1]), output_axis=matrix[-1])


def _adamw(cfg: OptimizerConfig, schedule: optax.Schedule, _names: PyTree, _steps: int) -> optax.GradientTransformation:
    return optax.adamw(schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay)


def _sgd(cfg: OptimizerConfig, schedule: optax.Schedule, _names: PyTree, _steps: int) -> optax.GradientTransformation:
    # Plain SGD with decoupled weight decay: linear in the gradient, as FedAvg analyses assume.
    return optax.chain(optax.add_decayed_weights(cfg.weight_decay), optax.sgd(schedule))


def _lion(cfg: OptimizerConfig, schedule: optax.Schedule, _names: PyTree, _steps: int) -> optax.GradientTransformation:
    return optax.lion(schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay)


def _adafactor(
    cfg: OptimizerConfig, schedule: optax.Schedule, names: PyTree, _steps: int
) -> optax.GradientTransformation:
    """`optax.adafactor`'s chain, with its two per-parameter RMS steps (update clipping, the parameter scale) taken
    per layer of a layer-stacked parameter, as for a model's own per-layer matrices; over the whole stack they would
    mix the layers, and count the padding rows of a pipeline layout. Weight decay is scheduled with the learning
    rate: decoupled, as the other optimizers have it (optax adds Adafactor's after the learning rate)."""
    clip = cfg.adafactor_clipping_threshold
    steps = [
        optax.scale_by_factored_rms(
            cfg.adafactor_factored,
            cfg.adafactor_decay_rate,
            min_dim_size_to_factor=cfg.adafactor_min_dim_size_to_factor,
        ),
        *([per_layer(optax.clip_by_block_rms(clip), names)] if clip > 0 else []),
        optax.scale_by_learning_rate(schedule, flip_sign=False),
        *([per_layer(optax.scale_by_param_block_rms(), names)] if cfg.adafactor_parameter_scale else []),
        *([optax.ema(cfg.adafactor_momentum, debias=False)] if cfg.adafactor_momentum > 0 else []),
        *([optax.add_decayed_weights(lambda count: cfg.weight_decay * schedule(count))] if cfg.weight_decay else []),
        optax.scale(-1),
    ]
    return optax.chain(*steps)


def per_layer(inner: optax.GradientTransformation, logical_names: PyTree) -> optax.GradientTransformation:
    """`inner`, a stateless transformation that treats each parameter as one block, applied to each layer of a
    layer-stacked parameter (leading `layers` dim) apart and to every other parameter whole."""

    def update(updates: PyTree, state: Any, params: PyTree | None = None) -> tuple[PyTree, Any]:
        def one(names: tuple, update: jax.Array, param: jax.Array | None) -> jax.Array:
            def apply(u, p):
                return inner.update(u, state, p)[0]

            return jax.vmap(apply)(update, param) if is_layer_stack(names) else apply(update, param)

        given = params if params is not None else jax.tree.map(lambda _: None, updates)
        return jax.tree.map(one, logical_names, updates, given, is_leaf=is_logical_names), state

    return optax.GradientTransformation(inner.init, update)


def _muon(cfg: OptimizerConfig, schedule: optax.Schedule, names: PyTree, steps: int) -> optax.GradientTransformation:
    if all(muon_dimensions(n) is None for n in jax.tree.leaves(names, is_leaf=is_logical_names)):
        raise ConfigError(
            "optimizer.name=muon: this model has no weight matrix Muon can take (see jaxtrain.training.optim."
            "muon_dimensions), so every parameter would be AdamW's; use optimizer.name=adamw."
        )
    adam_schedule = (
        make_schedule(dataclasses.replace(cfg, learning_rate=cfg.muon_adam_learning_rate), steps)
        if cfg.muon_adam_learning_rate > 0
        else schedule
    )
    return optax.contrib.muon(
        schedule,
        ns_steps=cfg.muon_ns_steps,
        beta=cfg.muon_momentum,
        weight_decay=cfg.weight_decay,
        nesterov=cfg.muon_nesterov,
        adam_b1=cfg.beta1,
        adam_b2=cfg.beta2,
        adam_weight_decay=cfg.weight_decay,
        adam_learning_rate=adam_schedule,
        muon_weight_dimension_numbers=jax.tree.map(muon_dimensions, names, is_leaf=is_logical_names),
        consistent_rms=cfg.muon_consistent_rms or None,
    )


BUILDERS = {"adamw": _adamw, "sgd": _sgd, "adafactor": _adafactor, "lion": _lion, "muon": _muon}  # OPTIMIZERS' order
