"""Pipeline parallelism: the model's layer stack split into stages along the `pipeline` mesh axis.

The model does not change. It runs its layers with `scan_layers(layer, x, stacked_params)`; here we run its loss
three ways, swapping what `scan_layers` does, to take it apart into
    pre(params, batch) -> x               everything before the layer stack (the embedding)
    layer(x, one layer's params) -> x     one layer, chunks of which each stage applies in turn
    post(params, x, microbatch) -> loss   everything after (final norm, head, loss), on the last stage
and a schedule (`jaxtrain.parallel.schedules`: gpipe, 1f1b, interleaved) says which stage runs which microbatch's
forward or backward at every tick. The step is one SPMD program: a `shard_map` manual over `pipeline` only, so data,
fsdp and tensor still shard the work inside each stage; `ppermute` hands activations forward and gradients back
between neighbours. Each forward keeps its autodiff residuals in a slot of a stash until its backward, so the
stash size, fixed by the schedule, is the activation memory (GPipe: M microbatches, 1F1B: at most 2P - 1).
`pre` runs once on the whole batch before the loop (on every stage: it is cheap, and XLA cannot partition its
gather inside the loop), and its gradient once after it.

Stages compute in lockstep. At a tick where some stage runs a forward (or backward), every stage does; those with
nothing to do compute on a placeholder and discard it, which takes exactly the time they would have waited, so the
bubble costs what it costs on real chips, and shows up as wasted compute on simulated CPU devices.

Layers are assigned to stages by a `StageLayout`: contiguous runs, sized to balance estimated cost (FLOPs of a
layer, plus the head and loss on the last stage), padded to equal length so the
stacked `layers` dim shards evenly; interleaved chunks sit round-robin on the devices. The stored order of the
stacked weights is therefore the layout's, not the model's (`StageLayout.to_model` converts back).

What a model must do for this to work (see `scan_layers`): `pre` treats batch rows independently (true of
embeddings), the layer function closes over nothing that depends on the batch, and the stacked params reach
`scan_layers` unchanged.

Reading the program: `_pipelined` (pre, the shard_map, pre's gradient) -> `_stage_program` (one device's step)
-> `_tick` at every row of the schedule -> `_forward` (with `_loss_tick` on the last virtual stage) and
`_backward`, then `_sum_over_stages`. A `_Stage` is what a device holds, a stash (`_ResidualStash`,
`_InputStash`) what a forward keeps for its backward, and `_Carry` what passes from tick to tick.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxtrain.errors import UserInputError
from jaxtrain.parallel.schedules import Schedule, build_schedule, check_schedule
from jaxtrain.parallel.step import (
    CountFn,
    GradFn,
    LossFn,
    merge_microbatches,
    microbatch_shares,
    scaled,
    split_microbatches,
    trained_leaves,
)
from jaxtrain.sharding.constraints import constrain, layer_runner
from jaxtrain.sharding.rules import is_layer_stack, is_logical_names

PyTree = Any


class PipelineError(UserInputError):
    """A pipeline configuration that cannot run: too few layers, an indivisible batch, ..."""


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Which model layers each virtual stage runs: `counts[j]` consecutive layers for virtual stage j.

    Virtual stage j = v * stages + s is chunk v of device s. Device s stores its chunks one after another, each
    padded to `slots` rows (padding rows are zeros and are skipped), so the stacked dim is stages*virtual*slots long.
    """

    stages: int
    virtual: int
    counts: tuple[int, ...]

    @property
    def slots(self) -> int:
        return max(self.counts)

    @property
    def stored_layers(self) -> int:
        return self.stages * self.virtual * self.slots

    def stored_rows(self) -> np.ndarray:
        """For each stored row of the stacked dim: the model layer it holds, or -1 for padding."""
        starts = np.cumsum((0, *self.counts[:-1]))
        rows = np.full(self.stored_layers, -1)
        for j, (start, count) in enumerate(zip(starts, self.counts)):
            v, s = divmod(j, self.stages)
            first = (s * self.virtual + v) * self.slots
            rows[first : first + count] = start + np.arange(count)
        return rows

    def is_identity(self) -> bool:
        return np.array_equal(self.stored_rows(), np.arange(sum(self.counts)))

    def to_stored(self, stacked: jax.Array) -> jax.Array:
        """(layers, ...) in model order -> (stored_layers, ...) in this layout."""
        rows = self.stored_rows()
        taken = jnp.take(stacked, np.maximum(rows, 0), axis=0)
        return jnp.where((rows >= 0).reshape(-1, *[1] * (stacked.ndim - 1)), taken, 0)

    def to_model(self, stored: jax.Array) -> jax.Array:
        """The inverse of `to_stored`."""
        rows = self.stored_rows()
        return jnp.take(stored, np.argsort(np.where(rows >= 0, rows, rows.size))[: sum(self.counts)], axis=0)

    def chunk_counts(self) -> np.ndarray:
        """(virtual, stages): layers in chunk v of device s."""
        return np.array(self.counts).reshape(self.virtual, self.stages)

    def describe(self, costs: LayerCosts | None = None) -> str:
        lines = []
        starts = np.cumsum((0, *self.counts[:-1]))
        for j, (start, count) in enumerate(zip(starts, self.counts)):
            v, s = divmod(j, self.stages)
            where = f"stage {s}" + (f" chunk {v}" if self.virtual > 1 else "")
            extra = " + head/loss" if j == len(self.counts) - 1 else ""
            cost = f"  ~{costs.stage_cost(j, count, len(self.counts)):.3g} GFLOP/microbatch" if costs else ""
            lines.append(f"  {where}: layers {start}..{start + count - 1} ({count}){extra}{cost}")
        return "pipeline stages:\n" + "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    """Forward FLOPs of one microbatch through one layer, and through the part after the layers (head and loss).

    The part before the layers (the embedding) runs on every stage alike, so it does not change the balance.
    """

    layer: float
    post: float

    def stage_cost(self, j: int, count: int, chunks: int) -> float:
        """GFLOPs of virtual stage j (of `chunks`) when it runs `count` layers."""
        return (count * self.layer + (j == chunks - 1) * self.post) / 1e9


def balanced_layout(n_layers: int, stages: int, virtual: int, costs: LayerCosts | None) -> StageLayout:
    """Contiguous layer counts per virtual stage minimising the most expensive one (each stage gets at least one).

    Interleaved chunks (virtual > 1) must be equal: V*P must divide the layers. Without costs, equal counts.
    """
    chunks = stages * virtual
    if n_layers < chunks:
        raise PipelineError(
            f"{n_layers} layers cannot fill {chunks} pipeline stages"
            + (f" ({stages} stages x {virtual} virtual stages)" if virtual > 1 else "")
            + ": every stage needs at least one layer. Use fewer stages or more layers."
        )
    if virtual > 1 or costs is None:
        if n_layers % chunks:
            raise PipelineError(
                f"{n_layers} layers do not split into {chunks} equal chunks ({stages} stages x {virtual} virtual "
                f"stages): the interleaved schedule needs V*P to divide the layer count."
                if virtual > 1
                else f"{n_layers} layers do not split evenly into {stages} stages; use pipeline.balance=cost."
            )
        return StageLayout(stages, virtual, (n_layers // chunks,) * chunks)
    extra = np.zeros(chunks)
    extra[-1] = costs.post
    counts = np.ones(chunks, int)
    for _ in range(n_layers - chunks):  # water-filling: each layer goes where the stage stays cheapest
        counts[np.argmin((counts + 1) * costs.layer + extra)] += 1
    return StageLayout(stages, virtual, tuple(int(c) for c in counts))


_NO_SCAN_LAYERS = (
    "the mesh has a pipeline axis, but the model never runs its layers with scan_layers "
    "(jaxtrain.sharding.constraints), where the pipeline takes them apart. Use a mesh without a pipeline axis for "
    "this model."
)


class _ModelPieces:
    """The model's loss taken apart at its `scan_layers` call (see the module docstring).

    Params are split into `outer` leaves (used by pre and post) and `stacked` leaves (the layer stack). Inside
    the pipeline's shard_map the stacked leaves are this device's rows. `trainable` picks the params whose gradients
    are taken (all of them when None): the others (an adapted model's base weights) are run but not differentiated,
    and no gradient buffer of theirs exists.
    """

    def __init__(
        self, loss_fn: LossFn, treedef: Any, names: list[tuple], trainable: Callable[[PyTree], PyTree] | None = None
    ):
        self.loss_fn, self.treedef, self.names, self.trainable = loss_fn, treedef, names, trainable
        self.is_stacked = [is_layer_stack(n) for n in names]
        picked = set(range(len(names)) if trainable is None else trained_leaves(treedef, trainable))
        trains = [i in picked for i in range(len(names))]
        self.outer_trains = [t for t, s in zip(trains, self.is_stacked) if not s]
        self.stacked_trains = [t for t, s in zip(trains, self.is_stacked) if s]
        self.trained_outer_names = [n for n, s, t in zip(names, self.is_stacked, trains) if t and not s]

    def gradient(self, d_outer: list, d_stacked: list) -> PyTree:
        """The trained params' gradients (as `trainable` picks them) from those of the trained outer and stacked
        leaves."""
        tree = self.join(
            _put([None] * len(self.outer_trains), self.outer_trains, d_outer),
            _put([None] * len(self.stacked_trains), self.stacked_trains, d_stacked),
        )
        return tree if self.trainable is None else self.trainable(tree)

    def split(self, params: PyTree) -> tuple[list, list]:
        leaves = jax.tree.leaves(params)
        return [x for x, s in zip(leaves, self.is_stacked) if not s], [x for x, s in zip(leaves, self.is_stacked) if s]

    def join(self, outer: list, stacked: list) -> PyTree:
        outer_it, stacked_it = iter(outer), iter(stacked)
        return jax.tree.unflatten(self.treedef, [next(stacked_it) if s else next(outer_it) for s in self.is_stacked])

    def _run(self, outer, stacked, micro, runner):
        with layer_runner(runner):
            return self.loss_fn(self.join(outer, stacked), micro)

    def pre(self, outer, stacked, micro) -> jax.Array:
        seen = {}

        def record(layer, x, stacked_tree):
            seen["x"] = x
            return x

        self._run(outer, stacked, micro, record)  # what follows the layers is dead code, dropped by XLA
        if "x" not in seen:
            raise PipelineError(_NO_SCAN_LAYERS)
        return seen["x"]

    def post(self, outer, stacked, x, micro) -> tuple[jax.Array, dict]:
        return self._run(outer, stacked, micro, lambda layer, _, stacked_tree: x)

    def layer_and_order(self, outer, stacked, micro) -> tuple[Callable, Callable[[list], Any]]:
        """The model's layer function, and how to build its params argument from our stacked leaves."""
        seen = {}

        def record(layer, x, stacked_tree):
            seen.update(layer=layer, tree=stacked_tree)
            return x

        self._run(outer, stacked, micro, record)
        if "tree" not in seen:
            raise PipelineError(_NO_SCAN_LAYERS)
        theirs, tree_def = jax.tree.flatten(seen["tree"])
        position = {id(x): i for i, x in enumerate(stacked)}
        if not all(id(x) in position for x in theirs):
            raise PipelineError(
                "the model must pass its stacked `layers` params to scan_layers unchanged (no casts or slicing "
                "before the call), so the pipeline can give each stage its own rows."
            )
        order = [position[id(x)] for x in theirs]
        return seen["layer"], lambda rows: jax.tree.unflatten(tree_def, [rows[i] for i in order])


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A model's loss run as a pipeline schedule over `mesh`'s pipeline axis, with layers placed by `layout`."""

    mesh: Mesh
    logical_names: PyTree
    layout: StageLayout
    schedule: Schedule  # for training steps
    forward_schedule: Schedule  # for evaluation: forwards only
    costs: LayerCosts | None = None  # what the layout was balanced on
    # What a forward keeps for its backward: "residuals" (autodiff's, no recompute) or "inputs" (the chunk's
    # input only; the backward recomputes the chunk's forward: less memory, one more forward).
    stash: str = "residuals"
    # How many targets a microbatch's loss is the mean over: the loss and gradients weigh each microbatch by its
    # share of them (`step.microbatch_shares`), so that they are the whole batch's; None: microbatches weigh alike.
    count: CountFn | None = None

    def describe(self) -> str:
        return self.schedule.describe() + "\n" + self.layout.describe(self.costs)

    def stage_costs(self) -> list[float]:
        """Estimated forward GFLOPs of one microbatch on each virtual stage (needs `costs`)."""
        chunks = len(self.layout.counts)
        return [self.costs.stage_cost(j, count, chunks) for j, count in enumerate(self.layout.counts)]

    def value_and_grad(self, loss_fn: LossFn, trainable: Callable[[PyTree], PyTree] | None = None) -> GradFn:
        """((loss, metrics), grads) of `loss_fn` on a batch, equal to `jax.value_and_grad(loss_fn)` up to rounding
        (the loss is the mean of the M microbatches' losses, each weighed by its share of the targets: `count`).
        Params arrive, and gradients leave, in `layout` order. `trainable`: the part of the params to differentiate,
        as `jaxtrain.parallel.step.value_and_grad_of` takes it."""
        recompute = self.stash == "inputs"
        return _pipelined(
            loss_fn, self.mesh, self.logical_names, self.layout, self.schedule, True, self.count, recompute, trainable
        )

    def loss(self, loss_fn: LossFn) -> LossFn:
        """(loss, metrics) only, for evaluation."""
        return _pipelined(loss_fn, self.mesh, self.logical_names, self.layout, self.forward_schedule, False, self.count)


def make_pipeline(
    mesh: Mesh,
    loss_fn: LossFn,
    logical_names: PyTree,
    abstract_params: PyTree,
    batch_shapes: dict[str, jax.ShapeDtypeStruct],
    *,
    schedule: str,
    microbatches: int,
    virtual: int = 1,
    balance: str = "cost",
    stash: str = "residuals",
    count: CountFn | None = None,
) -> Pipeline:
    """Check the configuration, assign layers to stages and build the schedule's tables.

    `microbatches`: 0 means one per stage. `batch_shapes`: the rows of one gradient computation (after any
    gradient accumulation split), which must divide into the microbatches. `count`: a batch's targets (see
    `Pipeline.count`).
    """
    stages = mesh.shape["pipeline"]
    microbatches = microbatches or stages
    check_schedule(schedule, stages, virtual, microbatches)
    if balance not in ("cost", "uniform"):
        raise PipelineError(f"pipeline.balance='{balance}': use cost or uniform.")
    if stash not in ("residuals", "inputs"):
        raise PipelineError(f"pipeline.stash='{stash}': use residuals or inputs.")
    rows = _check_microbatches(batch_shapes, microbatches)
    n_layers = stacked_layer_count(logical_names, abstract_params)
    costs = None
    if balance == "cost" and virtual == 1:
        micro = {
            k: jax.ShapeDtypeStruct((rows // microbatches, *s.shape[1:]), s.dtype) for k, s in batch_shapes.items()
        }
        costs = estimate_costs(loss_fn, logical_names, abstract_params, micro)
    layout = balanced_layout(n_layers, stages, virtual, costs)
    return Pipeline(
        mesh,
        logical_names,
        layout,
        build_schedule(schedule, stages, virtual, microbatches),
        build_schedule(schedule, stages, virtual, microbatches, forward_only=True),
        costs,
        stash,
        count,
    )


def _check_microbatches(batch: dict, microbatches: int) -> int:
    if "segment_ids" in batch:
        # A model's layers see the documents of their rows, which differ per microbatch; the stages are handed
        # one layer function, built before the batch is split (see `scan_layers`).
        raise PipelineError(
            "packed documents (batch['segment_ids']) do not run under pipeline parallelism yet: train them with "
            "pipeline=1, or without packing."
        )
    rows = {x.shape[0] for x in jax.tree.leaves(batch)}.pop()
    if rows % microbatches:
        raise PipelineError(
            f"a batch of {rows} rows does not split into {microbatches} pipeline microbatches; "
            "use a batch size divisible by pipeline.microbatches (times train.grad_accum)."
        )
    return rows


def _pipelined(loss_fn, mesh, logical_names, layout, schedule, with_grads, count, recompute=False, trainable=None):
    names = jax.tree.leaves(logical_names, is_leaf=is_logical_names)
    microbatches = schedule.microbatches

    def run(params: PyTree, batch: dict[str, jax.Array]):
        _check_microbatches(batch, microbatches)
        pieces = _ModelPieces(loss_fn, jax.tree.structure(params), names, trainable)
        outer, stacked = pieces.split(params)
        # The part before the layers runs outside the stage loop, on the whole batch (it is cheap, e.g. the
        # embedding lookup, and XLA's partitioner cannot yet place a gather inside a partly manual shard_map).
        mask = pieces.outer_trains
        x, pre_vjp = jax.vjp(lambda o: pieces.pre(_put(outer, mask, o), stacked, batch), _take(outer, mask))
        micro = jax.tree.map(lambda b: split_microbatches(b, microbatches), batch)
        x_micro = split_microbatches(x, microbatches)
        shares = microbatch_shares(micro, count)
        specs = ([PartitionSpec()] * len(outer), [PartitionSpec("pipeline")] * len(stacked))
        loss_specs = (PartitionSpec(), PartitionSpec())
        # The trained outer and stacked params' gradients, and d(loss)/d(x).
        trained = (sum(pieces.outer_trains), sum(pieces.stacked_trains))
        grad_specs = ([PartitionSpec()] * trained[0], [PartitionSpec("pipeline")] * trained[1], PartitionSpec())
        results = jax.shard_map(
            functools.partial(_stage_program, pieces, layout, schedule, with_grads, recompute),
            mesh=mesh,
            in_specs=(*specs, PartitionSpec(), PartitionSpec(), PartitionSpec()),
            out_specs=(loss_specs, grad_specs) if with_grads else loss_specs,
            axis_names={"pipeline"},
            # Results are made equal across stages by the final psums; the loop state differs per stage.
            check_vma=False,
        )(outer, stacked, micro, x_micro, shares)
        if not with_grads:
            return results
        (loss, metrics), (d_outer, d_stacked, d_x) = results
        d_pre = pre_vjp(merge_microbatches(d_x))[0]
        return (loss, metrics), pieces.gradient([a + b for a, b in zip(d_outer, d_pre)], d_stacked)

    return run


def _take(leaves: list, mask: list[bool]) -> list:
    """The leaves where `mask` is true (the trained ones)."""
    return [x for x, keep in zip(leaves, mask) if keep]


def _put(leaves: list, mask: list[bool], values: list) -> list:
    """`leaves` with the ones where `mask` is true replaced by `values`, in order: the inverse of `_take`."""
    given = iter(values)
    return [next(given) if keep else x for x, keep in zip(leaves, mask)]


def _stage_program(
    pieces: _ModelPieces,
    layout: StageLayout,
    schedule: Schedule,
    with_grads: bool,
    recompute: bool,
    outer,
    stacked,
    micro,
    x_micro,
    shares,
):
    """One device's whole step: the tick loop over `schedule`, then results summed over the stages.

    outer/stacked: the params (of the stacked ones, this device's rows); micro: (M, B/M, ...) the batch split into
    microbatches; x_micro: (M, B/M, ...) each microbatch's input to the first layer; shares: (M,) each microbatch's
    weight in the loss. Returns (loss, metrics), and with grads: (d_outer, d_stacked, d_x_micro).
    """
    stage = _Stage.inside(pieces, layout, schedule, with_grads, outer, stacked, micro, x_micro, shares)
    stash = None  # what each forward keeps for its backward
    if with_grads:
        stash = _InputStash(stage) if recompute else _ResidualStash(stage)
    tick = functools.partial(_tick, stage, stash)
    carry, _ = jax.lax.scan(tick, _initial_carry(stage, stash), _tick_tables(schedule))
    return _sum_over_stages(stage, carry)


def _pin_activation(x: jax.Array) -> jax.Array:
    # Both branches of a `cond` must agree on their outputs' layout: activations (and their gradients) keep the
    # batch layout.
    return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


def _buffer(n: int, like: jax.Array) -> jax.Array:
    """(n + 1, *like.shape) zeros: n slots and a trash slot, where work nobody needs is written."""
    return jnp.zeros((n + 1, *like.shape), like.dtype)


@dataclasses.dataclass(frozen=True)
class _Stage:
    """What one device holds inside the pipeline's shard_map, and the computations on its chunks of layers.

    outer/stacked: the params (stacked leaves: this device's rows, V chunks of `layout.slots` rows each);
    micro: (M, B/M, ...) the batch split into microbatches; x_micro: (M, B/M, ...) each microbatch's input to the
    first layer; shares: (M,) each microbatch's weight in the loss; index: this device's place on the pipeline axis.
    """

    pieces: _ModelPieces
    layout: StageLayout
    schedule: Schedule
    with_grads: bool
    outer: list
    stacked: list
    micro: dict
    x_micro: jax.Array
    shares: jax.Array
    index: jax.Array
    first_micro: dict
    layer: Callable  # the model's layer function: (x, one layer's params) -> x
    layer_tree: Callable[[list], Any]  # one row of each stacked leaf -> the layer's params argument
    counts: jax.Array  # (V, P): layers in chunk v of device s; rows past the count are padding

    @classmethod
    def inside(cls, pieces, layout, schedule, with_grads, outer, stacked, micro, x_micro, shares) -> _Stage:
        """Called inside the shard_map, where the pipeline axis index is known."""
        index = jax.lax.axis_index("pipeline")
        first_micro = jax.tree.map(lambda x: x[0], micro)
        layer, layer_tree = pieces.layer_and_order(outer, stacked, first_micro)
        counts = jnp.asarray(layout.chunk_counts())
        return cls(
            pieces=pieces,
            layout=layout,
            schedule=schedule,
            with_grads=with_grads,
            outer=outer,
            stacked=stacked,
            micro=micro,
            x_micro=x_micro,
            shares=shares,
            index=index,
            first_micro=first_micro,
            layer=layer,
            layer_tree=layer_tree,
            counts=counts,
        )

    def is_virtual_stage(self, v: jax.Array, j: int) -> jax.Array:
        """Whether chunk v of this device is virtual stage j (0: the first, P*V - 1: the last)."""
        return v * self.layout.stages + self.index == j

    @property
    def last_virtual_stage(self) -> int:
        return self.layout.stages * self.layout.virtual - 1

    def placeholder(self) -> jax.Array:
        """What a device with no work this tick computes on (and sends): zeros shaped like one microbatch's x."""
        return _pin_activation(jnp.zeros_like(self.x_micro[0]))

    def pin_outer(self, grads: list) -> list:
        # Both branches of a `cond` must agree on their outputs' layout: gradients keep their parameters' layout.
        return [constrain(g, n, like_params=True) for g, n in zip(grads, self.pieces.trained_outer_names)]

    def trained_outer(self) -> list:
        return _take(self.outer, self.pieces.outer_trains)

    def micro_at(self, m: jax.Array) -> dict:
        """Microbatch m of the batch: (B/M, ...) leaves."""
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, m, keepdims=False), self.micro)

    def chunk_rows(self, v: jax.Array) -> list:
        """Chunk v's rows of every stacked leaf: (slots, ...)."""
        slots = self.layout.slots
        return [jax.lax.dynamic_slice_in_dim(x, v * slots, slots) for x in self.stacked]

    def run_chunk(self, rows: list, x: jax.Array, count: jax.Array) -> jax.Array:
        """x (B/M, ...) through the first `count` layers of `rows`; the padding rows after them leave x as it is."""
        padded = self.layout.slots != min(self.layout.counts)

        def one(h, inputs):
            k, layer_rows = inputs
            if not padded:  # no padding anywhere: no per-layer test
                return self.apply_layer(h, layer_rows), None
            return jax.lax.cond(
                k < count, lambda: _pin_activation(self.apply_layer(h, layer_rows)), lambda: _pin_activation(h)
            ), None

        return jax.lax.scan(one, x, (jnp.arange(self.layout.slots), rows))[0]

    def apply_layer(self, x: jax.Array, layer_rows: list) -> jax.Array:
        """One layer: x (B/M, ...) through the layer whose params are `layer_rows` (one row of each stacked leaf)."""
        return self.layer(x, self.layer_tree(layer_rows))

    def forward_chunk(self, v: jax.Array, x: jax.Array) -> jax.Array:
        """Chunk v's forward on x, keeping nothing for a backward."""
        return self.run_chunk(self.chunk_rows(v), x, self.counts[v, self.index])

    def chunk_vjp(self, rows: list, v: jax.Array, x: jax.Array) -> tuple[jax.Array, Callable]:
        """Chunk v's forward on x, and its vjp: d(out) -> (d(trained rows), d(x))."""
        mask = self.pieces.stacked_trains

        def run(trained: list, h: jax.Array) -> jax.Array:
            return self.run_chunk(_put(rows, mask, trained), h, self.counts[v, self.index])

        return jax.vjp(run, _take(rows, mask), x)


class _InputStash:
    """Keeps only each forward's input; the backward runs the chunk's forward again (less memory, one more forward)."""

    def __init__(self, stage: _Stage):
        self.stage = stage
        self.like = [stage.x_micro[0]]  # what one stash slot holds

    def save(self, v: jax.Array, x: jax.Array) -> tuple[jax.Array, list]:
        """Chunk v's output on x, and what to stash for its backward."""
        return self.stage.forward_chunk(v, x), [x]

    def restore(self, v: jax.Array, kept: list) -> Callable:
        """Chunk v's vjp, from what `save` stashed."""
        return self.stage.chunk_vjp(self.stage.chunk_rows(v), v, kept[0])[1]


class _ResidualStash:
    """Keeps each forward's autodiff residuals, minus the chunk's weights (the same at every tick, so read again at
    the backward): no recompute."""

    def __init__(self, stage: _Stage):
        self.stage = stage
        # A vjp traced once tells which of its leaves are the chunk's weight rows (found by identity) and which are
        # residuals to keep; every chunk's vjp has the same structure.
        probe_rows = stage.chunk_rows(0)
        _, probe_vjp = stage.chunk_vjp(probe_rows, 0, stage.x_micro[0])
        vjp_leaves, self.vjp_def = jax.tree.flatten(probe_vjp)
        # For each vjp leaf: the index of the weight row it is, or -1 for a residual.
        self.weight_at = [next((i for i, w in enumerate(probe_rows) if leaf is w), -1) for leaf in vjp_leaves]
        self.like = [leaf for leaf, w in zip(vjp_leaves, self.weight_at) if w < 0]  # what one stash slot holds

    def save(self, v: jax.Array, x: jax.Array) -> tuple[jax.Array, list]:
        """Chunk v's output on x, and what to stash for its backward."""
        out, vjp = self.stage.chunk_vjp(self.stage.chunk_rows(v), v, x)
        return out, [leaf for leaf, w in zip(jax.tree.leaves(vjp), self.weight_at) if w < 0]

    def restore(self, v: jax.Array, kept: list) -> Callable:
        """Chunk v's vjp, from what `save` stashed and the chunk's weights."""
        rows, kept = self.stage.chunk_rows(v), iter(kept)
        return jax.tree.unflatten(self.vjp_def, [rows[w] if w >= 0 else next(kept) for w in self.weight_at])


_Stash = _InputStash | _ResidualStash


class _Carry(NamedTuple):
    """What the tick loop carries from tick to tick on one device. Buffers of slots have one more, the trash slot
    (see `_buffer`). The gradient fields are None when the program computes no gradients."""

    acts: jax.Array  # (act_slots + 1, B/M, ...): activations received, waiting for their forward
    d_outer: list | None  # the outer params' gradients (nonzero on the first and last devices only)
    d_stacked: list | None  # the gradients of this device's stacked rows
    d_x: jax.Array | None  # (M + 1, B/M, ...): d(loss)/d(x_micro), written by the first virtual stage
    grads: jax.Array | None  # (grad_slots + 1, B/M, ...): output gradients waiting for their backward
    loss: jax.Array  # the sum of the losses of the microbatches this device finished
    metrics: PyTree  # likewise, the sum of their metrics
    stash: list | None  # (stash_slots + 1, ...) per leaf: what each forward keeps for its backward


def _initial_carry(stage: _Stage, stash: _Stash | None) -> _Carry:
    """Empty buffers and zero sums, before the first tick."""
    x, schedule = stage.x_micro[0], stage.schedule
    metric_shapes = jax.eval_shape(stage.pieces.post, stage.outer, stage.stacked, x, stage.first_micro)[1]
    acts = _buffer(schedule.act_slots, x)
    loss = jnp.zeros((), jnp.float32)
    metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes)
    if not stage.with_grads:
        return _Carry(acts, d_outer=None, d_stacked=None, d_x=None, grads=None, loss=loss, metrics=metrics, stash=None)
    return _Carry(
        acts,
        stash=[_buffer(schedule.stash_slots, leaf) for leaf in stash.like],
        grads=_buffer(schedule.grad_slots, x),
        d_outer=[jnp.zeros_like(o) for o in stage.trained_outer()],
        d_stacked=[jnp.zeros_like(s) for s in _take(stage.stacked, stage.pieces.stacked_trains)],
        d_x=_buffer(schedule.microbatches, x),  # row M is the trash row
        loss=loss,
        metrics=metrics,
    )


