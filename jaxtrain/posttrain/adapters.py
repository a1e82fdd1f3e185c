"""Low-rank adapters (LoRA, Hu et al. 2021) on a model's weight matmuls, on any mesh.

    a weight W, frozen          ->  {"base": W, "lora_a": A, "lora_b": B} in the params (the parameter table's rows)
    where the model projects x  ->  x·W + (alpha / rank) · (dropout(x)·A)·B           (`Adapted.projected`)

A model needs no change: models multiply their weights through `jaxtrain.ops.projection.project`, which hands x to an
adapted weight. Which weights are adapted is chosen by logical dims or by name (`lora.targets`); a trace of the
model's loss with each chosen weight wrapped in a probe (`_probe_specs`) tells which einsum each takes part in, and so
the adapters' shapes. For the query projection "btd,dhk->bthk", W (d, h, k):

    A (d, r): the weight's contracted dims, then the rank;   B (r, h, k): the rank, then the weight's output dims.

A dim in the weight, the input and the output (an expert's) leads both; stacked `layers` dims lead all of them.
Each adapter dim keeps the logical name of the weight's dim (the rank's is `lora_rank`), so the sharding rules split
the adapters as their weights are split, on every mesh, and a layer scan or a pipeline stage slices them with their
weights. A starts as a uniform draw in +-1/sqrt(fan-in) (as peft's Kaiming init), B at zero: the adapted model
starts as the base model, exactly.

Training (`jaxtrain.training.setup.compose_step`): the step differentiates the adapters only and the optimizer keeps
state for them only (`AdaptedModel.trainable`); the base weights pass through the step untouched
(`jaxtrain.parallel.step.train_part`), and no gradient of one is formed, not even as dead code (`frozen_matmul`).
`AdaptedModel.merge` folds the adapters into the weights, W + (alpha / rank) · A·B, for generation or export.

QLoRA (`lora.quantize`): the base is stored quantized, {"base": {"qvalue", "scale"}, "lora_a", "lora_b"}, and
dequantized in the matmul (`jaxtrain.posttrain.quantized`, on qwix); initialising from float weights quantizes them,
and `merge` dequantizes them before folding the adapters in.

>>> from jaxtrain.run_config import LoraConfig
>>> adapted = adapt(placed.model, LoraConfig(rank=8), batch_shapes)                    # doctest: +SKIP
>>> merged = adapted.merge(state["params"])            # the base model's params        # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.errors import UserInputError
from jaxtrain.ops.cotangent import unfused_on_cpu
from jaxtrain.ops.projection import frozen_matmul, weight_matmul
from jaxtrain.ops.quantized_matmul import Recipe
from jaxtrain.placement.model import ModelParts
from jaxtrain.placement.weight_targets import (
    StandIn,
    chosen,
    flat,
    get_at,
    name_of,
    read_otherwise,
    replace_at,
    set_at,
)
from jaxtrain.posttrain import quantized
from jaxtrain.run_config import LoraConfig

PyTree = Any
Path = tuple  # a parameter's place in the params: its dict keys, ("blocks", "w_q")

RANK = "lora_rank"  # the logical name of an adapter's inner dim (a rule in jaxtrain.sharding.rules)
TRAINED = ("lora_a", "lora_b")  # an adapted weight's entries that train; "base" and "dropout_seed" are frozen


class AdapterError(UserInputError):
    """Adapters that cannot be made as asked: no rank, a target no weight matches, a weight read without `project`."""


class Letters(NamedTuple):
    """How an adapter factors a weight of einsum `x,w->out`: the letters of its factors `a` and `b`, of `h` = x·A,
    and of the rank, `r`."""

    x: str
    w: str
    out: str
    a: str
    b: str
    h: str
    r: str

    @classmethod
    def of(cls, spec: str) -> Letters:
        inputs, out = spec.replace(" ", "").split("->")
        x, w = inputs.split(",")
        r = next(c for c in "rzyxwvutsqponmlkjihgfedcba" if c not in spec)
        shared = [c for c in w if c in x and c in out]  # e.g. an expert's dim: each expert its own adapter
        contracted = [c for c in w if c in x and c not in out]
        output = [c for c in w if c not in x]
        h = "".join(c for c in x if c not in contracted) + r
        return cls(x, w, out, "".join(shared + contracted) + r, "".join(shared) + r + "".join(output), h, r)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: never compare arrays; JAX compares static fields only
class Adapted(StandIn):
    """A frozen weight with its low-rank adapter, where the model reads the weight: `project` computes
    x·base + scale · (dropout(x)·a)·b with it, forming gradients for `a` and `b` and none for `base`."""

    base: jax.Array | quantized.Stored  # Stored: the base stored quantized (QLoRA)
    a: jax.Array
    b: jax.Array
    seed: jax.Array | None  # uint32, this layer's dropout seed (None without dropout)
    name: str = dataclasses.field(metadata={"static": True})
    scale: float = dataclasses.field(metadata={"static": True})
    dropout: float = dataclasses.field(metadata={"static": True})
    # The base weight's matmul in low precision (`jaxtrain.placement.precision`): its recipe and logical names.
    precision: Recipe | None = dataclasses.field(default=None, metadata={"static": True})
    names: tuple = dataclasses.field(default=(), metadata={"static": True})
    option: ClassVar[str] = "lora.targets"
    refusal: ClassVar[type[UserInputError]] = AdapterError

    def projected(self, spec: str, x: jax.Array) -> jax.Array:
        if not self.scale:  # switched off: the base model's matmul (a reference model's)
            return self._base_matmul(spec, x)
        letters = Letters.of(spec)
        low = weight_matmul(f"{letters.x},{letters.a}->{letters.h}", self._dropped(x), self.a)  # (..., r)
        low = low * jnp.asarray(self.scale, low.dtype)  # scaled at rank width, the narrowest point
        y = self._base_matmul(spec, x) + weight_matmul(f"{letters.h},{letters.b}->{letters.out}", low, self.b)
        # Written out, as the base model's matmul output is: fused into its reader (RoPE's rotation), the sum changes
        # how XLA:CPU compiles the reader's float32 math, and the last bits with it; so with B = 0 the model
        # computes the base model's numbers bit for bit (tests/test_lora.py).
        return unfused_on_cpu(y)

    def _base_matmul(self, spec: str, x: jax.Array) -> jax.Array:
        if isinstance(self.base, quantized.Stored):
            return frozen_matmul(spec, x, self.base.qarray())
        if self.precision is not None:
            return self.precision.frozen_einsum(spec, x, self.base, self.names)
        return frozen_matmul(spec, x, self.base)

    def _dropped(self, x: jax.Array) -> jax.Array:
        if not self.dropout or self.seed is None:
            return x
        keep = jax.random.bernoulli(jax.random.key(self.seed), 1.0 - self.dropout, x.shape)
        return jnp.where(keep, x / jnp.asarray(1.0 - self.dropout, x.dtype), jnp.zeros((), x.dtype))


class _Seen:
    """The einsum specs each probed weight took part in, by the weight's name (compared by identity: a pytree's
    static field)."""

    def __init__(self) -> None:
        self.specs: dict[str, set[str]] = {}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class _Probe(StandIn):
    """A weight as it is, recording the spec of every `project` that reads it."""

    base: jax.Array
    name: str = dataclasses.field(metadata={"static": True})
    seen: _Seen = dataclasses.field(metadata={"static": True})
    option: ClassVar[str] = "lora.targets"
    refusal: ClassVar[type[UserInputError]] = AdapterError

    def projected(self, spec: str, x: jax.Array) -> jax.Array:
        self.seen.specs.setdefault(self.name, set()).add(spec)
        return weight_matmul(spec, x, self.base)


class Target(NamedTuple):
    """An adapted weight: the einsum it takes part in, and how many stacked dims (`layers`) lead its array."""

    spec: str
    lead: int

    def factor_dims(self, weight_dims: Sequence[Any], rank: Any) -> tuple[tuple, tuple]:
        """The dims (sizes or logical names) of A and B for a weight whose array has `weight_dims`."""
        letters = Letters.of(self.spec)
        by_letter = {**dict(zip(letters.w, weight_dims[self.lead :])), letters.r: rank}
        lead = tuple(weight_dims[: self.lead])
        return lead + tuple(by_letter[c] for c in letters.a), lead + tuple(by_letter[c] for c in letters.b)

    def fan_in(self, weight_shape: Sequence[int]) -> int:
        letters = Letters.of(self.spec)
        sizes = dict(zip(letters.w, weight_shape[self.lead :]))
        return math.prod(sizes[c] for c in letters.a if c != letters.r and c in letters.x and c not in letters.out)


@dataclasses.dataclass(frozen=True)
class AdaptedModel(ModelParts):
    """A model whose `targets` carry low-rank adapters: its params hold {"base", "lora_a", "lora_b"} at each target
    (and "dropout_seed", per stacked layer, with dropout), everything else as the model has it and frozen. With
    `quantize` other than "none" each "base" is {"qvalue", "scale"} (`jaxtrain.posttrain.quantized`)."""

    targets: Mapping[Path, Target] = dataclasses.field(default_factory=dict)
    rank: int = 8
    scale: float = 2.0  # alpha / rank
    dropout: float = 0.0
    quantize: str = "none"  # lora.quantize: how the base weights are stored

    def module(self, params: PyTree) -> nnx.Module:
        """The model with `params`, each adapted weight an `Adapted` (no dropout): it computes as `loss_fn` does."""
        return nnx.merge(self.graphdef, self._standing(params, dropout=0.0))

    def training_loss_fn(self, params: PyTree, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        return self._loss(nnx.merge(self.graphdef, self._standing(params, dropout=self.dropout)), params, batch)

    def reference_module(self, params: PyTree) -> nnx.Module:
        """The base model, from the same params: every adapter switched off (its product is not computed), the
        base weights as they are stored; no gradient flows into it."""
        return nnx.merge(self.graphdef, self._standing(jax.lax.stop_gradient(params), dropout=0.0, scale=0.0))

    def _standing(self, params: PyTree, dropout: float, scale: float | None = None) -> PyTree:
        """`params` with each adapted weight's entries turned into the `Adapted` the model reads (`scale` 0: the
        adapters switched off)."""
        scale = self.scale if scale is None else scale

        def stand_in(path: Path, entry: dict) -> Adapted:
            seed, base = entry.get("dropout_seed"), entry["base"]
            if quantized.is_quantized(base):
                base = quantized.stored(base, self.quantize, self.targets[path].spec)
            recipe, names = (None, ()) if self.precision is None else self.precision.of(path) or (None, ())
            return Adapted(base, entry["lora_a"], entry["lora_b"], seed, name_of(path), scale, dropout, recipe, names)

        return self.reading(replace_at(params, self.targets, stand_in))

    def init_params(self, seed: int, base: PyTree | None = None) -> PyTree:
        """The model's params (its own initialisation, or `base`) with new adapters: A uniform in +-1/sqrt(fan-in),
        B zero, drawn from `seed` apart from the model's own draws. With `quantize`, each base weight is quantized."""
        base = super().init_params(seed, base)
        key = jax.random.fold_in(jax.random.key(seed), 0x10A)  # not the stream nnx.Rngs(seed) draws the model from

        def with_adapter(index: int, path: Path, weight: jax.Array) -> dict:
            target, k = self.targets[path], jax.random.fold_in(key, index)
            a_shape, b_shape = target.factor_dims(weight.shape, self.rank)
            bound = 1.0 / math.sqrt(target.fan_in(weight.shape))
            entry = {
                "base": self._stored(target, weight),
                "lora_a": jax.random.uniform(jax.random.fold_in(k, 0), a_shape, jnp.float32, -bound, bound),
                "lora_b": jnp.zeros(b_shape, jnp.float32),
            }
            if self.dropout:
                entry["dropout_seed"] = jax.random.bits(jax.random.fold_in(k, 1), weight.shape[: target.lead])
            return entry

        order = {path: i for i, path in enumerate(self.targets)}
        return replace_at(base, self.targets, lambda path, weight: with_adapter(order[path], path, weight))

    def _stored(self, target: Target, weight: jax.Array) -> Any:
        """A base weight as the params hold it: as it is, or quantized."""
        if self.quantize == "none":
            return weight
        return quantized.quantize(weight, self.quantize, target.spec, target.lead)

    def _float_base(self, path: Path, entry: dict) -> Any:
        """An entry's base weight in float (dequantized where it is stored quantized)."""
        base = entry["base"]
        if not quantized.is_quantized(base):
            return base
        return quantized.dequantize(base, self.quantize, self.targets[path].spec)

    @property
    def freezes(self) -> bool:
        return True

    def trainable(self, params: PyTree) -> PyTree:
        """{path: {"lora_a", "lora_b"}} of `params` or of any tree shaped like them (names, shardings)."""
        picked: dict = {}
        for path in self.targets:
            set_at(picked, path, {k: get_at(params, path)[k] for k in TRAINED})
        return picked

    def split(self, params: PyTree) -> tuple[PyTree, PyTree]:
        """(the adapters, everything else): what trains and what is frozen."""
        frozen = replace_at(params, self.targets, lambda _, e: {k: v for k, v in e.items() if k not in TRAINED})
        return self.trainable(params), frozen

    def join(self, trainable: PyTree, frozen: PyTree) -> PyTree:
        """The inverse of `split`."""
        return replace_at(frozen, self.targets, lambda path, entry: {**entry, **get_at(trainable, path)})

    def for_step(self, frozen: PyTree, step: jax.Array) -> PyTree:
        """`frozen` with this step's dropout seeds: each stored seed hashed with the step, so every step, layer and
        weight draws its own mask, the same on any mesh."""
        if not self.dropout:
            return frozen

        def stepped(_: Path, entry: dict) -> dict:
            hashed = jax.vmap(lambda s: jax.random.bits(jax.random.fold_in(jax.random.key(s), step)))
            seeds = entry["dropout_seed"]
            return {**entry, "dropout_seed": hashed(seeds.reshape(-1)).reshape(seeds.shape)}

        return replace_at(frozen, self.targets, stepped)

    def merge(self, params: PyTree) -> PyTree:
        """The base model's params with every adapter folded in: W + (alpha / rank) · A·B (W dequantized where the
        base is stored quantized)."""

        def merged(path: Path, entry: dict) -> jax.Array:
            letters, lead = Letters.of(self.targets[path].spec), _free_letters(self.targets[path])
            product = jnp.einsum(f"{lead}{letters.a},{lead}{letters.b}->{lead}{letters.w}", *_factors(entry))
            base = self._float_base(path, entry)
            return base + self.scale * product.astype(base.dtype)

        return replace_at(params, self.targets, merged)

    def base_params(self, params: PyTree) -> PyTree:
        """The base model's params, dequantized where stored quantized; of abstract params, the float weights'
        shapes (what a checkpoint to fine-tune from holds)."""
        return replace_at(params, self.targets, self._float_base)


