"""Plan a run for hardware this machine does not have: per-device memory, collectives per step and a roofline step
time for a model, a mesh layout of any size and a chip, from abstract shapes alone (nothing is allocated or
compiled). Where enough devices exist, `measure` compiles the real train step to check the estimate.

    >>> cfg = apply_overrides(default_config("gpt-1b"), ["mesh=tpu-v5p-256", "batch_size=512", "seq_len=2048"])
    >>> est = estimate(cfg, chip("v5p"), devices=256)                         # doctest: +SKIP
    >>> print(est.format(fits_with(est)))                                      # doctest: +SKIP

How each figure is found (all per device):
- state: the plan's shardings on an abstract mesh (`jaxtrain.sharding.mesh.abstract_mesh`), exact.
- gradients: one params-sized tree, sharded like the params; two under gradient accumulation (sum and newest).
- activations: what `jax.vjp` keeps for the backward pass of the loss on one device's rows (one microbatch), so the
  model's own remat policy decides; plus a working set: the same count for the largest loop body or remat region
  (what the backward recomputes, and cotangents of that size) and one layer's weights gathered by FSDP.
- which share of a traced array a device holds: the step is traced under the activation constraints, with a batch of
  a prime number of rows (larger than any other dim) times the mesh size, so dims carrying the batch are
  recognisable and the constraints divide. Each value's layout is followed from the batch's sharding and the
  constraints through elementwise ops, broadcasts, reductions, transposes, matmuls and convolutions (batch dims take
  the axes of the op's first input that has them); a dim nothing speaks for is split over a mesh axis when its size
  is that of a logical dim the activation rules split over that axis (`mlp` over `tensor`). Two logical dims of
  equal size split differently can be confused there: a known limit of reading shapes.
- collectives: per param, the axes splitting the rows of the activations it meets (the batch axes; all but the
  replicas for a ResNet's convolutions; the lookups' own for a table). Its gradient is reduced over those it is not
  split over (reduce-scatter where FSDP shards it, all-reduce where replicated). A dim split over one of those axes
  is gathered before use (FSDP: once, and again in the backward pass for stacked layers, as XLA re-gathers each
  layer) unless the activation rule of its name splits that axis too: expert weights are used where they are. Rows
  of a table looked up on devices that split them are found locally and summed: reduce-scattered over those
  devices (their gradients gathered back) or all-reduced. A constraint moving an axis from one dim of its input to
  another is an all-to-all (an MoE's tokens to their experts and back); one dropping an axis an all-gather. An
  all-reduce of the result of every contraction or reduction over a dim split on another axis (tensor
  parallelism); under a pipeline, the activations at stage boundaries forward and their gradients back.
- batch shapes come from the model's config (the `synthetic` source): planning reads no data.
- time: FLOPs of every matmul and convolution in the traced step (remat recompute included) / peak; HBM: their
  operands and results plus reading and writing the state / HBM bandwidth; each collective / the bandwidth of its
  links (ICI or NVLink inside a slice or host, DCN or InfiniBand across `dcn_axes`). The step lies between the
  largest of the three (communication hidden under compute) and compute-or-memory plus all communication (none
  hidden).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun, jaxprs_in_params
from jax.sharding import PartitionSpec

from jaxtrain.analysis.chips import CHIPS, Chip, ChipError, chip, chip_for_device_kind
from jaxtrain.analysis.comm_report import SEND_SHARE, communication_report
from jaxtrain.analysis.memory import device_bytes, tree_device_bytes
from jaxtrain.config import RunConfig, apply_overrides
from jaxtrain.data.datasets import make_dataset, model_data_args
from jaxtrain.formatting import fmt_bytes, format_table
from jaxtrain.parallel.updates import UpdatePolicy
from jaxtrain.registry import resolve_model
from jaxtrain.sharding.constraints import activation_sharding
from jaxtrain.sharding.mesh import MESH_AXES, MeshLayout, abstract_mesh, parse_layout
from jaxtrain.sharding.rules import ShardingRules, is_layer_stack, is_logical_names, spec_axes
from jaxtrain.training.model import split_model
from jaxtrain.training.optim import make_optimizer
from jaxtrain.training.plan import Plan, make_plan

# Share of a chip's HBM a step may use: the runtime, XLA's scratch space and fragmentation take the rest.
USABLE_HBM = 0.9
# Ops that combine values along a dim: when that dim is split over a mesh axis the result is a partial sum there.
_COMBINING = {"dot_general", "gather"} | {f"reduce_{op}" for op in ("sum", "max", "min", "prod", "and", "or")}
_REMAT = {"remat2", "checkpoint"}  # jax.checkpoint's primitive (named remat2 in jax 0.12)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One kind of collective over one set of mesh axes: `bytes` each device sends per step, and why."""

    axes: tuple[str, ...]
    kind: str  # all-reduce | all-gather | reduce-scatter | collective-permute
    bytes: float
    what: str

    def on_cpu(self) -> Transfer:
        """As XLA:CPU does it: it has no reduce-scatter, so it all-reduces the whole array (twice the bytes of
        a reduce-scatter: 2(N-1)/N of N shards instead of (N-1) shards) and each device keeps its shard."""
        if self.kind != "reduce-scatter":
            return self
        return dataclasses.replace(self, kind="all-reduce", bytes=2 * self.bytes)


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

    @property
    def arguments(self) -> float:
        """What the compiled step takes as arguments: the state and the batch."""
        return self.params + self.opt_state + self.other_state + self.batch

    @property
    def peak(self) -> float:
        return self.arguments + self.grads + self.activations + self.working


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

    @property
    def devices(self) -> int:
        return math.prod(self.mesh_shape.values())

    @property
    def fits(self) -> bool:
        return self.memory.peak <= USABLE_HBM * self.chip.hbm_bytes

    @property
    def compute_s(self) -> float:
        return self.flops / self.chip.peak_bf16

    @property
    def memory_s(self) -> float:
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
        return tuple(self.model_flops / (s * self.chip.peak_bf16) for s in self.step_s)

    def _is_slow(self, axes: Sequence[str]) -> bool:
        return any(a in self.slow_axes for a in axes)

    def _bandwidth(self, axes: Sequence[str]) -> float:
        return self.chip.dcn_bw if self._is_slow(axes) else self.chip.ici_bw

    def describe(self) -> str:
        """One line: model, batch, mesh, chip."""
        t, d, live = self.cfg.train, self.cfg.data, [f"{a}={n}" for a, n in self.mesh_shape.items() if n > 1]
        remat = getattr(self.cfg.model, "remat", None)
        seq = f" x seq {d.seq_len}" if resolve_model(self.cfg.model_name)[0].task == "lm" else ""
        hosts = f"; across hosts: {' '.join(sorted(self.slow_axes))}" if self.slow_axes else ""
        return (
            f"{self.cfg.model_name}, batch {d.batch_size}{seq}, grad_accum {t.grad_accum}"
            f"{f', remat {remat}' if remat else ''}; mesh '{self.layout.name}' ({' '.join(live) or 'one device'}; "
            f"{self.devices} x {self.chip.name}{hosts})"
        )

    def format(self, changes: Sequence[tuple[str, Estimate]] = (), measured: Measured | None = None) -> str:
        """The memory table, collectives, roofline time and verdict; compiled figures beside the estimates when
        `measured` is given; `changes` (from `fits_with`) when it does not fit."""
        lines = [f"plan: {self.describe()}"]
        lines += _memory_table(self.memory, measured)
        lines += _comm_table(self.transfers, measured)
        lines += self._time_lines()
        lines += self._verdict(changes)
        return "\n".join(lines)

    def _time_lines(self) -> list[str]:
        c = self.chip
        fast, slow = self.comm_s(slow=False), self.comm_s(slow=True)
        hidden, exposed = self.step_s
        return [
            f"time per step (roofline of {c.name}: {c.peak_bf16 / 1e12:.0f} TFLOP/s bf16, HBM "
            f"{c.hbm_bw / 1e9:.0f} GB/s, fast links {c.ici_bw / 1e9:.0f} GB/s, slow links {c.dcn_bw / 1e9:.2f} GB/s "
            "per chip)",
            f"  compute        {self.flops:.3e} FLOPs ({self.model_flops:.3e} model FLOPs) {_ms(self.compute_s)}",
            f"  HBM traffic    {fmt_bytes(self.hbm_bytes)} {_ms(self.memory_s)}",
            f"  communication  fast links {_ms(fast)}, slow links {_ms(slow)}",
            f"  step           {_ms(hidden)} (communication hidden) to {_ms(exposed)} (none hidden); "
            f"MFU {self.mfu[1]:.0%} to {self.mfu[0]:.0%}",
        ]

    def _verdict(self, changes: Sequence[tuple[str, Estimate]]) -> list[str]:
        usable, peak = USABLE_HBM * self.chip.hbm_bytes, self.memory.peak
        share = f"peak {fmt_bytes(peak)} of {fmt_bytes(usable)} usable ({USABLE_HBM:.0%} of {self.chip.name}'s HBM)"
        if self.fits:
            return [f"verdict: fits: {share}, {peak / usable:.0%} used"]
        lines = [f"verdict: does not fit: {share}"]
        if not changes:
            return [*lines, "  no change tried fits (more FSDP, remat, gradient accumulation): use more chips"]
        lines.append("  changes that fit, re-estimated (fastest first):")
        for label, e in changes:
            lines.append(f"    {label}: peak {fmt_bytes(e.memory.peak)}, step {_ms(e.step_s[1])}, MFU {e.mfu[1]:.0%}")
        return lines


