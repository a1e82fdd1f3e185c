"""The Ray side of the engine: joining (or starting) a Ray cluster, and starting workers and server shards on it.

Local runs start Ray in this process (`ray.init`, no dashboard) and stop it at the end; with `engine.ray_address`
(`auto`: the cluster `ray start --head` began on this node; `ray://host:10001` from elsewhere) the job joins a running
cluster and leaves it running. Inside a session someone else started (`ray.is_initialized()`, e.g. a test fixture),
the engine uses it as it is.

A local session's processes die with the driver however it ends, kill -9 included (`watchdog.py`); on a cluster
Ray itself ends a job's actors when its driver dies, and the cluster stays up.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray

from jaxtrain.asynchronous import watchdog
from jaxtrain.asynchronous.server import ServerShard
from jaxtrain.asynchronous.worker import Worker
from jaxtrain.run_config import EngineConfig, RunConfig

# Where `jaxtrain` is imported from: a Ray process started by this job imports the same code, installed or not. The
# built-in models reach it as they reach this process, through the `jaxtrain.models` entry point: `jaxtrain_models`
# sits beside `jaxtrain` in site-packages, or an editable install's import finder maps it to the checkout's models/
# (the name is not the folder's, so this path alone would not find it).
SOURCE_ROOT = str(Path(__file__).resolve().parent.parent.parent)


def runtime_env() -> dict[str, Any]:
    """The environment of the job's Ray processes: this checkout on their import path, JAX on the CPU unless the
    cluster's nodes say otherwise."""
    path = os.pathsep.join(p for p in (SOURCE_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


@contextlib.contextmanager
def connected(engine: EngineConfig, log: Callable[[str], None] = print) -> Iterator[None]:
    """Inside: a Ray session for the job (see the module's doc)."""
    if ray.is_initialized():
        yield
        return
    local = not engine.ray_address
    before = watchdog.children()
    # Logical CPUs, not cores: one per worker, which is what a worker asks for; server shards ask none.
    ray.init(
        address=engine.ray_address or None,
        num_cpus=engine.workers if local else None,
        include_dashboard=False if local else None,
        runtime_env=runtime_env(),
        logging_level="warning",
        log_to_driver=True,
    )
    log(f"ray: {'local session' if local else engine.ray_address}, {ray.cluster_resources().get('CPU', 0):g} CPUs")
    started = sorted(watchdog.children() - before) if local else []
    with watchdog.watching(started) if started else contextlib.nullcontext():
        try:
            yield
        finally:
            ray.shutdown()


def start_worker(cfg: RunConfig, index: int, slowdown: float) -> Any:
    """A `Worker` actor (one CPU of the cluster's), on `engine.devices_per_worker` simulated devices in local runs
    and on its node's own devices on a cluster."""
    local = not cfg.engine.ray_address
    devices = cfg.engine.devices_per_worker if local else 0
    remote = ray.remote(num_cpus=1, max_restarts=0)(Worker)
    return remote.options(runtime_env=cpu_env(devices) if local else None).remote(cfg, index, devices, slowdown)


def start_server(cfg: RunConfig, names: list[tuple], params: list[np.ndarray] | ray.ObjectRef) -> Any:
    """A `ServerShard` actor holding `params` (with their logical `names`; or a reference to them), on its host's
    CPU."""
    remote = ray.remote(num_cpus=0, max_restarts=0)(ServerShard)
    return remote.options(runtime_env=cpu_env(1)).remote(cfg.optimizer, cfg.train.steps, names, params)


def cpu_env(devices: int) -> dict[str, Any]:
    """JAX on `devices` CPU devices from the moment the process starts: a process that imports JAX before the actor
    is built (to unpickle its arguments) must not probe for accelerators or settle on one device."""
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)}
    return {"env_vars": {**runtime_env()["env_vars"], **env}}


def actor_id(actor: Any) -> str:
    """The id of `actor` (a handle), as `RayActorError.actor_id` names a dead one."""
    return actor._actor_id.hex()
