"""The layout search (`jaxtrain plan --search`): for a model, a batch, a chip and a chip count, the meshes, remat
policies, gradient accumulations and pipeline microbatches that fit, fastest first by the planner's estimate, the
best few compiled for the real target to confirm them, and the chosen one written as a mesh file and a run config.

1. Meshes (`enumerate_meshes`): every split of the chips over the mesh axes that apply to the model, each axis
   dividing every dim it splits. An axis applies where the rules give it a weight dim (`fsdp`: embed; `tensor`:
   heads, kv heads, mlp, vocab; `pipeline`: layers; `expert`: the experts, MoE models only), and `data` and, for a
   language model, `context` (the sequence). The batch axes may not split the batch more ways than it has rows.
   Where the chips span hosts (GPUs, 8 a host), one axis crosses them: the first, in mesh order, whose size they
   divide (`data` before `pipeline` before `fsdp`).
2. The batch: a mesh is kept where its batch axes (times the pipeline's microbatches: one per stage, two or four)
   divide the batch's rows.
3. Pruned before estimating, cheaply: a mesh whose weights, optimizer state and gradients alone exceed the chip's
   usable memory (remat and accumulation shrink neither), and a mesh with a `context` axis whose factor the batch
   axes could take instead (the same tokens per device, without the key/value traffic: context parallelism is for
   batches too small to split over the devices).
4. Each mesh is estimated as it is: no remat, no accumulation (`jaxtrain.planner.estimate`: one trace of the step,
   a second or more each: most of the search's time). Meshes without a pipeline first; then the pipelined ones,
   least bubble first, until the bubble alone (ticks over microbatches, from the schedule's tick table) times the
   least compute of a mesh without one exceeds the `keep`-th fastest fit so far.
5. The meshes that do not fit, fastest first, try what trades step time for memory (`savers`: the model's remat
   policies, then gradient accumulation; offloading comes here when it lands), each combination that lies above no
   combination that already fits, so each mesh keeps its least savings that fit. Saving memory only adds time, so a
   mesh whose time as it is exceeds the `keep`-th fastest fit found so far is not tried. (Nearly: the estimate can
   give a remat policy a little less HBM traffic than none; the bounds take no margin for it.)
6. What fits is ranked by estimated step time, communication not hidden (as `fits_with` ranks its changes).
7. `check_best` compiles the best in rank order for the target (`--aot-topology`, or this process's devices) until
   the compiler confirms one fits: that one is chosen.

    >>> cfg = apply_overrides(default_config("llama-1b"), ["batch_size=256", "seq_len=2048"])   # doctest: +SKIP
    >>> found = search(cfg, chip("v5p"), 64)                                                     # doctest: +SKIP
    >>> print(format_search(found))                                                              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np
import tomli_w

from jaxtrain.analysis.chips import Chip, chip_for_device_kind
from jaxtrain.analysis.chips import chip as named_chip
from jaxtrain.analysis.flops import peak_flops
from jaxtrain.aot.targets import Target, TargetError
from jaxtrain.errors import UserInputError
from jaxtrain.formatting import fmt_bytes, format_table
from jaxtrain.parallel.schedules import build_schedule
from jaxtrain.placement.place import place_model
from jaxtrain.planner.estimate import USABLE_HBM, Estimate, estimate, platform_of
from jaxtrain.planner.hardware import target_for
from jaxtrain.planner.measure import Measured
from jaxtrain.planner.report import format_estimate, format_ms, local_check, target_check
from jaxtrain.registry import SEQUENCE_TASKS
from jaxtrain.run_config import RunConfig, apply_overrides, config_table, default_config
from jaxtrain.settings import accepts_of
from jaxtrain.sharding.mesh import MESH_AXES, MeshLayout, abstract_mesh
from jaxtrain.sharding.rules import is_logical_names
from jaxtrain.training.optim import make_optimizer
from jaxtrain.training.setup import with_data_vocab

# The axes a search splits the chips over: all but `replica`, which is data parallelism across slow links.
SEARCH_AXES = tuple(a for a in MESH_AXES if a != "replica")
GPUS_PER_HOST = 8
PIPELINE_MICROBATCHES = (1, 2, 4)  # per stage


class NoMeshError(UserInputError):
    """A chip count that no mesh of the model fills."""


class BatchSplitError(UserInputError):
    """A batch that no mesh of the chip count splits evenly."""


class FitsNowhereError(UserInputError):
    """A model and batch that fit no layout of the chips: says by how much, and what would."""


@dataclasses.dataclass(frozen=True)
class Splits:
    """What the mesh axes split, for one model and batch: each weight dim by its rule, the batch's rows, the sequence;
    and what the state weighs, for the cheap bound on its bytes per device."""

    model: str
    dims: tuple[tuple[tuple[str, ...], int, str], ...]  # (axes splitting it together, its size, its logical name)
    batch_axes: tuple[str, ...]
    rows: int
    seq_axes: tuple[str, ...]
    seq_len: int
    leaves: tuple[tuple[float, tuple[tuple[str, ...], ...]], ...]  # per param: bytes, the axes splitting each dim
    state_per_param_byte: float  # params, optimizer state and gradients, per byte of params

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes that apply: those splitting a weight, `data` where it splits the batch, and `context` where
        it splits the sequence, in mesh order."""
        named = {a for axes, _, _ in self.dims for a in axes} | set(self.seq_axes)
        named |= {"data"} & set(self.batch_axes)
        return tuple(a for a in SEARCH_AXES if a in named)

    def ways(self, sizes: Mapping[str, int], axes: Sequence[str]) -> int:
        return math.prod(sizes.get(a, 1) for a in axes)

    def valid(self, sizes: Mapping[str, int]) -> bool:
        """Every axis divides what it splits; the batch axes split the batch at most as many ways as it has rows."""
        return (
            all(size % self.ways(sizes, axes) == 0 for axes, size, _ in self.dims)
            and self.seq_len % self.ways(sizes, self.seq_axes) == 0
            and self.ways(sizes, self.batch_axes) <= self.rows
        )

    def state_bytes(self, sizes: Mapping[str, int]) -> float:
        """A lower bound on the bytes of params, optimizer state and gradients per device (untiled)."""
        held = sum(b / math.prod(self.ways(sizes, axes) for axes in dims) for b, dims in self.leaves)
        return held * self.state_per_param_byte

    def describe(self) -> str:
        """'batch 8 rows, embed 64, heads 4, layers 2, mlp 256, vocab 256, seq 32': what the axes that apply split."""
        named = sorted({(name, size) for axes, size, name in self.dims if set(axes) & set(self.axes)})
        seq = [f"seq {self.seq_len}"] if self.seq_axes else []
        return ", ".join([f"batch {self.rows} rows", *(f"{n} {s}" for n, s in named), *seq])