@dataclasses.dataclass(frozen=True)
class Measured:
    """Figures of the compiled step: per-device argument bytes, the live-bytes bound (arguments + outputs - aliased
    + temporaries) and bytes each device sends per step per exact set of mesh axes."""

    platform: str
    arguments: float
    peak: float
    comm: Mapping[tuple[str, ...], float]


def plan_report(cfg: RunConfig, chip_name: str | None, devices: int | None, check: bool = True) -> str:
    """What `jaxtrain plan` prints: the estimate for `devices` chips called `chip_name` (default: this machine's
    chips and count, or the layout's fixed size), the changes that would make it fit, and, when this process has
    enough devices and `check`, the compiled step's figures beside the estimates."""
    layout = parse_layout(cfg.mesh)
    if devices is None:
        fixed = -1 not in layout.axes.values()
        devices = math.prod([*layout.axes.values(), *layout.dcn_axes.values()]) if fixed else jax.device_count()
    spec = chip(chip_name) if chip_name else chip_for_device_kind(jax.devices()[0].device_kind)
    if spec is None:
        raise ChipError(f"say which chip to plan for with --chip: one of {', '.join(CHIPS)}.")
    est = estimate(cfg, spec, devices, layout)
    measured, note = None, ""
    if not check:
        note = "check: skipped (--no-check)"
    elif devices > jax.device_count():
        note = (
            f"check: not compiled: the mesh has {devices} devices, this process {jax.device_count()} "
            f"(--simulated-devices {devices} compiles it on that many CPU devices)"
        )
    else:
        measured = measure(cfg, jax.devices()[:devices])
        note = f"check: compiled the train step on {devices} {measured.platform} devices (figures beside the estimates)"
    return est.format(fits_with(est), measured) + "\n" + note


