"""`Shardings`: the one place that turns an abstract state plus sharding rules into shardings and compiled steps.

    abstract params + logical names --(rules, mesh)--> PartitionSpecs --> NamedShardings for the whole train state
    --> sharded init (`jit(init, out_shardings=...)`) and the compiled step (`jit(step, in/out shardings, donate)`).

Checkpoint restore goes through the same shardings, so a checkpoint carries no layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxtrain.analysis.memory import device_bytes, total_bytes, tree_device_bytes
from jaxtrain.formatting import fmt_bytes, format_table
from jaxtrain.parallel.pipeline import StageLayout
from jaxtrain.parallel.step import in_device_memory
from jaxtrain.parallel.updates import UpdatePolicy
from jaxtrain.placement.model import ModelParts, PlacementError, path_str
from jaxtrain.sharding.constraints import activation_sharding
from jaxtrain.sharding.param_state import kept_dims, map_like_params, shardings_like_params
from jaxtrain.sharding.rules import ShardingRules, is_layer_stack, is_logical_names, logical_to_spec, spec_axes

PyTree = Any
HOST_MEMORY = "pinned_host"  # the memory kind of arrays kept in host memory: page-locked, for the device to read


@dataclasses.dataclass(frozen=True)
class Shardings:
    """Where every array of a model's train state lives on a mesh (the state's and a batch's shardings), how the state
    is initialised there, and the steps compiled with them: what `PlacedModel.shardings` returns."""

    mesh: Mesh
    rules: ShardingRules
    model: ModelParts
    param_specs: PyTree  # PartitionSpec per parameter
    # {"params", "opt_state", "step"} of ShapeDtypeStruct, each with its sharding; `opt_state` covers the params that
    # train (`ModelParts.trainable`: all of them, or an adapted model's adapters)
    abstract_state: PyTree
    # Under pipeline parallelism: which stage holds which layers. The stacked `layers` dim of the params is stored
    # in this layout's order (padded to equal stages); `params_in_model_order` undoes it.
    layout: StageLayout | None = None
    optimizer: optax.GradientTransformation | None = None  # whose state, `opt_state`, mirrors the params
    policy: UpdatePolicy | None = None  # local_sgd, diloco, stale: what they add to the state

    @property
    def state_shardings(self) -> PyTree:
        return jax.tree.map(lambda x: x.sharding, self.abstract_state)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def with_offload(self, offload: str) -> Shardings:
        """These shardings with the optimizer state in host memory where `offload` is "state" (`optimizer.offload`):
        it lives there between steps, the update core (`jaxtrain.parallel.step.apply_update`) brings it to the device
        and the compiled step's output shardings send it back. "none": these shardings."""
        if offload == "none":
            return self
        _check_host_memory(self.mesh, offload)
        opt_state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding.with_memory_kind(HOST_MEMORY)),
            self.abstract_state["opt_state"],
        )
        return dataclasses.replace(self, abstract_state={**self.abstract_state, "opt_state": opt_state})

    def param_bytes(self) -> int:
        """Bytes of one full copy of the parameters that train (what a gradient all-reduce moves)."""
        trained = self.model.trainable(self.abstract_state["params"])
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trained))

    def param_axes(self) -> tuple[str, ...]:
        """The mesh axes that shard some parameter, in mesh order."""
        specs = jax.tree.leaves(self.param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        used = set().union(*map(spec_axes, specs))
        return tuple(a for a in self.mesh.axis_names if a in used)

    def is_pure_data_parallel(self) -> bool:
        """Every parameter replicated and every non-trivial mesh axis a batch axis."""
        live = {a for a in self.mesh.axis_names if self.mesh.shape[a] > 1}
        return not self.param_axes() and live <= set(self.rules.batch_axes())

    def batch_sharding(self, shape: tuple[int, ...], grad_accum: int = 1) -> NamedSharding:
        """Rows over the batch axes, other dims whole. Checks the global batch divides evenly."""
        axes = tuple(a for a in self.rules.batch_axes() if self.mesh.shape[a] > 1)
        ways = math.prod(self.mesh.shape[a] for a in axes)
        rows_per_piece = shape[0] // grad_accum if shape[0] % grad_accum == 0 else None
        if rows_per_piece is None or rows_per_piece % ways:
            where = ", ".join(f"{a}={self.mesh.shape[a]}" for a in axes)
            raise PlacementError(
                f"global batch size {shape[0]} is not divisible by {grad_accum} accumulation step(s) x {ways} devices "
                f"on the batch axes ({where or 'none'}). Use a batch size that is a multiple of {grad_accum * ways}."
            )
        spec = logical_to_spec(
            ("batch",) + (None,) * (len(shape) - 1), shape, self.rules.activations, self.mesh, "batch"
        )
        return NamedSharding(self.mesh, spec)

    def abstract_batch(self, shapes: dict[str, jax.ShapeDtypeStruct], grad_accum: int = 1) -> dict:
        return {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding(v.shape, grad_accum))
            for k, v in shapes.items()
        }

    def init_state(self, optimizer: optax.GradientTransformation, seed: int, params: PyTree | None = None) -> PyTree:
        """The train state at step 0, created directly in its shards (no device ever holds the whole thing): from
        the model's initialisation with `seed`, or from `params` (model order, e.g. to fine-tune: the model's own, which
        an adapted model wraps with new adapters)."""

        def init(given):
            params = self._stored(self.model.init_params(seed, given), "to_stored")
            state_optimizer = self.policy.state_optimizer(optimizer) if self.policy else optimizer
            opt_state = state_optimizer.init(self.model.trainable(params))
            state = {"params": params, "opt_state": opt_state, "step": jnp.zeros((), jnp.int32)}
            return {**state, **(self.policy.init_extra(params, optimizer, self.mesh) if self.policy else {})}

        return jax.jit(init, out_shardings=self.state_shardings, compiler_options=self._init_options())(params)

    def _init_options(self) -> dict[str, Any]:
        """XLA:CPU spends most of an init's compile in LLVM optimising the threefry bit mixing of every parameter
        (gpt-tiny on fsdp=8: 8.2 s at the default level, 1.75 s at level 0). The init runs once, so its code need not
        be fast; the values differ from the default level's in the last bit of some floats (1.5e-8 at most)."""
        return {"xla_backend_optimization_level": 0} if self.mesh.devices.flat[0].platform == "cpu" else {}

    def compile(
        self,
        step_fn: Callable,
        *abstract_args: PyTree,
        donate_state: bool = True,
        out_shardings: Any = None,
    ) -> jax.stages.Compiled:
        """Compile `step_fn(state_or_params, batch)` ahead of time under these activation rules.

        Input shardings are those of `abstract_args` (ShapeDtypeStructs carrying shardings); the first argument is
        donated unless `donate_state=False`.
        """

        def traced(*args):  # a new function per compile: JAX caches a trace per function, blind to these rules
            with activation_sharding(self.mesh, self.rules):
                return step_fn(*args)

        jitted = jax.jit(
            traced,
            in_shardings=tuple(jax.tree.map(lambda x: x.sharding, a) for a in abstract_args),
            out_shardings=out_shardings,
            donate_argnums=(0,) if donate_state else (),
        )
        lowered = jitted.lower(*abstract_args)
        return lowered.compile()

    def params_in_model_order(self, params: PyTree) -> PyTree:
        """Params (or gradients) as the model defines them, whatever the pipeline layout stores."""
        return self._stored(params, "to_model")

    def state_in_model_order(self, state: PyTree) -> PyTree:
        """The train state with every param-shaped array (params, optimizer moments) in the model's layer order:
        what a checkpoint holds, so that it restores under any mesh or pipeline layout."""
        if self._is_identity():
            return state
        return jax.jit(lambda s: self._state(s, "to_model"))(state)

    def state_from_model_order(self, state: PyTree) -> PyTree:
        """The inverse of `state_in_model_order`, placed in these shardings."""
        if self._is_identity():
            return jax.device_put(state, self.state_shardings)
        return jax.jit(lambda s: self._state(s, "to_stored"), out_shardings=self.state_shardings)(state)

    def abstract_model_state(self) -> PyTree:
        """`abstract_state` in model layer order: what to restore a checkpoint into. Under a padded or interleaved
        pipeline layout, stacked arrays are restored whole along `layers`, then reordered."""
        if self._is_identity():
            return self.abstract_state
        shapes = jax.eval_shape(lambda s: self._state(s, "to_model"), self.abstract_state)

        def unsharded_layers(x, stored):
            spec = stored.sharding.spec
            if x.shape == stored.shape:
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=stored.sharding)
            return jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(self.mesh, PartitionSpec(None, *spec[1:]))
            )

        return jax.tree.map(unsharded_layers, shapes, self.abstract_state)

    def _is_identity(self) -> bool:
        return self.layout is None or self.layout.is_identity()

    def _state(self, state: PyTree, direction: str) -> PyTree:
        if self._is_identity():
            return state
        convert = getattr(self.layout, direction)

        # The params `state` is laid out like: stored (padded stages) before `to_model`, the model's before `to_stored`.
        params = self.abstract_state["params"] if direction == "to_model" else self.model.abstract_params

        def one(x, param, names):
            return convert(x) if is_layer_stack(names) and _leads_with_layers(param.shape, x.shape) else x

        trained, names = self.model.trainable(params), self.model.trainable(self.model.logical_names)
        # An optimizer state kept in host memory (`with_offload`) is reordered in device memory, whole (at checkpoints
        # only); `state_from_model_order`'s output shardings put it back.
        opt_state = map_like_params(one, in_device_memory(state["opt_state"]), trained, names, other=lambda x: x)
        return {**state, "params": self._stored(state["params"], direction), "opt_state": opt_state}

    def _stored(self, params: PyTree, direction: str) -> PyTree:
        if self._is_identity():
            return params
        convert = getattr(self.layout, direction)
        return jax.tree.map(
            lambda names, x: convert(x) if is_layer_stack(names) else x,
            self.model.logical_names,
            params,
            is_leaf=is_logical_names,
        )

    def totals(self) -> str:
        """One line: the parameter count, and the bytes of params and optimizer state in all and per device."""
        params, opt = self.abstract_state["params"], self.abstract_state["opt_state"]
        n_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
        n_trained = sum(math.prod(p.shape) for p in jax.tree.leaves(self.model.trainable(params)))
        trained = f", {n_trained:,} of them trained ({n_trained / n_params:.2%})" if n_trained != n_params else ""
        on_host = any(x.sharding.memory_kind == HOST_MEMORY for x in jax.tree.leaves(opt))
        return (
            f"params: {n_params:,}{trained} ({fmt_bytes(total_bytes(params))} total, "
            f"{fmt_bytes(tree_device_bytes(params))}/device); optimizer state: {fmt_bytes(total_bytes(opt))} total, "
            f"{fmt_bytes(tree_device_bytes(opt))}/device" + (" in host memory" if on_host else "")
        )

    def table(self) -> str:
        """Parameter path, global shape, logical axes, PartitionSpec and bytes per device; then totals."""
        rows = [("parameter", "shape", "logical axes", "spec", "bytes/device")]
        flat_params = jax.tree_util.tree_flatten_with_path(self.abstract_state["params"])[0]
        flat_names = jax.tree.leaves(self.model.logical_names, is_leaf=is_logical_names)
        for (path, param), names in zip(flat_params, flat_names):
            spec = tuple(param.sharding.spec) + (None,) * (len(param.shape) - len(param.sharding.spec))
            rows.append(
                (
                    path_str(path),
                    str(tuple(param.shape)),
                    " ".join(n or "-" for n in names),
                    " ".join(_axes_str(s) for s in spec),
                    fmt_bytes(device_bytes(param)),
                )
            )
        lines = format_table(rows)
        lines.append(self.totals())
        if self.layout is not None:
            layout = self.layout
            padding = layout.stored_layers - sum(layout.counts)
            lines.append(
                f"per pipeline stage: {layout.virtual * layout.slots} of the {layout.stored_layers} stored layer rows "
                f"(the `layers` dim, in stage order{f', {padding} of them padding' if padding else ''}) and every "
                "other parameter"
            )
        return "\n".join(lines)


