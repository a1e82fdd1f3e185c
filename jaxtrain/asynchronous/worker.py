"""A worker: one JAX process on its own devices and its own mesh (data, FSDP, tensor inside it as in any run), which
computes the gradient of one batch on the params it holds, at its own pace.

It builds the run as `jaxtrain train` would (`jaxtrain.training.setup.build`: mesh, rules, plan, the composed
gradient with accumulation and gradient sync), and computes with its compiled gradient (`Run.compiled_grad`), so a
worker is the SPMD step without its update. The engine's driver says which batch and whether to pull params first.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import jax
import numpy as np
import optax

from jaxtrain.asynchronous import shards as leaves_of
from jaxtrain.devices import enable_compilation_cache, use_simulated_devices
from jaxtrain.run_config import RunConfig
from jaxtrain.sharding.rules import is_logical_names
from jaxtrain.training.loop import evaluate
from jaxtrain.training.setup import build

PyTree = Any


class Worker:
    """Worker `index` of the run `cfg`, on `devices` simulated CPU devices (0: the devices this process sees), which
    waits after each gradient until it took `slowdown` times as long as computing it did (a slower node, simulated
    without taking the machine's cores). `owned`: the leaf indices each server shard holds (None until known)."""

    def __init__(self, cfg: RunConfig, index: int, devices: int, slowdown: float = 1.0):
        if devices:
            use_simulated_devices(devices)
        enable_compilation_cache()
        self.index, self.slowdown = index, slowdown
        self.run = build(cfg, log=lambda *_: None)
        self.treedef = jax.tree.structure(self.run.shardings.abstract_state["params"])
        self._finish = jax.jit(functools.partial(_norm_and_clip, clip_norm=cfg.optimizer.clip_norm))
        self.params: PyTree = None
        self.owned: list[list[int]] | None = None
        # Compile, read the data and compute one gradient now, not in the first job: a slowed worker's first gradient
        # would otherwise wait out those one-off costs FACTOR - 1 times over, and the engine's clock count them.
        self._compute(self.run.shardings.init_state(self.run.optimizer, cfg.train.seed)["params"], 0)
        self.run.compiled_eval  # noqa: B018 - a cached property: compiles the evaluation step

    def pid(self) -> int:
        return os.getpid()

    def initial(self) -> tuple[list[np.ndarray], list[tuple]]:
        """The run's initial params (as `jaxtrain train` initialises them, from `train.seed`) as leaves, and their
        logical dim names."""
        run = self.run
        params = run.shardings.init_state(run.optimizer, run.cfg.train.seed)["params"]
        names = jax.tree.leaves(run.shardings.model.logical_names, is_leaf=is_logical_names)
        return leaves_of.host_leaves(params), names

    def set_shards(self, owned: list[list[int]]) -> None:
        self.owned = owned

    def gradient(self, batch: int, *pulled: tuple[int, list[np.ndarray]]) -> tuple[dict[str, float], ...]:
        """The gradient of training batch `batch` on the params pulled now (each server shard's (version, leaves)),
        else on those pulled last. Returns its metrics (loss, grad_norm, finite, seconds, the loss's own), then its
        leaves for each server shard, clipped as the optimizer would."""
        start = time.perf_counter()
        if pulled:
            self.params = self._place([leaves for _, leaves in pulled])
        info, grads = self._compute(self.params, batch)
        seconds = time.perf_counter() - start
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * seconds)
        return ({**info, "seconds": seconds}, *leaves_of.split(grads, self.owned))

    def _compute(self, params: PyTree, batch: int) -> tuple[dict[str, float], list[np.ndarray]]:
        """Metrics and clipped gradient leaves (on the host) of training batch `batch` at `params`."""
        (loss, metrics), grads = self.run.compiled_grad(params, self.run.batch("train", batch))
        norm, grads = self._finish(grads)
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        finite = bool(np.isfinite(float(loss)) and np.isfinite(float(norm)))
        info = {**values, "loss": float(loss), "grad_norm": float(norm), "finite": finite}
        return info, leaves_of.host_leaves(grads)

    def evaluate(self, *pulled: tuple[int, list[np.ndarray]]) -> dict[str, float]:
        """Validation metrics (`jaxtrain.training.loop.evaluate`) of the pulled params, with their version."""
        params = self._place([leaves for _, leaves in pulled])  # not kept: the next gradient uses the worker's own
        return {"step": pulled[0][0], **evaluate(self.run, params)}

    def _place(self, parts: list[list[np.ndarray]]) -> PyTree:
        """Params from the server shards' leaves, placed in this worker's plan's shardings."""
        tree = jax.tree.unflatten(self.treedef, leaves_of.join(parts, self.owned))
        return jax.device_put(tree, self.run.shardings.state_shardings["params"])


def _norm_and_clip(grads: PyTree, clip_norm: float) -> tuple[jax.Array, PyTree]:
    """The gradient's global norm, and the gradient clipped to `clip_norm` as the optimizer's own clipping does (a
    server shard sees only its part of the gradient, so the whole one is clipped here); <= 0: not clipped."""
    norm = optax.tree.norm(grads)
    if clip_norm <= 0:
        return norm, grads
    return norm, optax.clip_by_global_norm(clip_norm).update(grads, optax.EmptyState())[0]