def estimate(cfg: RunConfig, chip: Chip, devices: int, layout: MeshLayout | None = None) -> Estimate:
    """Plan `cfg` on `devices` chips laid out as `layout` (default: `cfg.mesh`)."""
    layout = layout or parse_layout(cfg.mesh)
    ici, dcn = layout.resolve(devices)
    mesh = abstract_mesh(layout, devices)
    spec, _ = resolve_model(cfg.model_name)
    rules = ShardingRules.default().with_overrides({**layout.rules, **cfg.rules})
    model = split_model(functools.partial(spec.module, cfg.model), spec.replicate_unnamed)
    optimizer, _ = make_optimizer(cfg.optimizer, cfg.train.steps)
    t = cfg.train
    policy = UpdatePolicy(t.sync, t.sync_every, t.staleness, t.outer_lr, t.outer_momentum)
    plan = make_plan(mesh, rules, model, optimizer, None, policy)
    shapes = _batch_shapes(cfg, spec.task)
    batch = plan.abstract_batch(shapes, t.grad_accum)  # checks the batch divides
    step = _StepTrace(plan, shapes, t.grad_accum)

    state = plan.abstract_state
    other = {k: v for k, v in state.items() if k not in ("params", "opt_state")}
    params = tree_device_bytes(state["params"])
    memory = Memory(
        params=params,
        opt_state=tree_device_bytes(state["opt_state"]),
        other_state=tree_device_bytes(other),
        batch=tree_device_bytes(batch),
        grads=params * (2 if t.grad_accum > 1 else 1),
        activations=step.saved_bytes(),
        working=step.working_bytes() + _gathered_layer_bytes(plan, step.used),
    )
    transfers = _merge([*_weight_transfers(plan, t.grad_accum, step.used), *step.transfers()])
    seq_len = cfg.data.seq_len if spec.task == "lm" else 1
    return Estimate(
        cfg,
        layout,
        dict(mesh.shape),
        frozenset(a for a in MESH_AXES if dcn[a] > 1),
        chip,
        memory,
        transfers,
        flops=step.flops,
        model_flops=cfg.model.train_flops(cfg.data.batch_size, seq_len) / devices,
        hbm_bytes=step.matmul_bytes + 2 * (memory.params + memory.opt_state) + 2 * memory.grads,
    )


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


def measure(cfg: RunConfig, devices: Sequence[jax.Device]) -> Measured:
    """Compile the real train step of `cfg` on `devices` and read its memory and communication."""
    from jaxtrain.training.setup import build

    run = build(cfg, log=lambda *_: None, devices=devices)
    compiled = run.train_step
    m = compiled.memory_analysis()
    comm: dict[tuple[str, ...], float] = collections.defaultdict(float)
    for row in communication_report(compiled, run.plan.mesh).rows:
        comm[row.axes] += row.mean
    live = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return Measured(devices[0].platform, m.argument_size_in_bytes, live, dict(comm))


def comm_by_axes(transfers: Sequence[Transfer]) -> dict[tuple[str, ...], float]:
    """Bytes each device sends per step, summed over collective kinds, per exact set of mesh axes."""
    out: dict[tuple[str, ...], float] = collections.defaultdict(float)
    for t in transfers:
        out[t.axes] += t.bytes
    return dict(out)


