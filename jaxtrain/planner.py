"""Plan a run for hardware this machine does not have: per-device memory, collectives per step and a roofline step
time for a model, a mesh layout of any size and a chip, from abstract shapes alone (nothing is allocated or
compiled). Where enough devices exist, `measure` compiles the real train step to check the estimate.

    >>> cfg = apply_overrides(default_config("gpt-1b"), ["mesh=tpu-v5p-256", "batch_size=512", "seq_len=2048"])
    >>> est = estimate(cfg, chip("v5p"), devices=256)                         # doctest: +SKIP
    >>> print(est.format(fits_with(est)))                                      # doctest: +SKIP

How each figure is found (all per device):
- state: the plan's shardings on an abstract mesh (`jaxtrain.mesh.abstract_mesh`), exact.
- gradients: one params-sized tree, sharded like the params; two under gradient accumulation (sum and newest).
- activations: what `jax.vjp` keeps for the backward pass of the loss on one device's rows (one microbatch), so the
  model's own remat policy decides; plus a working set: the same count for the largest loop body or remat region
  (what the backward recomputes, and cotangents of that size) and one layer's weights gathered by FSDP.
- which share of a traced array a device holds: the batch is traced with a prime number of rows larger than any
  other dim, so dims carrying the batch are recognisable and scaled to the device's rows; another dim is split over
  a mesh axis when its size is that of a logical dim the activation rules split over that axis (`mlp` over
  `tensor`). Two logical dims of equal size split differently can be confused: a known limit of reading shapes.
- collectives: the gradient reduced over the batch axes (reduce-scatter where the params are sharded on them,
  all-reduce where replicated); FSDP gathers of the weights (once, and again in the backward pass for stacked
  layers: XLA re-gathers each layer rather than keep them all); an all-reduce of the result of every contraction,
  reduction or gather over a dim split on another axis (tensor parallelism); under a pipeline, the activations at
  stage boundaries forward and their gradients back.
- time: FLOPs of every matmul in the traced step (remat recompute included) / peak; HBM: matmul operands and
  results plus reading and writing the state / HBM bandwidth; each collective / the bandwidth of its links (ICI or
  NVLink inside a slice or host, DCN or InfiniBand across `dcn_axes`). The step lies between the largest of the
  three (communication hidden under compute) and compute-or-memory plus all communication (none hidden).
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

from jaxtrain.chips import CHIPS, Chip, ChipError, chip, chip_for_device_kind
from jaxtrain.config import RunConfig, apply_overrides
from jaxtrain.data import make_dataset
from jaxtrain.mesh import MESH_AXES, MeshLayout, abstract_mesh, parse_layout
from jaxtrain.optim import make_optimizer
from jaxtrain.plan import Plan, device_bytes, fmt_bytes, format_table, make_plan, split_model, tree_device_bytes
from jaxtrain.rules import ShardingRules, is_layer_stack, is_logical_names
from jaxtrain.updates import UpdatePolicy
from models import resolve_model

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
        hosts = f"; across hosts: {' '.join(sorted(self.slow_axes))}" if self.slow_axes else ""
        return (
            f"{self.cfg.model_name}, batch {d.batch_size} x seq {d.seq_len}, grad_accum {t.grad_accum}"
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
    model = split_model(functools.partial(spec.module, cfg.model))
    optimizer, _ = make_optimizer(cfg.optimizer, cfg.train.steps)
    t = cfg.train
    policy = UpdatePolicy(t.sync, t.sync_every, t.staleness, t.outer_lr, t.outer_momentum)
    plan = make_plan(mesh, rules, model, optimizer, None, policy)
    shapes = _batch_shapes(cfg, spec.task, mesh.shape["replica"])
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
        working=step.working_bytes() + _gathered_layer_bytes(plan),
    )
    transfers = _merge([*_weight_transfers(plan, t.grad_accum), *step.transfers()])
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
    from jaxtrain.comm_report import communication_report
    from jaxtrain.run import build

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


def _batch_shapes(cfg: RunConfig, task: str, replicas: int) -> dict[str, jax.ShapeDtypeStruct]:
    dataset = make_dataset(
        cfg.data.source,
        task,
        seed=cfg.train.seed,
        seq_len=cfg.data.seq_len,
        vocab_size=getattr(cfg.model, "vocab_size", 256),
        val_fraction=cfg.data.val_fraction,
        partition=cfg.data.partition,
        replicas=replicas,
    )
    return dataset.shapes(cfg.data.batch_size)


@dataclasses.dataclass(frozen=True)
class _Shares:
    """Which part of a traced array one device holds, read from its shape (see the module docstring)."""

    probe: int  # rows the batch was traced with: a prime larger than any other dim
    rows: int  # the device's real rows
    split: Mapping[str, frozenset[int]]  # mesh axis -> sizes of the logical dims split over it
    mesh_shape: Mapping[str, int]

    def axes(self, shape: Sequence[int]) -> list[str | None]:
        """The mesh axis splitting each dim (None: whole, or a batch dim already cut to the device's rows)."""
        used, out = set(), []
        for size in shape:
            axis = None
            if size % self.probe:
                axis = next((a for a, s in self.split.items() if a not in used and size in s), None)
                if axis is not None and size % self.mesh_shape[axis]:
                    axis = None
            used.add(axis)
            out.append(axis)
        return out

    def sizes(self, shape: Sequence[int]) -> list[float]:
        """Per-device dim sizes."""
        return [
            s // self.probe * self.rows if s % self.probe == 0 else s / (self.mesh_shape[a] if a else 1)
            for s, a in zip(shape, self.axes(shape))
        ]

    def bytes(self, aval: Any) -> float:
        if not hasattr(aval, "shape"):
            return 0.0
        return math.prod(self.sizes(aval.shape)) * np.dtype(aval.dtype).itemsize


class _StepTrace:
    """The loss and its gradient for one microbatch of one device's rows, traced (not compiled) and read for
    residuals, FLOPs, matmul bytes and the collectives of split dims."""

    def __init__(self, plan: Plan, shapes: Mapping[str, jax.ShapeDtypeStruct], accum: int):
        mesh = plan.mesh
        batch_axes = [a for a in plan.rules.batch_axes() if mesh.shape[a] > 1]
        rows = next(iter(shapes.values())).shape[0] // (accum * math.prod(mesh.shape[a] for a in batch_axes))
        dims = _logical_sizes(plan)
        probe = _prime_above(max([rows, *dims.values(), *(d for s in shapes.values() for d in s.shape)]))
        table = {**plan.rules.activations, "layers": plan.rules.params.get("layers", ())}
        split = {
            axis: frozenset(size for name, size in dims.items() if axis in table.get(name, ()))
            for axis in mesh.axis_names
            if mesh.shape[axis] > 1 and axis not in batch_axes
        }
        self.shares = _Shares(probe, rows, split, dict(mesh.shape))
        self.accum = accum
        self.loss = lambda p, b: plan.model.loss_fn(p, b)[0]
        self.args = (
            plan.model.abstract_params,
            {k: jax.ShapeDtypeStruct((probe, *s.shape[1:]), s.dtype) for k, s in shapes.items()},
        )
        self.loss_jaxpr = jax.make_jaxpr(self.loss)(*self.args).jaxpr
        self._read_grad(jax.make_jaxpr(jax.value_and_grad(self.loss))(*self.args).jaxpr)

    def saved_bytes(self) -> float:
        """Residuals of the loss for one microbatch: what its forward pass keeps for the backward pass."""
        return _residual_bytes(self.loss, self.args, self.shares)

    def working_bytes(self) -> float:
        """The residuals of the largest loop body or remat region run as a function of its own, without its remat
        policy: what the backward pass of one layer holds (recomputed under remat) besides the saved residuals."""
        sizes = [0.0]
        for eqn, _ in _walk(self.loss_jaxpr):
            if (eqn.primitive.name == "scan" or eqn.primitive.name in _REMAT) and not _body(eqn).constvars:
                body = _body(eqn)
                args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.invars]
                sizes.append(_residual_bytes(jaxpr_as_fun(ClosedJaxpr(body, [])), args, self.shares))
        return max(sizes)

    def transfers(self) -> list[Transfer]:
        out = [Transfer(axes, "all-reduce", b * self.accum, "activations (split dims)") for axes, b in self._reduce]
        if self.shares.mesh_shape.get("pipeline", 1) > 1:
            out.append(Transfer(("pipeline",), "collective-permute", 2 * self._stage_io(), "stage activations"))
        return out

    def _read_grad(self, jaxpr: Jaxpr) -> None:
        shares, flops, matmul_bytes, reduce = self.shares, 0.0, 0.0, []
        for eqn, trips in _walk(jaxpr):
            name = eqn.primitive.name
            if name not in _COMBINING:
                continue
            ins, out = [v.aval for v in eqn.invars], eqn.outvars[0].aval
            if name == "dot_general":
                (lhs_c, _), _ = eqn.params["dimension_numbers"]
                contracted = math.prod(shares.sizes(ins[0].shape)[d] for d in lhs_c)
                flops += trips * 2 * math.prod(shares.sizes(out.shape)) * contracted
                matmul_bytes += trips * (sum(shares.bytes(a) for a in ins) + shares.bytes(out))
            combined = set(shares.axes(ins[0].shape)) - set(shares.axes(out.shape)) - {None, "pipeline"}
            reduce += [((axis,), trips * _all_reduce(shares.mesh_shape[axis]) * shares.bytes(out)) for axis in combined]
        self.flops, self.matmul_bytes, self._reduce = flops * self.accum, matmul_bytes * self.accum, reduce

    def _stage_io(self) -> float:
        """Bytes of the carry of the longest loop (the layer stack): what crosses a pipeline stage boundary."""
        scans = [eqn for eqn, _ in _walk(self.loss_jaxpr) if eqn.primitive.name == "scan"]
        if not scans:
            return 0.0
        longest = max(scans, key=lambda e: e.params["length"])
        start, count = longest.params["num_consts"], longest.params["num_carry"]
        return sum(self.shares.bytes(v.aval) for v in longest.invars[start : start + count])


