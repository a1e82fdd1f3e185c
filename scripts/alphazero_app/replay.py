"""A replay buffer of self-play positions, read by jaxtrain's train step as its dataset (the model's task is `custom`:
data the run brings, here `build(cfg, dataset=buffer)`): batch `step` is drawn from the positions held when it is
read, by a generator seeded with (seed, step, row), so on any mesh or process count the same step draws the same rows
from the same buffer. A checkpoint therefore holds the positions themselves (`saved`, `restore`), oldest first, as the
draws index them."""

from __future__ import annotations

import jax
import numpy as np

from jaxtrain import UserInputError

SPLITS = {"train": 0, "val": 1}  # a split's number in the draws' seed: each split draws its own rows


class ReplayBuffer:
    """The newest `capacity` positions: observation, policy target, value target."""

    task = "custom"  # the dataset protocol's field: data only this application makes

    def __init__(self, observation: tuple[int, ...], actions: int, capacity: int, seed: int):
        if capacity < 1:
            raise UserInputError(f"replay capacity {capacity}: give at least 1 position.")
        self.observation, self.actions, self.capacity, self.seed = observation, actions, capacity, seed
        self.data = {
            "observation": np.zeros((0, *observation), np.float32),
            "policy": np.zeros((0, actions), np.float32),
            "value": np.zeros((0,), np.float32),
        }

    def __len__(self) -> int:
        return len(self.data["value"])

    def add(self, rows: dict[str, np.ndarray]) -> None:
        """Append positions (as `selfplay.training_rows` gives them), dropping the oldest beyond `capacity`."""
        self.data = {k: np.concatenate([v, rows[k]])[-self.capacity :] for k, v in self.data.items()}

    def saved(self) -> dict[str, np.ndarray]:
        """The positions, zero-padded to `capacity` rows, and `size`, how many are real: what a checkpoint holds. The
        shapes to restore into must be known before a checkpoint is read, so they cannot depend on how full the buffer
        is (the padding's zeros cost little on disk: Orbax compresses)."""
        padded = {k: np.zeros((self.capacity, *v.shape[1:]), v.dtype) for k, v in self.data.items()}
        for k, v in self.data.items():
            padded[k][: len(v)] = v
        return {**padded, "size": np.asarray(len(self), np.int32)}

    def saved_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The shapes and dtypes of `saved()`; without a sharding, so a checkpoint reads them back as numpy arrays."""
        return {**self.shapes(self.capacity), "size": jax.ShapeDtypeStruct((), np.int32)}

    def restore(self, saved: dict[str, np.ndarray]) -> None:
        """Replace the positions with those of `saved` (from `saved()` of a buffer of the same capacity)."""
        size = int(saved["size"])
        self.data = {k: np.asarray(saved[k][:size]) for k in self.data}

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        """A batch of `batch_size` rows: the model's (models/alphazero.py) observation, policy and value targets."""
        return {
            "observation": jax.ShapeDtypeStruct((batch_size, *self.observation), np.float32),
            "policy": jax.ShapeDtypeStruct((batch_size, self.actions), np.float32),
            "value": jax.ShapeDtypeStruct((batch_size,), np.float32),
        }

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        """Rows `rows` of batch `step`, uniformly from the buffer (both splits: self-play has no held-out data)."""
        if not len(self):
            raise UserInputError("the replay buffer is empty: add self-play positions before the first step.")
        picks = [np.random.default_rng((self.seed, SPLITS[split], step, r)).integers(len(self)) for r in rows]
        return {k: v[picks] for k, v in self.data.items()}
