"""Bytes: of an array on one device under its sharding, of a tree, and of a compiled step's memory."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from jaxtrain.formatting import fmt_bytes

PyTree = Any


def device_bytes(x: jax.ShapeDtypeStruct | jax.Array) -> int:
    """Bytes one device holds of array `x` under its sharding."""
    return math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize


def tree_device_bytes(tree: PyTree) -> int:
    return sum(device_bytes(x) for x in jax.tree.leaves(tree))


def total_bytes(tree: PyTree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def memory_report(compiled: jax.stages.Compiled) -> str:
    """The compiled step's per-device memory: arguments, outputs, aliased (donated), temporaries, peak."""
    m = compiled.memory_analysis()
    if m is None:
        return "memory analysis: not available on this backend"
    bound = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    peak = getattr(m, "peak_memory_in_bytes", 0)
    return (
        f"compiled step memory per device: arguments {fmt_bytes(m.argument_size_in_bytes)}, outputs "
        f"{fmt_bytes(m.output_size_in_bytes)} (donated/aliased {fmt_bytes(m.alias_size_in_bytes)}), temporaries "
        f"{fmt_bytes(m.temp_size_in_bytes)}; at most {fmt_bytes(bound)} live"
        + (f" (XLA's peak estimate {fmt_bytes(peak)})" if peak else "")
    )
