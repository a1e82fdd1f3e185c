"""The HLO tools and the communication report on train steps compiled for real TPU topologies (libtpu) and GPU
nodes (the CUDA plugin), checked against what the parameters' shapes say FSDP must move. The tools' parsing of each
pattern on small modules: tests/test_hlo.py."""

import functools

import jax
import numpy as np
import pytest
from helpers import aot_run, aot_target

from jaxtrain.analysis.comm_report import communication_report, program_devices
from jaxtrain.analysis.hlo import collectives, parse_module, trip_count
from jaxtrain.analysis.memory import memory_report
from jaxtrain.training.setup import Run, communication, communication_summary

LAYERS = ("n_layers=3",)  # a layer count unlike the program's other counts (2 loops, 2 passes)
FSDP = 8


@functools.cache
def tpu_run(mesh: str = f"fsdp={FSDP}", overrides: tuple[str, ...] = LAYERS, model: str = "gpt-tiny") -> Run:
    return aot_run(aot_target("v5p:2x2x2"), mesh, overrides, model)


@functools.cache
def gpu_run() -> Run:
    return aot_run(aot_target("h100:8"), f"fsdp={FSDP}", LAYERS)


def fsdp_sharded(tree) -> list[jax.ShapeDtypeStruct]:
    return [w for w in jax.tree.leaves(tree) if "fsdp" in jax.tree.leaves(tuple(w.sharding.spec))]