def _residual_bytes(fn: Any, args: Sequence[Any], shares: _Shares) -> float:
    """Per-device bytes of what `jax.vjp(fn, *args)` keeps for the backward pass, not counting its inputs."""
    closed = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1])(*args)
    inputs = set(closed.jaxpr.invars)
    kept = {v for v in closed.jaxpr.outvars if not isinstance(v, Literal) and v not in inputs}
    return sum(shares.bytes(v.aval) for v in kept)


def _walk(jaxpr: Jaxpr, trips: int = 1) -> Iterator[tuple[Any, int]]:
    """Every equation, nested ones included, with how often it runs (loop trip counts multiplied)."""
    for eqn in jaxpr.eqns:
        yield eqn, trips
        inner = trips * eqn.params["length"] if eqn.primitive.name == "scan" else trips
        for sub in jaxprs_in_params(eqn.params):
            yield from _walk(sub, inner)


def _body(eqn: Any) -> Jaxpr:
    body = eqn.params["jaxpr"]
    return body.jaxpr if isinstance(body, ClosedJaxpr) else body


def _all_reduce(n: int) -> float:
    """Share of an array each of `n` devices sends in a bandwidth-optimal (ring) all-reduce."""
    return 2 * (n - 1) / n


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


def _param_axes(x: jax.ShapeDtypeStruct) -> set[str]:
    return {a for e in x.sharding.spec if e for a in ((e,) if isinstance(e, str) else e)}


