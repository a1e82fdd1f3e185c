"""The two splits every dataset has, and the random draws that depend only on where a row is, so that any mesh, any
number of processes and a resumed run read the same rows: (seed, split, step, row) for a row's own draws, (seed, split,
epoch) for an epoch's order of a fixed set of examples."""

from __future__ import annotations

import numpy as np

SPLITS = {"train": 0, "val": 1}  # a split's number in random streams


def row_rng(seed: int, split: str, step: int, row: int, *stream: int) -> np.random.Generator:
    """Row `row` of batch `step`'s generator; `stream` tags a draw of its own beside the row's (e.g. masking's)."""
    return np.random.default_rng((seed, SPLITS[split], step, row, *stream))


def epoch_walk(seed: int, split: str, samples: np.ndarray, n: int) -> np.ndarray:
    """Which of `n` examples each global sample number reads: sample g is the (g mod n)-th example of epoch g div n's
    order, a permutation drawn from (seed, split, epoch)."""
    epochs, within = np.divmod(samples, n)
    picked = np.empty(len(samples), np.int64)
    for epoch in np.unique(epochs):
        order = np.random.default_rng((seed, SPLITS[split], int(epoch))).permutation(n)
        picked[epochs == epoch] = order[within[epochs == epoch]]
    return picked
