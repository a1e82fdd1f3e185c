"""GRPO's rollouts on Ray (`engine.kind=ray`): `engine.workers` rollout workers, each a JAX process on its own mesh,
sample batches of rollouts while the learner trains, from params at most k = `engine.max_staleness` versions old.
The batch carries the worker's log-probs as the old policy's, so GRPO's clipped importance ratio corrects for the age
of the params it was sampled from, as it does for a batch's later optimizer steps (`jaxtrain.posttrain.rollouts`).

Params version v is the learner's after v batches of rollouts (v x grpo.num_iterations optimizer steps); batch n is
trained on at version n, so a batch sampled from version v is n - v stale (`Rollout.staleness`, in its metrics).
Asked for batch n with version n, the driver:

    puts version n into Ray's object store once (a worker is sent a reference only when it holds older params)
    hands each idle worker the next batch of n .. n + k that nobody holds, with version n: none is staler than k
    with the window all taken, hands an idle worker a copy of batch n (a slow worker's copy need not be waited for)
    returns batch n as soon as one copy of it is back (a later copy is dropped)

k = 0 samples every batch from the learner's current params: the in-process rollouts, batch for batch (the same
prompts and sampling seed on a mesh of the same layout). k = -1, `engine.max_staleness`'s default (unbounded for
gradients), reads as k = engine.workers - 1: a batch ahead per worker, as far as keeps every worker busy.

A worker lays `mesh` over its own `engine.devices_per_worker` devices, as the engine's gradient workers do: the
learner's layout, so it samples with the learner's program (a layout that does not fit is refused, not shrunk).
Rewards reach the workers by name (`exact_match`, `format:REGEX`, `module:function`; a module-level function is
sent as its `module:function`): a lambda or closure exists only in the driver's process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import ray
from ray.exceptions import RayTaskError

from jaxtrain.asynchronous.cluster import connected, cpu_env
from jaxtrain.asynchronous.shards import host_leaves
from jaxtrain.data.datasets import placed_batch
from jaxtrain.devices import enable_compilation_cache, use_simulated_devices
from jaxtrain.errors import UserInputError
from jaxtrain.posttrain.rewards import FORMAT, Reward, resolve_rewards
from jaxtrain.posttrain.rollouts import Prompts, Rollout, RolloutError, Rollouts, RolloutShapes, batch_shardings
from jaxtrain.run_config import RunConfig
from jaxtrain.sharding.mesh import MeshError, parse_layout
from jaxtrain.training.setup import Run, build

PyTree = Any
Decode = Callable[[Sequence[int]], str]


@contextlib.contextmanager
def ray_rollouts(
    run: Run,
    params: PyTree,
    prompts: Prompts,
    rewards: Sequence[Reward],
    decode: Decode,
    log: Callable[[str], None] = print,
) -> Iterator[RayRollouts]:
    """Inside: `RayRollouts` for `run` from `params`, in the job's Ray session (`cluster.connected`); the workers
    stop on leaving. Rewards a worker cannot resolve, and a mesh its devices cannot hold, are refused first."""
    names = portable_rewards(rewards)
    check_worker_mesh(run.cfg)
    with connected(run.cfg.engine, log):
        sampler = RayRollouts(run, params, prompts, names, decode)
        try:
            yield sampler
        finally:
            sampler.close()


def portable_rewards(rewards: Sequence[Reward]) -> list[str]:
    """The names a rollout worker resolves `rewards` by in its own process (see the module's doc)."""
    return [_portable(reward) for reward in rewards]


def _portable(reward: Reward) -> str:
    if reward.name.startswith(FORMAT):
        return reward.name
    module = sys.modules.get(getattr(reward.fn, "__module__", None) or "")
    name = getattr(reward.fn, "__qualname__", "")
    if module is not None and module.__name__ != "__main__" and getattr(module, name, None) is reward.fn:
        return f"{module.__name__}:{name}"
    raise RolloutError(
        f"reward '{reward.name}' is a function of this process only ({reward.fn!r}), which engine.kind=ray's rollout "
        "workers cannot import: define it at the top level of an importable module and name it as module:function, "
        "or use engine.kind=spmd."
    )


def check_worker_mesh(cfg: RunConfig) -> None:
    """A rollout worker's mesh is `mesh` over `engine.devices_per_worker` devices: refuse one that does not fit."""
    devices = cfg.engine.devices_per_worker
    try:
        parse_layout(cfg.mesh).resolve(devices)
    except MeshError:
        raise RolloutError(
            f"engine.devices_per_worker={devices} cannot hold mesh '{cfg.mesh}': a rollout worker lays the mesh over "
            "its own devices; raise engine.devices_per_worker to the mesh's device count, or give the mesh an axis "
            "of -1."
        ) from None


class RolloutWorker:
    """A Ray actor: one JAX process on `devices` simulated CPU devices (0: those it sees) that samples batches of
    rollouts as the in-process `Rollouts` would, then waits until each took `slowdown` times as long (a slower node,
    simulated without taking the machine's cores)."""

    def __init__(self, devices: int, slowdown: float = 1.0):
        if devices:
            use_simulated_devices(devices)
        enable_compilation_cache()
        self.slowdown, self.version = slowdown, -1

    def start(self, cfg: RunConfig, prompts: Prompts, rewards: list[str], decode: Decode, leaves: list) -> None:
        """Build the run (one SPMD program, whatever `engine.kind`), place `leaves` (params of no known version) and
        sample batch 0 once, so that compiling is not counted `slowdown` times over."""
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, kind="spmd"))
        self.run = build(cfg, log=lambda *_: None, dataset=RolloutShapes.of(cfg))
        self.treedef = jax.tree.structure(self.run.shardings.abstract_state["params"])
        self.params = self._placed(leaves)
        self.rollouts = Rollouts(self.run, self.params, prompts, resolve_rewards(rewards), decode)
        self.rollouts(self.params, 0)

    def rollout(self, number: int, version: int, leaves: list | None) -> tuple[Rollout, int]:
        """Batch of rollouts `number` from params version `version`: `leaves` when given, else those held. Returns
        it (numpy arrays) and the version it was sampled from."""
        start = time.perf_counter()
        if leaves is not None:
            self.version, self.params = version, self._placed(leaves)
        rollout = self.rollouts(self.params, number)
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * (time.perf_counter() - start))
        return rollout, self.version

    def _placed(self, leaves: list) -> PyTree:
        tree = jax.tree.unflatten(self.treedef, leaves)
        return jax.device_put(tree, self.run.shardings.state_shardings["params"])


