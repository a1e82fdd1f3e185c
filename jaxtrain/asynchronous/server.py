"""A parameter-server shard: some of the model's parameter arrays with their optimizer state, on one device of its own
process, updated by every gradient the driver sends it.

Its state is the train state of its leaves, `{"params": [...], "opt_state": ..., "step": version}`, and each update
goes through the update core of the SPMD step (`jaxtrain.parallel.step.apply_update`) with the run's optimizer and
schedule (`jaxtrain.training.optim.make_optimizer`), so one worker and one shard reproduce synchronous training. Two
differences, both because a shard sees only part of the gradient:

- global-norm clipping happens on the worker, over the whole gradient (`Worker.gradient`), so the shard's optimizer
  is built with `clip_norm=0`;
- whether the update is finite is decided on the worker too (its loss and its whole gradient): the driver passes a
  loss of 0 or NaN, so that every shard skips the same updates.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.parallel.step import apply_update
from jaxtrain.run_config import OptimizerConfig
from jaxtrain.training.optim import make_optimizer

PyTree = Any


class ServerShard:
    """One shard's state and its jitted update. `names`: the logical dim names of its leaves (Muon and Adafactor
    read them); `params`: their initial values; `steps`: the run's length, for the learning-rate schedule."""

    def __init__(self, optimizer: OptimizerConfig, steps: int, names: list[tuple], params: list[np.ndarray]):
        self.optimizer, schedule = make_optimizer(dataclasses.replace(optimizer, clip_norm=0.0), steps, names)
        params = [jnp.asarray(p) for p in params]
        self.state = {"params": params, "opt_state": self.optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

        def update(state, loss, scale, *grads):
            mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
            new_state, metrics, _ = apply_update(
                state, ((loss, {}), mean), optimizer=self.optimizer, schedule=schedule, update_scale=scale
            )
            return new_state, metrics["learning_rate"]

        self._update = jax.jit(update, donate_argnums=0)
        self.applied = 0  # gradients received, for the engine's counter check

    def apply(self, loss: float, scale: float, *grads: list[np.ndarray]) -> float:
        """One update with the mean of `grads` (each a list of this shard's leaves), its optimizer step scaled by
        `scale`; skipped (the version still advances) where `loss` is not finite. Returns the learning rate."""
        self.state, learning_rate = self._update(self.state, jnp.float32(loss), jnp.float32(scale), *grads)
        self.applied += len(grads)
        return float(learning_rate)

    def pid(self) -> int:
        return os.getpid()

    def params(self) -> tuple[int, list[np.ndarray]]:
        """The version (updates applied) and the current params of this shard."""
        return int(self.state["step"]), [np.asarray(p) for p in self.state["params"]]

    def applied_count(self) -> int:
        return self.applied

    def state_on_host(self) -> PyTree:
        """The whole state as numpy arrays, for a checkpoint."""
        return jax.tree.map(np.asarray, self.state)

    def load(self, state: PyTree) -> int:
        """Continue from `state_on_host`'s output (a restored checkpoint). Returns its version."""
        self.state = jax.tree.map(jnp.asarray, state)
        return int(self.state["step"])