def _tick_tables(schedule: Schedule) -> dict[str, jax.Array]:
    """The schedule's (ticks, P) tables, plus (ticks,) whether any device runs a forward / backward at each tick."""
    tables = {k: jnp.asarray(v) for k, v in schedule.tables.items()}
    tables["any_fwd"] = jnp.asarray((schedule.tables["fwd_v"] >= 0).any(axis=1))
    tables["any_bwd"] = jnp.asarray((schedule.tables["bwd_v"] >= 0).any(axis=1))
    return tables


@dataclasses.dataclass(frozen=True)
class _Work:
    """This device's entries in one tick's row of the schedule tables (see `Schedule`)."""

    row: dict[str, jax.Array]
    index: jax.Array
    fwd_on: jax.Array  # whether this device runs a forward at this tick
    bwd_on: jax.Array
    fwd_chunk: jax.Array  # the forward's chunk v and microbatch m (0 when there is none)
    fwd_micro: jax.Array
    bwd_chunk: jax.Array
    bwd_micro: jax.Array

    @classmethod
    def at(cls, row: dict[str, jax.Array], index: jax.Array) -> _Work:
        fwd_on, bwd_on = row["fwd_v"][index] >= 0, row["bwd_v"][index] >= 0
        chunks_and_micros = (jnp.maximum(row[k][index], 0) for k in ("fwd_v", "fwd_m", "bwd_v", "bwd_m"))
        return cls(row, index, fwd_on, bwd_on, *chunks_and_micros)

    def slot(self, table: str, trash: int) -> jax.Array:
        """The slot `table` names for this device, or `trash` where it names none."""
        entry = self.row[table][self.index]
        return jnp.where(entry >= 0, entry, trash)