def _batch_shapes(cfg: RunConfig, task: str) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch's shapes from the model's config alone (the synthetic source): planning reads no data."""
    dataset = make_dataset(
        "synthetic", task, seed=cfg.train.seed, seq_len=cfg.data.seq_len, **model_data_args(cfg.model)
    )
    return dataset.shapes(cfg.data.batch_size)


# What is known of a traced value's layout: per dim, the mesh axes splitting it, or None where unknown.
Spec = tuple[tuple[str, ...] | None, ...]


def _spec_entries(spec: PartitionSpec, ndim: int) -> Spec:
    entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    return tuple(entries + [()] * (ndim - len(entries)))


@dataclasses.dataclass(frozen=True)
class _Shares:
    """Which part of a traced array one device holds (see the module docstring): from its `Spec` where known, else
    read from its shape."""

    probe: int  # rows the batch was traced with: a multiple of the mesh size by a prime larger than any other dim
    batch: int  # real rows of one microbatch, all devices together
    batch_axes: tuple[str, ...]  # the axes splitting batch dims where nothing else is known
    split: Mapping[str, frozenset[int]]  # mesh axis -> sizes of the logical dims split over it
    mesh_shape: Mapping[str, int]

    def is_batch(self, size: int) -> bool:
        return size % self.probe == 0

    def dims(self, shape: Sequence[int], spec: Spec | None = None) -> list[tuple[str, ...]]:
        """The mesh axes splitting each dim: as `spec` says where known; batch dims by the batch axes; another dim
        by the first free axis splitting a logical dim of its size."""
        spec = spec or (None,) * len(shape)
        out = [s if s is not None else self.batch_axes if self.is_batch(n) else None for n, s in zip(shape, spec)]
        used = {a for axes in out if axes for a in axes}
        for i, size in enumerate(shape):
            if out[i] is None:
                axis = next((a for a, s in self.split.items() if a not in used and size in s), None)
                out[i] = (axis,) if axis is not None and size % self.mesh_shape[axis] == 0 else ()
                used.update(out[i])
        return out

    def model_axes(self, shape: Sequence[int], spec: Spec | None = None) -> set[str]:
        """Axes splitting dims other than the batch's."""
        return {a for n, axes in zip(shape, self.dims(shape, spec)) if not self.is_batch(n) for a in axes}

    def sizes(self, shape: Sequence[int], spec: Spec | None = None) -> list[float]:
        """Per-device dim sizes."""
        return [
            (n // self.probe * self.batch if self.is_batch(n) else n) / math.prod(self.mesh_shape[a] for a in axes)
            for n, axes in zip(shape, self.dims(shape, spec))
        ]

    def bytes(self, aval: Any, spec: Spec | None = None) -> float:
        if not hasattr(aval, "shape"):
            return 0.0
        return math.prod(self.sizes(aval.shape, spec)) * np.dtype(aval.dtype).itemsize


class _Flow:
    """What is known of each value of a traced step while walking it in order: its layout (`Spec`: from the batch's
    sharding and the activation constraints, carried through elementwise ops, broadcasts, reductions and transposes;
    elsewhere the batch dims take the axes of the op's first input that has them) and which parameter it is (a cast
    of one, or a layer's slice in a scan)."""

    # Ops whose output is still the parameter they take (cast, copied, broadcast for a bias, reshaped).
    _VIEWS = {"convert_element_type", "copy", "copy_p", "reshard", "broadcast_in_dim", "reshape", "squeeze"}

    def __init__(self, shares: _Shares, jaxpr: Jaxpr | None = None, param_specs: Sequence[Spec] = ()):
        self.shares = shares
        self.spec: dict[Any, Spec] = {}
        self.param: dict[Any, int] = {}
        if jaxpr is not None:  # invars: the params' leaves, then the batch's
            for i, v in enumerate(jaxpr.invars):
                if i < len(param_specs):
                    self.param[v], self.spec[v] = i, param_specs[i]
                else:
                    self.spec[v] = (shares.batch_axes, *[()] * (v.aval.ndim - 1))

    def of(self, v: Any) -> Spec | None:
        return None if isinstance(v, Literal) else self.spec.get(v)

    def infer(self, eqn: Any) -> None:
        """Set what is known of the outputs of `eqn`, an op without nested jaxprs."""
        name, p = eqn.primitive.name, eqn.params
        if name in self._VIEWS and not isinstance(eqn.invars[0], Literal) and eqn.invars[0] in self.param:
            self.param[eqn.outvars[0]] = self.param[eqn.invars[0]]
        src = self.of(eqn.invars[0]) if eqn.invars else None
        for out in eqn.outvars:
            ndim = len(out.aval.shape) if hasattr(out.aval, "shape") else 0
            if name == "sharding_constraint":
                spec = _spec_entries(p["sharding"].spec, ndim)
            elif src is not None and name == "broadcast_in_dim":
                spec = [None] * ndim  # new dims are free to take any layout
                for i, d in enumerate(p["broadcast_dimensions"]):
                    spec[d] = src[i]
            elif src is not None and "axes" in p and (name.startswith("reduce_") or name in ("argmax", "argmin")):
                spec = [s for i, s in enumerate(src) if i not in p["axes"]]
            elif src is not None and name == "transpose":
                spec = [src[i] for i in p["permutation"]]
            elif name == "dot_general":
                spec = self._contraction(eqn)
            elif name == "conv_general_dilated":
                spec = self._convolution(eqn)
            else:
                spec = self._elementwise(eqn, out) or self._batch_only(eqn, out)
            if spec is not None and len(spec) == ndim:
                self.spec[out] = tuple(spec)

    def _elementwise(self, eqn: Any, out: Any) -> Spec | None:
        same = (self.of(v) for v in eqn.invars if getattr(v.aval, "shape", None) == out.aval.shape)
        return next((s for s in same if s is not None), None)

    def _contraction(self, eqn: Any) -> Spec:
        """A matmul's output dims: the batch dims, then the free dims of each side, each split as it was."""
        (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
        lhs, rhs = [self.of(v) or (None,) * len(v.aval.shape) for v in eqn.invars]
        batch = [lhs[i] if lhs[i] is not None else rhs[j] for i, j in zip(lhs_b, rhs_b)]
        free = [lhs[i] for i in range(len(lhs)) if i not in (*lhs_c, *lhs_b)]
        return (*batch, *free, *(rhs[i] for i in range(len(rhs)) if i not in (*rhs_c, *rhs_b)))

    def _convolution(self, eqn: Any) -> Spec:
        """A convolution's output dims: its batch and window dims split as the input's, its features as the
        kernel's output features."""
        dn = eqn.params["dimension_numbers"]
        lhs, rhs = [self.of(v) or (None,) * len(v.aval.shape) for v in eqn.invars]
        out = [None] * len(lhs)
        out[dn.out_spec[0]], out[dn.out_spec[1]] = lhs[dn.lhs_spec[0]], rhs[dn.rhs_spec[0]]
        for o, i in zip(dn.out_spec[2:], dn.lhs_spec[2:]):
            out[o] = lhs[i]
        return tuple(out)

    def _batch_only(self, eqn: Any, out: Any) -> Spec | None:
        """The batch dims of `out` split as those of the first input whose batch dims are known; the rest unknown."""
        shape = getattr(out.aval, "shape", ())
        for v in eqn.invars:
            spec, in_shape = self.of(v), getattr(v.aval, "shape", ())
            axes = [s for n, s in zip(in_shape, spec or ()) if s is not None and self.shares.is_batch(n)]
            if axes:
                return tuple(axes[0] if self.shares.is_batch(n) else None for n in shape)
        return None

    def enter(self, eqn: Any, sub: Jaxpr) -> None:
        """Carry what is known of `eqn`'s inputs to `sub`'s (a scan's xs lose their leading dim)."""
        outer = eqn.invars[len(eqn.invars) - len(sub.invars) :]  # a cond's branches take all but the index
        if len(outer) != len(sub.invars):
            return
        for o, i in zip(outer, sub.invars):
            if isinstance(o, Literal):
                continue
            if o in self.param:
                self.param[i] = self.param[o]
            if (spec := self.spec.get(o)) is not None:
                self.spec[i] = spec[len(spec) - len(i.aval.shape) :]

    def leave(self, eqn: Any, sub: Jaxpr) -> None:
        """Carry what is known of `sub`'s outputs to `eqn`'s (a scan's ys gain a leading dim)."""
        if len(sub.outvars) != len(eqn.outvars):
            return
        for i, o in zip(sub.outvars, eqn.outvars):
            if (spec := self.of(i)) is not None:
                self.spec[o] = ((),) * (len(o.aval.shape) - len(spec)) + spec


class _StepTrace:
    """The loss and its gradient for one microbatch, traced (not compiled) under the activation constraints, and
    read for residuals, FLOPs, matmul bytes, the collectives of split dims and how each parameter is used."""

    def __init__(self, plan: Plan, shapes: Mapping[str, jax.ShapeDtypeStruct], accum: int):
        mesh = plan.mesh
        batch_axes = tuple(a for a in plan.rules.batch_axes() if mesh.shape[a] > 1)
        dims = _logical_sizes(plan)
        batch = next(iter(shapes.values())).shape[0] // accum
        probe = _prime_above(max([batch, *dims.values(), *(d for s in shapes.values() for d in s.shape)])) * mesh.size
        table = {**plan.rules.activations, "layers": plan.rules.params.get("layers", ())}
        split = {
            axis: frozenset(size for name, size in dims.items() if axis in table.get(name, ()))
            for axis in mesh.axis_names
            if mesh.shape[axis] > 1 and axis not in batch_axes
        }
        self.plan, self.accum = plan, accum
        self.shares = _Shares(probe, batch, batch_axes, split, dict(mesh.shape))
        self.param_specs = _params_in_use(plan)
        self.loss = lambda p, b: plan.model.loss_fn(p, b)[0]
        self.args = (
            plan.model.abstract_params,
            {k: jax.ShapeDtypeStruct((probe, *s.shape[1:]), s.dtype) for k, s in shapes.items()},
        )
        self.loss_jaxpr = self._trace(self.loss).jaxpr
        self._read_grad(self._trace(jax.value_and_grad(self.loss)).jaxpr)

    def _trace(self, fn: Any, args: Sequence[Any] | None = None) -> ClosedJaxpr:
        with activation_sharding(self.plan.mesh, self.plan.rules):
            return jax.make_jaxpr(fn)(*(args or self.args))

    def saved_bytes(self) -> float:
        """Residuals of the loss for one microbatch: what its forward pass keeps for the backward pass."""
        return self._residual_bytes(self.loss, self.args, self.param_specs)

    def working_bytes(self) -> float:
        """The residuals of the largest loop body or remat region run as a function of its own, without its remat
        policy: what the backward pass of one layer holds (recomputed under remat) besides the saved residuals."""
        sizes = [0.0]
        for eqn, _ in _walk(self.loss_jaxpr):
            if (eqn.primitive.name == "scan" or eqn.primitive.name in _REMAT) and not _body(eqn).constvars:
                body = _body(eqn)
                args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.invars]
                sizes.append(self._residual_bytes(jaxpr_as_fun(ClosedJaxpr(body, [])), args))
        return max(sizes)

    def _residual_bytes(self, fn: Any, args: Sequence[Any], param_specs: Sequence[Spec] = ()) -> float:
        """Per-device bytes of what `jax.vjp(fn, *args)` keeps for the backward pass, not counting its inputs."""
        closed = self._trace(lambda *a: jax.vjp(fn, *a)[1], args)
        flow = _Flow(self.shares, closed.jaxpr, param_specs)
        for _ in _walk(closed.jaxpr, flow=flow):
            pass
        inputs = set(closed.jaxpr.invars)
        kept = {v for v in closed.jaxpr.outvars if not isinstance(v, Literal) and v not in inputs}
        return sum(self.shares.bytes(v.aval, flow.of(v)) for v in kept)

    def transfers(self) -> list[Transfer]:
        out = [dataclasses.replace(t, bytes=t.bytes * self.accum) for t in self._transfers]
        if self.shares.mesh_shape.get("pipeline", 1) > 1:
            out.append(Transfer(("pipeline",), "collective-permute", 2 * self._stage_io(), "stage activations"))
        return out

    def _read_grad(self, jaxpr: Jaxpr) -> None:
        """FLOPs and bytes of every matmul and convolution; collectives of contractions over split dims, of
        resharded activations and of lookups into split tables; the batch axes each parameter is used over."""
        shares, flow = self.shares, _Flow(self.shares, jaxpr, self.param_specs)
        self.flops = self.matmul_bytes = 0.0
        self._transfers: list[Transfer] = []
        self.used: dict[int, set[str]] = collections.defaultdict(set)  # param -> axes splitting its inputs' rows
        lookups: dict[Any, tuple[tuple[str, ...], float]] = {}  # a lookup's rows -> (axes to sum over, bytes)
        for eqn, trips in _walk(jaxpr, flow=flow):
            if not eqn.outvars:
                continue
            name, out = eqn.primitive.name, eqn.outvars[0]
            ins = [(v.aval, flow.of(v)) for v in eqn.invars]
            self._note_uses(eqn, flow)
            if name in ("dot_general", "conv_general_dilated"):
                self.flops += trips * _flops(eqn, shares, flow)
                self.matmul_bytes += trips * (sum(shares.bytes(*a) for a in ins) + shares.bytes(out.aval, flow.of(out)))
            if name == "gather" and eqn.invars[0] in flow.param:
                axes = self._lookup_axes(eqn, flow.param[eqn.invars[0]])
                if axes:
                    lookups[out] = (axes, trips * shares.bytes(out.aval, flow.of(out)))
            elif name in ("convert_element_type", "copy", "copy_p") and eqn.invars[0] in lookups:
                lookups[out] = lookups.pop(eqn.invars[0])
            elif name == "sharding_constraint" and eqn.invars[0] in lookups:
                self._transfers += _lookup_sums(*lookups.pop(eqn.invars[0]), flow.of(out), shares.mesh_shape)
            elif name == "sharding_constraint" and not isinstance(eqn.invars[0], Literal):
                self._transfers += _reshards(eqn.invars[0].aval, ins[0][1], flow.of(out), trips, shares)
            elif name in _COMBINING:
                combined = (
                    shares.model_axes(ins[0][0].shape, ins[0][1])
                    - shares.model_axes(out.aval.shape, flow.of(out))
                    - {"pipeline"}
                )
                for axis in combined:
                    b = trips * SEND_SHARE["all-reduce"](shares.mesh_shape[axis]) * shares.bytes(out.aval, flow.of(out))
                    self._transfers.append(Transfer((axis,), "all-reduce", b, "activations (split dims)"))
        for axes, b in lookups.values():  # rows looked up and never laid out again: summed where they are
            self._transfers.extend(_lookup_sums(axes, b, None, shares.mesh_shape))
        self.flops *= self.accum
        self.matmul_bytes *= self.accum

    def _note_uses(self, eqn: Any, flow: _Flow) -> None:
        """Record, for each parameter `eqn` takes, the axes splitting the batch dims of its other operands."""
        params = {flow.param[v] for v in eqn.invars if not isinstance(v, Literal) and v in flow.param}
        if not params:
            return
        axes: set[str] = set()
        for v in [*eqn.invars, *eqn.outvars]:
            shape = getattr(v.aval, "shape", ())
            if not isinstance(v, Literal) and v not in flow.param and any(self.shares.is_batch(n) for n in shape):
                dims = self.shares.dims(shape, flow.of(v))
                axes.update(a for n, d in zip(shape, dims) if self.shares.is_batch(n) for a in d)
                axes.add("")  # marks the param as used with the batch, even over no axes
        for p in params:
            if axes:
                self.used[p].update(axes)

    def _lookup_axes(self, eqn: Any, param: int) -> tuple[str, ...]:
        """Axes splitting the dims a gather indexes in parameter `param`: each device looks up its own rows."""
        leaf = jax.tree.leaves(self.plan.abstract_state["params"])[param]
        spec = _spec_entries(leaf.sharding.spec, len(leaf.shape))
        indexed = eqn.params["dimension_numbers"].start_index_map
        axes = {a for d in indexed for a in spec[d] if a != "pipeline"}
        return tuple(a for a in MESH_AXES if a in axes and self.shares.mesh_shape[a] > 1)

    def _stage_io(self) -> float:
        """Bytes of the carry of the longest loop (the layer stack): what crosses a pipeline stage boundary."""
        scans = [eqn for eqn, _ in _walk(self.loss_jaxpr) if eqn.primitive.name == "scan"]
        if not scans:
            return 0.0
        longest = max(scans, key=lambda e: e.params["length"])
        start, count = longest.params["num_consts"], longest.params["num_carry"]
        return sum(self.shares.bytes(v.aval) for v in longest.invars[start : start + count])


def _params_in_use(plan: Plan) -> list[Spec]:
    """Each param's layout where it is used: split where the activation rule of a dim's name splits that dim too
    (tensor-parallel dims, experts), whole where its axes are gathered before use (FSDP) or indexed (tables)."""
    names = jax.tree.leaves(plan.model.logical_names, is_leaf=is_logical_names)
    out = []
    for ns, p in zip(names, jax.tree.leaves(plan.abstract_state["params"])):
        spec = _spec_entries(p.sharding.spec, len(p.shape))
        out.append(tuple(tuple(a for a in d if n and a in plan.rules.activations.get(n, ())) for n, d in zip(ns, spec)))
    return out


def _flops(eqn: Any, shares: _Shares, flow: _Flow) -> float:
    """Per-device FLOPs of a matmul or a convolution: 2 x output elements x the products summed into each."""
    (lhs, lhs_spec), (rhs, rhs_spec) = [(v.aval, flow.of(v)) for v in eqn.invars[:2]]
    out = eqn.outvars[0]
    if eqn.primitive.name == "dot_general":
        (lhs_c, _), _ = eqn.params["dimension_numbers"]
        lhs_sizes = shares.sizes(lhs.shape, lhs_spec)
        summed = math.prod(lhs_sizes[d] for d in lhs_c)
    else:  # a convolution: each output sums over the window and the input features of its group
        rhs_dims = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, *window)
        rhs_sizes = shares.sizes(rhs.shape, rhs_spec)
        summed = math.prod(rhs_sizes[d] for d in rhs_dims[1:])
    return 2 * math.prod(shares.sizes(out.aval.shape, flow.of(out))) * summed