def model_splits(cfg: RunConfig) -> Splits:
    """The `Splits` of `cfg`'s model and batch, from its abstract params (nothing is allocated)."""
    layout = MeshLayout({})
    placed = place_model(cfg.model_name, cfg.model, layout, cfg.rules, mesh=abstract_mesh(layout, 1))
    spec, parts, rules = placed.spec, placed.model, placed.rules
    params = jax.tree.leaves(parts.abstract_params)
    names = jax.tree.leaves(parts.logical_names, is_leaf=is_logical_names)
    dims, leaves = set(), []
    for param, logical in zip(params, names):
        axes = [tuple(a for a in rules.params.get(n, ()) if a in SEARCH_AXES) if n else () for n in logical]
        dims |= {(a, size, n) for a, size, n in zip(axes, param.shape, logical) if a}
        leaves.append((math.prod(param.shape) * np.dtype(param.dtype).itemsize, tuple(axes)))
    optimizer, _ = make_optimizer(cfg.optimizer, cfg.train.steps, parts.logical_names)
    opt_state = jax.eval_shape(optimizer.init, parts.abstract_params)
    param_bytes = sum(b for b, _ in leaves)
    opt_bytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(opt_state))
    lm = spec.task in SEQUENCE_TASKS and hasattr(cfg.model, "context_parallel")
    return Splits(
        model=cfg.model_name,
        dims=tuple(sorted(dims)),
        batch_axes=tuple(a for a in rules.batch_axes() if a in SEARCH_AXES),
        rows=cfg.data.batch_size,
        seq_axes=tuple(rules.activations.get("seq", ())) if lm else (),
        seq_len=cfg.data.seq_len,
        leaves=tuple(leaves),
        state_per_param_byte=2 + opt_bytes / param_bytes,  # the params, their gradients, the optimizer state
    )


def enumerate_meshes(splits: Splits, devices: int, hosts: int = 1) -> list[MeshLayout]:
    """Every mesh of `devices` chips valid for `splits` (`Splits.valid`), in `hosts` hosts or slices: one axis,
    the first in mesh order whose size `hosts` divides, crosses them."""
    meshes = []
    for sizes in _factorisations(devices, splits.axes):
        if splits.valid(sizes) and (layout := _layout(sizes, hosts)) is not None:
            meshes.append(layout)
    return meshes


