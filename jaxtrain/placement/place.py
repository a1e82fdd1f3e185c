"""Placement: a model on a mesh. The one way every product (training, generation, Hugging Face import and export,
the planner, the asynchronous engine, the examples) gets a model onto devices.

    model name + config --(registry)--> spec --(split)--> graph, abstract params, logical names
    mesh layout --> mesh (real devices, or an abstract mesh for planning) + the layout's rule overrides
    default rules + layout's overrides + the run's overrides --> rules
    all of it --> `PlacedModel.shardings(optimizer, stages, policy)`: the shardings of the state that product keeps

>>> placed = place_model("gpt-tiny", default_config("gpt-tiny").model, "data=2,tensor=2")  # doctest: +SKIP
>>> placed.shardings().table()                            # params only: generation and import keep no optimizer state
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import optax
from jax.sharding import AbstractMesh, Mesh

from jaxtrain.parallel.pipeline import StageLayout
from jaxtrain.parallel.updates import UpdatePolicy
from jaxtrain.placement.model import ModelParts, split_model
from jaxtrain.placement.shardings import Shardings, make_shardings
from jaxtrain.registry import ModelSpec, resolve_model
from jaxtrain.sharding.mesh import MeshLayout, build_mesh, parse_layout
from jaxtrain.sharding.rules import ShardingRules


@dataclasses.dataclass(frozen=True)
class PlacedModel:
    """A model split for functional use, on a mesh, with the rules that map its logical names to the mesh's axes."""

    spec: ModelSpec  # the registry's entry: module, task, presets
    layout: MeshLayout  # what the mesh was built from; its rule overrides are already in `rules`
    mesh: Mesh | AbstractMesh
    rules: ShardingRules
    model: ModelParts

    def on_mesh(self, mesh: Mesh | AbstractMesh) -> PlacedModel:
        """The same model and rules on another mesh (generation on fewer devices than training had)."""
        return dataclasses.replace(self, mesh=mesh)

    def shardings(
        self,
        optimizer: optax.GradientTransformation | None = None,
        stages: StageLayout | None = None,
        policy: UpdatePolicy | None = None,
    ) -> Shardings:
        """The shardings of the state kept with this model: its params, and the state of `optimizer` (none when
        omitted: generation and import keep params alone) and of an update `policy`; `stages`: a pipeline's stage
        layout, which changes how the stacked layers are stored."""
        return make_shardings(self.mesh, self.rules, self.model, optimizer or optax.identity(), stages, policy)


def place_model(
    model: str,
    model_config: object,
    layout: str | MeshLayout,
    rule_overrides: Mapping[str, object] | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    mesh: Mesh | AbstractMesh | None = None,
) -> PlacedModel:
    """Place registered model `model` (a name as `--model` takes it), built from `model_config` (its config
    dataclass: a preset's, or the one a checkpoint stores), on the mesh of `layout` (a layout name, inline
    `data=2,fsdp=-1`, a TOML file, or a parsed `MeshLayout`) over `devices` (default: all of them).

    `mesh`: a mesh already built (an abstract one for planning without devices); then `layout` only supplies its
    rule overrides. `rule_overrides` (the run's `rules.*` keys) apply after the layout's, over the default rules.
    Raises `PlacementError` for a parameter without logical names, and the registry's and mesh's errors for a bad name
    or layout: nothing is allocated.
    """
    spec, _ = resolve_model(model)
    layout = parse_layout(layout) if isinstance(layout, str) else layout
    rules = ShardingRules.default().with_overrides({**layout.rules, **(rule_overrides or {})})
    parts = split_model(functools.partial(spec.module, model_config), spec.replicate_unnamed)
    return PlacedModel(spec, layout, build_mesh(layout, devices) if mesh is None else mesh, rules, parts)
