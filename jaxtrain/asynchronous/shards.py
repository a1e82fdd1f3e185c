"""Which parameter leaves each server shard holds: the model's params as a list of leaves (in tree order), split
into `shards` groups of about equal bytes. Pure bookkeeping, no Ray and no devices."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxtrain.errors import UserInputError

PyTree = Any


class ShardingError(UserInputError):
    """More parameter-server shards than there are parameter arrays to hold."""


def assign_leaves(sizes: list[int], shards: int) -> list[list[int]]:
    """Leaf indices per shard: largest leaves first, each to the shard holding the fewest bytes so far (ties: the
    lowest shard), each shard's indices in tree order. Every shard gets at least one leaf."""
    if shards > len(sizes):
        raise ShardingError(
            f"engine.server_shards={shards}, but the model has only {len(sizes)} parameter arrays and a shard holds "
            f"whole arrays: use at most {len(sizes)} shards."
        )
    held, owned = [0] * shards, [[] for _ in range(shards)]
    for leaf in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        shard = min(range(shards), key=lambda s: (held[s], s))
        held[shard] += sizes[leaf]
        owned[shard].append(leaf)
    return [sorted(leaves) for leaves in owned]


def split(leaves: list[Any], owned: list[list[int]]) -> list[list[Any]]:
    """`leaves` grouped as `assign_leaves` says."""
    return [[leaves[i] for i in indices] for indices in owned]


def join(parts: list[list[Any]], owned: list[list[int]]) -> list[Any]:
    """The inverse of `split`: every leaf back at its index."""
    leaves: list[Any] = [None] * sum(map(len, owned))
    for indices, values in zip(owned, parts):
        for i, value in zip(indices, values):
            leaves[i] = value
    return leaves


def host_leaves(tree: PyTree) -> list[np.ndarray]:
    """The leaves of `tree` as numpy arrays on this host (gathered from every device that holds a part)."""
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(tree))]