def make_shardings(
    mesh: Mesh,
    rules: ShardingRules,
    model: ModelParts,
    optimizer: optax.GradientTransformation,
    layout: StageLayout | None = None,
    policy: UpdatePolicy | None = None,
) -> Shardings:
    """Shardings for params (from their logical names) and optimizer state (like the params they belong to).

    `layout`: under pipeline parallelism, the stacked `layers` dim is stored as `layout` says (padded stages).
    `policy`: an update policy that adds to the state (per-replica params, delayed gradients).
    """
    abstract_params = model.abstract_params
    if layout is not None:
        abstract_params = jax.tree.map(
            lambda names, p: (
                jax.ShapeDtypeStruct((layout.stored_layers, *p.shape[1:]), p.dtype) if is_layer_stack(names) else p
            ),
            model.logical_names,
            abstract_params,
            is_leaf=is_logical_names,
        )
    param_specs = jax.tree.map(
        lambda names, p, path: logical_to_spec(names, p.shape, rules.params, mesh, path),
        model.logical_names,
        abstract_params,
        _path_tree(abstract_params),
        is_leaf=is_logical_names,
    )
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    state_optimizer = policy.state_optimizer(optimizer) if policy else optimizer
    # The optimizer keeps state for the params that train only (an adapted model's adapters, not its frozen weights).
    trained = model.trainable(abstract_params)
    abstract_opt = jax.eval_shape(state_optimizer.init, trained)
    replicated = NamedSharding(mesh, PartitionSpec())
    # Moments shard like their parameters, factored statistics like the dims they keep; counts and other scalars
    # are replicated (optax's naive init would put them all on device 0).
    opt_shardings = shardings_like_params(abstract_opt, trained, model.trainable(shardings), mesh)
    extra, extra_shardings = (
        _policy_state(policy, abstract_params, shardings, optimizer, mesh, model, rules) if policy else ({}, {})
    )
    state = {"params": abstract_params, "opt_state": abstract_opt, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    state_shardings = {"params": shardings, "opt_state": opt_shardings, "step": replicated}
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        {**state, **extra},
        {**state_shardings, **extra_shardings},
    )
    return Shardings(mesh, rules, model, param_specs, abstract_state, layout, state_optimizer, policy)