def layer_bytes(run: Run, itemsize: int, shards: int = 1) -> int:
    """Bytes of one layer's FSDP-sharded block weights, whole (shards=1) or one device's share, at `itemsize`."""
    sharded = fsdp_sharded(run.shardings.abstract_state["params"]["blocks"])
    return sum(w.size // w.shape[0] for w in sharded) * itemsize // shards


def head_bytes(run: Run, itemsize: int, shards: int = 1) -> int:
    return run.shardings.abstract_state["params"]["head"].size * itemsize // shards


def loop_trip_counts(run: Run) -> list[int]:
    module = parse_module(run.train_step.as_text())
    return [
        trip_count(module, name, instruction)
        for name, body in module.computations.items()
        for instruction in body.values()
        if instruction.opcode == "while"
    ]


@pytest.mark.parametrize("run", [tpu_run, gpu_run], ids=["v5p:2x2x2", "h100:8"])
def test_layer_loops_run_once_per_layer(run):
    # TPU programs carry no known_trip_count: the count is read from the loop's counter.
    layers = run().cfg.model.n_layers
    assert loop_trip_counts(run()) == [layers, layers]  # the forward and the backward layer scan
    in_loops = [c for c in collectives(run().train_step.as_text()) if c.executions > 1]
    assert in_loops and all(c.executions == layers and c.exact for c in in_loops)


def test_tpu_fsdp_gathers_bf16_weights_per_layer_and_all_reduces_gradients():
    run = tpu_run()
    layers = run.cfg.model.n_layers
    found = collectives(run.train_step.as_text())
    # In each layer, forward and backward, every FSDP-sharded weight is gathered once, cast to bf16 first.
    gathered = sum(c.bytes * c.executions for c in found if c.kind == "all-gather" and c.executions == layers)
    assert gathered == 2 * layers * layer_bytes(run, itemsize=2)
    report = communication_report(run.train_step, run.shardings.mesh)
    assert {r.axes for r in report.rows} == {("fsdp",)}
    ring = (FSDP - 1) / FSDP
    # Beside them the head's weight (in bf16) and the batch's token ids (0.2%) are gathered.
    weights = 2 * layers * layer_bytes(run, 2) + head_bytes(run, 2)
    assert report.measured(("fsdp",), ("all-gather",)) == pytest.approx(ring * weights, rel=0.01)
    # libtpu reduces the f32 gradients with all-reduces (each device then keeps its slice); the norms' gradients and
    # the loss add 0.2%.
    gradients = layers * layer_bytes(run, 4) + head_bytes(run, 4)
    assert report.measured(("fsdp",), ("all-reduce",)) == pytest.approx(2 * ring * gradients, rel=0.01)


def test_communication_report_and_setup_on_a_tpu_run():
    run = tpu_run()
    mesh = run.shardings.mesh
    # The device order comes from the compiled program: the mesh's devices, which are not in id order here.
    assert [d.id for d in program_devices(run.train_step)] == [d.id for d in mesh.devices.flat]
    assert [d.id for d in mesh.devices.flat] != sorted(d.id for d in mesh.devices.flat)
    report = communication_report(run.train_step, mesh)
    assert np.allclose(report.per_device, report.per_device.mean())  # FSDP's traffic is even
    text = communication(run)
    assert "fsdp   all-gather" in text and "fsdp   all-reduce" in text and "busiest" not in text
    # The preflight `setup` logs: memory from the TPU compiler, and the one-line communication summary.
    assert "fsdp" in communication_summary(run) and memory_report(run.train_step)


def test_tpu_all_reduce_scatter_fusions_are_reduce_scatters():
    run = tpu_run("data=2,fsdp=4", overrides=())
    found = collectives(run.train_step.as_text())
    fused = [c for c in found if c.via == "all-reduce-scatter fusion"]
    assert fused and all(c.kind == "reduce-scatter" for c in fused)
    # Each keeps one device's quarter of f32 gradients of FSDP-sharded weights: the shapes of the weights' shards.
    params = run.shardings.abstract_state["params"]
    shards = {w.sharding.shard_shape(w.shape)[1:] for w in fsdp_sharded(params["blocks"])}
    shards.add(params["head"].sharding.shard_shape(params["head"].shape))
    assert {dims for c in fused for _, dims in c.shapes} <= shards
    report = communication_report(run.train_step, run.shardings.mesh)
    fsdp_scatter = sum(3 * c.bytes * c.executions for c in fused)  # (N-1) x the share, N = 4
    assert report.measured(("fsdp",), ("reduce-scatter",)) == pytest.approx(fsdp_scatter)


@pytest.mark.slow  # the windowed einsums' 15 loops take the TPU compiler 7-12 s; tests/test_hlo.py reads one
def test_tpu_windowed_einsums_count_as_the_gathers_and_reduce_scatters_they_replace():
    # At batch 64 x 256 tokens the TPU compiler multiplies by FSDP-sharded weights in windowed einsums.
    run = tpu_run(overrides=(*LAYERS, "batch_size=64", "seq_len=256"))
    layers = run.cfg.model.n_layers
    found = collectives(run.train_step.as_text())
    assert not [c for c in found if c.kind == "collective-permute"]  # every permute is part of a windowed einsum
    report = communication_report(run.train_step, run.shardings.mesh)
    rows = {(r.axes, r.kind): r for r in report.rows}
    assert rows[("fsdp",), "all-gather"].via == ("windowed einsum",)
    # Each windowed einsum sends FSDP + 1 shards round the ring (two trips of four permutes for 8 devices, and one
    # before the loop), where a ring all-gather or reduce-scatter sends FSDP - 1.
    sends = FSDP + 1
    windowed_gathers = sum(c.bytes * c.executions for c in found if c.via and c.kind == "all-gather")
    assert windowed_gathers == sends * 2 * layers * layer_bytes(run, itemsize=2, shards=FSDP)
    # The weights' f32 gradients, and the head's, leave each layer reduce-scattered by windowed einsums.
    scattered = sends * (layers * layer_bytes(run, 4, FSDP) + head_bytes(run, 4, FSDP))
    assert report.measured(("fsdp",), ("reduce-scatter",)) == scattered


def test_a_multi_slice_step_counts_every_slice_and_what_crosses_them():
    # Two v5p:2x2x2 slices, data parallel across them over DCN, FSDP inside each. The compiled program is one slice's;
    # what crosses slices it hands to the megascale runtime as sends.
    run = aot_run(aot_target("v5p:2x2x2", slices=2), "tpu-v5e-2x256", ("batch_size=16",))
    mesh = run.shardings.mesh
    report = communication_report(run.train_step, mesh)
    per_slice = mesh.size // 2
    assert report.per_device.min() > 0 and np.allclose(report.per_device[:per_slice], report.per_device[per_slice:])
    dcn = [r for r in report.rows if r.via == ("DCN send",)]
    assert {(r.axes, r.kind) for r in dcn} == {(("data",), "all-reduce")}
    assert all("data" not in r.axes for r in report.rows if r not in dcn)
    # Every byte of a device's f32 gradient shard crosses slices at least once.
    assert sum(r.mean for r in dcn) >= run.shardings.param_bytes() / per_slice


def test_gpu_fsdp_gathers_weights_and_reduce_scatters_gradients():
    run = gpu_run()
    layers = run.cfg.model.n_layers
    report = communication_report(run.train_step, run.shardings.mesh)
    assert [d.id for d in program_devices(run.train_step)] == [d.id for d in run.shardings.mesh.devices.flat]
    ring = (FSDP - 1) / FSDP
    # The GPU compiler gathers gpt-tiny's f32 weights as they are, and reduce-scatters the gradients.
    weights = 2 * layers * layer_bytes(run, 4) + head_bytes(run, 4)
    assert report.measured(("fsdp",), ("all-gather",)) == pytest.approx(ring * weights, rel=0.01)
    gradients = layers * layer_bytes(run, 4, FSDP) + head_bytes(run, 4, FSDP)
    assert report.measured(("fsdp",), ("reduce-scatter",)) == (FSDP - 1) * gradients


@pytest.mark.slow  # gpt-small: ~12 s of TPU compile
def test_gpt_small_fsdp_step_on_tpu_sends_what_its_weights_say():
    run = tpu_run(overrides=(), model="gpt-small")
    layers = run.cfg.model.n_layers
    assert loop_trip_counts(run) == [layers, layers]
    report = communication_report(run.train_step, run.shardings.mesh)
    ring = (FSDP - 1) / FSDP
    # bf16 weights gathered per layer, forward and backward; bf16 gradients all-reduced per layer. What is left
    # (token ids, the norms' f32 gradients, the loss) is under 0.1%.
    weights = 2 * layers * layer_bytes(run, 2) + head_bytes(run, 2)
    assert report.measured(("fsdp",), ("all-gather",)) == pytest.approx(ring * weights, rel=1e-3)
    gradients = layers * layer_bytes(run, 2) + head_bytes(run, 2)
    assert report.measured(("fsdp",), ("all-reduce",)) == pytest.approx(2 * ring * gradients, rel=1e-3)


@pytest.mark.slow  # gpt-1b on 64 chips: 30-100 s of TPU compile
def test_gpt_1b_on_a_v5p_128_gathers_through_windowed_einsums():
    # The loss over whole logits: the chunked one adds a loop of its own (32 chunks) and gathers the head once.
    overrides = ("batch_size=256", "seq_len=2048", "chunked_loss=false")
    run = aot_run(aot_target("v5p:4x4x4"), "tpu-v5p-128", overrides, "gpt-1b")  # fsdp=16, tensor=4
    layers, fsdp = run.cfg.model.n_layers, run.shardings.mesh.shape["fsdp"]
    found = collectives(run.train_step.as_text())
    windowed = [c for c in found if c.via == "windowed einsum"]
    assert {c.kind for c in windowed} == {"all-gather", "reduce-scatter"}
    assert sorted(set(loop_trip_counts(run))) == [fsdp // 4, layers]  # windowed loops: two steps each way per trip
    report = communication_report(run.train_step, run.shardings.mesh)
    # Each device gathers its tensor quarter of every block weight per layer, forward and backward, in bf16, and
    # the head's: a ring sends (N-1)/N of that; a windowed einsum sends N+1 shards for the ring's N-1.
    weights = 2 * layers * layer_bytes(run, 2, 4) + head_bytes(run, 2, 4)
    ring = (fsdp - 1) / fsdp * weights
    assert ring < report.measured(("fsdp",), ("all-gather",)) <= (fsdp + 1) / (fsdp - 1) * ring


def test_fsdp_across_a_whole_v5p_torus_gathers_each_weight_once_and_reduces_bf16_gradients():
    """Over all 64 chips of v5p:4x4x4, a torus, every FSDP weight is all-gathered: (N-1)/N of its bf16 bytes per
    gather. (Compiled for an open 4x4x4 mesh, libtpu's default topology, each gather was an all-reduce of a
    zero-filled buffer, 2(N-1)/N.) The tied table's gradient is reduced in bf16, as the layers' are (it was float32:
    four times the bytes)."""
    # A vocabulary and sequence large enough for the chunked loss's loop (2 chunks), whose table gradient this is.
    overrides = ("dtype=bfloat16", "d_model=256", "n_layers=3", "vocab_size=65536", "batch_size=64", "seq_len=512")
    run = aot_run(aot_target("v5p:4x4x4"), "fsdp=64", overrides, "llama-tiny")
    layers, fsdp = run.cfg.model.n_layers, run.shardings.mesh.shape["fsdp"]
    table = run.shardings.abstract_state["params"]["embedding"]
    table_bytes = table.size * 2
    report = communication_report(run.train_step, run.shardings.mesh)
    ring = (fsdp - 1) / fsdp
    # In each layer, forward and backward, each block weight once; the table once (the lookup and the tied head).
    weights = 2 * layers * layer_bytes(run, itemsize=2) + table_bytes
    assert report.measured(("fsdp",), ("all-gather",)) == pytest.approx(ring * weights, rel=0.05)
    gradients = layers * layer_bytes(run, itemsize=2) + table_bytes
    assert report.measured(("fsdp",), ("all-reduce",)) == pytest.approx(2 * ring * gradients, rel=0.05)


def test_gpu_fsdp_moves_bf16_rows_and_reduce_scatters_bf16_gradients():
    """On an 8-GPU node, FSDP over all 8: the embedding's looked-up rows, their cotangents and every weight gradient
    (the chunked loss's head gradient included) travel in the compute dtype. (A lookup in the float32 table moved its
    rows and their cotangents by a float32 all-to-all, and `jnp.sum`'s float32 accumulation of the batch shards' head
    gradients made their reduce-scatter float32: llama-1b, 2 layers, on h100:8 sent 1.96 GiB a device, now 1.51.)"""
    overrides = ("dtype=bfloat16", "d_model=256", "n_layers=3", "vocab_size=65536", "batch_size=64", "seq_len=512")
    run = aot_run(aot_target("h100:8"), f"fsdp={FSDP}", overrides, "llama-tiny")
    found = collectives(run.train_step.as_text())
    moved = {(c.kind, dtype) for c in found for dtype, _ in c.shapes if c.kind in ("all-to-all", "reduce-scatter")}
    assert moved == {("all-to-all", "bf16"), ("reduce-scatter", "bf16")}