def _ways(axes: Sequence[str], mesh_shape: Mapping[str, int]) -> int:
    return math.prod(mesh_shape[a] for a in axes)


def _lookup_sums(axes: tuple[str, ...], b: float, after: Spec | None, mesh_shape: Mapping[str, int]) -> list[Transfer]:
    """Rows looked up in a table split over `axes` (`b` bytes per device, each device's own rows found, zeros
    elsewhere) are summed over `axes`: scattered there when the next layout splits the rows over `axes` (and the
    backward pass gathers their gradients back), else all-reduced."""
    n = _ways(axes, mesh_shape)
    if set(axes) <= {a for d in after or () if d for a in d}:
        return [
            Transfer(axes, "reduce-scatter", (n - 1) / n * b, "looked-up rows"),
            Transfer(axes, "all-gather", (n - 1) / n * b, "looked-up rows' gradients"),
        ]
    return [Transfer(axes, "all-reduce", SEND_SHARE["all-reduce"](n) * b, "looked-up rows")]


def _reshards(aval: Any, before: Spec | None, after: Spec | None, trips: int, shares: _Shares) -> list[Transfer]:
    """What a sharding constraint moves: an all-to-all over the axes that split another dim of its input (tokens
    sorted by expert moving to their experts), an all-gather over those that split its input but not its output."""
    if before is None or after is None:
        return []
    where_after = {a: i for i, d in enumerate(after) for a in d or ()}
    moved, dropped = [], []
    for i, d in enumerate(before):
        for a in d or ():
            if a in where_after and where_after[a] != i:
                moved.append(a)
            elif a not in where_after:
                dropped.append(a)
    b, out = trips * shares.bytes(aval, before), []
    if moved := tuple(a for a in MESH_AXES if a in moved and shares.mesh_shape[a] > 1):
        out.append(
            Transfer(moved, "all-to-all", (1 - 1 / _ways(moved, shares.mesh_shape)) * b, "activations (resharded)")
        )
    if dropped := tuple(a for a in MESH_AXES if a in dropped and shares.mesh_shape[a] > 1):
        out.append(
            Transfer(dropped, "all-gather", (_ways(dropped, shares.mesh_shape) - 1) * b, "activations (resharded)")
        )
    return out