def _factors(entry: dict) -> tuple[jax.Array, jax.Array]:
    return entry["lora_a"].astype(jnp.float32), entry["lora_b"].astype(jnp.float32)


def _free_letters(target: Target) -> str:
    """Letters for the stacked dims that lead an adapted weight, unused by its einsum."""
    used = "".join(Letters.of(target.spec))
    return "".join(c for c in "ABCDEFGHIJ" if c not in used)[: target.lead]


def adapt(model: ModelParts, lora: LoraConfig, batch: Mapping[str, jax.ShapeDtypeStruct]) -> AdaptedModel:
    """`model` with adapters of `lora.rank` on the weights `lora.targets` chooses. `batch`: the shapes of a batch of
    the model's loss, which is traced once (abstractly: nothing is computed) to see how each weight is multiplied.

    Raises `AdapterError` for a rank under 1, a target that names no weight (listing the ones that can be chosen), or
    a chosen weight the model reads without `project`."""
    if lora.rank < 1:
        raise AdapterError(
            f"lora.rank={lora.rank}: expected an integer >= 1, each adapter's inner dim (e.g. lora.rank=8)."
        )
    paths = chosen(model.logical_names, lora.targets, "lora.targets", AdapterError)
    specs = _probe_specs(model, paths, batch)
    weights = dict(flat(model.abstract_params))
    targets = {path: Target(specs[path], weights[path].ndim - len(Letters.of(specs[path]).w)) for path in paths}
    if lora.quantize in ("int4", "nf4"):
        _check_packable(targets, weights, lora.quantize)
    adapted = AdaptedModel(
        model.graphdef, model.abstract_params, model.logical_names, model.build,
        objective=model.objective, precision=model.precision, targets=targets, rank=lora.rank,
        scale=lora.alpha / lora.rank, dropout=lora.dropout, quantize=lora.quantize,
    )  # fmt: skip
    return dataclasses.replace(
        adapted,
        abstract_params=_with_factors(adapted, model.abstract_params, _abstract_entry),
        logical_names=_with_factors(adapted, model.logical_names, _names_entry),
    )


