"""Logical names -> mesh axes, without devices: an abstract mesh is enough."""

import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from jaxtrain.sharding.mesh import MESH_AXES
from jaxtrain.sharding.rules import ShardingRuleError, ShardingRules, logical_to_spec


def mesh(**sizes):
    return AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES)


PARAMS = ShardingRules.default().params


def test_fsdp_and_tensor_rules():
    spec = logical_to_spec(("embed", "mlp"), (64, 256), PARAMS, mesh(fsdp=2, tensor=4), "w_in")
    assert spec == PartitionSpec("fsdp", "tensor")


def test_size_one_axes_are_dropped_and_need_no_divisibility():
    assert logical_to_spec(("embed", "mlp"), (63, 255), PARAMS, mesh(data=8), "w") == PartitionSpec(None, None)


def test_multi_axis_rule():
    acts = ShardingRules.default().activations
    assert logical_to_spec(("batch", "seq"), (8, 5), acts, mesh(data=2, fsdp=4), "x") == PartitionSpec(
        ("data", "fsdp"), None
    )


def test_unknown_logical_name_names_the_array():
    with pytest.raises(ShardingRuleError, match=r"'blocks/w': no sharding rule for logical axis 'hidden'"):
        logical_to_spec(("embed", "hidden"), (8, 8), PARAMS, mesh(), "blocks/w")


def test_axis_used_twice_is_refused():
    rules = ShardingRules.default().with_overrides({"mlp": "fsdp"})
    with pytest.raises(ShardingRuleError, match=r"mesh axis 'fsdp' is used by both logical axes 'embed' and 'mlp'"):
        logical_to_spec(("embed", "mlp"), (8, 8), rules.params, mesh(fsdp=2), "w_in")


def test_indivisible_dimension_names_parameter_dim_and_axis():
    with pytest.raises(
        ShardingRuleError, match=r"'head': dimension 'vocab' of size 250 is not divisible by mesh axes \('tensor',\)"
    ):
        logical_to_spec(("embed", "vocab"), (64, 250), PARAMS, mesh(tensor=4), "head")


def test_overrides_target_one_or_both_tables():
    rules = ShardingRules.default().with_overrides({"params.embed": "", "mlp": "fsdp,tensor"})
    assert rules.params["embed"] == () and rules.activations["embed"] == ()
    assert rules.params["mlp"] == ("fsdp", "tensor") == rules.activations["mlp"]
    with pytest.raises(ShardingRuleError, match="use 'name', 'params.name' or 'activations.name'"):
        ShardingRules.default().with_overrides({"weights.embed": "fsdp"})


def test_rule_naming_a_missing_mesh_axis():
    rules = ShardingRules.default().with_overrides({"mlp": "model"})
    with pytest.raises(ShardingRuleError, match="names mesh axis 'model', which the mesh does not have"):
        logical_to_spec(("mlp",), (8,), rules.params, mesh(), "w")
