"""Every mesh computes the same training run as one device: losses step by step, and the gradients."""

import functools

import numpy as np
import pytest
from conftest import shared_file
from helpers import (
    BF16_GRAD_RTOL,
    assert_curves_close,
    assert_gradients_close,
    cached_run,
    curve,
    gradients,
    make_run,
    reference_curve,
)

MESHES = [  # (layout, devices)
    ("data=8", 8),
    ("fsdp=8", 8),
    ("tensor=4", 4),
    ("data=2,fsdp=2,tensor=2", 8),
    ("data=2,tensor=4", 8),
]


@pytest.mark.parametrize("mesh,devices", MESHES)
def test_losses_match_single_device(mesh, devices):
    sharded = curve(make_run(mesh, devices=devices))
    # Five AdamW steps at lr 0.01 amplify reduction-order rounding: measured 1.8e-5 in a gradient norm on data=8.
    assert_curves_close(sharded, reference_curve(), rtol=3e-5)
    assert sharded["loss"][-1] < sharded["loss"][0]  # it is training, not replaying a constant


HYBRID = "data=2,fsdp=2,tensor=2"


@pytest.mark.parametrize("mesh", ["fsdp=8", HYBRID])
def test_gradients_match_single_device(mesh):
    ref_loss, reference = gradients(cached_run("single"))
    loss, sharded = gradients(cached_run(mesh))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_gradients_close(sharded, reference)


# The default `gpt` preset as it is (bfloat16 compute, full remat), at gpt-tiny's size.
GPT_PRESET_SHRUNK = ("n_layers=2", "d_model=64", "d_ff=256")


def test_default_gpt_preset_in_bfloat16_matches_single_device():
    """The same in bfloat16 on one device and on a hybrid mesh: rounding apart (measured: the loss within 2.2e-5,
    each gradient within 9.2e-3), the same numbers."""
    single = make_run("single", GPT_PRESET_SHRUNK, model="gpt", devices=1)
    assert (single.cfg.model.dtype, single.cfg.model.remat) == ("bfloat16", "full")
    ref_loss, reference = gradients(single)
    loss, sharded = gradients(make_run(HYBRID, GPT_PRESET_SHRUNK, model="gpt"))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-4)
    assert_gradients_close(sharded, reference, rtol=BF16_GRAD_RTOL)


@pytest.mark.parametrize("remat", ["save_dots", "full"])
def test_rematerialization_changes_no_number(remat):
    """Recomputing activations in the backward pass, on a hybrid mesh, gives the gradients of one device that
    keeps them all."""
    ref_loss, reference = gradients(cached_run("single"))
    loss, got = gradients(cached_run(HYBRID, (f"remat={remat}",)))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_gradients_close(got, reference)


REMATS = ("none", "save_dots", "full")


def test_remat_policies_recompute_what_they_say():
    """save_dots keeps the weight matmuls' outputs and recomputes the rest (the attention's batched dots too), full
    recomputes everything: backward FLOPs none < save_dots < full, and save_dots keeps less than none."""
    compiled = {r: cached_run(HYBRID, (f"remat={r}",) if r != "none" else ()).compiled_grad for r in REMATS}
    flops = {r: c.cost_analysis()["flops"] for r, c in compiled.items()}
    temp = {r: c.memory_analysis().temp_size_in_bytes for r, c in compiled.items()}
    assert flops["none"] < flops["save_dots"] < flops["full"], flops
    assert temp["save_dots"] < temp["none"], temp


@pytest.mark.parametrize("mesh", ["single", pytest.param("data=8", marks=pytest.mark.slow), HYBRID])
def test_gradient_accumulation_equals_one_batch(mesh):
    """The mean of 4 pieces' gradients is the whole batch's gradient (a sum would be 4 times it)."""
    devices = 1 if mesh == "single" else 8
    whole_loss, whole = gradients(make_run(mesh, ["batch_size=32"], devices=devices))
    loss, accumulated = gradients(make_run(mesh, ["batch_size=32", "grad_accum=4"], devices=devices))
    np.testing.assert_allclose(loss, whole_loss, rtol=1e-6)
    assert_gradients_close(accumulated, whole)


# With accumulation the fused sync wraps the accumulated gradient, so that case covers the plain one (slow).
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param([], marks=pytest.mark.slow, id="plain"),
        pytest.param(["grad_accum=2", "batch_size=16"], id="accumulated"),
    ],
)
def test_fused_data_parallel_sync_equals_xla_placement(overrides):
    fused = curve(make_run("data=8", ["allreduce.algorithm=fused", *overrides]))
    assert_curves_close(fused, curve(make_run("data=8", overrides)))


def test_fused_sync_refuses_sharded_parameters():
    with pytest.raises(
        ValueError, match="allreduce.algorithm=fused averages gradients over data-parallel .*sharded over fsdp"
    ):
        make_run("fsdp=8", ["allreduce.algorithm=fused"])


@pytest.mark.parametrize("mesh", ["data=8", "data=2,tensor=4"])
def test_mlp_matches_single_device(mesh):
    digits = str(shared_file("digits.csv.gz"))
    mlp = functools.partial(make_run, model="mlp", overrides=[f"data.source={digits}", "batch_size=64"])
    assert_curves_close(curve(mlp(mesh)), curve(mlp("single", devices=1)))
