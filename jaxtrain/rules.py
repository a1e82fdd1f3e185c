"""Logical dimension names -> mesh axes.

Models name the dimensions of their arrays (`embed`, `mlp`, `heads`, ...). One table maps each name to zero or more
mesh axes. Weights and activations get separate tables because FSDP shards a weight's `embed` dim while the
activations' `embed` dim stays whole. The mapping refuses to guess: an unknown name, an axis used twice in one
array, or a dimension the axes do not divide is an error naming the array.

    >>> rules = ShardingRules.default()
    >>> rules.params["embed"], rules.activations["batch"]
    (('fsdp',), ('replica', 'data', 'fsdp'))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from jax.sharding import Mesh, PartitionSpec

from jaxtrain.errors import UserInputError

AxisRule = tuple[str, ...]

# Weights: FSDP shards the `embed` dim of every matrix, tensor parallel the Megatron dims (mlp, heads, vocab).
DEFAULT_PARAM_RULES: dict[str, AxisRule] = {
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv": (),
    "qkv": (),
    "vocab": ("tensor",),
    "layers": ("pipeline",),  # pipeline stages own contiguous blocks of layers
    "features": (),
    "classes": (),
    "norm": (),
}
# Activations: the batch is split over every data-like axis; model dims follow tensor parallel.
DEFAULT_ACTIVATION_RULES: dict[str, AxisRule] = {
    "batch": ("replica", "data", "fsdp"),
    "seq": (),
    "embed": (),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv": (),
    "qkv": (),
    "vocab": ("tensor",),
    "features": (),
    "classes": (),
}


class ShardingRuleError(UserInputError):
    """A logical name, rule or dimension that cannot be mapped onto the mesh."""


def _as_rule(value: object) -> AxisRule:
    if value is None or value == "" or value == ():
        return ()
    if isinstance(value, str):
        return tuple(a.strip() for a in value.split(",") if a.strip())
    return tuple(value)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Two tables, logical name -> mesh axes: one for weights (and optimizer state), one for activations/batches."""

    params: Mapping[str, AxisRule]
    activations: Mapping[str, AxisRule]

    @classmethod
    def default(cls) -> ShardingRules:
        return cls(dict(DEFAULT_PARAM_RULES), dict(DEFAULT_ACTIVATION_RULES))

    def with_overrides(self, overrides: Mapping[str, object]) -> ShardingRules:
        """Override rules: `{"embed": "fsdp,tensor"}` sets both tables; `params.embed` / `activations.embed` one.

        A value is a comma-separated axis list, a list of axes, or "" / None for "replicate".
        """
        params, activations = dict(self.params), dict(self.activations)
        for key, value in overrides.items():
            table, _, name = key.rpartition(".")
            if table not in ("", "params", "activations"):
                raise ShardingRuleError(f"rule override '{key}': use 'name', 'params.name' or 'activations.name'.")
            rule = _as_rule(value)
            if table in ("", "params"):
                params[name] = rule
            if table in ("", "activations"):
                activations[name] = rule
        return ShardingRules(params, activations)

    def batch_axes(self) -> AxisRule:
        return tuple(self.activations.get("batch", ()))


def is_logical_names(x: object) -> bool:
    """True for a tuple of dim names (str or None): the leaves of a tree of logical names."""
    return isinstance(x, tuple) and all(isinstance(n, str | None) for n in x)


def is_layer_stack(names: Sequence[str | None]) -> bool:
    """True for the logical names of a stacked-layers array (leading `layers` dim), which pipelines split."""
    return bool(names) and names[0] == "layers"


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int],
    table: Mapping[str, AxisRule],
    mesh: Mesh,
    array_name: str,
) -> PartitionSpec:
    """The PartitionSpec for an array whose dims are called `names`, checked against `shape` and `mesh`.

    Mesh axes of size 1 are dropped, so an absent parallelism costs nothing and needs no divisibility.
    """
    if len(names) != len(shape):
        raise ShardingRuleError(f"'{array_name}': {len(names)} logical names {tuple(names)} for shape {tuple(shape)}.")
    used: dict[str, str] = {}
    spec = []
    for name, size in zip(names, shape):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ShardingRuleError(
                f"'{array_name}': no sharding rule for logical axis '{name}'. Known: {', '.join(sorted(table))}. "
                f"Add one, e.g. override rules.{name}=tensor (or rules.{name}= to replicate)."
            )
        axes = tuple(a for a in table[name] if _axis_size(mesh, a, array_name, name) > 1)
        for axis in axes:
            if axis in used:
                raise ShardingRuleError(
                    f"'{array_name}': mesh axis '{axis}' is used by both logical axes '{used[axis]}' and '{name}'. "
                    "A mesh axis can shard only one dimension of an array; change one of the two rules."
                )
            used[axis] = name
        ways = math.prod(mesh.shape[a] for a in axes)
        if size % ways:
            raise ShardingRuleError(
                f"'{array_name}': dimension '{name}' of size {size} is not divisible by mesh axes {axes} "
                f"(together {ways} ways). Pick sizes that divide, or change the rule for '{name}'."
            )
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*spec)


def _axis_size(mesh: Mesh, axis: str, array_name: str, name: str) -> int:
    if axis not in mesh.shape:
        raise ShardingRuleError(
            f"'{array_name}': the rule for '{name}' names mesh axis '{axis}', which the mesh does not have "
            f"(mesh axes: {', '.join(mesh.axis_names)})."
        )
    return mesh.shape[axis]
