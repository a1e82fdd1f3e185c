"""The estimate of one run: per-device memory, collectives per step and a roofline step time for a model, a mesh
layout of any size and a chip, from abstract shapes alone (nothing is allocated; a pipeline's stage balancing
compiles one layer for XLA's cost analysis, as the runtime does); and `fits_with`, the changes that would make a run
that does not fit fit.

An estimate describes what the chip's compiler (XLA for TPU or GPU) makes of the step; `compiler="cpu"` describes
the same step compiled for simulated CPU devices, to check an estimate on this machine. tests/test_planner_aot.py
holds the estimate to the TPU and GPU compilers' own figures, tests/test_planner.py to XLA:CPU's.

How each figure is found (all per device):
- state: the plan's shardings on an abstract mesh (`jaxtrain.sharding.mesh.abstract_mesh`), exact; on TPU as it
  stores arrays, in tiles (`jaxtrain.planner.tiling`).
- gradients: one params-sized tree, sharded like the params; two under gradient accumulation (sum and newest).
- host memory: the optimizer state where `optimizer.offload=state` keeps it there (the update copies it back in,
  after the backward pass: the peak is then at least the arguments, gradients and that state), and the residuals a
  remat policy offloads (`remat=offload`), which are not in the device's activations.
- activations: what `jax.vjp` keeps for the backward pass of the loss on one device's rows (one microbatch), so the
  model's own remat policy decides, less what the compiler recomputes instead (`jaxtrain.planner.residuals`); plus
  a working set: the same count for the largest loop body or remat region (what the backward recomputes, and
  cotangents of that size) and one layer's weights gathered by FSDP.
- which share of a traced array a device holds: `jaxtrain.planner.layouts`.
- collectives: the weights' (`jaxtrain.planner.weights`: in the dtype they are used in), those the traced step
  implies (`jaxtrain.planner.tracing`), and context parallelism's attention (`jaxtrain.planner.context`).
- under a pipeline, the traced microbatch run through the schedule's ticks: `jaxtrain.planner.stages`.
- batch shapes come from the model's config (the `synthetic` source): planning reads no data.
- time: FLOPs of every matmul and convolution in the traced step (remat recompute included) / peak; HBM: their
  operands and results plus reading and writing the state / HBM bandwidth; each collective / the bandwidth of its
  links (ICI or NVLink inside a slice or host, DCN or InfiniBand across `dcn_axes`). The step lies between the
  largest of the three (communication hidden under compute) and compute-or-memory plus all communication (none
  hidden).
- model FLOPs (for MFU): the model config's `train_flops(batch_size, seq_len)`; a config without one gets 3 x the
  traced forward pass's matmul and convolution FLOPs (forward and backward, remat recompute left out).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence

import jax
import numpy as np

from jaxtrain.analysis.chips import Chip
from jaxtrain.aot.targets import TPU_CHIPS, TargetError, auto_target, parse_target, wraparound
from jaxtrain.data.datasets import make_dataset, model_data_args
from jaxtrain.errors import UserInputError
from jaxtrain.ops.plain import plain_kernels
from jaxtrain.parallel.pipeline import PipelineError, StageLayout
from jaxtrain.placement.place import place_model
from jaxtrain.placement.precision import with_precision
from jaxtrain.placement.shardings import HOST_MEMORY, Shardings
from jaxtrain.planner.context import context_attention_bytes
from jaxtrain.planner.loss import ChunkedLoss, chunked_loss
from jaxtrain.planner.stages import (
    Stages,
    pipeline_microbatches,
    pipelined_memory,
    pipelined_work,
    plan_stages,
    stage_transfers,
)
from jaxtrain.planner.tiling import held_bytes
from jaxtrain.planner.tracing import StepTrace
from jaxtrain.planner.transfers import Transfer, merge_transfers
from jaxtrain.planner.weights import Runs, gathered_layer_bytes, weight_transfers
from jaxtrain.registry import SEQUENCE_TASKS, resolve_model
from jaxtrain.run_config import RunConfig, apply_overrides
from jaxtrain.sharding.mesh import MESH_AXES, MeshLayout, abstract_mesh, parse_layout
from jaxtrain.sharding.rules import is_logical_names
from jaxtrain.training.optim import make_optimizer
from jaxtrain.training.setup import update_policy, with_data_vocab, with_offload

# The compilers an estimate can follow: XLA for TPU and for GPU (what the chips run), and XLA:CPU (simulated devices,
# to check an estimate on this machine: it stores arrays untiled and casts no weights before gathering them).
COMPILERS = ("tpu", "gpu", "cpu")
# Share of a chip's HBM a step may use: the runtime, XLA's scratch space and fragmentation take the rest.
USABLE_HBM = 0.9


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes on one device."""

    params: float
    opt_state: float
    other_state: float  # the step counter and what an update policy adds
    batch: float
    grads: float
    activations: float  # saved by the forward pass for the backward pass
    working: float  # the largest layer's (or remat region's) transient buffers and gathered weights
    # In host memory (`optimizer.offload=state`, `remat=offload`): not part of the device's peak, but the state is
    # copied back for the update.
    host_opt_state: float = 0.0
    host_activations: float = 0.0

    @property
    def arguments(self) -> float:
        """What the compiled step takes as arguments in device memory: the state and the batch."""
        return self.params + self.opt_state + self.other_state + self.batch

    @property
    def peak(self) -> float:
        """Arguments, gradients, saved activations and the working set, all live at once; or, where the optimizer
        state is kept in host memory and larger than those activations and working set, that state copied in for
        the update, once the backward pass has freed them."""
        return self.arguments + self.grads + max(self.activations + self.working, self.host_opt_state)

    @property
    def host(self) -> float:
        """Bytes one device keeps in host memory."""
        return self.host_opt_state + self.host_activations


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The plan of one run: memory, collectives and time per device per step on `chip`."""

    cfg: RunConfig
    layout: MeshLayout
    mesh_shape: Mapping[str, int]
    slow_axes: frozenset[str]  # axes that cross DCN / InfiniBand
    chip: Chip
    memory: Memory
    transfers: tuple[Transfer, ...]
    flops: float  # executed, remat recompute included
    model_flops: float  # the model's own count, for MFU
    hbm_bytes: float
    model_flops_traced: bool = False  # the config has no `train_flops`: model_flops is 3 x the traced forward pass
    compiler: str = "tpu"  # whose habits the memory and collectives follow (`COMPILERS`)
    stages: Stages | None = None  # the pipeline's schedule and stage layout, where the mesh has a pipeline axis

    @property
    def devices(self) -> int:
        """Chips in the mesh."""
        return math.prod(self.mesh_shape.values())

    @property
    def fits(self) -> bool:
        """Whether the peak fits in the usable share (`USABLE_HBM`) of the chip's HBM."""
        return self.memory.peak <= USABLE_HBM * self.chip.hbm_bytes

    @property
    def compute_s(self) -> float:
        """Seconds of compute per step at the chip's bf16 peak."""
        return self.flops / self.chip.peak_bf16

    @property
    def memory_s(self) -> float:
        """Seconds of HBM traffic per step at the chip's HBM bandwidth."""
        return self.hbm_bytes / self.chip.hbm_bw

    def comm_s(self, slow: bool | None = None) -> float:
        """Seconds of communication per step: over the slow links, the fast ones, or (None) both."""
        return sum(
            t.bytes / self._bandwidth(t.axes) for t in self.transfers if slow is None or self._is_slow(t.axes) == slow
        )

    @property
    def step_s(self) -> tuple[float, float]:
        """(communication hidden under compute, none hidden)."""
        busy = max(self.compute_s, self.memory_s)
        return max(busy, self.comm_s()), busy + self.comm_s()

    @property
    def mfu(self) -> tuple[float, float]:
        """Model FLOPs utilisation at each bound of `step_s`."""
        return tuple(self.model_flops / (s * self.chip.peak_bf16) for s in self.step_s)

    def _is_slow(self, axes: Sequence[str]) -> bool:
        return any(a in self.slow_axes for a in axes)

    def _bandwidth(self, axes: Sequence[str]) -> float:
        return self.chip.dcn_bw if self._is_slow(axes) else self.chip.ici_bw


