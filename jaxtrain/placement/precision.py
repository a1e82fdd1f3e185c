"""Low-precision matmuls on chosen weights (`precision.*`): int8 or FP8 training of the attention and MLP weights,
FSDP's all-gather in 8 bits, while the output head, the embeddings and the norms stay in high precision unless named.

A model needs no change: where the model reads a chosen weight it finds a `LowPrecision` in place of the array, and
`jaxtrain.ops.projection.project` hands it the activations; it multiplies them as its recipe says
(`jaxtrain.ops.quantized_matmul.Recipe`). The params, their shardings, the optimizer state and the checkpoints are
those of the plain model: the weights stay float32 and are quantized afresh at every matmul (current scaling), so a
run can switch precision between restarts. With adapters (`lora.*`) the frozen base weights' matmuls take the
recipe and the adapters' own small matmuls stay in the compute dtype.

    >>> model = with_precision(placed.model, apply_overrides(cfg, ["precision.matmuls=int8"]), mesh)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
from jax.sharding import AbstractMesh, Mesh

from jaxtrain.errors import UserInputError
from jaxtrain.ops.quantized_matmul import Recipe
from jaxtrain.placement.model import ModelParts
from jaxtrain.placement.weight_targets import Path, StandIn, chosen, get_at, name_of, replace_at
from jaxtrain.run_config import PrecisionConfig, RunConfig

PyTree = Any


class PrecisionError(UserInputError):
    """Low-precision matmuls that cannot be made as asked: a target that names no weight, a weight read without
    `project`, a combination that is not supported, a backend that cannot compile the mode."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: never compare arrays; JAX compares static fields only
class LowPrecision(StandIn):
    """A weight where the model reads it, multiplied as `recipe` says; `names`: its dims' logical names."""

    weight: jax.Array
    name: str = dataclasses.field(metadata={"static": True})
    names: tuple = dataclasses.field(metadata={"static": True})
    recipe: Recipe = dataclasses.field(metadata={"static": True})
    option: ClassVar[str] = "precision.targets"
    refusal: ClassVar[type[UserInputError]] = PrecisionError

    def projected(self, spec: str, x: jax.Array) -> jax.Array:
        return self.recipe.einsum(spec, x, self.weight, self.names)


@dataclasses.dataclass(frozen=True)
class Precision:
    """Which weights take which recipe: the chosen weights' paths, with their logical names."""

    recipe: Recipe
    targets: Mapping[Path, tuple]

    def reading(self, params: PyTree) -> PyTree:
        """`params` as the model reads them: each chosen weight a `LowPrecision` (weights another feature already
        stands in for, an adapter's, are left to it: it takes the recipe itself)."""

        def stand_in(path: Path, weight: Any) -> Any:
            if isinstance(weight, StandIn) or isinstance(weight, dict):
                return weight
            return LowPrecision(weight, name_of(path), self.targets[path], self.recipe)

        return replace_at(params, self.targets, stand_in)

    def describe(self) -> str:
        r = self.recipe
        what = []
        if r.matmuls != "none":
            what.append(f"{r.matmuls} matmuls ({r.scales} scales, {r.backward} backward)")
        if r.gather != "none":
            what.append("FSDP gathers in 8 bits")
        names = ", ".join(name_of(path) for path in self.targets)
        return f"precision: {' and '.join(what)} on {len(self.targets)} weights ({names})"

    def of(self, path: Path) -> tuple[Recipe, tuple] | None:
        """(recipe, logical names) of the weight at `path`, or None where it is not chosen."""
        return (self.recipe, self.targets[path]) if path in self.targets else None


def recipe_of(cfg: PrecisionConfig) -> Recipe:
    return Recipe(cfg.matmuls, cfg.scales, cfg.backward, cfg.gather)


def with_precision(model: ModelParts, cfg: RunConfig, mesh: Mesh | AbstractMesh) -> ModelParts:
    """`model` whose weights `cfg.precision.targets` chooses are multiplied as `cfg.precision` says, checked against
    the rest of the run and the devices of `mesh`; unchanged where `cfg.precision` changes no matmul."""
    p = cfg.precision
    if not p.active:
        return model
    _check_combination(cfg, mesh)
    _check_backend(p, mesh)
    paths = chosen(model.logical_names, p.targets, "precision.targets", PrecisionError)
    return dataclasses.replace(
        model, precision=Precision(recipe_of(p), {path: get_at(model.logical_names, path) for path in paths})
    )


def _check_combination(cfg: RunConfig, mesh: Mesh | AbstractMesh) -> None:
    if cfg.lora.rank and cfg.lora.quantize != "none" and cfg.precision.matmuls != "none":
        raise PrecisionError(
            f"precision.matmuls={cfg.precision.matmuls} with lora.quantize={cfg.lora.quantize}: the base weights are "
            "stored quantized already and are multiplied by dequantizing them; use one of the two (lora.quantize=none "
            "to quantize the matmuls, or precision.matmuls=none)."
        )
    if cfg.precision.gather != "none" and mesh.shape.get("fsdp", 1) == 1:
        raise PrecisionError(
            f"precision.gather={cfg.precision.gather} with mesh={cfg.mesh}: there is no FSDP all-gather to make "
            "smaller without an fsdp axis; add one (e.g. mesh=fsdp=8) or set precision.gather=none."
        )


# Chips whose matrix units multiply FP8 (device_kind, lower case): NVIDIA from Ada and Hopper on, TPU from v7 on.
# Elsewhere the compilers widen FP8 operands to bfloat16 before the dot: the run is correct but gains nothing.
FP8_CHIPS = ("h100", "h200", "h20", "h800", "gh200", "b200", "b100", "gb200", "l4", "l40", "rtx 40", "tpu7")


def _check_backend(p: PrecisionConfig, mesh: Mesh | AbstractMesh) -> None:
    if p.matmuls != "fp8" or not isinstance(mesh, Mesh):  # an abstract mesh (the planner's) has no devices
        return
    device = mesh.devices.flat[0]
    kind = str(getattr(device, "device_kind", "")).lower()
    if device.platform != "cpu" and not any(chip in kind for chip in FP8_CHIPS):
        raise PrecisionError(
            f"precision.matmuls=fp8 on {device.device_kind}: its matrix units have no FP8, so the compiler would "
            "widen every FP8 operand to bfloat16 (no faster, less accurate); use precision.matmuls=int8 there, or "
            "fp8 on a chip that has it (H100/H200 and later, TPU v7)."
        )
