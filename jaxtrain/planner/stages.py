"""A pipelined step per device, from one pipeline microbatch's trace and the schedule's tick table.

`jaxtrain.parallel.pipeline` runs the embedding once on the whole batch, then a loop over the schedule's ticks in
lockstep: at a tick where any stage runs a forward (backward), every stage runs its chunk of `slots` layers forward
(backward) on one microbatch, those with nothing to do on a placeholder; the last stage turns its outputs into the
loss and its gradient within the tick. Every tick hands one microbatch's activations to the next stage and their
gradients to the previous one (a collective-permute each, work or not); at the end the stages sum the losses, the
gradients of the params outside the layer stack and the embedding's output gradient over the pipeline axis.

So, per device and gradient-accumulation piece, with P stages, M microbatches, T ticks of which T_f have a forward
and T_b a backward, and a chunk of `slots` of the L layers:
- work: the layers' forward pass T_f x slots/L times (and again at every backward tick when the stash keeps inputs
  only), their backward pass T_b x slots/L times, the rest of the model (embedding, head, loss) M times: that of the
  last stage, the busiest;
- weights: FSDP gathers a chunk's weights at every forward and backward tick and reduces its gradient at every
  backward tick; the head's at every loss tick (M); the embedding's lookups and gradient once;
- activations: the stash (its slots and the trash slot) of one chunk's residuals on one microbatch, or its input
  only; the buffers of received activations and gradients, the embedding's output gradients (M + 1) and the
  microbatches' inputs (M), each one microbatch's activations; the working set: the head's residuals of one
  microbatch, or one layer's working set.
Comparing with a compiled program: its collectives inside the tick loop's branches are counted by a static reader
as running at every tick (T), where they run at T_f, T_b or M of them.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxtrain.analysis.comm_report import SEND_SHARE
from jaxtrain.analysis.memory import device_bytes
from jaxtrain.parallel.pipeline import StageLayout, balanced_layout, estimate_costs
from jaxtrain.parallel.schedules import Schedule, build_schedule
from jaxtrain.placement.shardings import Shardings
from jaxtrain.planner.tracing import StepTrace, Tally
from jaxtrain.planner.transfers import Transfer
from jaxtrain.planner.weights import Runs, exchanged_tables
from jaxtrain.run_config import RunConfig
from jaxtrain.sharding.rules import is_layer_stack, is_logical_names


@dataclasses.dataclass(frozen=True)
class Stages:
    """The schedule and stage layout of a pipelined run, as `jaxtrain.training.setup` builds them."""

    schedule: Schedule
    layout: StageLayout
    stash: str  # what a forward keeps for its backward: "residuals" or "inputs"

    @property
    def chunk(self) -> float:
        """Share of the layer stack one tick's forward or backward runs (its longest chunk, padding included)."""
        return self.layout.slots / sum(self.layout.counts)

    @property
    def forward_ticks(self) -> int:
        return int((self.schedule.tables["fwd_v"] >= 0).any(axis=1).sum())

    @property
    def backward_ticks(self) -> int:
        return int((self.schedule.tables["bwd_v"] >= 0).any(axis=1).sum())

    def weight_runs(self, accum: int) -> Runs:
        """How often the weights travel per step (see the module docstring)."""
        m, v = self.schedule.microbatches, self.layout.virtual
        return Runs(
            layer_gathers=accum * (self.forward_ticks + self.backward_ticks) / v,
            layer_reductions=accum * self.backward_ticks / v,
            other_gathers=accum * m,
            other_reductions=accum * m,
            table_lookups=accum * m,
            table_reductions=accum,
        )


def plan_stages(cfg: RunConfig, step: StepTrace) -> Stages:
    """The schedule and the stage layout of `cfg`'s pipeline, as the runtime builds them: balanced on XLA's cost
    analysis of one layer and of the head on one microbatch (two small programs compiled for this machine's CPU,
    the only compiling planning does), which decides how many layers the busiest stage runs."""
    t, p = cfg.pipeline, step.shardings.mesh.shape["pipeline"]
    microbatches = t.microbatches or p
    costs = None
    if t.balance == "cost" and t.virtual_stages == 1:
        model = step.shardings.model
        micro = {k: jax.ShapeDtypeStruct((step.shares.batch, *s.shape[1:]), s.dtype) for k, s in step.args[1].items()}
        costs = estimate_costs(model.loss_fn, model.logical_names, model.abstract_params, micro)
    layout = balanced_layout(step.layers, p, t.virtual_stages, costs)
    return Stages(build_schedule(t.schedule, p, t.virtual_stages, microbatches), layout, t.stash)


