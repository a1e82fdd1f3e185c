"""Sharding mistakes a user can make through config (rule overrides, mesh layouts, update policies) end in our own
errors naming the parameter, never in a bare JAX error from deep inside."""

import numpy as np
import pytest
from helpers import gradients, make_run

from jaxtrain.placement.model import PlacementError
from jaxtrain.sharding.rules import ShardingRuleError


@pytest.mark.parametrize(
    "overrides,path,spec,rule",
    [
        (
            ["updates.policy=local_sgd", "rules.params.embed=replica"],
            "blocks/w_down",
            "P(None, None, 'replica')",
            "embed=replica",
        ),
        (["updates.policy=diloco", "rules.params.vocab=replica"], "embedding", "P('replica', None)", "vocab=replica"),
    ],
)
def test_jax_refusing_a_policy_state_sharding_names_the_parameter(overrides, path, spec, rule):
    # local_sgd/diloco keep one copy of every parameter per index of the `replica` axis, stacked along a new leading
    # dim sharded over `replica`; a weight rule using `replica` too makes JAX refuse the spec.
    with pytest.raises(PlacementError) as caught:
        make_run("replica=2,data=4", overrides)
    message = str(caught.value)
    assert f"parameter '{path}'" in message and f"spec {spec}" in message and f"rules.params.{rule}" in message
    assert "duplicate entries for `replica`" in message  # JAX's own words, kept
    cause = caught.value.__cause__
    assert type(cause).__module__.startswith("jax") and "Duplicate" in type(cause).__name__


@pytest.mark.parametrize(
    "mesh,overrides,message",
    [
        ("data=2,tensor=4", ["rules.params.embed=tensor"], "'blocks/w_down': mesh axis 'tensor' is used by both"),
        ("data=2,tensor=4", ["rules.params.layers=tensor"], "dimension 'layers' of size 2 is not divisible"),
        ("pipeline=2,data=4", ["rules.params.embed=pipeline"], "mesh axis 'pipeline' is used by both"),
        ("data=2,tensor=4", ["vocab_size=258"], "'embedding': dimension 'vocab' of size 258 is not divisible"),
        ("data=2,tensor=4", ["rules.params.embed=expert2"], "names mesh axis 'expert2', which the mesh does not have"),
    ],
)
def test_rule_mistakes_on_params_are_ours(mesh, overrides, message):
    with pytest.raises(ShardingRuleError, match=message.replace("(", r"\(")):
        make_run(mesh, overrides)


def test_activation_rule_mistakes_are_ours_at_trace_time():
    run = make_run("data=2,tensor=4", ["rules.activations.seq=tensor"])
    with pytest.raises(ShardingRuleError, match="mesh axis 'tensor' is used by both logical axes 'seq' and 'heads'"):
        run.train_step  # noqa: B018 (tracing the step applies the activation rules)


def test_ring_over_batch_axes_listed_out_of_mesh_order():
    # The batch rule lists fsdp before data; ppermute over several axes needs mesh order (JAX raised before).
    batch = ["rules.params.embed=", "rules.activations.batch=fsdp,data", "data.source=synthetic"]
    loss, grads = gradients(make_run("data=2,fsdp=4", [*batch, "allreduce.algorithm=ring"], model="mlp"))
    ref_loss, ref_grads = gradients(make_run("data=2,fsdp=4", batch, model="mlp"))
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
