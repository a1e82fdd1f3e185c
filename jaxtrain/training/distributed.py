"""Joining several processes into one JAX job: one process per host (TPU pods) or per GPU, or several on one machine
with simulated CPU devices, whose collectives then go through gloo.

Single process by default. Otherwise give the coordinator (process 0's `host:port`), the process count and this
process's id, as flags (`--coordinator`, `--num-processes`, `--process-id`) or environment variables
(`JAXTRAIN_COORDINATOR`, `JAXTRAIN_NUM_PROCESSES`, `JAXTRAIN_PROCESS_ID`), or let JAX detect them (`--auto-cluster`:
TPU pods, SLURM, Open MPI, Kubernetes). The coordinator (process 0) listens only on the coordinator address's own
host, the one given or the one JAX detects, unless `--coordinator-bind` (`JAXTRAIN_COORDINATOR_BIND`) names another
address; JAX alone would listen on every interface. JAX's mutual TLS between processes is passed through when its
certificate files are given.

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
    "bind_address": "JAXTRAIN_COORDINATOR_BIND",
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
    local_device_ids: tuple[int, ...] | None = None  # the devices this process uses (None: all it sees)

    @property
    def is_single(self) -> bool:
        return not self.auto and self.num_processes == 1

    def check(self) -> None:
        for name in ("init_timeout_s", "heartbeat_timeout_s"):
            if getattr(self, name) < 1:
                raise DistributedError(
                    f"{name.removesuffix('_s')} {getattr(self, name)}: give a number of seconds >= 1."
                )
        if self.bind_address:
            _check_address(self.bind_address, "coordinator bind address", "--coordinator-bind 10.0.0.1:8476")
        if self.auto or self.is_single:
            if self.coordinator:
                _check_address(self.coordinator, "coordinator address", "--coordinator 10.0.0.1:8476")
            return
        if not self.coordinator:
            raise DistributedError(
                f"{self.num_processes} processes need a coordinator address host:port (process 0's), e.g. "
                f"--coordinator 10.0.0.1:8476 or {ENV['coordinator']}; got '{self.coordinator}'."
            )
        _check_address(self.coordinator, "coordinator address", "--coordinator 10.0.0.1:8476")
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise DistributedError(
                f"process id {self.process_id} is not in 0..{self.num_processes - 1} for {self.num_processes} "
                "processes: give each process a distinct --process-id below --num-processes."
            )

    def bind(self) -> str:
        """Where process 0's coordinator listens: `bind_address` if given, else the coordinator address itself, so
        it listens on the coordinator's host address only (JAX's own default is every interface, [::]:port)."""
        return self.bind_address or self.coordinator


def _check_address(address: str, what: str, example: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"{what} '{address}' is not host:port with a port 1..65535, e.g. {example}.")


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


def detect_cluster(group: ProcessGroup) -> ProcessGroup:
    """`group` with the coordinator, process count, id and local devices that JAX's cluster detection finds (SLURM,
    Open MPI, TPU pods on GCE or GKE, Kubernetes), asked before joining so that the coordinator can be bound to the
    detected host's address: left to itself, `jax.distributed.initialize` would bind every interface."""
    from jax._src import clusters  # JAX's own detection: no public API exposes it

    given = group.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    try:
        coordinator, count, process, local = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            given, None, None, None, None, group.init_timeout_s
        )
    except Exception as err:  # noqa: BLE001 - a cluster environment that is present but broken
        raise DistributedError(
            f"--auto-cluster: JAX's cluster detection failed ({type(err).__name__}: {err})."
        ) from err
    if coordinator is None or count is None or process is None:
        raise DistributedError(
            "--auto-cluster: JAX found no cluster it knows (SLURM, Open MPI, a TPU pod on GCE or GKE, Kubernetes) "
            "in this environment. Start the job under one, or give --coordinator, --num-processes and --process-id."
        )
    local = None if local is None else tuple(local)
    found = dataclasses.replace(
        group, coordinator=coordinator, num_processes=count, process_id=process, local_device_ids=local, auto=False
    )
    found.check()
    return found


def join_arguments(group: ProcessGroup) -> dict:
    """The arguments `initialize` passes to `jax.distributed.initialize` for `group` (detected first with
    `auto`): always an explicit coordinator and bind address."""
    if group.auto:
        group = detect_cluster(group)
    return dict(
        coordinator_address=group.coordinator,
        num_processes=group.num_processes,
        process_id=group.process_id,
        local_device_ids=None if group.local_device_ids is None else list(group.local_device_ids),
        initialization_timeout=group.init_timeout_s,
        heartbeat_timeout_seconds=group.heartbeat_timeout_s,
        coordinator_bind_address=group.bind(),
        **{f"mtls_{k}": v for k, v in group.mtls.items()},
    )


def initialize(group: ProcessGroup) -> None:
    """Join the job `group` describes (nothing for a single process). Call before any JAX computation."""
    group.check()
    if group.is_single:
        return
    if jax.config.jax_platforms == "cpu":  # cross-process collectives between CPU devices
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    args = join_arguments(group)
    process, count = args["process_id"], args["num_processes"]
    found = " (found by JAX's cluster detection)" if group.auto else ""
    where = f"coordinator {args['coordinator_address']}{found}, which listens on {args['coordinator_bind_address']}"
    # Said before joining: a failed join can end in JAX's own abort, which no Python handler sees.
    print(
        f"process {process} of {count}: joining {where}, timeout {group.init_timeout_s} s", file=sys.stderr, flush=True
    )
    try:
        jax.distributed.initialize(**args)
    except Exception as err:  # noqa: BLE001 - whatever the runtime raises, the job did not form
        raise DistributedError(
            f"process {process} of {count} could not join {where} within {group.init_timeout_s} s "
            f"({type(err).__name__}: {err}). Check that every process got the same coordinator address and process "
            "count, distinct ids, and that process 0 is running."
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
