"""Every mesh computes the same training run as one device: losses step by step, and the gradients."""

import functools

import numpy as np
import pytest
from conftest import shared_file
from helpers import assert_curves_close, assert_gradients_close, curve, gradients, make_run, reference_curve

MESHES = [  # (layout, devices)
    ("data=8", 8),
    ("fsdp=8", 8),
    ("tensor=4", 4),
    ("data=2,fsdp=2,tensor=2", 8),
    ("data=2,tensor=4", 8),
]


@pytest.mark.parametrize("mesh,devices", MESHES)
def test_losses_match_single_device(mesh, devices):
    assert_curves_close(curve(make_run(mesh, devices=devices)), reference_curve())


@pytest.mark.parametrize("mesh,devices", [("fsdp=8", 8), ("data=2,fsdp=2,tensor=2", 8)])
def test_gradients_match_single_device(mesh, devices):
    ref_loss, reference = gradients(make_run("single", devices=1))
    loss, sharded = gradients(make_run(mesh, devices=devices))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_gradients_close(sharded, reference)


@pytest.mark.parametrize("mesh", ["single", pytest.param("data=8", marks=pytest.mark.slow), "data=2,fsdp=2,tensor=2"])
def test_gradient_accumulation_equals_one_batch(mesh):
    """The mean of 4 pieces' gradients is the whole batch's gradient (a sum would be 4 times it)."""
    devices = 1 if mesh == "single" else 8
    whole_loss, whole = gradients(make_run(mesh, ["batch_size=32"], devices=devices))
    loss, accumulated = gradients(make_run(mesh, ["batch_size=32", "grad_accum=4"], devices=devices))
    np.testing.assert_allclose(loss, whole_loss, rtol=1e-6)
    assert_gradients_close(accumulated, whole)


@pytest.mark.parametrize("overrides", [[], ["grad_accum=2", "batch_size=16"]])
def test_fused_data_parallel_sync_equals_xla_placement(overrides):
    fused = curve(make_run("data=8", ["grad_sync=fused", *overrides]))
    assert_curves_close(fused, curve(make_run("data=8", overrides)))


def test_fused_sync_refuses_sharded_parameters():
    with pytest.raises(ValueError, match="grad_sync=fused averages gradients over data-parallel .*sharded over fsdp"):
        make_run("fsdp=8", ["grad_sync=fused"])


@pytest.mark.parametrize("mesh", ["data=8", "data=2,tensor=4"])
def test_mlp_matches_single_device(mesh):
    digits = str(shared_file("digits.csv.gz"))
    mlp = functools.partial(make_run, model="mlp", overrides=[f"data.source={digits}", "batch_size=64"])
    assert_curves_close(curve(mlp(mesh)), curve(mlp("single", devices=1)))