def _walk(jaxpr: Jaxpr, trips: int = 1, flow: _Flow | None = None) -> Iterator[tuple[Any, int]]:
    """Every equation, nested ones included, with how often it runs (loop trip counts multiplied); with `flow`,
    what is known of each value is updated as the walk goes."""
    for eqn in jaxpr.eqns:
        subs = list(jaxprs_in_params(eqn.params))
        if flow is not None and not subs:
            flow.infer(eqn)
        yield eqn, trips
        inner = trips * eqn.params["length"] if eqn.primitive.name == "scan" else trips
        for sub in subs:
            if flow is not None:
                flow.enter(eqn, sub)
            yield from _walk(sub, inner, flow)
            if flow is not None:
                flow.leave(eqn, sub)


def _body(eqn: Any) -> Jaxpr:
    body = eqn.params["jaxpr"]
    return body.jaxpr if isinstance(body, ClosedJaxpr) else body


def _logical_sizes(plan: Plan) -> dict[str, int]:
    """Size of each logical dim name, from the params that use it."""
    names = jax.tree.leaves(plan.model.logical_names, is_leaf=is_logical_names)
    params = jax.tree.leaves(plan.model.abstract_params)
    return {n: s for ns, p in zip(names, params) for n, s in zip(ns, p.shape) if n}