def _tick(stage: _Stage, stash: _Stash | None, carry: _Carry, row: dict[str, jax.Array]) -> tuple[_Carry, None]:
    """One tick on one device: its forward, the activations' hand-on, then its backward, the gradients' hand-back.

    A part runs on every device when any device has work for it this tick; the others compute on a placeholder and
    write to trash slots, taking the time they would have spent waiting.
    """
    work, schedule, stages = _Work.at(row, stage.index), stage.schedule, stage.layout.stages
    forward = functools.partial(_forward, stage, stash, work)
    carry, sent_act = jax.lax.cond(row["any_fwd"], forward, functools.partial(_no_work, stage), carry)
    # Activations go to the next device, gradients to the previous one. Both are rings: in the interleaved
    # schedule the last device's output feeds the first device's next chunk.
    received = jax.lax.ppermute(sent_act, "pipeline", _ring(stages, +1))
    carry = carry._replace(acts=carry.acts.at[work.slot("recv_act", schedule.act_slots)].set(received))
    if stage.with_grads:
        backward = functools.partial(_backward, stage, stash, work)
        carry, sent_grad = jax.lax.cond(row["any_bwd"], backward, functools.partial(_no_work, stage), carry)
        received = jax.lax.ppermute(sent_grad, "pipeline", _ring(stages, -1))
        carry = carry._replace(grads=carry.grads.at[work.slot("recv_grad", schedule.grad_slots)].set(received))
    return carry, None


