"""Update policies (`updates.policy`): when the replicas' gradients meet the parameters.

- `synchronous`: every step, the mean gradient over every data-parallel device updates one set of parameters.
- `local_sgd` (federated averaging): each replica (an index on the `replica` mesh axis, itself possibly data-,
  FSDP- or tensor-parallel inside) keeps its own parameters and optimizer state and takes `average_every` = H steps on
  its own rows; then the parameters are averaged over the replicas. Communication across replicas drops H-fold.
- `diloco`: the same, but the average is an outer step: the replicas' mean change since the last sync is a
  pseudo-gradient for an outer optimizer (SGD with Nesterov momentum, `outer_lr`, `outer_momentum`) on the global
  parameters, to which every replica is then reset (Douillard et al., 2023). `local_sgd` is the outer step with
  learning rate 1 and no momentum.
- `stale`: the mean gradient is applied `staleness` = tau steps after it was computed, as an asynchronous parameter
  server would apply a worker's gradient computed on parameters tau updates old. tau = 0 is synchronous.

The train state keeps `params` as the global model (what evaluation and checkpoints see), and adds what a policy
needs: `local` (per-replica params and optimizer state, leading dim sharded over `replica`) or `delayed` (the
gradients not yet applied). Their steps are pure functions around the update core every step shares,
`step.apply_update`; `training/setup.py:compose_step` chooses one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain.errors import UserInputError
from jaxtrain.parallel.step import GradFn, apply_update
from jaxtrain.sharding.param_state import shardings_like_params

PyTree = Any
POLICIES = ("synchronous", "local_sgd", "diloco", "stale")
REPLICA_AXIS = "replica"


class UpdatePolicyError(UserInputError):
    """An update policy that cannot run with these settings or on this mesh."""


@dataclasses.dataclass(frozen=True)
class UpdatePolicy:
    name: str = "synchronous"
    average_every: int = 1  # local_sgd, diloco: H local steps between averages
    staleness: int = 0  # stale: tau
    outer_lr: float = 0.7  # diloco's outer SGD
    outer_momentum: float = 0.9

    def __post_init__(self):
        if self.name not in POLICIES:
            raise UpdatePolicyError(f"updates.policy='{self.name}': use one of {', '.join(POLICIES)}.")
        if self.is_local and self.average_every < 1:
            raise UpdatePolicyError(
                f"updates.average_every={self.average_every}: {self.name} needs H >= 1 local steps between averages "
                "(H = 1 averages every step)."
            )
        if self.name == "stale" and self.staleness < 0:
            raise UpdatePolicyError(f"updates.staleness={self.staleness}: a gradient cannot arrive before it is made.")

    @property
    def is_local(self) -> bool:
        return self.name in ("local_sgd", "diloco")

    def check_mesh(self, mesh: Mesh) -> None:
        if self.is_local and mesh.shape[REPLICA_AXIS] < 2:
            raise UpdatePolicyError(
                f"updates.policy={self.name} trains replicas apart, one per index of the '{REPLICA_AXIS}' mesh axis, "
                f"but this mesh has {REPLICA_AXIS}=1. Use e.g. --mesh {REPLICA_AXIS}=8, or {REPLICA_AXIS}=2,data=4 "
                "(data parallel inside each replica)."
            )

    def outer_optimizer(self) -> optax.GradientTransformation:
        """The optimizer of the global params: FedAvg's plain average, or DiLoCo's Nesterov SGD."""
        if self.name == "local_sgd":
            return optax.sgd(1.0)
        return optax.sgd(self.outer_lr, momentum=self.outer_momentum or None, nesterov=self.outer_momentum > 0)

    def state_optimizer(self, optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
        """The optimizer whose state is `state["opt_state"]` (that of the global params)."""
        return self.outer_optimizer() if self.is_local else optimizer

    def extra_state(
        self, params: PyTree, shardings: PyTree, optimizer: optax.GradientTransformation, mesh: Mesh
    ) -> tuple[dict[str, PyTree], dict[str, PyTree]]:
        """Abstract shapes and shardings of the state this policy adds to {params, opt_state, step}."""
        if self.is_local:
            replicas = mesh.shape[REPLICA_AXIS]
            local_opt = jax.eval_shape(optimizer.init, params)
            opt_shardings = shardings_like_params(local_opt, params, shardings, mesh)
            shapes = {"params": params, "opt_state": local_opt}
            return {"local": _stacked(shapes, replicas)}, {
                "local": _stacked_shardings({"params": shardings, "opt_state": opt_shardings}, REPLICA_AXIS)
            }
        if self.name == "stale":
            return {"delayed": {"grads": _stacked(params, self.staleness), "count": _scalar()}}, {
                "delayed": {"grads": _stacked_shardings(shardings, None), "count": _replicated(mesh)}
            }
        return {}, {}

    def init_extra(self, params: PyTree, optimizer: optax.GradientTransformation, mesh: Mesh) -> dict[str, PyTree]:
        """The added state at the start: every replica at the global params with a fresh optimizer, or no delayed
        gradients yet."""
        if self.is_local:
            replicas = mesh.shape[REPLICA_AXIS]
            local = jax.tree.map(lambda p: jnp.broadcast_to(p, (replicas, *p.shape)), params)
            return {"local": {"params": local, "opt_state": jax.vmap(optimizer.init)(local)}}
        if self.name == "stale":
            grads = jax.tree.map(lambda p: jnp.zeros((self.staleness, *p.shape), p.dtype), params)
            return {"delayed": {"grads": grads, "count": jnp.zeros((), jnp.int32)}}
        return {}


def stale_step(
    state: dict[str, PyTree],
    batch: dict[str, jax.Array],
    *,
    grad_fn: GradFn,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    staleness: int,
) -> tuple[dict[str, PyTree], dict[str, jax.Array]]:
    """Compute this step's gradient, apply the one computed `staleness` steps ago (nothing until there is one).

    A non-finite gradient is dropped: neither queued nor applied, the queue waits."""
    gradient = grad_fn(state["params"], batch)
    delayed = state["delayed"]
    queue = jax.tree.map(lambda q, g: jnp.concatenate([q, g[None]]), delayed["grads"], gradient[1])
    oldest = jax.tree.map(lambda q: q[0], queue)
    ready = delayed["count"] >= staleness
    new_state, metrics, finite = apply_update(
        state, gradient, optimizer=optimizer, schedule=schedule, applied=oldest, ready=ready
    )
    kept = jax.tree.map(lambda q, old: jnp.where(finite, q[1:], old), queue, delayed["grads"])
    count = jnp.minimum(delayed["count"] + finite.astype(jnp.int32), staleness)
    return {**new_state, "delayed": {"grads": kept, "count": count}}, metrics


def local_step(
    state: dict[str, PyTree],
    batch: dict[str, jax.Array],
    *,
    grad_fn: GradFn,
    optimizer: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    schedule: optax.Schedule,
    mesh: Mesh,
    average_every: int,
    total_steps: int,
) -> tuple[dict[str, PyTree], dict[str, jax.Array]]:
    """Each replica takes an optimizer step on its own rows; every `average_every` steps (and at the last step) the
    replicas' mean change is applied to the global params by `outer`, and every replica restarts from them.

    One `shard_map` manual over `replica` only: inside, each replica's step is the ordinary one, sharded over the
    data, fsdp and tensor axes as the rules say."""

    def per_replica(local, params, opt_state, step, batch):
        own = jax.tree.map(lambda x: x[0], local)  # this replica's {"params", "opt_state"}
        gradient = grad_fn(own["params"], batch)
        own, metrics, _ = apply_update({**own, "step": step}, gradient, optimizer=optimizer, schedule=schedule)

        def average():
            change = jax.tree.map(jnp.subtract, params, jax.lax.pmean(own["params"], REPLICA_AXIS))
            updates, new_opt_state = outer.update(change, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            return new_params, new_opt_state, new_params

        due = ((step + 1) % average_every == 0) | (step + 1 == total_steps)
        params, opt_state, own_params = jax.lax.cond(due, average, lambda: (params, opt_state, own["params"]))
        nonfinite = jax.lax.pmax(metrics.pop("nonfinite"), REPLICA_AXIS)
        metrics = {**jax.lax.pmean(metrics, REPLICA_AXIS), "nonfinite": nonfinite}
        local = jax.tree.map(lambda x: x[None], {"params": own_params, "opt_state": own["opt_state"]})
        return local, params, opt_state, metrics

    local, params, opt_state, metrics = jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(PartitionSpec(REPLICA_AXIS), PartitionSpec(), PartitionSpec(), PartitionSpec(),
                  PartitionSpec(REPLICA_AXIS)),
        out_specs=(PartitionSpec(REPLICA_AXIS), PartitionSpec(), PartitionSpec(), PartitionSpec()),
        axis_names={REPLICA_AXIS},
        # The global params and metrics leave equal on every replica (set from a pmean, or passed through), which
        # the type system cannot follow through the cond.
        check_vma=False,
    )(state["local"], state["params"], state["opt_state"], state["step"], batch)  # fmt: skip
    new_state = {**state, "params": params, "opt_state": opt_state, "step": state["step"] + 1, "local": local}
    return new_state, metrics


def _scalar() -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((), jnp.int32)


def _replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _stacked(tree: PyTree, count: int) -> PyTree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((count, *x.shape), x.dtype), tree)


def _stacked_shardings(shardings: PyTree, axis: str | None) -> PyTree:
    """Shardings for arrays with a new leading dim over `axis` (None: whole), the other dims as before."""
    return jax.tree.map(lambda s: NamedSharding(s.mesh, PartitionSpec(axis, *s.spec)), shardings)