def _prime_above(n: int) -> int:
    n += 1
    while any(n % k == 0 for k in range(2, math.isqrt(n) + 1)):
        n += 1
    return n


def _weight_axes(plan: Plan, used: Mapping[int, set[str]]) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """Per param: (axes its weights are gathered over before use, axes its gradient is all-reduced over).

    A param is used over the axes that split the rows of the activations it meets (`used`; the batch axes when it
    meets none). A dim split over one of those axes is gathered (FSDP), unless the activation rule of its logical
    name splits over that axis too: then each device uses its own slice where it is (an expert's weights, the
    experts' tokens travelling to them instead). A table's rows split over axes its lookups are not split over are
    never gathered either: each device looks up its own rows. The gradient is summed over the axes the param is
    used over but not split over."""
    mesh, default = plan.mesh, set(plan.rules.batch_axes())
    names = jax.tree.leaves(plan.model.logical_names, is_leaf=is_logical_names)
    out = []
    for i, (ns, p) in enumerate(zip(names, jax.tree.leaves(plan.abstract_state["params"]))):
        over = used.get(i, default) - {""}
        spec = _spec_entries(p.sharding.spec, len(p.shape))
        in_place = {a for n, d in zip(ns, spec) for a in d if n and a in plan.rules.activations.get(n, ())}
        live = [a for a in MESH_AXES if mesh.shape[a] > 1]
        gathered = tuple(a for a in live if a in spec_axes(p.sharding.spec) and a in over and a not in in_place)
        reduced = tuple(a for a in live if a in over and a not in spec_axes(p.sharding.spec))
        out.append((gathered, reduced))
    return out