def pipelined_work(step: StepTrace, stages: Stages) -> Tally:
    """FLOPs, matmul bytes and activation collectives of one accumulation piece on the last stage."""
    grad, fwd, chunk = step.gradient, step.forward, stages.chunk
    t_f, t_b = stages.forward_ticks, stages.backward_ticks
    recompute = t_b if stages.stash == "inputs" else 0
    # The backward pass of the layers is the gradient's part less the forward's.
    layers = grad["layers"] * (t_b * chunk) + fwd["layers"] * ((t_f - t_b + recompute) * chunk)
    return layers + grad["rest"] * stages.schedule.microbatches


def stage_transfers(step: StepTrace, shardings: Shardings, stages: Stages, accum: int) -> list[Transfer]:
    """The pipeline axis's own collectives per step: activations and gradients handed on at every tick, and the
    sums over the stages at the end (on XLA:CPU the embedding's output gradient is summed in float32)."""
    p, m = shardings.mesh.shape["pipeline"], stages.schedule.microbatches
    x, itemsize = step.stage_io(), step.stage_io_itemsize()
    names = jax.tree.leaves(shardings.model.logical_names, is_leaf=is_logical_names)
    leaves = jax.tree.leaves(shardings.abstract_state["params"])
    outer = sum(device_bytes(leaf) for ns, leaf in zip(names, leaves) if not is_layer_stack(ns))
    # TPU and GPU compilers sum the gradient of a table whose rows are exchanged (an embedding under FSDP) over the
    # stages a second time, forming it outside the loop from the stages' parts; XLA:CPU sums the parts first.
    tables = sum(
        device_bytes(leaves[i])
        for i in exchanged_tables(shardings, step.used, {i: t.rows for i, t in step.tables.items()})
    )
    share = SEND_SHARE["all-reduce"](p) * accum
    summed, in_float32 = share * (outer + tables + m * x), share * (outer + m * x * 4 / itemsize)
    return [
        Transfer(("pipeline",), "collective-permute", accum * 2 * stages.schedule.ticks * x, "stage activations"),
        Transfer(("pipeline",), "all-reduce", summed, "sums over stages", ("all-reduce", in_float32)),
    ]


# Per compiler, the copies of the tick loop's state (stash and buffers) it holds and the chunk residuals besides them
# (a tick's fresh ones before they are stashed, those read back for its backward), read off the compiled programs'
# loops: XLA:CPU updates the stash in place; the GPU compiler holds one chunk's residuals beside it; the TPU compiler
# copies the loop's state around the tick's branches and holds both.
_TICK_HOLDS = {"cpu": (1, 0), "gpu": (1, 1), "tpu": (2, 2)}


def pipelined_memory(step: StepTrace, stages: Stages, compiler: str) -> tuple[float, float]:
    """(activations, working set) per device as `compiler` holds them: see the module docstring."""
    s, m = stages.schedule, stages.schedule.microbatches
    layers_saved, rest_saved = step.saved_split()
    x = step.stage_io_held()
    kept = x if stages.stash == "inputs" else stages.chunk * layers_saved
    buffers = s.act_slots + 1 + s.grad_slots + 1 + (m + 1) + m
    copies, beside = _TICK_HOLDS[compiler]
    return copies * ((s.stash_slots + 1) * kept + buffers * x), max(step.working_bytes(), rest_saved) + beside * kept


def pipeline_microbatches(cfg: RunConfig, stages: int) -> int:
    """Pipeline microbatches per accumulation piece over `stages` stages (1 without a pipeline)."""
    return (cfg.pipeline.microbatches or stages) if stages > 1 else 1