def estimate(
    cfg: RunConfig, chip: Chip, devices: int, layout: MeshLayout | None = None, compiler: str | None = None
) -> Estimate:
    """Plan `cfg` on `devices` chips laid out as `layout` (default: `cfg.mesh`), as `compiler` (one of `COMPILERS`;
    default: the chip's) compiles it; `compiler="cpu"` describes the same step compiled for simulated CPU devices,
    to check the estimate against it.

    >>> est = estimate(default_config("gpt-small"), chip("v5p"), 256, parse_layout("tpu-v5p-512"))  # doctest: +SKIP
    >>> est.fits, est.memory.peak, est.step_s                                                      # doctest: +SKIP
    """
    cfg = with_data_vocab(cfg)  # the model as training builds it on this data
    compiler = compiler or platform_of(chip)
    if compiler not in COMPILERS:
        raise UserInputError(f"compiler '{compiler}': plan for one of {', '.join(COMPILERS)}.")
    layout = layout or parse_layout(cfg.mesh)
    _, dcn = layout.resolve(devices)  # checks the layout takes `devices`
    task = resolve_model(cfg.model_name)[0].task
    accum = cfg.train.grad_accum
    shardings = _abstract_shardings(cfg, layout, devices)
    shapes = _batch_shapes(cfg, task)
    batch = shardings.abstract_batch(shapes, accum)  # checks the batch divides
    micro = pipeline_microbatches(cfg, shardings.mesh.shape["pipeline"])
    _check_microbatches(shapes, accum, micro)
    loss = _chunked_loss(cfg, shardings, shapes, accum * micro, compiler) if task == "lm" else None
    step = StepTrace(shardings, shapes, accum * micro, tiled=compiler == "tpu", chunked_loss=loss)
    stages = plan_stages(cfg, step) if shardings.mesh.shape["pipeline"] > 1 else None
    torus = _torus_axes(chip, layout, devices) if compiler == "tpu" else frozenset()
    if stages is not None:
        shardings = _abstract_shardings(cfg, layout, devices, stages.layout)  # the params as the stages store them
        work = _pipelined(
            shardings, step, stages, accum, compiler, torus, eight_bit_itemsizes(shardings, cfg, compiler)
        )
    else:
        work = _unpipelined(shardings, step, accum, torus, compiler, eight_bit_itemsizes(shardings, cfg, compiler))
    memory = _memory(shardings, batch, step, work, accum)
    transfers = [*work.transfers, *context_attention_bytes(cfg, shardings)]
    model_flops, traced = _model_flops(cfg, task, step, devices)
    return Estimate(
        cfg,
        layout,
        dict(shardings.mesh.shape),
        frozenset(a for a in MESH_AXES if dcn[a] > 1),
        chip,
        memory,
        merge_transfers([t.on_cpu() for t in transfers] if compiler == "cpu" else transfers),
        flops=work.flops,
        model_flops=model_flops,
        hbm_bytes=work.matmul_bytes + 2 * (memory.params + memory.opt_state) + 2 * memory.grads,
        model_flops_traced=traced,
        compiler=compiler,
        stages=stages,
    )


