"""Placement: every product puts a model on a mesh through `jaxtrain.placement.place_model`, and so lays out the
same model on the same mesh the same way."""

import ast
from pathlib import Path

import jax
import optax
import pytest

from jaxtrain.inference.generate import generation_shardings
from jaxtrain.interop.importing import params_shardings
from jaxtrain.placement.place import place_model
from jaxtrain.planner.estimate import _abstract_shardings
from jaxtrain.run_config import apply_overrides, default_config
from jaxtrain.sharding.mesh import parse_layout
from jaxtrain.training.setup import build

ROOT = Path(__file__).resolve().parent.parent
PLACEMENT = ROOT / "jaxtrain" / "placement"
# What only placement does: split a model into its parts, build the default rules and apply a layout's overrides to
# them, and turn the parts into a plan. Anyone else doing one of these has placed a model by hand.
PLACING_CALLS = {"split_model", "make_shardings", "default"}


def _placing_calls(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name == "default" and not (isinstance(func.value, ast.Name) and func.value.id == "ShardingRules"):
            continue  # only ShardingRules.default(): other classes' `default` are not rules
        if name in PLACING_CALLS:
            found.append(f"{path.relative_to(root)}:{node.lineno} calls {name}")
    return found


def _sources() -> list[Path]:
    folders = [ROOT / "jaxtrain", ROOT / "scripts", ROOT / "benchmarks"]
    return [p for folder in folders if folder.is_dir() for p in folder.rglob("*.py") if PLACEMENT not in p.parents]


def test_only_placement_places_models():
    found = [line for path in _sources() for line in _placing_calls(path)]
    assert not found, "place the model with jaxtrain.placement.place_model instead:\n" + "\n".join(found)


def test_the_check_sees_a_model_placed_by_hand(tmp_path):
    by_hand = tmp_path / "by_hand.py"
    by_hand.write_text(
        "rules = ShardingRules.default().with_overrides({})\nparts = split_model(build)\n"
        "shardings = make_shardings(m, r, p, o)\n"
    )
    found = _placing_calls(by_hand, tmp_path)
    assert sorted(line.rsplit(" ", 1)[1] for line in found) == ["default", "make_shardings", "split_model"]


def _param_specs(shardings) -> list:
    return jax.tree.leaves(jax.tree.map(lambda x: x.sharding.spec, shardings.abstract_state["params"]))


@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2"])
def test_every_product_lays_out_the_model_alike(mesh: str):
    """Training, Hugging Face import/export, generation and the planner (on an abstract mesh) give each parameter
    the same PartitionSpec, rule overrides included."""
    cfg = apply_overrides(default_config("llama-tiny"), [f"mesh={mesh}", "rules.params.embed=fsdp,data"])
    training = build(cfg, log=lambda _: None, devices=jax.devices()[:8]).shardings
    importing = params_shardings(cfg, mesh, jax.devices()[:8])
    generating = generation_shardings(
        place_model(cfg.model_name, cfg.model, mesh, cfg.rules, devices=jax.devices()[:8])
    )
    planning = _abstract_shardings(cfg, parse_layout(mesh), 8)
    expected = _param_specs(training)
    assert any(spec != jax.sharding.PartitionSpec() for spec in expected)
    for other in (importing, generating, planning):
        assert _param_specs(other) == expected
    if "data=2" in mesh:  # the override, which puts the weights' embed dim over data too, reached every product
        assert jax.sharding.PartitionSpec(None, ("fsdp", "data"), "tensor") in expected


def test_placed_plan_keeps_what_it_is_given():
    placed = place_model("gpt-tiny", default_config("gpt-tiny").model, "data=-1", devices=jax.devices()[:2])
    assert placed.spec.task == "lm" and dict(placed.mesh.shape)["data"] == 2
    params_only = placed.shardings()
    with_adam = placed.shardings(optax.adam(1e-3))
    assert jax.tree.leaves(params_only.abstract_state["opt_state"]) == []
    assert len(jax.tree.leaves(with_adam.abstract_state["opt_state"])) > len(
        jax.tree.leaves(placed.model.abstract_params)
    )