def _check_packable(targets: Mapping[Path, Target], weights: Mapping[Path, Any], kind: str) -> None:
    """4-bit codes pair up along each weight's last contracted dim (`quantized.packed_axis`): it must be even."""
    for path, target in targets.items():
        size = weights[path].shape[quantized.packed_axis(target.spec)]
        if size % 2:
            raise AdapterError(
                f"lora.quantize={kind}: weight '{name_of(path)}' has a contracted dim of odd size {size}, and its "
                "4-bit codes are stored two to a byte along it; use lora.quantize=int8, or leave the weight out of "
                "lora.targets."
            )


def _abstract_entry(target: Target, weight: jax.ShapeDtypeStruct, adapted: AdaptedModel) -> dict:
    a, b = target.factor_dims(weight.shape, adapted.rank)
    kind = adapted.quantize
    entry = {
        "base": weight if kind == "none" else quantized.abstract(weight, kind, target.spec, target.lead),
        "lora_a": jax.ShapeDtypeStruct(a, jnp.float32),
        "lora_b": jax.ShapeDtypeStruct(b, jnp.float32),
    }
    if adapted.dropout:
        entry["dropout_seed"] = jax.ShapeDtypeStruct(weight.shape[: target.lead], jnp.uint32)
    return entry


def _names_entry(target: Target, names: tuple, adapted: AdaptedModel) -> dict:
    a, b = target.factor_dims(names, RANK)
    base = names if adapted.quantize == "none" else quantized.names(names, target.spec, target.lead)
    entry = {"base": base, "lora_a": a, "lora_b": b}
    return {**entry, "dropout_seed": names[: target.lead]} if adapted.dropout else entry