@dataclasses.dataclass(frozen=True)
class _Work:
    """What the step costs one device, however its microbatches run: FLOPs and matmul bytes, collectives, the
    activations kept for the backward pass and the working set besides them."""

    flops: float
    matmul_bytes: float
    transfers: list[Transfer]
    activations: float
    working: float


def _unpipelined(
    shardings: Shardings, step: StepTrace, accum: int, torus: frozenset[str], compiler: str, itemsizes: tuple
) -> _Work:
    """The traced microbatch `accum` times over, its weights travelling as `Runs.unpipelined` says."""
    tally = (step.gradient["layers"] + step.gradient["rest"]) * accum
    weights = _weight_transfers(shardings, step, Runs.unpipelined(accum), compiler, torus, itemsizes)
    return _Work(
        tally.flops, tally.matmul_bytes, [*weights, *tally.transfers], step.saved_bytes(), step.working_bytes()
    )


def _pipelined(
    shardings: Shardings,
    step: StepTrace,
    stages: Stages,
    accum: int,
    compiler: str,
    torus: frozenset[str],
    itemsizes: tuple,
) -> _Work:
    """The traced pipeline microbatch through the schedule's ticks (`jaxtrain.planner.stages`), `accum` times."""
    tally = pipelined_work(step, stages) * accum
    weights = _weight_transfers(shardings, step, stages.weight_runs(accum), compiler, torus, itemsizes)
    transfers = [*weights, *tally.transfers, *stage_transfers(step, shardings, stages, accum)]
    return _Work(tally.flops, tally.matmul_bytes, transfers, *pipelined_memory(step, stages, compiler))