def _weight_transfers(plan: Plan, accum: int, used: Mapping[int, set[str]]) -> list[Transfer]:
    """FSDP gathers (every microbatch) and the gradient reduction over the batch axes (once per step)."""
    mesh, out = plan.mesh, []
    names = jax.tree.leaves(plan.model.logical_names, is_leaf=is_logical_names)
    params = jax.tree.leaves(plan.abstract_state["params"])
    for ns, p, (gathered, reduced) in zip(names, params, _weight_axes(plan, used)):
        shard = device_bytes(p)
        if gathered:
            n = math.prod(mesh.shape[a] for a in gathered)
            passes = 2 if is_layer_stack(ns) else 1  # forward, and again in the backward pass
            out.append(Transfer(gathered, "all-gather", passes * accum * (n - 1) * shard, "weights (FSDP)"))
            out.append(Transfer(gathered, "reduce-scatter", (n - 1) * shard, "gradients"))
        if reduced:
            n = math.prod(mesh.shape[a] for a in reduced)
            out.append(Transfer(reduced, "all-reduce", SEND_SHARE["all-reduce"](n) * shard, "gradients"))
    return out


def _gathered_layer_bytes(plan: Plan, used: Mapping[int, set[str]]) -> float:
    """Bytes of the weights FSDP gathers at once: one layer of each stacked param, or the other params."""
    names = jax.tree.leaves(plan.model.logical_names, is_leaf=is_logical_names)
    params = jax.tree.leaves(plan.abstract_state["params"])
    stacked = other = 0.0
    for ns, p, (gathered, _) in zip(names, params, _weight_axes(plan, used)):
        ways = math.prod(plan.mesh.shape[a] for a in gathered)
        if ways == 1:
            continue
        if is_layer_stack(ns):
            stacked += device_bytes(p) * ways / p.sharding.shard_shape(p.shape)[0]
        else:
            other += device_bytes(p) * ways
    return max(stacked, other)


def _merge(transfers: Sequence[Transfer]) -> tuple[Transfer, ...]:
    """One row per (axes, kind, what), largest first."""
    total: dict[tuple, float] = collections.defaultdict(float)
    for t in transfers:
        total[(t.axes, t.kind, t.what)] += t.bytes
    rows = [Transfer(axes, kind, b, what) for (axes, kind, what), b in total.items() if b > 0]
    return tuple(sorted(rows, key=lambda t: -t.bytes))


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


def _ms(seconds: float) -> str:
    """Milliseconds, or microseconds below one (a small model's step would read 0.00 ms)."""
    return f"{seconds * 1e3:,.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.2f} us"


def _ratio(estimate: float, measured: float | None) -> str:
    return f"{estimate / measured:.2f}" if measured else "-"


def _memory_table(m: Memory, measured: Measured | None) -> list[str]:
    compiled = f"compiled ({measured.platform})" if measured else ""
    rows = [("memory per device", "estimate", compiled, "est/compiled" if measured else "")]
    parts = [
        ("params", m.params),
        ("optimizer state", m.opt_state),
        ("step and policy state", m.other_state),
        ("batch", m.batch),
    ]
    rows += [(f"  {label}", fmt_bytes(b), "", "") for label, b in parts]
    got = measured.arguments if measured else None
    rows.append(("= arguments", fmt_bytes(m.arguments), fmt_bytes(got) if got else "", _ratio(m.arguments, got)))
    rows += [
        ("  gradients", fmt_bytes(m.grads), "", ""),
        ("  activations saved for backward", fmt_bytes(m.activations), "", ""),
        ("  working set of one layer", fmt_bytes(m.working), "", ""),
    ]
    got = measured.peak if measured else None
    rows.append(("= peak", fmt_bytes(m.peak), fmt_bytes(got) if got else "", _ratio(m.peak, got)))
    return [line.rstrip() for line in format_table([r if measured else r[:2] for r in rows])]


def _comm_table(transfers: Sequence[Transfer], measured: Measured | None) -> list[str]:
    """Estimated collectives; with `measured`, per set of axes the estimate (as XLA on that platform does it)
    beside the compiled program's bytes."""
    lines = ["communication per step (bytes each device sends)"]
    if not transfers and not (measured and measured.comm):
        return lines + ["  none"]
    rows = [("axes", "collective", "what", "estimate")]
    rows += [(" ".join(t.axes), t.kind, t.what, fmt_bytes(t.bytes)) for t in transfers]
    lines += ["  " + line.rstrip() for line in format_table(rows)]
    if measured:
        on_platform = [t.on_cpu() for t in transfers] if measured.platform == "cpu" else transfers
        estimated = comm_by_axes(on_platform)
        rows = [("axes", "estimate", f"compiled ({measured.platform})", "est/compiled")]
        for axes in sorted(set(estimated) | set(measured.comm), key=lambda a: -measured.comm.get(a, 0.0)):
            got, est = measured.comm.get(axes, 0.0), estimated.get(axes, 0.0)
            rows.append((" ".join(axes) or "-", fmt_bytes(est), fmt_bytes(got), _ratio(est, got)))
        cpu = measured.platform == "cpu"
        note = " (XLA:CPU all-reduces where accelerators reduce-scatter: estimated that way)" if cpu else ""
        lines += [f"  per set of axes, beside the compiled step{note}"]
        lines += ["  " + line.rstrip() for line in format_table(rows)]
    return lines