def _with_factors(adapted: AdaptedModel, tree: PyTree, entry: Callable[..., dict]) -> PyTree:
    """`tree` (abstract params or logical names) with each target's entry as `entry` makes it."""
    return replace_at(tree, adapted.targets, lambda path, w: entry(adapted.targets[path], w, adapted))


def _probe_specs(model: ModelParts, paths: list[Path], batch: Mapping[str, jax.ShapeDtypeStruct]) -> dict[Path, str]:
    """The einsum spec each weight at `paths` takes part in, from an abstract trace of the model's loss with those
    weights wrapped in probes. A weight read another way than through `project` is an `AdapterError` naming it,
    as is one never read, or read through einsums of different shapes."""
    seen = _Seen()
    try:
        _trace_probed(model, paths, batch, seen)
    except AdapterError:
        raise
    except Exception as err:  # JAX refuses the probe in its own words (a gather of it): find which weight it was
        culprit = next((path for path in paths if _probe_fails(model, path, batch)), None)
        if culprit is None:
            raise
        raise AdapterError(read_otherwise(name_of(culprit), "lora.targets")) from err
    specs = {}
    for path in paths:
        found = seen.specs.get(name_of(path), set())
        if len(found) != 1:
            how = "never" if not found else f"through {len(found)} different einsums ({', '.join(sorted(found))})"
            raise AdapterError(
                f"lora.targets: weight '{name_of(path)}' is read {how} by jaxtrain.ops.projection.project; an adapter "
                "fits a weight multiplied one way: drop it from lora.targets."
            )
        specs[path] = found.pop()
    return specs


def _trace_probed(model: ModelParts, paths: list[Path], batch: Mapping, seen: _Seen) -> None:
    def loss(params, batch):
        return model.loss_fn(replace_at(params, paths, lambda path, w: _Probe(w, name_of(path), seen)), batch)

    jax.eval_shape(loss, model.abstract_params, dict(batch))


def _probe_fails(model: ModelParts, path: Path, batch: Mapping) -> bool:
    try:
        _trace_probed(model, [path], batch, _Seen())
    except Exception:  # noqa: BLE001 - any refusal of this one probe names it
        return True
    return False