def _no_work(stage: _Stage, carry: _Carry) -> tuple[_Carry, jax.Array]:
    """A tick part no device has work for: the carry unchanged, and a placeholder to send."""
    return carry, stage.placeholder()


def _forward(stage: _Stage, stash: _Stash | None, work: _Work, carry: _Carry) -> tuple[_Carry, jax.Array]:
    """This tick's forward on this device: chunk `fwd_chunk` on microbatch `fwd_micro`, its stash written, and on
    the last virtual stage the loss. Returns the output, for the next virtual stage."""
    schedule = stage.schedule
    # The first virtual stage reads its microbatch's input; the others, what they received earlier.
    from_batch = work.fwd_on & stage.is_virtual_stage(work.fwd_chunk, 0)
    x = jnp.where(from_batch, stage.x_micro[work.fwd_micro], carry.acts[work.slot("fwd_in", schedule.act_slots)])
    if stage.with_grads:
        out, kept = stash.save(work.fwd_chunk, x)
        where = work.slot("stash", schedule.stash_slots)
        carry = carry._replace(stash=[buf.at[where].set(leaf) for buf, leaf in zip(carry.stash, kept)])
    else:
        out = stage.forward_chunk(work.fwd_chunk, x)
    loss, metrics, d_out, d_outer = _loss_tick(stage, work, out)
    carry = carry._replace(loss=carry.loss + loss, metrics=jax.tree.map(jnp.add, carry.metrics, metrics))
    if stage.with_grads:
        carry = carry._replace(
            grads=carry.grads.at[work.slot("loss_grad", schedule.grad_slots)].set(d_out),
            d_outer=[a + b for a, b in zip(carry.d_outer, d_outer)],
        )
    return carry, _pin_activation(out)