class RayRollouts:
    """GRPO's sampler on Ray's rollout workers (inside a Ray session): `sampler(params, number) -> Rollout`, batch
    `number` sampled from params at most k versions older than `params` (version `number`), and `place(batch)`."""

    def __init__(self, run: Run, params: PyTree, prompts: Prompts, rewards: list[str], decode: Decode):
        """`rewards`: names a worker resolves (`portable_rewards`); starts the workers and waits until each is ready."""
        engine = run.cfg.engine
        self.ahead = engine.max_staleness if engine.max_staleness >= 0 else engine.workers - 1
        self.shardings = batch_shardings(run)
        local, slowdowns = not engine.ray_address, engine.slowdowns()
        devices = engine.devices_per_worker if local else 0
        actor = ray.remote(num_cpus=1, max_restarts=0)(RolloutWorker).options(
            runtime_env=cpu_env(devices) if local else None
        )
        self.workers = [actor.remote(devices, slowdowns.get(i, 1.0)) for i in range(engine.workers)]
        initial = ray.put(host_leaves(params))
        _get([w.start.remote(run.cfg, prompts, rewards, decode, initial) for w in self.workers])
        self.held: list[int | None] = [None] * engine.workers  # the params version each worker holds
        self.running: dict[ray.ObjectRef, tuple[int, int]] = {}  # a result to come -> (worker, batch)
        self.ready: dict[int, tuple[Rollout, int, int]] = {}  # batch -> (rollout, version, worker)
        self.used, self.dropped = [0] * engine.workers, 0  # batches trained on per worker; copies dropped
        self.version, self.leaves = -1, initial  # the newest params published: each call publishes its own

    def __call__(self, params: PyTree, number: int) -> Rollout:
        """Batch of rollouts `number`, with its staleness; `params` are version `number`, the learner's now."""
        self.version, self.leaves = number, ray.put(host_leaves(params))  # on the host: the step donates params
        self._assign(number)
        while number not in self.ready:
            self._collect(number)
            self._assign(number)
        rollout, version, worker = self.ready.pop(number)
        self.used[worker] += 1
        return dataclasses.replace(rollout, staleness=number - version)

    def place(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
        """`batch` on the learner's mesh in the train step's batch shardings."""
        return placed_batch(batch, self.shardings)

    def close(self) -> None:
        """Stop the workers (what they are computing is dropped)."""
        for worker in self.workers:
            ray.kill(worker)
        self.running.clear()

    def _assign(self, number: int) -> None:
        """Every idle worker takes the next batch of `number` .. `number` + k that nobody holds, else a copy of batch
        `number` while it is not back."""
        held = {batch for _, batch in self.running.values()} | set(self.ready)
        wanted = [b for b in range(number, number + self.ahead + 1) if b not in held]
        busy = {worker for worker, _ in self.running.values()}
        for worker in (w for w in range(len(self.workers)) if w not in busy):
            if wanted or number not in self.ready:
                self._start(worker, wanted.pop(0) if wanted else number)

    def _start(self, worker: int, batch: int) -> None:
        leaves = None if self.held[worker] == self.version else self.leaves
        self.held[worker] = self.version
        self.running[self.workers[worker].rollout.remote(batch, self.version, leaves)] = (worker, batch)

    def _collect(self, number: int) -> None:
        """Wait for the next result: keep it unless its batch is behind `number` (a copy of a batch already used)."""
        [ref], _ = ray.wait(list(self.running), num_returns=1)
        worker, batch = self.running.pop(ref)
        rollout, version = _get(ref)
        if batch < number:
            self.dropped += 1
        else:
            self.ready[batch] = (rollout, version, worker)


def _get(refs: Any) -> Any:
    """`ray.get(refs)`, with a worker's error in bad input (a prompt too long, a reward module that does not import)
    raised as the one-line error it is."""
    try:
        return ray.get(refs)
    except RayTaskError as err:
        if isinstance(err.cause, UserInputError):
            raise err.cause from None
        raise
