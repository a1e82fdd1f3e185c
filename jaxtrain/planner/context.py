"""The bytes context parallelism's attention sends over the axes that split the sequence: an analytic model.

Per layer and device, with C devices on the axis, L the bytes of one device's K (or V) block, b x T/C x G x K in
the compute dtype (G: the kv heads a device holds; all H query heads where the tensor axis does not divide G, since
the kernel then repeats K and V), and L32 the same in float32:
- `ring`: the forward passes K and V on C - 1 times (2(C-1)L); the backward passes them on C - 1 times again and
  dK and dV, float32 accumulators, C times (2(C-1)L + 2C L32).
- `allgather`: the forward gathers K and V ((C-1)/C of 2CL: 2(C-1)L); the backward gathers them again (it keeps
  only the device's own) and reduce-scatters dK and dV, summed in float32 (2(C-1)L + 2(C-1)L32).
A remat policy recomputes the forward in the backward, but not its transfers: models apply remat with
prevent_cse=False and XLA reuses the forward's results (measured: the same bytes under remat=full). Positions and
segment ids travel with the blocks, but once per step (they are the same in every layer): under 1% at any useful
head dim, and left out. Under a pipeline the layers divide over the stages and idle ticks add placeholder traffic,
which this model does not count.

    >>> transfers = context_attention_bytes(run.cfg, run.shardings)        # doctest: +SKIP
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxtrain.placement.shardings import Shardings
from jaxtrain.planner.transfers import Transfer
from jaxtrain.run_config import RunConfig


def context_attention_bytes(cfg: RunConfig, shardings: Shardings) -> list[Transfer]:
    """Bytes each device sends per step for attention over the axes that split `seq`; none where nothing does or the
    model has no attention of this kind (a config without `context_parallel`)."""
    model = cfg.model
    axes = tuple(a for a in shardings.rules.activations.get("seq", ()) if shardings.mesh.shape[a] > 1)
    if not axes or not hasattr(model, "context_parallel"):
        return []
    ways = math.prod(shardings.mesh.shape[a] for a in axes)
    block = _kv_block_bytes(cfg, shardings, ways)
    forward = model.n_layers * 2 * (ways - 1) * block
    if model.context_parallel == "ring":
        backward = model.n_layers * (2 * (ways - 1) * block + 2 * ways * block * 4 / _itemsize(model.dtype))
        return [Transfer(axes, "collective-permute", forward + backward, "attention K/V blocks (ring)")]
    scattered = model.n_layers * 2 * (ways - 1) * block * 4 / _itemsize(model.dtype)
    return [
        Transfer(axes, "all-gather", 2 * forward, "attention K/V (allgather)"),  # again in the backward
        # XLA:CPU writes this one as a reduce-scatter too (a psum_scatter inside shard_map).
        Transfer(axes, "reduce-scatter", scattered, "attention dK/dV (allgather)", ("reduce-scatter", scattered)),
    ]


def _kv_block_bytes(cfg: RunConfig, shardings: Shardings, ways: int) -> float:
    """Bytes of one device's K (or V) per step: its rows, T / ways positions, the kv heads it holds."""
    model, shape = cfg.model, shardings.mesh.shape
    rows = cfg.data.batch_size / math.prod(shape[a] for a in shardings.rules.batch_axes() if shape[a] > 1)
    tensor = math.prod(shape[a] for a in shardings.rules.activations.get("heads", ()) if shape[a] > 1)
    heads = model.kv_heads if model.kv_heads % tensor == 0 else model.n_heads
    return rows * cfg.data.seq_len / ways * heads / tensor * model.head_channels * _itemsize(model.dtype)


def _itemsize(dtype: str) -> int:
    return jnp.dtype(dtype).itemsize  # bfloat16 too, which numpy does not know
