"""Every mesh computes the same training run as one device: losses step by step, and the gradients."""

import functools

import numpy as np
import pytest
from conftest import shared_file
from helpers import assert_gradients_close, gradients, losses, make_run

MESHES = [  # (layout, devices)
    ("data=8", 8),
    ("fsdp=8", 8),
    ("tensor=4", 4),
    ("data=2,fsdp=2,tensor=2", 8),
    ("data=2,tensor=4", 8),
]


@pytest.fixture(scope="module")
def reference_losses():
    return losses(make_run("single", devices=1))


@pytest.mark.parametrize("mesh,devices", MESHES)
def test_losses_match_single_device(mesh, devices, reference_losses):
    sharded = losses(make_run(mesh, devices=devices))
    np.testing.assert_allclose(sharded, reference_losses, rtol=1e-5)
    assert sharded[-1] < sharded[0]  # it is training, not replaying a constant


@pytest.mark.parametrize("mesh,devices", [("fsdp=8", 8), ("data=2,fsdp=2,tensor=2", 8)])
def test_gradients_match_single_device(mesh, devices):
    ref_loss, reference = gradients(make_run("single", devices=1))
    loss, sharded = gradients(make_run(mesh, devices=devices))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_gradients_close(sharded, reference)


@pytest.mark.parametrize("mesh", ["single", pytest.param("data=8", marks=pytest.mark.slow), "data=2,fsdp=2,tensor=2"])
def test_gradient_accumulation_equals_one_batch(mesh):
    devices = 1 if mesh == "single" else 8
    whole = losses(make_run(mesh, ["batch_size=32"], devices=devices))
    accumulated = losses(make_run(mesh, ["batch_size=32", "grad_accum=4"], devices=devices))
    np.testing.assert_allclose(accumulated, whole, rtol=1e-5)


@pytest.mark.parametrize("overrides", [[], ["grad_accum=2", "batch_size=16"]])
def test_fused_data_parallel_sync_equals_xla_placement(overrides):
    fused = losses(make_run("data=8", ["grad_sync=fused", *overrides]))
    by_xla = losses(make_run("data=8", overrides))
    np.testing.assert_allclose(fused, by_xla, rtol=1e-5)


def test_fused_sync_refuses_sharded_parameters():
    with pytest.raises(ValueError, match="grad_sync=fused averages gradients over data-parallel .*sharded over fsdp"):
        make_run("fsdp=8", ["grad_sync=fused"])


@pytest.mark.parametrize("mesh", ["data=8", "data=2,tensor=4"])
def test_mlp_matches_single_device(mesh):
    digits = str(shared_file("digits.csv.gz"))
    mlp = functools.partial(make_run, model="mlp", overrides=[f"data.source={digits}", "batch_size=64"])
    np.testing.assert_allclose(losses(mlp(mesh)), losses(mlp("single", devices=1)), rtol=1e-5)
