"""Checkpoints of runs trained with low-rank adapters (`lora.rank` > 0): the adapter settings a checkpoint stores,
its adapters restored onto a mesh, and its params merged into the base model's.

A LoRA run's checkpoint holds {"base", "lora_a", "lora_b"} (and "dropout_seed" with dropout) where the base model
holds a weight, so it cannot be read as the base model. What reads a checkpoint as a model (`jaxtrain export-hf`,
`jaxtrain generate`, a run starting from its params: `jaxtrain.training.recovery`) rebuilds the adapted model from the
stored `lora` settings, restores into it, and folds each adapter into its weight (`AdaptedModel.merge`) on the mesh:
the base model's params, which every reader takes.

    >>> params = restore_merged(step_dir, meta, placed)  # the base model's params, adapters folded in  # doctest: +SKIP
    >>> adapters = restore_adapters(step_dir, adapted)   # {path: {"lora_a", "lora_b"}}                 # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.placement.place import PlacedModel
from jaxtrain.posttrain.adapters import AdaptedModel, adapt
from jaxtrain.run_config import LoraConfig, config_from_table
from jaxtrain.training.checkpoint import restore_params

PyTree = Any
PROBE_SEQ_LEN = 8  # the adapters' shapes come from an abstract trace of the loss: any sequence the model takes


def stored_lora(step_dir: Path, meta: dict[str, Any]) -> LoraConfig:
    """The `lora` settings the run of checkpoint `step_dir` (meta `meta`) trained with; rank 0 where it trained no
    adapters (a checkpoint written before adapters existed stores none)."""
    stored = meta.get("config") or {}
    table = {"model_name": stored.get("model_name", ""), "lora": stored.get("lora") or {}}
    return config_from_table(table, f"{step_dir} (the config it stores)").lora


def with_stored_adapters(placed: PlacedModel, lora: LoraConfig, meta: dict[str, Any]) -> PlacedModel:
    """`placed` (the base model of a checkpoint) with the adapters `lora` puts on it, laid out by the same rules:
    the model whose params the checkpoint holds, less the dropout seeds (dropout acts in training only)."""
    seq_len = ((meta.get("config") or {}).get("data") or {}).get("seq_len", PROBE_SEQ_LEN)
    batch = {"tokens": jax.ShapeDtypeStruct((1, seq_len + 1), np.int32)}
    return dataclasses.replace(placed, model=adapt(placed.model, dataclasses.replace(lora, dropout=0.0), batch))


def restore_adapters(step_dir: Path, adapted: PlacedModel) -> PyTree:
    """The adapter factors of checkpoint `step_dir`, {path: {"lora_a", "lora_b"}} as `AdaptedModel.trainable`
    returns them, on `adapted`'s mesh; the base weights are not read."""
    model: AdaptedModel = adapted.model
    abstract = adapted.shardings().abstract_state["params"]
    return restore_params(step_dir, model.trainable(abstract))[0]


def restore_merged(step_dir: Path, meta: dict[str, Any], placed: PlacedModel, dtype: str | None = None) -> PyTree:
    """The base model's params of checkpoint `step_dir` on `placed`'s mesh and shardings (model layer order): as
    stored, or, from a run trained with adapters, each adapter folded into its weight, W + (alpha / rank)·A·B.
    `dtype`: the weights' dtype (default: the model's); the factors are read as stored (float32)."""
    base = placed.shardings()
    lora = stored_lora(step_dir, meta)
    if not lora.rank:
        return restore_params(step_dir, _weights_in(base.abstract_state["params"], dtype))[0]
    adapted = with_stored_adapters(placed, lora, meta)
    model: AdaptedModel = adapted.model
    trainable, frozen = model.split(adapted.shardings().abstract_state["params"])
    params, _ = restore_params(step_dir, model.join(trainable, _weights_in(frozen, dtype)))
    trainable, frozen = model.split(params)

    def merged(frozen: PyTree, trainable: PyTree) -> PyTree:
        return model.merge(model.join(trainable, frozen))

    # Merged where the weights lie, into the buffers they were restored in (donated): no weight is gathered, and the
    # devices hold the model once, besides the products A·B.
    return jax.jit(merged, out_shardings=base.state_shardings["params"], donate_argnums=0)(frozen, trainable)


def _weights_in(abstract: PyTree, dtype: str | None) -> PyTree:
    """`abstract` params with their floating-point arrays in `dtype` (as they are where None); integer arrays (the
    adapters' dropout seeds) as they are."""
    if dtype is None:
        return abstract

    def cast(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=x.sharding)

    return jax.tree.map(cast, abstract)
