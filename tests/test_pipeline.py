"""Pipeline parallelism (GPipe) equals the non-pipelined 1-device run, alone and composed with other axes."""

import jax
import numpy as np
import pytest
from helpers import losses, make_run

from jaxtrain.hlo import collectives
from jaxtrain.pipeline import PipelineError

LAYERS = ["n_layers=4", "batch_size=16"]


@pytest.fixture(scope="module")
def reference():
    return losses(make_run("single", LAYERS, devices=1))


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("per_stage", [0, 1, 2])  # M = 1, P, 2P
def test_gpipe_matches_single_device(stages, per_stage, reference):
    microbatches = max(1, per_stage * stages)
    run = make_run(f"pipeline={stages}", [*LAYERS, f"microbatches={microbatches}"], devices=stages)
    np.testing.assert_allclose(losses(run), reference, rtol=1e-5)


@pytest.mark.parametrize("mesh", ["pipeline=2,data=2,tensor=2", "pipeline=4,fsdp=2"])
def test_gpipe_composes_with_other_axes(mesh, reference):
    np.testing.assert_allclose(losses(make_run(mesh, [*LAYERS, "microbatches=4"])), reference, rtol=1e-5)


def test_gpipe_with_gradient_accumulation(reference):
    run = make_run("pipeline=2,data=2,tensor=2", [*LAYERS, "microbatches=2", "grad_accum=2"])
    np.testing.assert_allclose(losses(run), reference, rtol=1e-5)


def test_stages_pass_activations_and_never_gather_other_stages_weights():
    run = make_run("pipeline=4", [*LAYERS, "microbatches=4"], devices=4)
    found = collectives(run.train_step.as_text())
    assert any(c.kind == "collective-permute" for c in found)
    stacked = {tuple(p.shape) for p in jax.tree.leaves(run.plan.abstract_state["params"]["blocks"])}
    gathers = [s for c in found if c.kind == "all-gather" for _, s in c.shapes]
    assert not [s for s in gathers if s in stacked]  # no stage ever holds all layers' weights


def test_fewer_layers_than_stages():
    with pytest.raises(PipelineError, match="2 layers cannot be split evenly into 4 pipeline stages"):
        make_run("pipeline=4,data=2", ["n_layers=2"])


def test_batch_not_divisible_into_microbatches():
    with pytest.raises(PipelineError, match="a batch of 16 rows does not split into 3 pipeline microbatches"):
        make_run("pipeline=2", [*LAYERS, "microbatches=3"], devices=2)


def test_model_without_layer_stack():
    with pytest.raises(PipelineError, match="has no stacked `layers` dim"):
        make_run("pipeline=2", ["data.source=digits"], model="mlp-tiny", devices=2)