def _loss_tick(stage: _Stage, work: _Work, out: jax.Array) -> tuple[jax.Array, PyTree, jax.Array, list]:
    """(loss, metrics, d(loss)/d(out), d(loss)/d(outer)) of this tick's forward output `out`: computed where this
    device's forward is the last virtual stage's, which turns its output into the loss and, at once, the gradient
    its backward needs; zeros elsewhere."""
    compute = functools.partial(_loss_and_grads, stage, out, work.fwd_micro)
    last = work.fwd_on & stage.is_virtual_stage(work.fwd_chunk, stage.last_virtual_stage)
    return jax.lax.cond(last, compute, functools.partial(_no_loss, stage, compute))


def _loss_and_grads(stage: _Stage, out: jax.Array, m: jax.Array) -> tuple[jax.Array, PyTree, jax.Array, list]:
    """The loss of microbatch m from the last layer's output `out`, and with grads its gradients (see `_loss_tick`)."""
    outer, stacked, micro, mask = stage.outer, stage.stacked, stage.micro_at(m), stage.pieces.outer_trains
    share = stage.shares[m]  # the step's loss is the microbatches' losses weighed by their shares
    if not stage.with_grads:
        loss, metrics = stage.pieces.post(outer, stacked, out, micro)
        zeros = stage.pin_outer([jnp.zeros_like(o) for o in stage.trained_outer()])
        return share * loss, scaled(metrics, share), stage.placeholder(), zeros
    loss, post_vjp, metrics = jax.vjp(
        lambda o, h: stage.pieces.post(_put(outer, mask, o), stacked, h, micro), _take(outer, mask), out, has_aux=True
    )
    d_outer, d_out = post_vjp(share * jnp.ones_like(loss))
    return share * loss, scaled(metrics, share), _pin_activation(d_out), stage.pin_outer(d_outer)


