"""Explicit gradient synchronisation over the data-parallel axes, written with `shard_map` and `jax.lax.ppermute` so
that what crosses the network is the algorithm's and nothing else (`allreduce.algorithm`):

- `ring`: reduce-scatter then all-gather around a ring of the N replicas, N - 1 neighbour exchanges each, per bucket.
  Every device sends 2(N - 1)/N of the gradient: the bandwidth-optimal all-reduce.
- `hierarchical`: a ring reduce-scatter inside each group of K devices (the axes other than `replica`: one host or
  slice), a ring all-reduce of each 1/K shard across the R groups (the `replica` axis, the slow link), a ring
  all-gather inside the group. The slow link carries 2(R - 1)/R of a 1/K shard instead of the whole gradient.
- `star`: the gradient is cut into S shards, one per hub (devices 0, N/S, 2N/S, ...); every device sends each
  shard to its hub, the hubs sum, and send the sum back to every device. A hub sends (N - 1)/S of the gradient,
  another device 1: the centralised pattern's hot spot, kept so its cost can be compared. Every device then applies
  the same optimizer update (sending back updated parameters instead would move the same bytes; keeping the
  optimizer state on the hubs only is what `fsdp` does in this framework). (Not the Ray engine's parameter server,
  `engine.kind=ray`, which applies updates apart from the workers.)

The gradient is flattened, padded to a multiple of N and cut into buckets of `bucket_bytes`; with
`compression="bf16"` every message is bfloat16 while sums are kept in float32, and each value is rounded once, by
its owner, so all replicas end with the same bits. The result is the mean over the replicas, like XLA's.

    >>> sync = GradientSync("ring", axes=("data",), sizes={"data": 8})                 # doctest: +SKIP
    >>> grad_fn = replica_gradients(grad_fn, mesh, sync.axes, sync.mean)                # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from jaxtrain.analysis.comm_report import Expected
from jaxtrain.errors import UserInputError

ALGORITHMS = ("ring", "hierarchical", "star")
COMPRESSIONS = {"none": None, "bf16": jnp.bfloat16}
GROUP_AXIS = "replica"  # hierarchical: the axis across groups; the other data-parallel axes are inside a group


class GradSyncError(UserInputError):
    """A gradient synchronisation that cannot run on this mesh or with these settings."""


@dataclasses.dataclass(frozen=True)
class GradientSync:
    """One explicit algorithm over the data-parallel `axes` (sizes from the mesh, all > 1)."""

    algorithm: str
    axes: tuple[str, ...]
    sizes: Mapping[str, int]
    bucket_bytes: int = 4 << 20
    hubs: int = 1
    compression: str = "none"

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise GradSyncError(
                f"allreduce.algorithm='{self.algorithm}': use xla, fused or one of {', '.join(ALGORITHMS)}."
            )
        if self.compression not in COMPRESSIONS:
            raise GradSyncError(f"allreduce.compression='{self.compression}': use {' or '.join(COMPRESSIONS)}.")
        if self.replicas < 2:
            raise GradSyncError(
                f"allreduce.algorithm={self.algorithm} needs at least 2 data-parallel replicas; the mesh has 1."
            )
        if self.algorithm == "hierarchical" and (GROUP_AXIS not in self.axes or self.replicas == self.groups):
            raise GradSyncError(
                f"allreduce.algorithm=hierarchical needs groups: a '{GROUP_AXIS}' axis (across the slow link) and data "
                f"parallelism inside each group, e.g. --mesh {GROUP_AXIS}=2,data=4; this mesh has "
                f"{', '.join(f'{a}={self.sizes[a]}' for a in self.axes)}."
            )
        if self.algorithm == "star" and (self.hubs < 1 or self.replicas % self.hubs):
            raise GradSyncError(
                f"allreduce.hubs={self.hubs} must divide the {self.replicas} data-parallel replicas: choose a divisor."
            )
        if self.bucket_bytes < 4 * self.replicas:
            raise GradSyncError("allreduce.bucket_mb is too small: a bucket needs at least one value per replica.")

    @property
    def replicas(self) -> int:
        return math.prod(self.sizes[a] for a in self.axes)

    @property
    def groups(self) -> int:
        return self.sizes.get(GROUP_AXIS, 1) if GROUP_AXIS in self.axes else 1

    @property
    def inner_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.axes if a != GROUP_AXIS)

    def mean(self, grads):
        """Inside `shard_map`: the mean of `grads` over the replicas (`step.replica_gradients` runs it). Every
        parameter must be replicated over `axes` (the caller checks)."""
        flat, unravel = ravel_pytree(grads)
        unit = 2 * self.replicas  # every chunk even-sized, so bfloat16 messages pack into 32-bit words
        padded = jnp.pad(flat.astype(jnp.float32), (0, -flat.size % unit))
        step = max(unit, self.bucket_bytes // 4 // unit * unit)
        reduce = {"ring": self._ring, "hierarchical": self._hierarchical, "star": self._star}
        summed = jnp.concatenate([reduce[self.algorithm](padded[i : i + step]) for i in range(0, padded.size, step)])
        return unravel((summed[: flat.size] / self.replicas).astype(flat.dtype))

    @property
    def _wire(self):
        return COMPRESSIONS[self.compression]

    def _send(self, x, axes, perm):
        wire = self._wire
        if wire is None:
            return jax.lax.ppermute(x, axes, perm)
        # Two bfloat16 values per 32-bit word: left as bfloat16, XLA:CPU widens the message back to float32.
        packed = jax.lax.bitcast_convert_type(x.astype(wire).reshape(-1, 2), jnp.uint32)
        received = jax.lax.bitcast_convert_type(jax.lax.ppermute(packed, axes, perm), wire)
        return received.reshape(x.shape).astype(x.dtype)

    def _round(self, x):
        """The value as every receiver sees it: an owner's own copy must match what it sent."""
        wire = self._wire
        return x if wire is None else x.astype(wire).astype(x.dtype)

    def _ring(self, bucket):
        return self._ring_all_gather(self._ring_reduce_scatter(bucket, self.axes), self.axes)

    def _hierarchical(self, bucket):
        inner, outer = self.inner_axes, (GROUP_AXIS,)
        shard = self._ring_reduce_scatter(bucket, inner)
        return self._ring_all_gather(self._ring_all_gather(self._ring_reduce_scatter(shard, outer), outer), inner)

    def _ring_reduce_scatter(self, x, axes):
        """x (L,) -> the sum over `axes` of chunk i of L/n, where i is this device's index along `axes`.

        At step k device i sends its running sum of chunk (i - k - 1) to i + 1 and adds what comes from i - 1; after
        n - 1 steps the chunk it adds last, chunk i, holds every device's contribution."""
        n, i = self._size(axes), jax.lax.axis_index(axes)
        chunks = x.reshape(n, -1)
        ring = [(j, (j + 1) % n) for j in range(n)]
        for k in range(n - 1):
            received = self._send(chunks[(i - k - 1) % n], axes, ring)
            chunks = chunks.at[(i - k - 2) % n].add(received)
        return chunks[i]

    def _ring_all_gather(self, chunk, axes):
        """Device i holds chunk i; after n - 1 steps of passing on what arrived last, every device holds them all."""
        n, i = self._size(axes), jax.lax.axis_index(axes)
        chunk = self._round(chunk)
        chunks = jnp.zeros((n, *chunk.shape), chunk.dtype).at[i].set(chunk)
        ring = [(j, (j + 1) % n) for j in range(n)]
        for k in range(n - 1):
            chunks = chunks.at[(i - k - 1) % n].set(self._send(chunks[(i - k) % n], axes, ring))
        return chunks.reshape(-1)

    def _star(self, bucket):
        """Push: in round r, hub s (device s * N/S) receives its shard from device (s * N/S + r) mod N. Pull: in
        round r, it sends the summed shard to that device. 2(N - 1) rounds, each a partial permutation."""
        n, s, i = self.replicas, self.hubs, jax.lax.axis_index(self.axes)
        stride, shards = n // s, bucket.reshape(s, -1)
        own = jnp.where(i % stride == 0, i // stride, 0)  # the shard this device sums, if it is a hub
        total = shards[own]
        for r in range(1, n):
            sources = [((k * stride + r) % n, k * stride) for k in range(s)]
            target = (i - r) % n  # the device this one pushes to in round r, if that one is a hub
            total = total + self._send(shards[(target // stride) % s], self.axes, sources)
        summed = self._round(total)
        gathered = jnp.zeros_like(shards).at[own].set(jnp.where(i % stride == 0, summed, 0))
        for r in range(1, n):
            targets = [(k * stride, (k * stride + r) % n) for k in range(s)]
            origin = (i - r) % n  # the hub this device hears from in round r, if it is one
            received = self._send(summed, self.axes, targets)
            is_hub = origin % stride == 0
            gathered = gathered.at[(origin // stride) % s].add(jnp.where(is_hub, received, 0))
        return gathered.reshape(-1)

    def _size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.sizes[a] for a in axes)

    def expected(self, gradient_bytes: int) -> list[Expected]:
        """What each device sends per step by this algorithm's analytic model (mean over devices), per level, for a
        float32 gradient of `gradient_bytes`, padded as `mean` pads it."""
        n, sent, g = self.replicas, ("collective-permute",), self._sent_gradient(gradient_bytes)
        if self.algorithm == "ring":
            return [Expected(f"ring, 2(N-1)/N x gradient, N={n}", 2 * (n - 1) / n * g, self.axes, sent)]
        if self.algorithm == "hierarchical":
            k, r = n // self.groups, self.groups
            return [
                Expected(f"inside groups, 2(K-1)/K x gradient, K={k}", 2 * (k - 1) / k * g, self.inner_axes, sent),
                Expected(f"across groups, 2(R-1)/R x gradient/K, R={r}", 2 * (r - 1) / r * g / k, (GROUP_AXIS,), sent),
            ]
        s, hub = self.hubs, self.hub_bytes(gradient_bytes)
        mean = (s * hub + (n - s) * g) / n  # another device sends each of the S shards to its hub: g
        return [Expected(f"star (a hub sends {hub / g:.2f}x gradient)", mean, self.axes, sent)]

    def hub_bytes(self, gradient_bytes: int) -> float:
        """star: what each hub (the busiest devices) sends per sync: its summed shard to the N - 1 others, and its
        push of the other shards to the S - 1 other hubs."""
        return (self.replicas - 1 + self.hubs - 1) * self._sent_gradient(gradient_bytes) / self.hubs

    def _sent_gradient(self, gradient_bytes: int) -> float:
        """The bytes of a float32 gradient as `mean` sends it: padded to 2N values, halved in bfloat16."""
        n = self.replicas
        return math.ceil(gradient_bytes / 8 / n) * 2 * n * 4 * (0.5 if self.compression == "bf16" else 1.0)
