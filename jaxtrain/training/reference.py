"""A DPO run's reference log-probs without adapters: every pair's, computed once with the run's starting weights.

With adapters the reference is the same weights with the adapters switched off, computed in the step; without, the
reference would be a second copy of the model held beside it for the whole run. Computing each pair's chosen and
rejected log-probs once, on the training mesh, before the first step (TRL's `precompute_ref_log_probs`) costs one
forward pass over the pairs and no memory. A resumed run computes them again from the same starting weights (its
seed's initialisation, or `checkpoint.restore`'s), so the values are the uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxtrain.data.datasets import placed_batch
from jaxtrain.data.pairs import PAIR_KEYS
from jaxtrain.posttrain.preference import sequence_log_probs
from jaxtrain.training.recovery import initial_state
from jaxtrain.training.setup import Run


def reference_at_start(run: Run, state: Any, step: int, log: Callable[[str], None] = print) -> None:
    """Where the run's batches carry reference log-probs, compute them with its starting weights: `state`'s at step
    0; a resumed run's start made again (its seed's initialisation, or `checkpoint.restore`). Every run computes its
    own, so a dataset reused by another run never carries that run's."""
    if not getattr(run.dataset, "expects_reference", False):
        return
    start = state if step == 0 else initial_state(run, None, log)[0]
    attach_reference(run, start["params"], log)


def attach_reference(run: Run, params: Any, log: Callable[[str], None] = print) -> None:
    """Compute every pair's reference log-probs with `params` (the run's starting weights, as its state holds them)
    and hand them to the dataset, `data.batch_size` pairs at a time."""
    shardings, batch_size = run.shardings, run.cfg.data.batch_size
    shapes = {k: v for k, v in run.dataset.shapes(batch_size).items() if k in PAIR_KEYS}
    abstract = shardings.abstract_batch(shapes)
    model = shardings.model

    def log_probs(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return sequence_log_probs(model.module(params).target_log_probs, batch)

    compiled = shardings.compile(
        log_probs, shardings.abstract_state["params"], abstract, donate_state=False, out_shardings=shardings.replicated
    )

    shardings_of = {k: v.sharding for k, v in abstract.items()}

    def on_mesh(batch: dict[str, np.ndarray]) -> np.ndarray:
        return np.asarray(jax.device_get(compiled(params, placed_batch(batch, shardings_of))))

    run.dataset.attach_reference(on_mesh, batch_size)
    sizes = ", ".join(f"{run.dataset.size(split)} {split}" for split in ("train", "val"))
    log(f"reference log-probs of every pair ({sizes}), computed once with the starting weights")