def _no_loss(stage: _Stage, compute: Callable) -> tuple[jax.Array, PyTree, jax.Array, list]:
    """Zeros shaped like what `compute` (a `_loss_and_grads`) returns."""
    loss, metrics, _, _ = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(compute))
    return loss, metrics, stage.placeholder(), stage.pin_outer([jnp.zeros_like(o) for o in stage.trained_outer()])


def _backward(stage: _Stage, stash: _Stash, work: _Work, carry: _Carry) -> tuple[_Carry, jax.Array]:
    """This tick's backward on this device: chunk `bwd_chunk`'s vjp, restored from its stash slot, applied to the
    output gradient waiting for it; the rows' gradients accumulated. Returns d(input), for the previous stage."""
    schedule, slots = stage.schedule, stage.layout.slots
    kept = work.slot("bwd_stash", schedule.stash_slots)
    vjp = stash.restore(work.bwd_chunk, [buf[kept] for buf in carry.stash])
    d_rows, d_x = vjp(carry.grads[work.slot("bwd_grad", schedule.grad_slots)])
    start = work.bwd_chunk * slots
    d_stacked = [
        jax.lax.dynamic_update_slice_in_dim(
            acc, jax.lax.dynamic_slice_in_dim(acc, start, slots) + work.bwd_on * d, start, 0
        )
        for acc, d in zip(carry.d_stacked, d_rows)
    ]
    # The first chunk's input gradient leaves the loop, for the part before the layers.
    d_x_row = jnp.where(work.bwd_on & stage.is_virtual_stage(work.bwd_chunk, 0), work.bwd_micro, schedule.microbatches)
    carry = carry._replace(d_stacked=d_stacked, d_x=carry.d_x.at[d_x_row].set(d_x))
    return carry, _pin_activation(d_x)