def _weight_transfers(
    shardings: Shardings,
    step: StepTrace,
    runs: Runs,
    compiler: str,
    torus: frozenset[str],
    itemsizes: tuple[dict[int, int], dict[int, int]] = ({}, {}),
) -> list[Transfer]:
    """The weights' gathers and gradient reductions (`jaxtrain.planner.weights`) as the traced step uses them."""
    return weight_transfers(
        shardings,
        runs,
        *step.weight_uses(compiler),
        whole_torus=torus,
        reduced_as=_heads(shardings, step),
        compiler=compiler,
        gathered_itemsize=itemsizes[0],
        reduced_itemsize=itemsizes[1],
    )


def eight_bit_itemsizes(shardings: Shardings, cfg: RunConfig, compiler: str) -> tuple[dict[int, int], dict[int, int]]:
    """Per param index, the bytes per element of FSDP's gather and of the gradient's reduction where
    `precision.*` makes them other than the dtype the weight is used in (`jaxtrain.placement.precision`): the
    chosen weights cross as 8-bit codes with 8-bit matmuls (both compilers quantize a weight's shard before
    gathering it) or `precision.gather=8bit`; with int8 matmuls and their backward, XLA:GPU reduce-scatters the
    weight gradient's int32 partial sums before scaling them (measured: docs/precision.md). The model is traced
    without them: the compilers quantize inside the dots' operand fusions, so the plain model's memory stands."""
    precision = with_precision(shardings.model, cfg, shardings.mesh).precision
    if precision is None:
        return {}, {}
    flat = jax.tree_util.tree_flatten_with_path(shardings.abstract_state["params"])[0]
    paths = [tuple(getattr(k, "key", k) for k in path) for path, _ in flat]
    targets = set(precision.targets)
    chosen = [i for i, path in enumerate(paths) if path in targets or (path[-1] == "base" and path[:-1] in targets)]
    r = precision.recipe
    int32_sums = compiler == "gpu" and r.matmuls == "int8" and r.backward == "quantized"
    return {i: 1 for i in chosen}, ({i: 4 for i in chosen} if int32_sums else {})


def _check_microbatches(shapes: Mapping[str, jax.ShapeDtypeStruct], accum: int, micro: int) -> None:
    rows = next(iter(shapes.values())).shape[0]
    if micro > 1 and rows % (accum * micro):
        raise PipelineError(
            f"a batch of {rows} rows does not split into {accum} accumulation pieces of {micro} pipeline "
            "microbatches; use a batch size divisible by pipeline.microbatches (times train.grad_accum)."
        )


def _abstract_shardings(
    cfg: RunConfig, layout: MeshLayout, devices: int, stages: StageLayout | None = None
) -> Shardings:
    """The run's plan on an abstract mesh of `devices`: the same shardings a real run gets, nothing allocated;
    `stages`: the pipeline's stage layout (how the stacked layers are stored). The model computes with plain kernels
    (`jaxtrain.ops.plain`): loops under custom gradients are not read, their plain math is."""
    model = _traceable(plain_kernels(cfg.model))
    placed = place_model(cfg.model_name, model, layout, cfg.rules, mesh=abstract_mesh(layout, devices))
    optimizer, _ = make_optimizer(cfg.optimizer, cfg.train.steps, placed.model.logical_names)
    policy = update_policy(cfg, placed.mesh)
    return with_offload(cfg, placed.shardings(optimizer, stages, policy), policy)


def _traceable(model_config: object) -> object:
    """`model_config` with a kernel that runs on one platform only (splash, cuDNN) traced as `chunked`: the trace
    runs on this machine's backend, which refuses them, and under plain kernels every fused implementation computes
    as the same recomputed reference (`jaxtrain.ops.plain`), so the choice changes nothing the planner reads."""
    if getattr(model_config, "attention", None) in _ONE_PLATFORM_KERNELS:
        return dataclasses.replace(model_config, attention="chunked")
    return model_config


