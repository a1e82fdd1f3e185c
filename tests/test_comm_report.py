"""The communication report: device groups parsed from every replica-group form, mapped to mesh axes, and bytes sent
per device per step on compiled training steps and hand-built programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, make_run
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.analysis.comm_report import Expected, axes_of_group, communication_report, sent_per_device
from jaxtrain.analysis.hlo import collectives, replica_groups, source_target_pairs
from jaxtrain.analysis.memory import total_bytes, tree_device_bytes
from jaxtrain.cli import main

PERMUTED = [3, 1, 7, 0, 5, 2, 6, 4]  # device ids in mesh order, so that mesh positions and device ids differ


@pytest.mark.parametrize(
    "attribute,groups",
    [
        ("replica_groups={{0,1},{2,3}}", [[0, 1], [2, 3]]),
        ("replica_groups={}", []),  # one group of every device
        ("replica_groups=[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        # iota [2,4] transposed to [4,2]: the devices 4 apart pair up
        ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['a'=2,'b'=4] {'b'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=mesh['a'=2,'b'=4] {'a'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh[a=2,b=4] {a,b}", [list(range(8))]),
        ("replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ("replica_groups=mesh['a'=2,'b'=4], device_ids=(3,1,7,0,5,2,6,4) {'b'}", [[3, 1, 7, 0], [5, 2, 6, 4]]),
        ("replica_groups=mesh['a'=8] {'a':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),  # the middle factor of 2x2x2
        ("dimensions={0}", None),
    ],
)
def test_replica_group_forms(attribute, groups):
    line = f"  %x = f32[8]{{0}} all-gather(%p), channel_id=1, {attribute}, use_global_device_ids=true"
    assert replica_groups(line) == groups


def test_source_target_pairs():
    line = "  %x = f32[8]{0} collective-permute(%p), channel_id=1, source_target_pairs={{0,1},{1,2},{4,5}}"
    assert source_target_pairs(line) == [(0, 1), (1, 2), (4, 5)]


# Two replicas of four partitions: device index = replica * 4 + partition.
ID_MODES = """HloModule m, replica_count=2, num_partitions=4

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8] parameter(0)
  %cross_replica = f32[8] all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
  %replicas_and_partitions = f32[8] all-reduce(%p), channel_id=1, replica_groups={{0},{1}}, to_apply=%add
  %flattened = f32[8] all-reduce(%p), channel_id=2, replica_groups={{0,5}}, use_global_device_ids=true, to_apply=%a
  %partitions = f32[8] all-to-all(%p), channel_id=3, replica_groups={{0,1},{2,3}}, dimensions={0}
  %gather = (f32[8], f32[32]) all-gather-start(%p), channel_id=4, replica_groups=[2,4]<=[8], use_global_device_ids=true
  %permute = (f32[8], f32[8], u32[], u32[]) collective-permute-start(%p), channel_id=5, source_target_pairs={{0,1}}
  %scatter = ((f32[8]), f32[2]) reduce-scatter-start(%p), channel_id=6, replica_groups={}, use_global_device_ids=true
}
"""


def test_ids_mean_what_channel_id_and_use_global_device_ids_say():
    found = {c.name: c for c in collectives(ID_MODES)}
    assert found["cross_replica"].groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert found["replicas_and_partitions"].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert found["flattened"].groups == ((0, 5),)
    assert found["partitions"].groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert found["gather"].groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and found["gather"].bytes == 32 * 4  # the result
    assert found["permute"].pairs == ((0, 1), (4, 5)) and found["permute"].bytes == 8 * 4
    assert found["scatter"].groups == (tuple(range(8)),) and found["scatter"].bytes == 2 * 4


def test_axes_of_group():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    assert axes_of_group(mesh, [0, 1, 2, 3]) == ("fsdp",)
    assert axes_of_group(mesh, [1, 5]) == ("data",)
    assert axes_of_group(mesh, [0, 5]) == ("data", "fsdp")
    assert axes_of_group(mesh, [6]) == ()


def permuted_mesh() -> Mesh:
    return Mesh(np.array([jax.devices()[i] for i in PERMUTED]).reshape(2, 4), ("a", "b"))


def compile_shard_map(fn, mesh, shape, spec):
    sharding = NamedSharding(mesh, spec)
    program = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))
    return program.lower(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)).compile()


def test_group_ids_are_positions_in_the_mesh_not_device_ids():
    mesh = permuted_mesh()
    spec = P(("a", "b"))
    compiled = compile_shard_map(lambda x: jax.lax.ppermute(x, "b", [(0, 1)]), mesh, (8, 1), spec)
    (permute,) = collectives(compiled.as_text())
    assert permute.pairs == ((0, 1), (4, 5))
    assert [d.id for d in compiled.runtime_executable().local_devices()] == PERMUTED
    # Run it: each shard holds its mesh position. Pair (0, 1) moves position 0's shard (device 3) to position 1
    # (device 1); read as device ids it would move device 0's (position 3) instead.
    out = compiled(jax.device_put(jnp.arange(8.0).reshape(8, 1), NamedSharding(mesh, spec)))
    received = {s.device.id: float(s.data[0, 0]) for s in out.addressable_shards}
    assert received[PERMUTED[1]] == 0.0 and received[PERMUTED[5]] == 4.0
    # The report follows devices: over a mesh of the same devices in id order, the senders sit at their ids.
    by_id = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    sent = communication_report(compiled, by_id).per_device
    assert np.flatnonzero(sent).tolist() == sorted([PERMUTED[0], PERMUTED[4]]) and sent.max() == permute.bytes


def test_each_kind_is_counted_by_its_algorithm():
    mesh = permuted_mesh()

    def step(x):  # x: f32[8, 16] per device, 512 B
        return (
            jax.lax.psum(x, "b")
            + jax.lax.all_gather(x, "a", tiled=True)[:8]
            + jnp.tile(jax.lax.psum_scatter(x, "b", tiled=True), (4, 1))
            + jax.lax.all_to_all(x, "b", 0, 0, tiled=True)
        )

    report = communication_report(compile_shard_map(step, mesh, (64, 16), P(("a", "b"))), mesh)
    rows = {(r.axes, r.kind): r for r in report.rows}
    b = 8 * 16 * 4
    expected = {
        (("b",), "all-reduce"): 2 * 3 / 4 * b,
        (("a",), "all-gather"): 1 / 2 * 2 * b,  # of the gathered result, twice the input
        (("b",), "reduce-scatter"): 3 * b / 4,  # (N-1) x the scattered result
        (("b",), "all-to-all"): 3 / 4 * b,
    }
    assert {k: r.mean for k, r in rows.items()} == pytest.approx(expected)
    assert all(r.max == r.mean and r.ops == 1 for r in rows.values())


def test_parameter_server_shows_its_hot_spot():
    mesh = Mesh(np.array(jax.devices()), ("d",))

    def parameter_server(x):  # every device pushes to device 0, which sums and sends the total back to each
        total = x + sum(jax.lax.ppermute(x, "d", [(i, 0)]) for i in range(1, 8))
        return sum(jax.lax.ppermute(total, "d", [(0, i)]) for i in range(1, 8))

    compiled = compile_shard_map(parameter_server, mesh, (64, 16), P("d"))
    b = 8 * 16 * 4
    pushes = [c for c in collectives(compiled.as_text()) if c.pairs[0][1] == 0]
    pushed = sum(sent_per_device(c, 8) for c in pushes)
    assert pushed.tolist() == [0] + [b] * 7  # device 0 only receives
    report = communication_report(compiled, mesh)
    assert [(r.axes, r.kind, r.ops) for r in report.rows] == [(("d",), "collective-permute", 14)]
    assert report.per_device.tolist() == [7 * b] + [b] * 7
    assert "busiest device: id 0 (d=0) sends 3.5 KiB, 4.00x the mean" in report.format()


def test_data_parallel_gradient_all_reduce_is_the_ring_volume():
    run = make_run("data=8")
    report = communication_report(run.train_step, run.shardings.mesh)
    # XLA splits the gradient into a few all-reduces (one inside the layer loop); their total is the gradient.
    assert {(r.axes, r.kind) for r in report.rows} == {(("data",), "all-reduce")}
    ring = 2 * 7 / 8 * total_bytes(run.shardings.abstract_state["params"])
    assert report.measured(("data",), ("all-reduce",)) == pytest.approx(ring, rel=0.01)
    text = report.format([Expected("ring all-reduce of f32 gradients", ring, ("data",), ("all-reduce",))])
    assert "ratio 1.000" in text and "busiest" not in text


def test_fsdp_gathers_weights_and_reduces_gradients_over_fsdp():
    run = make_run("fsdp=8")
    report = communication_report(run.train_step, run.shardings.mesh)
    assert {r.axes for r in report.rows} == {("fsdp",)}
    # CPU XLA reduces the gradients with all-reduce (and all-to-all), where GPU and TPU emit reduce-scatter.
    assert {"all-gather", "all-reduce"} <= {r.kind for r in report.rows}
    blocks = total_bytes(run.shardings.abstract_state["params"]["blocks"])
    assert report.measured(("fsdp",), ("all-gather",)) >= 7 / 8 * blocks  # every block weight, at least once
    gradients = report.measured(("fsdp",), ("all-reduce", "reduce-scatter", "all-to-all"))
    assert gradients >= 7 / 8 * blocks


def test_data_and_tensor_axes_are_separated():
    run = make_run("data=2,tensor=4")
    report = communication_report(run.train_step, run.shardings.mesh)
    assert {(r.axes, r.kind) for r in report.rows} == {(("data",), "all-reduce"), (("tensor",), "all-reduce")}
    # Over data=2 a ring all-reduce sends 2(N-1)/N = 1x each device's share of the gradient.
    per_device = tree_device_bytes(run.shardings.abstract_state["params"])
    assert report.measured(("data",), ("all-reduce",)) == pytest.approx(per_device, rel=0.01)
    tensor = next(r for r in report.rows if r.axes == ("tensor",))
    assert tensor.executions >= 4 * run.cfg.model.n_layers  # attention and MLP outputs, forward and backward


def test_comm_command_prints_the_report(capsys):
    argv = ["comm", "--simulated-devices", "8", "--mesh", "data=2,tensor=4", "--model", "gpt-tiny", *TINY]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "communication per step: bytes each device sends" in out
    assert "tensor  all-reduce" in out and "data    all-reduce" in out
    assert main(["comm", "--simulated-devices", "8", "--mesh", "data=3"]) == 2
    assert "multiplies to 3 devices" in capsys.readouterr().err