def _sum_over_stages(stage: _Stage, carry: _Carry) -> tuple:
    """The step's results from each device's carry: (loss, metrics), and with grads (d_outer, d_stacked, d_x)."""
    m_count = stage.schedule.microbatches
    # Only the last stage computed losses (each weighed by its share); only the first and last stages touched the
    # outer params and d_x.
    loss = jax.lax.psum(carry.loss, "pipeline")
    metrics = jax.tree.map(lambda x: jax.lax.psum(x, "pipeline"), carry.metrics)
    if not stage.with_grads:
        return loss, metrics
    d_outer = [jax.lax.psum(g, "pipeline") for g in carry.d_outer]
    # (Summed in float32: XLA:CPU fails to compile a bfloat16 all-reduce here.)
    d_x = jax.lax.psum(carry.d_x[:m_count].astype(jnp.float32), "pipeline").astype(stage.x_micro.dtype)
    return (loss, metrics), (d_outer, carry.d_stacked, d_x)


def _ring(stages: int, step: int) -> list[tuple[int, int]]:
    return [(s, (s + step) % stages) for s in range(stages)]


def stacked_layer_count(logical_names: PyTree, abstract_params: PyTree) -> int:
    """The length of the model's stacked `layers` dim; an error if the model has no layer stack to pipeline."""
    counts = {
        p.shape[0]
        for names, p in zip(jax.tree.leaves(logical_names, is_leaf=is_logical_names), jax.tree.leaves(abstract_params))
        if is_layer_stack(names)
    }
    if not counts:
        raise PipelineError("the mesh has a pipeline axis, but the model has no stacked `layers` dim to split.")
    return counts.pop()


def estimate_costs(loss_fn: LossFn, logical_names: PyTree, abstract_params: PyTree, abstract_micro: dict) -> LayerCosts:
    """Forward FLOPs of one layer and of the part after the layers on one microbatch (XLA's cost analysis)."""
    names = jax.tree.leaves(logical_names, is_leaf=is_logical_names)
    pieces = _ModelPieces(loss_fn, jax.tree.structure(abstract_params), names)
    outer, stacked = pieces.split(abstract_params)

    def one_layer(outer, stacked, micro, x):
        layer, tree = pieces.layer_and_order(outer, stacked, micro)
        return layer(x, tree([s[0] for s in stacked]))

    def post_loss(outer, stacked, x, micro):
        return pieces.post(outer, stacked, x, micro)[0]

    x = jax.eval_shape(pieces.pre, outer, stacked, abstract_micro)

    def flops(fn, *args) -> float:
        analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        return float((analysis or {}).get("flops", 0.0))

    return LayerCosts(
        layer=flops(one_layer, outer, stacked, abstract_micro, x),
        post=flops(post_loss, outer, stacked, x, abstract_micro),
    )