def _weight_transfers(plan: Plan, accum: int) -> list[Transfer]:
    """FSDP gathers (every microbatch) and the gradient reduction over the batch axes (once per step)."""
    mesh, out = plan.mesh, []
    batch_axes = [a for a in MESH_AXES if a in plan.rules.batch_axes() and mesh.shape[a] > 1]
    names = jax.tree.leaves(plan.model.logical_names, is_leaf=is_logical_names)
    for ns, p in zip(names, jax.tree.leaves(plan.abstract_state["params"])):
        shard = device_bytes(p)
        gathered = tuple(a for a in batch_axes if a in _param_axes(p))
        replicated = tuple(a for a in batch_axes if a not in _param_axes(p))
        if gathered:
            n = math.prod(mesh.shape[a] for a in gathered)
            passes = 2 if is_layer_stack(ns) else 1  # forward, and again in the backward pass
            out.append(Transfer(gathered, "all-gather", passes * accum * (n - 1) * shard, "weights (FSDP)"))
            out.append(Transfer(gathered, "reduce-scatter", (n - 1) * shard, "gradients"))
        if replicated:
            n = math.prod(mesh.shape[a] for a in replicated)
            out.append(Transfer(replicated, "all-reduce", _all_reduce(n) * shard, "gradients"))
    return out


def _gathered_layer_bytes(plan: Plan) -> float:
    """Bytes of the weights FSDP gathers at once: one layer of each stacked param, or the other params."""
    mesh, batch_axes = plan.mesh, plan.rules.batch_axes()
    names = jax.tree.leaves(plan.model.logical_names, is_leaf=is_logical_names)
    stacked = other = 0.0
    for ns, p in zip(names, jax.tree.leaves(plan.abstract_state["params"])):
        ways = math.prod(mesh.shape[a] for a in _param_axes(p) if a in batch_axes)
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
    return f"{seconds * 1e3:,.2f} ms"


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
