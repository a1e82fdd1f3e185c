"""Joining several processes into one JAX job: one process per host (TPU pods) or per GPU, or several on one machine
with simulated CPU devices, whose collectives then go through gloo.

Single process by default. Otherwise give the coordinator (process 0's `host:port`), the process count and this
process's id, as flags (`--coordinator`, `--num-processes`, `--process-id`) or environment variables
(`JAXTRAIN_COORDINATOR`, `JAXTRAIN_NUM_PROCESSES`, `JAXTRAIN_PROCESS_ID`), or let JAX detect them (`--auto-cluster`:
TPU pods, SLURM, Open MPI). The coordinator listens only on the coordinator address's own host unless
`--coordinator-bind` says otherwise (JAX alone would listen on every interface); JAX's mutual TLS between processes
is passed through when its certificate files are given.

    >>> initialize(ProcessGroup("10.0.0.1:8476", num_processes=4, process_id=int(os.environ["RANK"])))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping

import jax
import numpy as np

from jaxtrain.errors import UserInputError

ENV = {
    "coordinator": "JAXTRAIN_COORDINATOR",
    "num_processes": "JAXTRAIN_NUM_PROCESSES",
    "process_id": "JAXTRAIN_PROCESS_ID",
}


class DistributedError(UserInputError):
    """Processes that cannot join: a bad process count or id, an unreachable coordinator, a timeout."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    coordinator: str = ""  # host:port of process 0
    num_processes: int = 1
    process_id: int = 0
    bind_address: str = ""  # where the coordinator listens (default: the coordinator's host, never all interfaces)
    init_timeout_s: int = 300
    heartbeat_timeout_s: int = 100  # a process silent this long is declared dead, and the job stops
    auto: bool = False  # let JAX detect the cluster (TPU pod, SLURM, Open MPI)
    mtls: Mapping[str, str] = dataclasses.field(default_factory=dict)  # JAX's mtls_* arguments, when given

    @property
    def is_single(self) -> bool:
        return not self.auto and self.num_processes == 1

    def check(self) -> None:
        if self.auto or self.is_single:
            return
        if not self.coordinator or ":" not in self.coordinator:
            raise DistributedError(
                f"{self.num_processes} processes need a coordinator address host:port (process 0's), e.g. "
                f"--coordinator 10.0.0.1:8476 or {ENV['coordinator']}; got '{self.coordinator}'."
            )
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise DistributedError(
                f"process id {self.process_id} is not in 0..{self.num_processes - 1} for {self.num_processes} "
                "processes: give each process a distinct --process-id below --num-processes."
            )


def from_environment(env: Mapping[str, str] = os.environ, **flags) -> ProcessGroup:
    """A ProcessGroup from flags (those not None) over the JAXTRAIN_* environment variables."""
    values = {field: env[var] for field, var in ENV.items() if var in env}
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        for field in ("num_processes", "process_id", "init_timeout_s", "heartbeat_timeout_s"):
            if field in values:
                values[field] = int(values[field])
    except ValueError as err:
        raise DistributedError(f"process settings must be integers: {err}.") from None
    return ProcessGroup(**values)


def initialize(group: ProcessGroup) -> None:
    """Join the job `group` describes (nothing for a single process). Call before any JAX computation."""
    group.check()
    if group.is_single:
        return
    if jax.config.jax_platforms == "cpu":  # cross-process collectives between CPU devices
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    host = group.coordinator.rsplit(":", 1)[0] if group.coordinator else ""
    bind = group.bind_address or (f"{host}:{group.coordinator.rsplit(':', 1)[1]}" if host else None)
    # Said before joining: a failed join can end in JAX's own abort, which no Python handler sees.
    where = "the cluster JAX detects" if group.auto else f"coordinator {group.coordinator} (listening on {bind})"
    print(
        f"process {group.process_id} of {group.num_processes}: joining {where}, timeout {group.init_timeout_s} s",
        file=sys.stderr,
        flush=True,
    )
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator or None,
            num_processes=None if group.auto else group.num_processes,
            process_id=None if group.auto else group.process_id,
            initialization_timeout=group.init_timeout_s,
            heartbeat_timeout_seconds=group.heartbeat_timeout_s,
            coordinator_bind_address=bind,
            **{f"mtls_{k}": v for k, v in group.mtls.items()},
        )
    except Exception as err:  # noqa: BLE001 - whatever the runtime raises, the job did not form
        raise DistributedError(
            f"process {group.process_id} of {group.num_processes} could not join {where} within "
            f"{group.init_timeout_s} s ({type(err).__name__}: {err}). Check that every process got the same "
            "coordinator address and process count, distinct ids, and that process 0 is running."
        ) from err


def describe_processes(mesh: jax.sharding.Mesh) -> str:
    """Processes, devices per process, and which process owns each position of the mesh."""
    owners = np.vectorize(lambda d: d.process_index)(mesh.devices)
    live = [(a, n) for a, n in mesh.shape.items() if n > 1]
    shape = " x ".join(f"{a}={n}" for a, n in live) or "1 device"
    lines = [
        f"processes: {jax.process_count()} x {jax.local_device_count()} local devices "
        f"({jax.device_count()} in all); this is process {jax.process_index()}",
        f"owner process of each mesh position ({shape}):",
    ]
    grid = owners.reshape([n for _, n in live] or [1])
    lines += ["  " + line for line in np.array2string(grid, separator=" ").splitlines()]
    return "\n".join(lines)


def to_host(tree):
    """Numpy copies of replicated arrays, also when they span processes (each process reads its own replica; a
    plain `device_get` refuses arrays that are not fully addressable)."""
    return jax.tree.map(lambda x: np.asarray(x if x.is_fully_addressable else x.addressable_data(0)), tree)