def _factorisations(n: int, axes: Sequence[str]) -> Iterator[dict[str, int]]:
    """Every way of writing `n` as a product of one size per axis."""
    if not axes:
        yield from [{}] if n == 1 else []
        return
    for size in (d for d in range(1, n + 1) if n % d == 0):
        for rest in _factorisations(n // size, axes[1:]):
            yield {axes[0]: size, **rest}


def _layout(sizes: Mapping[str, int], hosts: int) -> MeshLayout | None:
    live = {a: sizes[a] for a in MESH_AXES if sizes.get(a, 1) > 1}
    name = ",".join(f"{a}={n}" for a, n in live.items()) or "data=1"
    if hosts == 1:
        return MeshLayout(axes=live, name=name)
    slow = next((a for a in live if live[a] % hosts == 0), None)
    if slow is None:
        return None
    axes = {a: n // hosts if a == slow else n for a, n in live.items()}
    return MeshLayout(axes={a: n for a, n in axes.items() if n > 1}, dcn_axes={slow: hosts}, name=name)


def sizes_of(layout: MeshLayout) -> dict[str, int]:
    """Each axis's size, all hosts together."""
    return {a: layout.axes.get(a, 1) * layout.dcn_axes.get(a, 1) for a in MESH_AXES}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout the search weighs: a mesh and the config overrides that go with it (remat, grad_accum, pipeline
    microbatches)."""

    mesh: MeshLayout
    overrides: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        return self.mesh.name, str(sorted(self.mesh.dcn_axes.items())), self.overrides


@dataclasses.dataclass
class Found:
    """A search's outcome: what fits, fastest first, with what was dropped on the way, and (after `check_best`)
    the compiler's figures and the choice."""

    cfg: RunConfig
    chip: Chip
    devices: int
    hosts: int
    ranked: list[tuple[Candidate, Estimate]]
    counts: dict[str, int]
    seconds: float
    compiler: str
    measured: dict[int, Measured | str] = dataclasses.field(default_factory=dict)  # rank -> figures or refusal
    check_lines: list[str] = dataclasses.field(default_factory=list)  # the chosen one's compiled figures
    chosen: int | None = None  # rank in `ranked`

    def config(self, rank: int) -> RunConfig:
        """The run config of the `rank`-th layout, its mesh inline (a mesh across hosts needs a file: `write_mesh`)."""
        candidate = self.ranked[rank][0]
        return configured(self.cfg, candidate)


def configured(cfg: RunConfig, candidate: Candidate, mesh: str | None = None) -> RunConfig:
    """`cfg` with the candidate's overrides and its mesh: `mesh` (a file) where given, else the inline spec."""
    return apply_overrides(cfg, [*candidate.overrides, f"mesh={mesh or candidate.mesh.name}"])


def search(
    cfg: RunConfig,
    chip: Chip,
    devices: int,
    hosts: int = 1,
    compiler: str | None = None,
    keep: int = 10,
    log: Callable[[str], None] = lambda _: None,
) -> Found:
    """The layouts of `cfg`'s model and batch on `devices` chips (in `hosts` hosts or slices) that fit, fastest
    first (see the module docstring); the `keep` fastest are those of every layout under its assumptions (saving
    memory and a pipeline's bubble only add time). Raises NoMeshError, BatchSplitError or FitsNowhereError (one line
    each) when nothing fits."""
    start, cfg = time.perf_counter(), with_data_vocab(cfg)
    splits = model_splits(cfg)
    meshes = enumerate_meshes(splits, devices, hosts)
    if not meshes:
        raise NoMeshError(_no_mesh(splits, devices, hosts))
    bases = _bases(cfg, splits, meshes)
    if not bases:
        raise BatchSplitError(_no_batch_split(splits, meshes, devices))
    counts = {"meshes": len(meshes), "layouts": len(bases)}
    small = [c for c in bases if splits.state_bytes(sizes_of(c.mesh)) <= USABLE_HBM * chip.hbm_bytes]
    counts["state alone too big"] = len(bases) - len(small)
    if not small:
        raise FitsNowhereError(_state_too_big(splits, bases, chip, devices))
    lean = [c for c in small if not _context_dominated(splits, sizes_of(c.mesh))]
    counts["context where the batch could split"] = len(small) - len(lean)
    weigh = _Weigher(cfg, chip, devices, compiler or platform_of(chip), log)
    fits, rest = _estimate_bases(weigh, lean, keep, counts)
    counts[f"too big as they are and no faster than the {keep} fastest fits"] = _save_memory(
        weigh, splits, rest, fits, keep
    )
    counts.update(estimates=weigh.count, refused=len(weigh.refused), fit=len(fits))
    if not fits:
        raise FitsNowhereError(_fits_nowhere(weigh, splits))
    ranked = sorted(fits, key=lambda f: f[1].step_s[1])
    return Found(cfg, chip, devices, hosts, ranked, counts, time.perf_counter() - start, weigh.compiler)


def _bases(cfg: RunConfig, splits: Splits, meshes: Sequence[MeshLayout]) -> list[Candidate]:
    """Each mesh as it is (no remat, no accumulation), a pipelined one with 1, 2 and 4 microbatches per stage, where
    the batch axes (times the microbatches) divide the rows."""
    remat = [f"remat={_remats(cfg)[0]}"] if _remats(cfg) else []
    bases = []
    for mesh in meshes:
        for micro in _microbatch_options(splits, mesh):
            pipelined = [f"pipeline.microbatches={micro}"] if sizes_of(mesh)["pipeline"] > 1 else []
            bases.append(Candidate(mesh, (*remat, "grad_accum=1", *pipelined)))
    return bases


def _microbatch_options(splits: Splits, mesh: MeshLayout) -> list[int]:
    """The pipeline microbatches (1 without a pipeline) with which `mesh`'s batch axes divide the rows."""
    sizes = sizes_of(mesh)
    stages, ways = sizes["pipeline"], splits.ways(sizes, splits.batch_axes)
    options = [stages * m for m in PIPELINE_MICROBATCHES] if stages > 1 else [1]
    return [m for m in options if splits.rows % (ways * m) == 0]


def _remats(cfg: RunConfig) -> list[str]:
    """The model's remat policies, least recompute first: none, the named ones, full."""
    field = next((f for f in dataclasses.fields(cfg.model) if f.name == "remat"), None)
    if field is None:
        return []
    choices = accepts_of(field).choices or (cfg.model.remat,)
    return sorted(choices, key=lambda p: {"none": 0, "full": 2}.get(p, 1))


def _context_dominated(splits: Splits, sizes: Mapping[str, int]) -> bool:
    """A context axis whose factor the batch could take instead (see the module docstring)."""
    context = splits.ways(sizes, splits.seq_axes)
    return context > 1 and splits.rows % (splits.ways(sizes, splits.batch_axes) * context) == 0


class _Weigher:
    """Estimates candidates once each, counting them, keeping the planner's refusals, reporting progress."""

    def __init__(self, cfg: RunConfig, chip: Chip, devices: int, compiler: str, log: Callable[[str], None]):
        self.cfg, self.chip, self.devices, self.compiler, self.log = cfg, chip, devices, compiler, log
        self.count, self.start = 0, time.perf_counter()
        self.done: dict[tuple, Estimate | None] = {}
        self.refused: dict[tuple, str] = {}

    def __call__(self, candidate: Candidate) -> Estimate | None:
        """The estimate of `candidate`, or None where the planner refuses it (its reason kept)."""
        if candidate.key not in self.done:
            self.count += 1
            try:
                cfg = apply_overrides(self.cfg, candidate.overrides)
                self.done[candidate.key] = estimate(cfg, self.chip, self.devices, candidate.mesh, self.compiler)
            except UserInputError as err:
                self.done[candidate.key], self.refused[candidate.key] = None, str(err)
            if self.count % 10 == 0:
                self.log(f"search: {self.count} estimates in {time.perf_counter() - self.start:.0f} s")
        return self.done[candidate.key]

    @property
    def usable(self) -> float:
        return USABLE_HBM * self.chip.hbm_bytes


def _estimate_bases(weigh: _Weigher, bases: Sequence[Candidate], keep: int, counts: dict[str, int]) -> tuple:
    """(those that fit, those that do not), each a list of (candidate, estimate); refused ones in neither. Meshes
    without a pipeline first; then the pipelined ones, least bubble first, while the compute of the fastest mesh
    without one, times the bubble (`_bubble`), could still beat the `keep`-th fastest fit."""
    fits, rest = [], []
    flat = [c for c in bases if sizes_of(c.mesh)["pipeline"] == 1]
    piped = sorted(((_bubble(weigh.cfg, c), c) for c in bases if c not in flat), key=lambda bc: bc[0])
    for candidate in flat:
        est = weigh(candidate)
        if est is not None:
            (fits if est.fits else rest).append((candidate, est))
    floor = min((e.compute_s for _, e in fits + rest), default=0.0)
    for n, (bubble, candidate) in enumerate(piped):
        if floor * bubble >= _kth(fits, keep):
            counts["pipelines whose bubble alone is slower"] = len(piped) - n
            break
        est = weigh(candidate)
        if est is not None:
            (fits if est.fits else rest).append((candidate, est))
    return fits, rest


def _bubble(cfg: RunConfig, candidate: Candidate) -> float:
    """How much longer a pipeline's ticks take than its microbatches' work on one device: the ticks with a forward
    (or backward, the fewer) over the microbatches times the chunks per device; inf for a schedule that refuses."""
    p, v = sizes_of(candidate.mesh)["pipeline"], cfg.pipeline.virtual_stages
    m = _microbatches(candidate)
    try:
        tables = build_schedule(cfg.pipeline.schedule, p, v, m).tables
    except UserInputError:
        return math.inf
    ticks = min(int((tables[k] >= 0).any(axis=1).sum()) for k in ("fwd_v", "bwd_v"))
    return ticks / (m * v)


def _kth(fits: Sequence[tuple[Candidate, Estimate]], keep: int) -> float:
    """The `keep`-th fastest step among `fits`, inf while there are fewer."""
    times = sorted(e.step_s[1] for _, e in fits)
    return times[keep - 1] if len(times) >= keep else math.inf


def savers(cfg: RunConfig, splits: Splits, candidate: Candidate) -> list[list[tuple[str, ...]]]:
    """What trades step time for memory on `candidate`'s mesh, each a list of alternatives from the least saving
    (the candidate as it is) to the most, as config overrides: the model's remat policies, gradient accumulation by
    each divisor of the rows its batch axes and microbatches leave. Offloading (a later issue) is one more list."""
    sizes, found = sizes_of(candidate.mesh), []
    remats = _remats(cfg)
    if len(remats) > 1:
        found.append([(f"remat={r}",) for r in remats])
    pieces = splits.rows // (splits.ways(sizes, splits.batch_axes) * _microbatches(candidate))
    found.append([(f"grad_accum={a}",) for a in range(1, pieces + 1) if pieces % a == 0])
    return found


def _save_memory(weigh: _Weigher, splits: Splits, rest: list, fits: list, keep: int) -> int:
    """For each mesh that does not fit as it is, fastest first, its least savings that fit (added to `fits`), while
    it is faster as it is than the `keep`-th fastest fit (savings only add time). Returns how many were left."""
    ordered = sorted(rest, key=lambda r: r[1].step_s[1])
    for n, (candidate, est) in enumerate(ordered):
        if est.step_s[1] >= _kth(fits, keep):
            return len(ordered) - n
        fits.extend(_least_savings(weigh, splits, candidate))
    return 0


def _least_savings(weigh: _Weigher, splits: Splits, candidate: Candidate) -> list[tuple[Candidate, Estimate]]:
    """The combinations of savings on `candidate`'s mesh that fit and lie above none that fits, each estimated; no
    more once the state alone (the arguments and one gradient, which no saving shrinks) exceeds the usable memory."""
    options = savers(weigh.cfg, splits, candidate)
    fit_combos, found = [], []
    for combo in sorted(itertools.product(*(range(len(o)) for o in options)), key=sum):
        if not any(combo) or any(all(f <= c for f, c in zip(fit, combo)) for fit in fit_combos):
            continue
        changes = [o for option, i in zip(options, combo) for o in option[i]]
        tried = dataclasses.replace(candidate, overrides=_merged(candidate.overrides, changes))
        est = weigh(tried)
        if est is None:
            continue
        if est.fits:
            fit_combos.append(combo)
            found.append((tried, est))
        elif est.memory.arguments + est.memory.params > weigh.usable:
            break
    return found


def _merged(overrides: Sequence[str], changes: Sequence[str]) -> tuple[str, ...]:
    """`overrides` with each key `changes` sets replaced in place; keys they lack appended."""
    new = {c.split("=")[0]: c for c in changes}
    kept = [new.pop(o.split("=")[0], o) for o in overrides]
    return (*kept, *new.values())


def _no_mesh(splits: Splits, devices: int, hosts: int) -> str:
    """The one-line error for a chip count no mesh fills, with the nearest counts that some mesh fills."""
    near = [n for n in _near(devices) if hosts == 1 and _splits_batch(splits, enumerate_meshes(splits, n))]
    below = max((n for n in near if n < devices), default=None)
    above = min((n for n in near if n > devices), default=None)
    counts = " or ".join(str(n) for n in (below, above) if n)
    across = f" in {hosts} hosts (one axis across them)" if hosts > 1 else ""
    return (
        f"no mesh of {splits.model} fills {devices} chips{across}: every mesh axis must divide what it splits "
        f"({splits.describe()}), and no split of {devices} does{f'; {counts} chips would' if counts else ''}."
    )


def _splits_batch(splits: Splits, meshes: Sequence[MeshLayout]) -> bool:
    return any(_microbatch_options(splits, m) for m in meshes)


def _near(devices: int, span: int = 64) -> list[int]:
    return [n for n in range(max(1, devices - span), devices + span + 1) if n != devices]


def _no_batch_split(splits: Splits, meshes: Sequence[MeshLayout], devices: int) -> str:
    """The one-line error for a batch no mesh divides, with the nearest batch sizes that some mesh divides."""
    ways = sorted({_batch_split(splits, sizes_of(m)) for m in meshes})
    batch = min(-(-splits.rows // w) * w for w in ways)
    return (
        f"batch size {splits.rows} splits evenly over no mesh of {splits.model} on {devices} chips ({len(meshes)} "
        f"enumerated): their batch axes (times one pipeline microbatch per stage) split it "
        f"{', '.join(map(str, ways))} ways; "
        f"use a batch size divisible by one of them, e.g. {batch}."
    )


def _batch_split(splits: Splits, sizes: Mapping[str, int]) -> int:
    """The fewest ways a mesh splits the batch's rows: its batch axes, times one microbatch per pipeline stage."""
    return splits.ways(sizes, splits.batch_axes) * sizes["pipeline"]


def _state_too_big(splits: Splits, bases: Sequence[Candidate], chip: Chip, devices: int) -> str:
    """The one-line error for a model whose state alone fits no mesh: by how much, and what would fit."""
    least, mesh = min((splits.state_bytes(sizes_of(c.mesh)), c.mesh.name) for c in bases)
    usable = USABLE_HBM * chip.hbm_bytes
    opt = least * (splits.state_per_param_byte - 2) / splits.state_per_param_byte
    times = math.ceil(least / usable)
    return (
        f"{splits.model} fits no layout of {devices} x {chip.name}: its params, optimizer state and gradients alone "
        f"take at least {fmt_bytes(least)} per device on its best split ({mesh}), {fmt_bytes(least - usable)} over the "
        f"{_usable(chip)}; it needs more chips (at least {times}x: {times * devices}) or offloading the optimizer "
        f"state ({fmt_bytes(opt)} of it per device; not searched yet); a smaller batch does not shrink them."
    )


def _usable(spec: Chip) -> str:
    share = f"{USABLE_HBM:.0%} of {spec.name}'s {fmt_bytes(spec.hbm_bytes)}"
    return f"{fmt_bytes(USABLE_HBM * spec.hbm_bytes)} usable ({share})"


def _fits_nowhere(weigh: _Weigher, splits: Splits) -> str:
    """The one-line error for a model and batch that fit no estimated layout: the smallest peak, by how much it is
    over, and what would fit (more chips, offloading the optimizer state, a smaller batch)."""
    estimated = [(e, k) for k, e in weigh.done.items() if e is not None]
    if not estimated:
        reason = next(iter(weigh.refused.values()), "")
        return f"the planner refused every layout of {splits.model} on {weigh.devices} chips; the first: {reason}"
    est, key = min(estimated, key=lambda ek: ek[0].memory.peak)
    candidate = Candidate(est.layout, key[2])
    over, times = est.memory.peak - weigh.usable, math.ceil(est.memory.peak / weigh.usable)
    offload = est.memory.peak - est.memory.opt_state <= weigh.usable
    return (
        f"{splits.model}, batch {splits.rows}, fits no layout of {weigh.devices} x {weigh.chip.name}: the smallest "
        f"peak, {fmt_bytes(est.memory.peak)} on {_label(candidate)}, is {fmt_bytes(over)} over the "
        f"{_usable(weigh.chip)}; what would fit: more chips (about {times}x: {times * weigh.devices}), offloading the "
        f"optimizer state ({fmt_bytes(est.memory.opt_state)} per device there; {'enough' if offload else 'not enough'}"
        f" alone; not searched yet), {_smaller_batch(weigh, splits, candidate)}."
    )


def _smaller_batch(weigh: _Weigher, splits: Splits, candidate: Candidate) -> str:
    """'a smaller batch (batch 64 fits there ...)', or that none does: the batch halved on `candidate`'s mesh and
    settings while its batch axes and microbatches split it, without accumulation (a smaller batch replaces it)."""
    split = splits.ways(sizes_of(candidate.mesh), splits.batch_axes) * _microbatches(candidate)
    rows = splits.rows
    while rows % 2 == 0 and (rows // 2) % split == 0:
        rows //= 2
        tried = Candidate(candidate.mesh, _merged(candidate.overrides, [f"batch_size={rows}", "grad_accum=1"]))
        est = weigh(tried)
        if est is not None and est.fits:
            return f"a smaller batch (batch {rows} fits there: peak {fmt_bytes(est.memory.peak)})"
    if rows == splits.rows:
        return f"a smaller batch (on another mesh: this one splits the batch {split} ways, and it halves no further)"
    return f"a smaller batch (none down to batch {rows} fits there: shorter sequences or more chips would)"


def _microbatches(candidate: Candidate) -> int:
    key = "pipeline.microbatches="
    return next((int(o.removeprefix(key)) for o in candidate.overrides if o.startswith(key)), 1)


def _label(candidate: Candidate) -> str:
    """'fsdp=16,tensor=4 (remat=full, grad_accum=2)'."""
    return f"{candidate.mesh.name} ({', '.join(_settings(candidate))})"


def _settings(candidate: Candidate) -> list[str]:
    return [o.removeprefix("pipeline.") for o in candidate.overrides]


# ---- the check, the table, the files ----


def check_best(
    found: Found, check: Callable[[RunConfig, Estimate], tuple[Measured | None, list[str]]], limit: int
) -> None:
    """Compile the best layouts in rank order with `check` (`jaxtrain.planner.report`'s `target_check` or
    `local_check`: the figures and the lines they print) until one compiles and fits, at most `limit`; that one is
    chosen. None chosen where none of them does."""
    usable = USABLE_HBM * found.chip.hbm_bytes
    with tempfile.TemporaryDirectory(prefix="jaxtrain-search-") as scratch:
        for rank, (candidate, est) in enumerate(found.ranked[:limit]):
            mesh = write_mesh(Path(scratch) / f"{rank}.toml", found, rank) if candidate.mesh.dcn_axes else None
            measured, lines = check(configured(found.cfg, candidate, mesh and str(mesh)), est)
            found.measured[rank] = measured if measured is not None else "refused"
            if measured is not None and measured.peak <= usable:
                found.chosen, found.check_lines = rank, lines
                return
    found.chosen = None


_TALLIES = ("meshes", "layouts", "estimates", "refused", "fit")  # the counts that are not reasons to drop a layout


def format_search(found: Found, rows: int = 10) -> str:
    """The summary, the ranked table of the `rows` fastest fits (with the compiled peak of those compiled) and the
    choice."""
    c, d = found.counts, found.cfg.data
    dropped = [f"{n} {why}" for why, n in c.items() if why not in _TALLIES and n]
    refused = f"; {c['refused']} refused by the planner" if c["refused"] else ""
    hosts = f" in {found.hosts} hosts" if found.hosts > 1 else ""
    lines = [
        f"search: {found.cfg.model_name}, batch {d.batch_size} x seq {d.seq_len} on {found.devices} x "
        f"{found.chip.name}{hosts}: {c['meshes']} meshes, {c['layouts']} with pipeline microbatches"
        f"{f' (not estimated: {"; ".join(dropped)})' if dropped else ''}; {c['estimates']} estimates in "
        f"{found.seconds:.0f} s; {c['fit']} fit{refused}",
        *format_table(_table(found, rows)),
    ]
    if len(found.ranked) > rows:
        lines.append(f"  ... {len(found.ranked) - rows} slower layouts that fit")
    return "\n".join(line.rstrip() for line in lines)


def _table(found: Found, rows: int) -> list[tuple[str, ...]]:
    head = ("rank", "mesh", "across hosts", "settings", "peak", "step (comm hidden .. not)", "MFU", "compiled peak")
    table = [head]
    for rank, (candidate, est) in enumerate(found.ranked[:rows]):
        measured = found.measured.get(rank)
        compiled = fmt_bytes(measured.peak) if isinstance(measured, Measured) else measured or ""
        mark = " <- chosen" if rank == found.chosen else ""
        hidden, exposed = est.step_s
        table.append(
            (
                str(rank + 1),
                candidate.mesh.name,
                ",".join(f"{a}={n}" for a, n in candidate.mesh.dcn_axes.items()),
                " ".join(_settings(candidate)),
                fmt_bytes(est.memory.peak),
                f"{format_ms(hidden)} .. {format_ms(exposed)}",
                f"{est.mfu[1]:.0%}",
                compiled + mark,
            )
        )
    return [r if found.hosts > 1 else r[:2] + r[3:] for r in table]


def refuse_existing(*paths: str | Path | None) -> None:
    """A UserInputError for the first of `paths` that exists: the search never overwrites a file."""
    for path in filter(None, paths):
        if Path(path).exists():
            raise UserInputError(_EXISTS.format(path=path))


_EXISTS = "{path} exists: the search does not overwrite files; remove it or name another path."


def write_mesh(path: str | Path, found: Found, rank: int) -> Path:
    """The `rank`-th layout's mesh as a TOML mesh file (`jaxtrain.sharding.mesh.load_layout_file`'s format) at
    `path`, which must not exist."""
    candidate, est = found.ranked[rank]
    d = found.cfg.data
    table: dict = {
        "description": f"Found by jaxtrain plan --search for {found.cfg.model_name}, batch {d.batch_size} x seq "
        f"{d.seq_len} on {found.devices} x {found.chip.name}: estimated step {format_ms(est.step_s[1])}, peak "
        f"{fmt_bytes(est.memory.peak)} per device, with {', '.join(_settings(candidate))}.",
        "axes": dict(candidate.mesh.axes),
    }
    if candidate.mesh.dcn_axes:
        table["dcn_axes"] = dict(candidate.mesh.dcn_axes)
    return _write_new(path, tomli_w.dumps(table))


def write_run_config(path: str | Path, found: Found, rank: int, mesh: str | Path | None) -> Path:
    """The `rank`-th layout's run config at `path` (which must not exist), as `jaxtrain train --config` reads it:
    the model, the keys that differ from its preset and the mesh, `mesh` (a mesh file) where given, else inline."""
    candidate = found.ranked[rank][0]
    if mesh is None and candidate.mesh.dcn_axes:
        raise UserInputError(
            f"the chosen mesh {candidate.mesh.name} crosses hosts ({candidate.mesh.dcn_axes}), which an inline mesh "
            "cannot say: give --write-mesh too."
        )
    cfg = configured(found.cfg, candidate, mesh and str(mesh))
    table, preset = config_table(cfg), config_table(default_config(cfg.model_name))
    changed: dict = {"model_name": cfg.model_name, "mesh": cfg.mesh}
    for section, values in table.items():
        if isinstance(values, dict):
            diff = {k: v for k, v in values.items() if preset.get(section, {}).get(k) != v}
            changed.update({section: diff} if diff else {})
    header = (
        f"# Found by jaxtrain plan --search ({found.devices} x {found.chip.name}). Train with it:\n"
        f"#   jaxtrain train --config {path} [key=value ...]\n"
    )
    return _write_new(path, header + tomli_w.dumps(changed))


def _write_new(path: str | Path, text: str) -> Path:
    """`text` at `path`, which must not exist: written whole beside it, then linked in, which is atomic and refuses
    an existing path, so a reader (or an interrupted write) never leaves part of a file."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.link(temporary, path)
    except FileExistsError:
        raise UserInputError(_EXISTS.format(path=path)) from None
    except OSError as err:
        raise UserInputError(f"cannot write {path}: {err.strerror or err}.") from None
    finally:
        temporary.unlink(missing_ok=True)
    return path


# ---- the chips ----


def hosts_for(chip: Chip, devices: int) -> int:
    """Hosts the chips span: GPUs come `GPUS_PER_HOST` a host; a TPU count is one slice; simulated CPU devices one
    machine."""
    if chip.device_kinds != ("cpu",) and platform_of(chip) == "gpu" and devices > GPUS_PER_HOST:
        if devices % GPUS_PER_HOST:
            raise NoMeshError(
                f"{devices} {chip.name} GPUs do not fill hosts of {GPUS_PER_HOST}: plan for up to {GPUS_PER_HOST} or "
                f"a multiple of {GPUS_PER_HOST}."
            )
        return devices // GPUS_PER_HOST
    return 1


def simulated_chip(devices: int, dtype: str) -> Chip:
    """This machine's CPU as the chip of `devices` simulated devices, which share it: each gets that share of the
    measured matmul peak in `dtype` (`jaxtrain.analysis.flops.peak_flops`), of half the memory available now (the
    process itself needs the rest: XLA's compiles, its runtime; a step planned at 90% of all of it was killed for
    memory here) and of the bandwidth of a measured copy, which stands for its memory bandwidth and its links (a
    collective between simulated devices is a copy in the same memory)."""
    peak, _ = peak_flops(jax.devices("cpu")[:1], dtype)
    bandwidth = _copy_bandwidth()
    share = [peak, _available_memory() / 2, *[bandwidth] * 3]
    return Chip("cpu", ("cpu",), *(x / devices for x in share))


def _available_memory() -> float:
    """Bytes of memory available to a new process now (MemAvailable), else all of it."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@functools.cache
def _copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes per second a copy of `nbytes` reads and writes, the best of `repeats`."""
    source, target = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


# ---- what `jaxtrain plan --search` prints ----


def search_report(
    cfg: RunConfig,
    chip_name: str | None,
    devices: int | None,
    check: bool = True,
    aot_topology: str | None = None,
    compile_best: int = 3,
    mesh_path: str | None = None,
    config_path: str | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> str:
    """What `jaxtrain plan --search` prints: the search's table for `devices` chips called `chip_name` (default:
    this process's devices; simulated CPU devices plan as `simulated_chip`), or for the `aot_topology` target, whose
    compiler then compiles the best in rank order until one fits (at most `compile_best`; with enough devices in this
    process they compile here); the chosen layout's plan; and its mesh file and run config written to `mesh_path` and
    `config_path` (neither may exist). Raises FitsNowhereError where none of the compiled ones fits."""
    refuse_existing(mesh_path, config_path)
    target = _target(aot_topology, chip_name, devices, check)  # before anything else starts JAX
    spec, devices = (target.chip, len(target.devices)) if target else _chip_and_count(cfg, chip_name, devices)
    hosts = target.slices if target else hosts_for(spec, devices)
    found = search(cfg, spec, devices, hosts, "cpu" if spec.device_kinds == ("cpu",) else None, log=log)
    if not check or (target is None and devices > jax.device_count()):
        found.chosen, found.check_lines = 0, [_not_compiled(found, check)]
    else:
        check_best(found, (lambda c, e: target_check(c, e, target)) if target else _local_check_on, compile_best)
    table = format_search(found)
    if found.chosen is None:
        log(table)
        raise FitsNowhereError(
            f"the compiler confirmed none of the {min(compile_best, len(found.ranked))} best layouts fits (table "
            "above): more chips, or --compile-best N to compile more of them."
        )
    candidate, est = found.ranked[found.chosen]
    measured = found.measured.get(found.chosen)
    lines = [table, f"chosen: rank {found.chosen + 1}, {_label(candidate)}"]
    lines += [format_estimate(est, (), measured if isinstance(measured, Measured) else None), *found.check_lines]
    return "\n".join([*lines, *_written(found, mesh_path, config_path)])


def _local_check_on(cfg: RunConfig, est: Estimate) -> tuple[Measured | None, list[str]]:
    return local_check(cfg, est, True)


def _target(name: str | None, chip_name: str | None, devices: int | None, check: bool) -> Target | None:
    """The compile-only devices `name` (or `auto` for the chip and count): any layout of their count."""
    if name is None:
        return None
    if not check:
        raise TargetError(f"--no-check skips the compile --aot-topology {name} asks for: drop one.")
    return target_for(MeshLayout(axes={"data": -1}, name="any"), name, chip_name, devices)


def _chip_and_count(cfg: RunConfig, chip_name: str | None, devices: int | None) -> tuple[Chip, int]:
    """The chip named, or this process's (simulated CPU devices: `simulated_chip`), and the count asked for, or this
    process's (a named chip needs a count: this machine's devices say nothing about it)."""
    if chip_name is not None:
        if devices is None:
            raise UserInputError(
                f"--search on {chip_name} needs the chip count: --devices N (or --aot-topology, which has one)."
            )
        return named_chip(chip_name), devices
    devices = devices or jax.device_count()
    local = jax.devices()[0]
    spec = chip_for_device_kind(local.device_kind)
    if spec is None and local.platform == "cpu":
        spec = simulated_chip(devices, getattr(cfg.model, "dtype", "float32"))
    if spec is None:
        raise UserInputError(f"no spec for device kind '{local.device_kind}': name the chip with --chip.")
    return spec, devices


def _not_compiled(found: Found, check: bool) -> str:
    if not check:
        return "check: skipped (--no-check): chosen by the estimate alone"
    return (
        f"check: not compiled: the mesh has {found.devices} devices, this process {jax.device_count()} "
        f"(--aot-topology auto compiles the best layouts for {found.chip.name} with its own compiler)"
    )


def _written(found: Found, mesh_path: str | None, config_path: str | None) -> list[str]:
    """Write the chosen layout's files; the lines saying where, and how to train with them."""
    candidate = found.ranked[found.chosen][0]
    lines = []
    if mesh_path:
        write_mesh(mesh_path, found, found.chosen)
        lines.append(f"wrote the mesh file {mesh_path}")
    if config_path:
        write_run_config(config_path, found, found.chosen, mesh_path)
        lines.append(f"wrote the run config {config_path}: jaxtrain train --config {config_path}")
    elif not candidate.mesh.dcn_axes or mesh_path:
        settings = " ".join(candidate.overrides)
        mesh = mesh_path or candidate.mesh.name
        lines.append(
            f"train it: jaxtrain train --model {found.cfg.model_name} --mesh {mesh} {settings} (and your flags)"
        )
    return lines
