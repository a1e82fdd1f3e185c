"""Where process 0's coordinator listens, in each mode, without a cluster: jax.distributed.initialize is replaced by a
recorder, and SLURM is played by the environment variables JAX's own cluster detection reads."""

import os

import jax
import pytest

from jaxtrain.cli import main
from jaxtrain.training.distributed import DistributedError, ProcessGroup, from_environment, initialize

# A SLURM step over nodes gpu007..gpu010: JAX takes the first node as the coordinator, on port 61440 + job id % 4096.
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "gpu[007-010]",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}
SLURM_COORDINATOR = f"gpu007:{61440 + 4242 % 4096}"


@pytest.fixture
def joins(monkeypatch) -> list[dict]:
    """The keyword arguments of every jax.distributed.initialize call, which does nothing else."""
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    for var in [v for v in os.environ if v.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR", "KUBERNETES_"))]:
        monkeypatch.delenv(var)
    collectives = jax.config.jax_cpu_collectives_implementation  # initialize sets gloo for CPU devices
    yield calls
    jax.config.update("jax_cpu_collectives_implementation", collectives)


@pytest.fixture
def slurm(monkeypatch, joins) -> list[dict]:
    for var, value in SLURM.items():
        monkeypatch.setenv(var, value)
    return joins


def test_explicit_coordinator_listens_on_its_own_address(joins):
    initialize(ProcessGroup("10.0.0.5:8476", num_processes=2, process_id=0))
    assert joins[0]["coordinator_address"] == joins[0]["coordinator_bind_address"] == "10.0.0.5:8476"


def test_coordinator_bind_is_used_as_given(joins):
    initialize(ProcessGroup("10.0.0.5:8476", num_processes=2, process_id=0, bind_address="0.0.0.0:8476"))
    assert joins[0]["coordinator_bind_address"] == "0.0.0.0:8476"


def test_auto_cluster_binds_the_detected_coordinators_host_not_every_interface(slurm):
    initialize(ProcessGroup(auto=True))
    assert slurm[0]["coordinator_bind_address"] == SLURM_COORDINATOR != f"[::]:{SLURM_COORDINATOR.split(':')[1]}"
    assert slurm[0]["coordinator_address"] == SLURM_COORDINATOR
    assert (slurm[0]["num_processes"], slurm[0]["process_id"], slurm[0]["local_device_ids"]) == (8, 0, [0])


def test_auto_cluster_on_another_process_and_with_a_bind_address(slurm, monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    initialize(from_environment({"JAXTRAIN_COORDINATOR_BIND": "10.9.8.7:61586"}, auto=True))
    assert (slurm[0]["process_id"], slurm[0]["local_device_ids"]) == (5, [1])
    assert slurm[0]["coordinator_address"] == SLURM_COORDINATOR
    assert slurm[0]["coordinator_bind_address"] == "10.9.8.7:61586"


def test_the_flags_reach_the_join(slurm, capsys):
    argv = ["train", "--simulated-devices", "8", "--auto-cluster", "--coordinator-bind", "gpu007-ib0:61586"]
    assert main([*argv, "--help-config"]) == 0
    assert slurm[0]["coordinator_bind_address"] == "gpu007-ib0:61586"
    assert f"joining coordinator {SLURM_COORDINATOR} (found by JAX's cluster detection)" in capsys.readouterr().err


def test_auto_cluster_outside_a_cluster_says_so(joins):
    with pytest.raises(DistributedError, match="--auto-cluster: JAX found no cluster it knows"):
        initialize(ProcessGroup(auto=True))
    assert not joins


@pytest.mark.parametrize("address", ["10.0.0.5", "10.0.0.5:", ":8476", "10.0.0.5:http", "10.0.0.5:70000"])
def test_an_address_without_a_valid_port_is_refused(address, joins):
    with pytest.raises(DistributedError, match=f"'{address}' is not host:port with a port 1..65535"):
        initialize(ProcessGroup(address, num_processes=2, process_id=1))
    with pytest.raises(DistributedError, match=f"coordinator bind address '{address}' is not host:port"):
        initialize(ProcessGroup("10.0.0.5:8476", num_processes=2, process_id=0, bind_address=address))
    assert not joins