_ONE_PLATFORM_KERNELS = ("splash", "cudnn")


def _batch_shapes(cfg: RunConfig, task: str) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch's shapes from the model's config alone (the synthetic source): planning reads no data."""
    dataset = make_dataset(
        "synthetic", task, seed=cfg.train.seed, seq_len=cfg.data.seq_len, **model_data_args(cfg.model)
    )
    return dataset.shapes(cfg.data.batch_size)


def _heads(shardings: Shardings, step: StepTrace) -> dict[int, tuple[str, int]]:
    """Per output head (a param with a vocabulary dim that a matmul takes), how the chunked loss reduces its
    gradient over the FSDP axes (`jaxtrain.planner.loss`); none without a chunked loss."""
    reduction = step.chunked_loss.head_reduction if step.chunked_loss is not None else None
    if reduction is None:
        return {}
    names = jax.tree.leaves(shardings.model.logical_names, is_leaf=is_logical_names)
    return {i: reduction for i, ns in enumerate(names) if "vocab" in ns and i in step.multiplied}


def _chunked_loss(
    cfg: RunConfig, shardings: Shardings, shapes: Mapping[str, jax.ShapeDtypeStruct], pieces: int, compiler: str
) -> ChunkedLoss | None:
    """The chunked loss's memory (`jaxtrain.planner.loss`) for one microbatch's rows and positions on a device."""
    mesh, rules = shardings.mesh, shardings.rules
    rows = next(iter(shapes.values())).shape[0] / pieces / math.prod(mesh.shape[a] for a in rules.batch_axes())
    positions = cfg.data.seq_len // math.prod(mesh.shape[a] for a in rules.activations.get("seq", ()))
    vocab_axes = [a for a in rules.activations.get("vocab", ()) if mesh.shape[a] > 1]
    return chunked_loss(cfg.model, rows, positions, mesh.shape, vocab_axes, compiler)


def _torus_axes(chip: Chip, layout: MeshLayout, devices: int) -> frozenset[str]:
    """The mesh axes that together span each whole TPU slice when its sides all close into rings, as the standard
    slice for the chip count is laid out (a v4 or v5p slice of whole 4x4x4 cubes: `aot.targets.wraparound`); none
    otherwise. Over such a group XLA:TPU reduces a gradient by an all-reduce and keeps each device's part, where it
    reduce-scatters over a part of the slice or an open one (compiled: llama-1b and a 2-layer d_model 256 or 2048
    model at fsdp=64 on v5p:4x4x4 all-reduce every layer's gradient; fsdp=8 on the open v5p:2x2x2 and llama-8b's
    fsdp=32 of v5p:4x4x8 reduce-scatter)."""
    ici, dcn = layout.resolve(devices)
    slices = math.prod(dcn.values())
    try:
        chip_name, dims = parse_target(auto_target(chip, devices, slices))
    except TargetError:  # not a standard slice: no torus assumed
        return frozenset()
    if chip_name not in TPU_CHIPS or not all(wraparound(chip_name, dims)):
        return frozenset()
    return frozenset(a for a, n in ici.items() if n > 1 and dcn[a] == 1)


def platform_of(chip: Chip) -> str:
    """'tpu' or 'gpu': whose compiler the estimate describes."""
    return "tpu" if chip.device_kinds[0].startswith("TPU") else "gpu"


def _memory(shardings: Shardings, batch: object, step: StepTrace, work: _Work, accum: int) -> Memory:
    state, tiled = shardings.abstract_state, step.shares.tiled
    other = {k: v for k, v in state.items() if k not in ("params", "opt_state")}
    params = _held(state["params"], tiled)
    return Memory(
        params=params,
        opt_state=_held(state["opt_state"], tiled),
        other_state=_held(other, tiled),
        batch=_held(batch, tiled),
        grads=params * (2 if accum > 1 else 1),
        activations=work.activations,
        working=work.working + gathered_layer_bytes(shardings, step.used, {**step.use_itemsize, **step.multiplied}),
        host_opt_state=_held(state["opt_state"], tiled, on_host=True),
        host_activations=step.host_saved_bytes(),  # one microbatch's: the next one's replace them
    )


def _held(tree: object, tiled: bool, on_host: bool = False) -> float:
    """Bytes one device holds of the arrays of `tree` (as XLA:TPU stores them where `tiled`) in device memory, or
    `on_host`, in host memory."""
    leaves = [x for x in jax.tree.leaves(tree) if (x.sharding.memory_kind == HOST_MEMORY) == on_host]
    return sum(held_bytes(x.sharding.shard_shape(x.shape), np.dtype(x.dtype).itemsize, tiled) for x in leaves)


def _model_flops(cfg: RunConfig, task: str, step: StepTrace, devices: int) -> tuple[float, bool]:
    """Model FLOPs per device per step, and whether they were traced: the config's `train_flops(batch_size,
    seq_len)` where it defines one, else 3 x the forward pass's traced matmul and convolution FLOPs (a backward pass
    costs two forward passes; remat recompute is not the model's work). Unlike XLA's cost analysis (the runtime's
    fallback), the trace counts every trip of a scanned layer stack."""
    train_flops = getattr(cfg.model, "train_flops", None)
    if train_flops is None:
        return 3 * step.forward_flops() / step.shardings.mesh.shape["pipeline"], True  # stages share the layers
    seq_len = cfg.data.seq_len if task in SEQUENCE_TASKS else 1
    return train_flops(cfg.data.batch_size, seq_len) / devices, False


def fits_with(est: Estimate, limit: int = 4) -> list[tuple[str, Estimate]]:
    """Changes that make a run that does not fit fit, each confirmed by re-estimating: FSDP over the data axis,
    remat, gradient accumulation, alone and then combined; the `limit` fastest, fastest first."""
    if est.fits:
        return []
    found, changes = [], _single_changes(est)
    # Gradient accumulation alone or with one other change first; two other changes only if none of those fits.
    for sizes in ((0, 1), (2,)):
        for combo in itertools.chain.from_iterable(itertools.combinations(changes, n) for n in sizes):
            labels, cfg, layout = _combine(est, combo)
            for accum_label, accum_cfg in _accumulations(cfg, layout, est.devices):
                candidate = estimate(accum_cfg, est.chip, est.devices, layout)
                if candidate.fits:
                    found.append(("; ".join(filter(None, [*labels, accum_label])), candidate))
                    break
        if found:
            break
    return sorted(found, key=lambda f: f[1].step_s[1])[:limit]


def _single_changes(est: Estimate) -> list[tuple[str, list[str], MeshLayout | None]]:
    """(label, config overrides, new layout) for each change that saves memory on its own."""
    changes = []
    ici, dcn = est.layout.resolve(est.devices)
    if ici["data"] > 1:
        axes = {**ici, "fsdp": ici["fsdp"] * ici["data"], "data": 1}
        axes = {a: n for a, n in axes.items() if n > 1}
        spec = ",".join(f"{a}={n}" for a, n in axes.items())
        where = f"--mesh {spec}" if not est.layout.dcn_axes else f"[axes] {spec} in the layout file"
        changes.append((f"FSDP over the data axis too ({where})", [], dataclasses.replace(est.layout, axes=axes)))
    remat = getattr(est.cfg.model, "remat", None)
    if remat is not None and remat != "full":
        changes.append(("remat=full", ["remat=full"], None))
    return changes


def _combine(est: Estimate, combo: Sequence[tuple]) -> tuple[list[str], RunConfig, MeshLayout]:
    labels = [label for label, _, _ in combo]
    cfg = apply_overrides(est.cfg, [o for _, overrides, _ in combo for o in overrides])
    layout = next((layout for _, _, layout in combo if layout is not None), est.layout)
    return labels, cfg, layout


def _accumulations(cfg: RunConfig, layout: MeshLayout, devices: int) -> Iterator[tuple[str, RunConfig]]:
    """The config as it is, then with 2, 4, 8, ... times the gradient accumulation while the batch divides."""
    yield "", cfg
    ici, dcn = layout.resolve(devices)
    batch_ways = math.prod(ici[a] * dcn[a] for a in ("replica", "data", "fsdp"))
    accum = cfg.train.grad_accum * 2
    while cfg.data.batch_size % (accum * batch_ways) == 0:
        yield f"grad_accum={accum}", apply_overrides(cfg, [f"grad_accum={accum}"])
        accum *= 2
