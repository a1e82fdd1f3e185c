"""Logical dimension names -> mesh axes.

Models name the dimensions of their arrays (`embed`, `mlp`, `heads`, ...). One table maps each name to zero or more
mesh axes. Weights and activations get separate tables because FSDP shards a weight's `embed` dim while the
activations' `embed` dim stays whole. The mapping refuses to guess: an unknown name, an axis used twice in one
array, or a dimension the axes do not divide is an error naming the array.

    >>> rules = ShardingRules.default()
    >>> rules.params["embed"], rules.activations["batch"]
    (('fsdp',), ('replica', 'data', 'fsdp', 'expert'))
"""

from __future__ import annotations

import dataclasses
import functools
import logging
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
    # Grouped-query attention's key/value heads: fewer than the query heads, so split only where they divide
    # (`SPLIT_WHERE_DIVIDES`); where not, every tensor device keeps all of them.
    "kv_heads": ("tensor",),
    "kv": (),
    "qkv": (),
    "vocab": ("tensor",),
    "layers": ("pipeline",),  # pipeline stages own contiguous blocks of layers
    "features": (),
    "classes": (),
    "norm": (),
    # Convolution kernels (ResNet): few weights, much compute, so every device keeps them whole (data parallel).
    "conv_in": (),
    "conv_out": (),
    # The input dim of the ResNet's fully connected head: its weights are split over tensor (row-parallel).
    "pooled": ("tensor",),
    # A recommender's embedding tables hold nearly all its weights and a step reads few of their rows: split the rows
    # over every device but the replicas (slow links). A lookup is a masked local gather plus a sum over devices,
    # and each device's rows get their gradient from its own lookups: no table gradient is ever reduced (with rows
    # replicated over `data`, a dense all-reduce of them would be: 4 GiB per device and step for recsys-large on
    # data=2,fsdp=2,tensor=2, against 28 MiB in all this way). Rows stay whole.
    "tables": (),
    "table_rows": ("data", "fsdp", "expert", "tensor"),
    "table_embed": (),
    # The recommender's MLPs: small and compute-heavy per weight, so replicated (data parallel).
    "fc_in": (),
    "fc_out": (),
    # Mixture of experts: each expert's weights live on their own slice of the expert axis (expert parallel). The
    # router (each token scores every expert) is small: replicated.
    "expert": ("expert",),
    "router": (),
    # A low-rank adapter's inner dim (jaxtrain/posttrain/adapters.py): a few dozen wide, whole on every device. The
    # adapter's other dims are the adapted weight's, with its rules, so it is split as the weight is.
    "lora_rank": (),
}
# Activations: the batch is split over every data-like axis; model dims follow tensor parallel.
DEFAULT_ACTIVATION_RULES: dict[str, AxisRule] = {
    # Outside the experts an expert axis is one more data axis: tokens are split over it, and an MoE layer moves
    # them to their experts by all-to-all over it.
    "batch": ("replica", "data", "fsdp", "expert"),
    # Context parallelism: each device holds a share of every sequence's positions (jaxtrain.ops.sequence lays
    # them out; attention exchanges keys and values over the axis, jaxtrain.ops.context_attention).
    "seq": ("context",),
    "embed": (),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "kv": (),
    "qkv": (),
    "vocab": ("tensor",),
    # A KV cache's slots (generation): whole on every device, like `seq`.
    "cache_seq": (),
    # A KV cache's stacked layers: every device holds all of them (generation runs without a pipeline).
    "layers": (),
    "features": (),
    "classes": (),
    # The batch dim inside a ResNet's convolutions: split over every axis but pipeline, tensor and expert included,
    # so all devices share the compute-heavy convolutions; the head then switches to "batch" x "pooled".
    "conv_batch": ("replica", "data", "fsdp", "expert", "tensor"),
    "conv_out": (),
    "pooled": ("tensor",),
    # A recommender's table lookups: the batch axes but those splitting `table_rows`, so every device holding some
    # rows of a table looks up the same examples (ids are small) in its own rows. Change both rules together.
    "lookup_batch": ("replica",),
    # The rest of a recommender (MLPs, interaction) is data parallel over every device, the model axes included:
    # the looked-up rows are summed and scattered to it over the devices that split the table rows.
    "dense_batch": ("replica", "data", "fsdp", "expert", "tensor"),
    "tables": (),
    "table_embed": (),
    "fc_out": (),
    # An MoE layer's tokens grouped by expert, (expert, group, capacity, embed): the expert dim takes the expert
    # axis, so the groups (the batch's sequences) take the batch axes but that one: a mesh axis splits one dim.
    "expert": ("expert",),
    "expert_group": ("replica", "data", "fsdp"),
    "capacity": (),
}


# Names whose rule applies only where the mesh axes divide the dimension; elsewhere the dimension is replicated, with
# a warning. Grouped-query attention has few key/value heads (Llama 3 8B: 8), often fewer than tensor devices.
SPLIT_WHERE_DIVIDES = frozenset({"kv_heads"})
log = logging.getLogger(__name__)


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


def spec_axes(spec: PartitionSpec) -> set[str]:
    """Every mesh axis a PartitionSpec names, over all its dims."""
    return {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}


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
        if size % ways and name in SPLIT_WHERE_DIVIDES:
            _warn_replicated(array_name, name, size, axes, ways)
            for axis in axes:
                del used[axis]
            spec.append(None)
            continue
        if size % ways:
            raise ShardingRuleError(
                f"'{array_name}': dimension '{name}' of size {size} is not divisible by mesh axes {axes} "
                f"(together {ways} ways). Pick sizes that divide, or change the rule for '{name}'."
            )
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*spec)


@functools.cache
def _warn_replicated(array_name: str, name: str, size: int, axes: AxisRule, ways: int) -> None:
    log.warning(
        "'%s': %d %s do not split over mesh axes %s (%d ways): every device along them keeps all %d. "
        "To split them, use a mesh whose %s size divides %d.",
        *(array_name, size, name, axes, ways, size, "x".join(axes), size),
    )


def _axis_size(mesh: Mesh, axis: str, array_name: str, name: str) -> int:
    if axis not in mesh.shape:
        raise ShardingRuleError(
            f"'{array_name}': the rule for '{name}' names mesh axis '{axis}', which the mesh does not have "
            f"(mesh axes: {', '.join(mesh.axis_names)})."
        )
    return mesh.shape[axis]
