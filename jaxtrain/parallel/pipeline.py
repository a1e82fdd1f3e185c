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
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxtrain.errors import UserInputError
from jaxtrain.parallel.schedules import Schedule, build_schedule, check_schedule
from jaxtrain.parallel.step import GradFn, LossFn, merge_microbatches, split_microbatches
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
                else f"{n_layers} layers do not split evenly into {stages} stages; use train.stage_balance=cost."
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
    the pipeline's shard_map the stacked leaves are this device's rows.
    """

    def __init__(self, loss_fn: LossFn, treedef: Any, names: list[tuple]):
        self.loss_fn, self.treedef, self.names = loss_fn, treedef, names
        self.is_stacked = [is_layer_stack(n) for n in names]

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

    def describe(self) -> str:
        return self.schedule.describe() + "\n" + self.layout.describe(self.costs)

    def stage_costs(self) -> list[float]:
        """Estimated forward GFLOPs of one microbatch on each virtual stage (needs `costs`)."""
        chunks = len(self.layout.counts)
        return [self.costs.stage_cost(j, count, chunks) for j, count in enumerate(self.layout.counts)]

    def value_and_grad(self, loss_fn: LossFn) -> GradFn:
        """((loss, metrics), grads) of `loss_fn` on a batch, equal to `jax.value_and_grad(loss_fn)` up to rounding
        (the loss is the mean over M equal microbatches). Params arrive, and gradients leave, in `layout` order."""
        return _pipelined(
            loss_fn, self.mesh, self.logical_names, self.layout, self.schedule, True, self.stash == "inputs"
        )

    def loss(self, loss_fn: LossFn) -> LossFn:
        """(loss, metrics) only, for evaluation."""
        return _pipelined(loss_fn, self.mesh, self.logical_names, self.layout, self.forward_schedule, False)


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
) -> Pipeline:
    """Check the configuration, assign layers to stages and build the schedule's tables.

    `microbatches`: 0 means one per stage. `batch_shapes`: the rows of one gradient computation (after any
    gradient accumulation split), which must divide into the microbatches.
    """
    stages = mesh.shape["pipeline"]
    microbatches = microbatches or stages
    check_schedule(schedule, stages, virtual, microbatches)
    if balance not in ("cost", "uniform"):
        raise PipelineError(f"train.stage_balance='{balance}': use cost or uniform.")
    if stash not in ("residuals", "inputs"):
        raise PipelineError(f"train.pipeline_stash='{stash}': use residuals or inputs.")
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
    )


def _check_microbatches(batch: dict, microbatches: int) -> int:
    rows = {x.shape[0] for x in jax.tree.leaves(batch)}.pop()
    if rows % microbatches:
        raise PipelineError(
            f"a batch of {rows} rows does not split into {microbatches} pipeline microbatches; "
            "use a batch size divisible by train.microbatches (times train.grad_accum)."
        )
    return rows


def _pipelined(loss_fn, mesh, logical_names, layout, schedule, with_grads, recompute=False):
    names = jax.tree.leaves(logical_names, is_leaf=is_logical_names)
    microbatches = schedule.microbatches

    def run(params: PyTree, batch: dict[str, jax.Array]):
        _check_microbatches(batch, microbatches)
        pieces = _ModelPieces(loss_fn, jax.tree.structure(params), names)
        outer, stacked = pieces.split(params)
        # The part before the layers runs outside the stage loop, on the whole batch (it is cheap, e.g. the
        # embedding lookup, and XLA's partitioner cannot yet place a gather inside a partly manual shard_map).
        x, pre_vjp = jax.vjp(lambda o: pieces.pre(o, stacked, batch), outer)
        micro = jax.tree.map(lambda b: split_microbatches(b, microbatches), batch)
        x_micro = split_microbatches(x, microbatches)
        specs = ([PartitionSpec()] * len(outer), [PartitionSpec("pipeline")] * len(stacked))
        loss_specs = (PartitionSpec(), PartitionSpec())
        grad_specs = (*specs, PartitionSpec())  # outer, stacked, d(loss)/d(x)
        results = jax.shard_map(
            functools.partial(_stage_program, pieces, layout, schedule, with_grads, recompute),
            mesh=mesh,
            in_specs=(*specs, PartitionSpec(), PartitionSpec()),
            out_specs=(loss_specs, grad_specs) if with_grads else loss_specs,
            axis_names={"pipeline"},
            # Results are made equal across stages by the final psums; the loop state differs per stage.
            check_vma=False,
        )(outer, stacked, micro, x_micro)
        if not with_grads:
            return results
        (loss, metrics), (d_outer, d_stacked, d_x) = results
        d_pre = pre_vjp(merge_microbatches(d_x))[0]
        return (loss, metrics), pieces.join([a + b for a, b in zip(d_outer, d_pre)], d_stacked)

    return run


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
):
    """One device's whole step: the tick loop over `schedule`, then results summed over the stages.

    outer/stacked: the params (of the stacked ones, this device's rows); micro: (M, B/M, ...) the batch split into
    microbatches; x_micro: (M, B/M, ...) each microbatch's input to the first layer.
    Returns (loss, metrics), and with grads: (d_outer, d_stacked, d_x_micro).
    """
    p, slots, m_count = layout.stages, layout.slots, schedule.microbatches
    last_chunk = p * layout.virtual - 1
    stage = jax.lax.axis_index("pipeline")
    first_micro = jax.tree.map(lambda x: x[0], micro)
    layer, layer_tree = pieces.layer_and_order(outer, stacked, first_micro)
    counts = jnp.asarray(layout.chunk_counts())  # (V, P)
    outer_names = [n for n, is_stacked in zip(pieces.names, pieces.is_stacked) if not is_stacked]

    # Both branches of a `cond` must agree on their outputs' layout: pin activations to the batch layout and
    # parameter gradients to their parameters' layout.
    def pin_x(x):
        return constrain(x, ("batch",) + (None,) * (x.ndim - 1))

    def pin_outer(grads):
        return [constrain(g, n, like_params=True) for g, n in zip(grads, outer_names)]

    def placeholder():
        return pin_x(jnp.zeros_like(x_micro[0]))

    def chunk_rows(v):
        return [jax.lax.dynamic_slice_in_dim(x, v * slots, slots) for x in stacked]

    def run_chunk(rows, x, count):
        def one(h, inputs):
            k, layer_rows = inputs
            if slots == min(layout.counts):  # no padding anywhere: no per-layer test
                return layer(h, layer_tree(layer_rows)), None
            return jax.lax.cond(k < count, lambda: pin_x(layer(h, layer_tree(layer_rows))), lambda: pin_x(h)), None

        return jax.lax.scan(one, x, (jnp.arange(slots), rows))[0]

    def micro_at(m):
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, m, keepdims=False), micro)

    def chunk_vjp(rows, v, x):
        return jax.vjp(lambda r, h: run_chunk(r, h, counts[v, stage]), rows, x)

    if recompute:
        # The stash keeps only each forward's input; the backward runs the chunk's forward again.
        stash_like = [x_micro[0]]

        def save(v, x):
            return run_chunk(chunk_rows(v), x, counts[v, stage]), [x]

        def restore(v, kept):
            return chunk_vjp(chunk_rows(v), v, kept[0])[1]
    elif with_grads:
        # The stash keeps each forward's autodiff residuals, minus the chunk's weights (the same at every tick, so
        # read again at the backward).
        probe_rows = chunk_rows(0)
        _, probe_vjp = chunk_vjp(probe_rows, 0, x_micro[0])
        vjp_leaves, vjp_def = jax.tree.flatten(probe_vjp)
        weight_at = [next((i for i, w in enumerate(probe_rows) if leaf is w), -1) for leaf in vjp_leaves]
        stash_like = [leaf for leaf, w in zip(vjp_leaves, weight_at) if w < 0]

        def save(v, x):
            out, vjp = chunk_vjp(chunk_rows(v), v, x)
            return out, [leaf for leaf, w in zip(jax.tree.leaves(vjp), weight_at) if w < 0]

        def restore(v, kept):
            rows, kept = chunk_rows(v), iter(kept)
            return jax.tree.unflatten(vjp_def, [rows[w] if w >= 0 else next(kept) for w in weight_at])

    def buffer(n, like):  # n slots + 1 trash slot, where work nobody needs is written
        return jnp.zeros((n + 1, *like.shape), like.dtype)

    metric_shapes = jax.eval_shape(pieces.post, outer, stacked, x_micro[0], first_micro)[1]
    state = {
        "acts": buffer(schedule.act_slots, x_micro[0]),
        "loss": jnp.zeros((), jnp.float32),
        "metrics": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes),
    }
    if with_grads:
        state |= {
            "stash": [buffer(schedule.stash_slots, leaf) for leaf in stash_like],
            "grads": buffer(schedule.grad_slots, x_micro[0]),
            "d_outer": [jnp.zeros_like(o) for o in outer],
            "d_stacked": [jnp.zeros_like(s) for s in stacked],
            "d_x": buffer(m_count, x_micro[0]),  # row M is the trash row
        }

    def tick(state, row):
        def at(name):
            return row[name][stage]

        def slot(name, trash):
            return jnp.where(at(name) >= 0, at(name), trash)

        f_on, b_on = at("fwd_v") >= 0, at("bwd_v") >= 0
        fv, fm, bv, bm = (jnp.maximum(at(k), 0) for k in ("fwd_v", "fwd_m", "bwd_v", "bwd_m"))

        def forward(state):
            state = dict(state)
            x = jnp.where(f_on & (fv * p + stage == 0), x_micro[fm], state["acts"][slot("fwd_in", schedule.act_slots)])
            if with_grads:
                out, kept = save(fv, x)
                where = slot("stash", schedule.stash_slots)
                state["stash"] = [buf.at[where].set(leaf) for buf, leaf in zip(state["stash"], kept)]
            else:
                out = run_chunk(chunk_rows(fv), x, counts[fv, stage])

            def loss_and_grads():
                if not with_grads:
                    loss, metrics = pieces.post(outer, stacked, out, micro_at(fm))
                    return loss, metrics, placeholder(), pin_outer([jnp.zeros_like(o) for o in outer])
                loss, post_vjp, metrics = jax.vjp(
                    lambda o, h: pieces.post(o, stacked, h, micro_at(fm)), outer, out, has_aux=True
                )
                d_o, d_h = post_vjp(jnp.ones_like(loss) / m_count)  # the step's loss is the mean over microbatches
                return loss, metrics, pin_x(d_h), pin_outer(d_o)

            def nothing():
                loss, metrics, _, _ = jax.tree.map(
                    lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(loss_and_grads)
                )
                return loss, metrics, placeholder(), pin_outer([jnp.zeros_like(o) for o in outer])

            # The last virtual stage turns its output into the loss and, at once, the gradient its backward needs.
            loss, metrics, d_h, d_o = jax.lax.cond(f_on & (fv * p + stage == last_chunk), loss_and_grads, nothing)
            state["loss"] = state["loss"] + loss
            state["metrics"] = jax.tree.map(jnp.add, state["metrics"], metrics)
            if with_grads:
                state["grads"] = state["grads"].at[slot("loss_grad", schedule.grad_slots)].set(d_h)
                state["d_outer"] = [a + b for a, b in zip(state["d_outer"], d_o)]
            return state, pin_x(out)

        def backward(state):
            state = dict(state)
            vjp = restore(bv, [buf[slot("bwd_stash", schedule.stash_slots)] for buf in state["stash"]])
            d_rows, d_x = vjp(state["grads"][slot("bwd_grad", schedule.grad_slots)])
            state["d_stacked"] = [
                jax.lax.dynamic_update_slice_in_dim(
                    acc, jax.lax.dynamic_slice_in_dim(acc, bv * slots, slots) + b_on * d, bv * slots, 0
                )
                for acc, d in zip(state["d_stacked"], d_rows)
            ]
            # The first chunk's input gradient leaves the loop, for the part before the layers.
            state["d_x"] = state["d_x"].at[jnp.where(b_on & (bv * p + stage == 0), bm, m_count)].set(d_x)
            return state, pin_x(d_x)

        # A part runs on every device when any device has work for it this tick; the others compute on a
        # placeholder and write to trash slots, taking the time they would have spent waiting.
        state, sent_act = jax.lax.cond(row["any_fwd"], forward, lambda s: (s, placeholder()), state)
        # Activations go to the next device, gradients to the previous one. Both are rings: in the interleaved
        # schedule the last device's output feeds the first device's next chunk.
        received = jax.lax.ppermute(sent_act, "pipeline", _ring(p, +1))
        state["acts"] = state["acts"].at[slot("recv_act", schedule.act_slots)].set(received)
        if with_grads:
            state, sent_grad = jax.lax.cond(row["any_bwd"], backward, lambda s: (s, placeholder()), state)
            received = jax.lax.ppermute(sent_grad, "pipeline", _ring(p, -1))
            state["grads"] = state["grads"].at[slot("recv_grad", schedule.grad_slots)].set(received)
        return state, None

    tables = {k: jnp.asarray(v) for k, v in schedule.tables.items()}
    tables["any_fwd"] = jnp.asarray((schedule.tables["fwd_v"] >= 0).any(axis=1))
    tables["any_bwd"] = jnp.asarray((schedule.tables["bwd_v"] >= 0).any(axis=1))
    state, _ = jax.lax.scan(tick, state, tables)
    # Only the last stage computed losses; only the first and last stages touched the outer params and d_x.
    loss = jax.lax.psum(state["loss"], "pipeline") / m_count
    metrics = jax.tree.map(lambda x: jax.lax.psum(x, "pipeline") / m_count, state["metrics"])
    if not with_grads:
        return loss, metrics
    d_outer = [jax.lax.psum(g, "pipeline") for g in state["d_outer"]]
    # (Summed in float32: XLA:CPU fails to compile a bfloat16 all-reduce here.)
    d_x = jax.lax.psum(state["d_x"][:m_count].astype(jnp.float32), "pipeline").astype(x_micro.dtype)
    return (loss, metrics), (d_outer, state["d_stacked"], d_x)


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