def _check_host_memory(mesh: Mesh | AbstractMesh, offload: str) -> None:
    """Refuse `optimizer.offload=offload` on devices that list no host memory: JAX would drop the memory kind from
    their shardings and keep the state on the device without a word (the CUDA plugin's compile-only GPUs list no
    memories). An abstract mesh (planning) has no devices to ask: the chips planned for (TPU, GPU) all have it."""
    if isinstance(mesh, AbstractMesh):
        return
    device = mesh.devices.flat[0]
    kinds = [m.kind for m in device.addressable_memories()]
    if HOST_MEMORY not in kinds:
        raise PlacementError(
            f"optimizer.offload={offload} keeps the optimizer state in host memory ({HOST_MEMORY}), which these "
            f"{device.platform} devices ({device.device_kind}) do not have (their memories: "
            f"{', '.join(kinds) or 'none listed'}): set optimizer.offload=none, and shrink the state per device by "
            "sharding it over more devices (fsdp) or with optimizer.name=adafactor."
        )


def _policy_state(
    policy: UpdatePolicy,
    params: PyTree,
    shardings: PyTree,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    model: ModelParts,
    rules: ShardingRules,
) -> tuple[PyTree, PyTree]:
    """The state `policy` adds (abstract, with shardings). It stacks copies of each parameter along a mesh axis,
    which JAX refuses when the parameter's own rules use that axis too: then the error names the parameter."""
    try:
        return policy.extra_state(params, shardings, optimizer, mesh)
    except Exception as err:  # JAX's sharding errors (e.g. DuplicateSpecError) have no public base class
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        for (path, param), sharding, names in zip(
            flat, jax.tree.leaves(shardings), jax.tree.leaves(model.logical_names, is_leaf=is_logical_names)
        ):
            try:
                policy.extra_state({"p": param}, {"p": sharding}, optimizer, mesh)
            except Exception:
                raise PlacementError(
                    f"parameter '{path_str(path)}' ({_spec_origin(names, sharding.spec, rules)}): the state "
                    f"updates.policy={policy.name} adds for it has a sharding JAX refuses: {str(err).rstrip('.')}. "
                    "Change one of those rules."
                ) from err
        raise


def _spec_origin(names: tuple[str | None, ...], spec: PartitionSpec, rules: ShardingRules) -> str:
    """'logical axes layers embed mlp, spec P(None, 'replica', None), from rules.params.embed=replica': which
    table entry put each mesh axis into a parameter's spec."""
    used = [f"rules.params.{n}={','.join(rules.params[n])}" for n, axes in zip(names, spec) if n and axes]
    return f"logical axes {' '.join(n or '-' for n in names)}, spec {spec}, from {', '.join(used) or 'no rule'}"


def _leads_with_layers(param_shape: tuple[int, ...], state_shape: tuple[int, ...]) -> bool:
    """Whether a state array of a layer-stacked parameter keeps the parameter's leading `layers` dim as its own
    first dim (a moment, or a factored statistic that reduced another dim), so that it follows the stage layout."""
    readings = kept_dims(param_shape, state_shape)
    return bool(readings) and all(dims[0] == 0 for dims in readings)


def _path_tree(tree: PyTree) -> PyTree:
    return jax.tree_util.tree_map_with_path(lambda path, _: path_str(path), tree)


def _axes_str(axes: Any) -> str:
    if axes is None:
        return "-"
    return "+".join(axes) if isinstance(axes, tuple) else str(axes)
