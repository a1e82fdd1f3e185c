"""The train step of a plan, traced (not compiled) for one microbatch under the activation constraints, and read
for what the estimate needs: residuals kept for the backward pass, FLOPs and bytes of every matmul and convolution,
the collectives the traced ops imply and how each parameter is used.

Collectives read from the trace (those of the weights are `jaxtrain.planner.weights`'): rows of a table looked up on
devices that split them are found locally and summed: reduce-scattered over those devices (their gradients gathered
back) or all-reduced. A constraint moving an axis from one dim of its input to another is an all-to-all (an MoE's
tokens to their experts and back); one dropping an axis an all-gather. An all-reduce of the result of every
contraction or reduction over a dim split on another axis (tensor parallelism); under a pipeline, the activations at
stage boundaries forward and their gradients back.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun, jaxprs_in_params

from jaxtrain.analysis.comm_report import SEND_SHARE
from jaxtrain.placement.shardings import Shardings
from jaxtrain.planner.layouts import Flow, Shares, Spec, body_of, scan_parts, spec_entries, walk
from jaxtrain.planner.loss import ChunkedLoss
from jaxtrain.planner.residuals import held_residuals
from jaxtrain.planner.transfers import Transfer
from jaxtrain.planner.weights import params_in_use
from jaxtrain.sharding.constraints import activation_sharding
from jaxtrain.sharding.mesh import MESH_AXES
from jaxtrain.sharding.rules import is_layer_stack, is_logical_names

# Ops that combine values along a dim: when that dim is split over a mesh axis the result is a partial sum there.
_COMBINING = {"dot_general", "gather"} | {f"reduce_{op}" for op in ("sum", "max", "min", "prod", "and", "or")}
_REMAT = {"remat2", "checkpoint"}  # jax.checkpoint's primitive (named remat2 in jax 0.12)
_MATMULS = ("dot_general", "conv_general_dilated")


class Held(NamedTuple):
    """Per-device bytes of the residuals a compiler holds for a backward pass, by where they are kept."""

    layers: float  # stacked by a loop (the scanned layers), in device memory
    rest: float  # other residuals in device memory
    logits: float  # those with a dim of the vocabulary's size (where the model has one)
    host: float  # in host memory: a remat policy that offloads (`remat=offload`) copies them out and back

    @property
    def on_device(self) -> float:
        return self.layers + self.rest + self.logits


@dataclasses.dataclass
class Lookup:
    """The rows looked up in one table (a parameter a gather indexes) per microbatch."""

    rows: float = 0.0  # bytes of the rows one device looks up, in the dtype it looks them up in
    row_itemsize: int = 4  # bytes per element of that dtype
    cotangent_itemsize: int = 4  # bytes per element of the rows' gradient: the dtype they are cast to after the lookup

    def cotangent_bytes(self, table_itemsize: int, compiler: str) -> float:
        """Bytes of the rows' gradient as it travels: in the dtype the rows are used in, but on TPU in the table's,
        to which XLA:TPU casts it before it leaves the device (compiled: a bfloat16 lookup into a float32 table,
        `jaxtrain.ops.embedding`, sends its rows' gradients as float32 on v5p:2x2x2 and as bfloat16 on h100:8)."""
        itemsize = table_itemsize if compiler == "tpu" else self.cotangent_itemsize
        return self.rows * itemsize / self.row_itemsize


@dataclasses.dataclass
class Tally:
    """Per-device work of one part of a traced step (the layer stack, or the rest), for one microbatch: FLOPs and
    bytes of its matmuls and convolutions, and the collectives its activations imply."""

    flops: float = 0.0
    matmul_bytes: float = 0.0
    transfers: list[Transfer] = dataclasses.field(default_factory=list)

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.flops + other.flops, self.matmul_bytes + other.matmul_bytes, self.transfers + other.transfers)

    def __mul__(self, times: float) -> Tally:
        scaled = [dataclasses.replace(t, bytes=t.bytes * times) for t in self.transfers]
        return Tally(self.flops * times, self.matmul_bytes * times, scaled)


class StepTrace:
    """The loss and its gradient for one microbatch, traced (not compiled) under the activation constraints, and
    read for residuals, FLOPs, matmul bytes, the collectives of split dims and how each parameter is used.

    After construction: `flops` and `matmul_bytes` (per device per step, remat recompute included), `used` (param
    index -> the axes splitting the rows of the activations it meets), and per part of the step ("layers": inside
    the scanned layer stack, "rest": the embedding, head and loss) the `gradient`'s and the `forward` pass's
    `Tally` for one microbatch. `tiled`: memory is counted as XLA:TPU stores arrays."""

    def __init__(
        self,
        shardings: Shardings,
        shapes: Mapping[str, jax.ShapeDtypeStruct],
        accum: int,
        tiled: bool = False,
        chunked_loss: ChunkedLoss | None = None,
    ):
        self.shardings, self.accum, self.chunked_loss = shardings, accum, chunked_loss
        self.shares = dataclasses.replace(_shares(shardings, shapes, accum), tiled=tiled)
        self.param_specs = params_in_use(shardings)
        # Per param: the share of it a device holds over the share it uses (below 1 where FSDP gathers it).
        leaves = jax.tree.leaves(shardings.abstract_state["params"])
        self._gathered = [
            math.prod(p.sharding.shard_shape(p.shape)) / math.prod(self.shares.sizes(p.shape, spec))
            for p, spec in zip(leaves, self.param_specs)
        ]
        self.loss = lambda p, b: shardings.model.loss_fn(p, b)[0]
        probe = self.shares.probe
        self.args = (
            shardings.model.abstract_params,
            {k: jax.ShapeDtypeStruct((probe, *s.shape[1:]), s.dtype) for k, s in shapes.items()},
        )
        self.layers = _stacked_layers(shardings)
        self.loss_jaxpr = self._trace(self.loss).jaxpr
        self._note_params(grad_jaxpr := self._trace(jax.value_and_grad(self.loss)).jaxpr)
        self.gradient, self.forward = self._read(grad_jaxpr), self._read(self.loss_jaxpr)
        total = (self.gradient["layers"] + self.gradient["rest"]) * accum
        self.flops, self.matmul_bytes = total.flops, total.matmul_bytes

    def _trace(self, fn: Any, args: Sequence[Any] | None = None) -> ClosedJaxpr:
        with activation_sharding(self.shardings.mesh, self.shardings.rules):
            return jax.make_jaxpr(fn)(*(args or self.args))

    def saved_bytes(self) -> float:
        """Residuals of the loss for one microbatch: what its forward pass keeps in device memory for the backward
        pass."""
        return sum(self.saved_split())

    def saved_split(self) -> tuple[float, float]:
        """`saved_bytes` of the layer stack's loop, and of the rest; with a `chunked_loss`, what it keeps in place
        of the trace's whole logits and what the softmax keeps of them (the residuals outside loops with a dim of
        the vocabulary's size)."""
        held = self._saved
        if self.chunked_loss is None:
            return held.layers, held.rest + held.logits
        return held.layers, held.rest + self.chunked_loss.kept

    def host_saved_bytes(self) -> float:
        """Residuals of the loss for one microbatch that its remat policy keeps in host memory (`remat=offload`)."""
        return self._saved.host

    @functools.cached_property
    def _saved(self) -> Held:
        return self._residual_bytes(self.loss, self.args, self.param_specs)

    def working_bytes(self) -> float:
        """What the backward pass of one layer holds (recomputed under remat) besides the saved residuals: the
        residuals of the largest loop body or remat region (`_working_regions`) run as a function of its own,
        without its remat policy; or a `chunked_loss`'s while it runs, where larger."""
        sizes = [0.0 if self.chunked_loss is None else self.chunked_loss.working]
        for body in _working_regions(self.loss_jaxpr):
            args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.invars]
            sizes.append(self._residual_bytes(jaxpr_as_fun(ClosedJaxpr(body, [])), args).on_device)
        return max(sizes)

    def forward_flops(self) -> float:
        """Per-device FLOPs of the forward pass's matmuls and convolutions per step (all microbatches)."""
        return (self.forward["layers"].flops + self.forward["rest"].flops) * self.accum

    def _residual_bytes(self, fn: Any, args: Sequence[Any], param_specs: Sequence[Spec] = ()) -> Held:
        """Per-device bytes of what `jax.vjp(fn, *args)` keeps for the backward pass that a compiler holds
        (`jaxtrain.planner.residuals`), not counting its inputs, by where it is kept (`Held`)."""
        closed = self._trace(lambda *a: jax.vjp(fn, *a)[1], args)
        flow = Flow(self.shares, closed.jaxpr, param_specs)
        for _ in walk(closed.jaxpr, flow=flow):
            pass
        inputs = set(closed.jaxpr.invars)
        kept = dict.fromkeys(v for v in closed.jaxpr.outvars if not isinstance(v, Literal) and v not in inputs)
        tally = dict.fromkeys(Held._fields, 0.0)
        vocab = self.chunked_loss.vocab if self.chunked_loss is not None else None
        for v, param, looped in held_residuals(closed.jaxpr, kept, flow):
            held = self.shares.held(v.aval, flow.of(v)) * (1.0 if param is None else self._gathered[param])
            if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host:
                tally["host"] += held
            elif looped:
                tally["layers"] += held
            elif vocab in getattr(v.aval, "shape", ()):
                tally["logits"] += held
            else:
                tally["rest"] += held
        return Held(**tally)

    def weight_uses(
        self, compiler: str
    ) -> tuple[dict[int, set[str]], dict[int, int], dict[int, tuple[float, float]], dict[int, int]]:
        """What `jaxtrain.planner.weights.weight_transfers` needs of the step: per param, the axes splitting the
        rows it meets and the dtype it is used in; per table, the bytes of the rows looked up and of their
        gradients as `compiler` sends them (per microbatch); per param a matmul or convolution takes, the dtype it
        takes it in."""
        leaves = jax.tree.leaves(self.shardings.abstract_state["params"])
        tables = {
            i: (t.rows, t.cotangent_bytes(np.dtype(leaves[i].dtype).itemsize, compiler)) for i, t in self.tables.items()
        }
        return self.used, self.use_itemsize, tables, self.multiplied

    def transfers(self) -> list[Transfer]:
        """The collectives the traced step's activations imply, per step (every microbatch's)."""
        return ((self.gradient["layers"] + self.gradient["rest"]) * self.accum).transfers

    def stage_io(self) -> float:
        """Bytes of the carry of the layer stack's loop for one microbatch: what crosses a pipeline stage boundary."""
        return sum(self.shares.bytes(v.aval) for v in self._stage_carry())

    def stage_io_held(self) -> float:
        """`stage_io` as it is held in memory."""
        return sum(self.shares.held(v.aval) for v in self._stage_carry())

    def stage_io_itemsize(self) -> int:
        """Bytes per element of what crosses a stage boundary (the compute dtype)."""
        return max((np.dtype(v.aval.dtype).itemsize for v in self._stage_carry()), default=4)

    def _stage_carry(self) -> tuple:
        scans = [eqn for eqn, _ in walk(self.loss_jaxpr) if self._is_layer_stack(eqn)]
        return scan_parts(scans[0]).carry if scans else ()

    def _is_layer_stack(self, eqn: Any) -> bool:
        return eqn.primitive.name == "scan" and scan_parts(eqn).length == self.layers

    def _note_params(self, jaxpr: Jaxpr) -> None:
        """The batch axes each parameter is used over, the dtype it is used in, and the rows looked up in tables."""
        flow = Flow(self.shares, jaxpr, self.param_specs)
        self.used: dict[int, set[str]] = collections.defaultdict(set)  # param -> axes splitting its inputs' rows
        self.use_itemsize: dict[int, int] = {}  # param -> bytes per element where it is used (after any cast)
        self.multiplied: dict[int, int] = {}  # param -> bytes per element where a matmul or convolution takes it
        self.tables: dict[int, Lookup] = {}  # param -> the rows looked up in it
        self._looked_up: dict[Any, int] = {}  # a lookup's result -> the table
        self._returned_as: dict[Any, Any] = {}  # a call's result inside it -> outside
        for eqn, trips in walk(jaxpr, flow=flow):
            if eqn.outvars:
                self._note_uses(eqn, flow)
                self._note_lookups(eqn, trips, flow)

    def _read(self, jaxpr: Jaxpr) -> dict[str, Tally]:
        """FLOPs and bytes of every matmul and convolution, and the collectives of contractions over split dims,
        of resharded activations and of lookups into split tables, of the layer stack and of the rest."""
        shares, flow = self.shares, Flow(self.shares, jaxpr, self.param_specs)
        inside = {id(e) for eqn, _ in walk(jaxpr) if self._is_layer_stack(eqn) for e, _ in walk(body_of(eqn))}
        parts = {"layers": Tally(), "rest": Tally()}
        lookups: dict[Any, tuple[tuple[str, ...], float]] = {}  # a lookup's rows -> (axes to sum over, bytes)
        partials = _PartialSums()
        for eqn, trips in walk(jaxpr, flow=flow):
            if not eqn.outvars:
                continue
            part = parts["layers" if id(eqn) in inside else "rest"]
            if _is_matmul(eqn):
                part.flops += trips * _flops(eqn, shares, flow)
                operands = [*((v.aval, flow.of(v)) for v in eqn.invars), (eqn.outvars[0].aval, flow.of(eqn.outvars[0]))]
                part.matmul_bytes += trips * sum(shares.bytes(*a) for a in operands)
            part.transfers += partials.read(eqn)
            part.transfers += self._collectives(eqn, trips, flow, lookups, partials)
        parts["rest"].transfers += partials.flush()
        for axes, b in lookups.values():  # rows looked up and never laid out again: summed where they are
            parts["rest"].transfers += _lookup_sums(axes, b, None, shares.mesh_shape)
        return parts

    def _collectives(self, eqn: Any, trips: int, flow: Flow, lookups: dict, partials: _PartialSums) -> list[Transfer]:
        """What `eqn` sends: a lookup into a split table is noted in `lookups` until its rows are laid out again (a
        sharding constraint) and summed there; a constraint reshards; a contraction over split dims leaves partial
        sums, all-reduced where they are used (`partials`)."""
        shares, name, out = self.shares, eqn.primitive.name, eqn.outvars[0]
        src = eqn.invars[0] if eqn.invars else None
        if name == "gather" and src in flow.param:
            if axes := self._lookup_axes(eqn, flow.param[src]):
                lookups[out] = (axes, trips * shares.bytes(out.aval, flow.of(out)))
        elif name in ("convert_element_type", "copy", "copy_p") and src in lookups:
            lookups[out] = lookups.pop(src)
        elif name == "sharding_constraint" and src in lookups:
            return _lookup_sums(*lookups.pop(src), flow.of(out), shares.mesh_shape)
        elif name == "sharding_constraint" and not isinstance(src, Literal):
            return _reshards(src.aval, flow.of(src), flow.of(out), trips, shares)
        elif name in _COMBINING:
            combined = shares.model_axes(src.aval.shape, flow.of(src)) - shares.model_axes(out.aval.shape, flow.of(out))
            b = shares.bytes(out.aval, flow.of(out))
            sums = [
                Transfer(
                    (axis,),
                    "all-reduce",
                    trips * SEND_SHARE["all-reduce"](shares.mesh_shape[axis]) * b,
                    "activations (split dims)",
                )
                # Sums over positions of a split sequence are weights' gradients, reduced with the weights
                # (`jaxtrain.planner.weights`), or attention's, which `jaxtrain.planner.context` models.
                for axis in combined - {"pipeline", *self.shardings.rules.activations.get("seq", ())}
            ]
            if sums:
                partials.hold(out, sums)
        return []

    def _note_uses(self, eqn: Any, flow: Flow) -> None:
        """Record, for each parameter `eqn` takes, the axes splitting the batch dims of its other operands, and the
        widest dtype it is used in (a weight cast to the compute dtype is used in that dtype)."""
        taken = [v for v in eqn.invars if not isinstance(v, Literal) and v in flow.param]
        params = {flow.param[v] for v in taken}
        if not params:
            return
        if eqn.primitive.name not in Flow.VIEWS and not any(jaxprs_in_params(eqn.params)):  # loops: their bodies
            for v in taken:
                itemsize = np.dtype(v.aval.dtype).itemsize
                self.use_itemsize[flow.param[v]] = max(itemsize, self.use_itemsize.get(flow.param[v], 0))
                if eqn.primitive.name in _MATMULS:
                    self.multiplied[flow.param[v]] = max(itemsize, self.multiplied.get(flow.param[v], 0))
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

    def _note_lookups(self, eqn: Any, trips: int, flow: Flow) -> None:
        """Record the rows each lookup into a parameter (a gather from a table) finds, and the dtype they are cast to
        after it (that of their gradient)."""
        subs = list(jaxprs_in_params(eqn.params))
        if len(subs) == 1 and len(subs[0].outvars) == len(eqn.outvars):  # a call: its results leave it as these
            self._returned_as.update((i, o) for i, o in zip(subs[0].outvars, eqn.outvars) if not isinstance(i, Literal))
        src = eqn.invars[0] if eqn.invars else None
        if isinstance(src, Literal):
            return
        if eqn.primitive.name == "gather" and src in flow.param:
            out = eqn.outvars[0]
            table = self.tables.setdefault(flow.param[src], Lookup())
            table.rows += trips * self.shares.bytes(out.aval, flow.of(out))
            table.row_itemsize = table.cotangent_itemsize = np.dtype(out.aval.dtype).itemsize
            while out is not None:
                self._looked_up[out] = flow.param[src]
                out = self._returned_as.get(out)
        elif eqn.primitive.name == "convert_element_type" and src in self._looked_up:
            param = self._looked_up[src]
            self.tables[param].cotangent_itemsize = np.dtype(eqn.outvars[0].aval.dtype).itemsize

    def _lookup_axes(self, eqn: Any, param: int) -> tuple[str, ...]:
        """Axes splitting the dims a gather indexes in parameter `param`: each device looks up its own rows."""
        leaf = jax.tree.leaves(self.shardings.abstract_state["params"])[param]
        spec = spec_entries(leaf.sharding.spec, len(leaf.shape))
        indexed = eqn.params["dimension_numbers"].start_index_map
        axes = {a for d in indexed for a in spec[d] if a != "pipeline"}
        return tuple(a for a in MESH_AXES if a in axes and self.shares.mesh_shape[a] > 1)


class _PartialSums:
    """Contractions over split dims leave each device a partial sum; the TPU and GPU compilers all-reduce it where
    a value is used, not where it is made. Partial sums added together (the gradients of x from its q, k and v
    projections, or from SwiGLU's two input matrices) are reduced once, as their sum; casts and reshapes carry a
    partial sum along. XLA:CPU reduces each where it is made (the `cpu` figure of the merged ones)."""

    _ADDS = frozenset({"add", "add_any"})
    _CARRY = frozenset({"convert_element_type", "reshape", "squeeze", "expand_dims", "transpose", "copy", "copy_p"})

    def __init__(self):
        self._pending: dict[Any, list[Transfer]] = {}  # value -> the all-reduces it still owes

    def hold(self, v: Any, sums: list[Transfer]) -> None:
        self._pending[v] = sums

    def read(self, eqn: Any) -> list[Transfer]:
        """The all-reduces `eqn` forces: those of the partial sums it reads, unless it adds partial sums over the
        same axes together or casts or reshapes one (then its output owes them, once)."""
        held = [v for v in eqn.invars if not isinstance(v, Literal) and v in self._pending]
        if not held:
            return []
        name = eqn.primitive.name
        owed = [self._pending.pop(v) for v in held]
        axes = {tuple(t.axes for t in sums) for sums in owed}
        every_input = len(held) == len([v for v in eqn.invars if not isinstance(v, Literal)])
        if len(axes) == 1 and every_input and (name in self._ADDS or (name in self._CARRY and len(held) == 1)):
            owed.sort(key=lambda sums: sum(t.bytes for t in sums))
            self._pending[eqn.outvars[0]] = owed.pop()
            # XLA:CPU reduces each partial sum where it is made: the merged ones still send there.
            return [dataclasses.replace(t, bytes=0.0, cpu=("all-reduce", t.bytes)) for sums in owed for t in sums]
        return [t for sums in owed for t in sums]

    def flush(self) -> list[Transfer]:
        """The partial sums no traced op reads (a loop's outputs): reduced where they leave."""
        owed = [t for sums in self._pending.values() for t in sums]
        self._pending.clear()
        return owed


def _working_regions(jaxpr: Jaxpr) -> Iterator[Jaxpr]:
    """The regions whose backward pass runs one at a time, each holding its own residuals: every loop's body and,
    where a remat region computes the body's carry (a layer under a remat policy), that region, measured without
    its policy; remat regions outside loops. Other remat regions inside these are the fused attention kernels'
    plain stand-ins (`jaxtrain.ops.plain`: the reference's math under `jax.checkpoint`) and are not measured on
    their own: the kernels hold one block of scores at a time, where the stand-in's residuals are all (T, T) of
    them (llama-1b, 4 rows of 2048 positions a device: 3.0 GiB, against a compiled layer's 0.7)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in ("scan", *_REMAT):
            for sub in jaxprs_in_params(eqn.params):
                yield from _working_regions(sub)
            continue
        body = body_of(eqn)
        if body.constvars:
            continue
        yield body
        if eqn.primitive.name == "scan":
            layer = [e for e in body.eqns if e.primitive.name in _REMAT and body.outvars[0] in e.outvars]
            yield from (body_of(e) for e in layer if not body_of(e).constvars)


def _shares(shardings: Shardings, shapes: Mapping[str, jax.ShapeDtypeStruct], accum: int) -> Shares:
    """How to read per-device shares of the step traced for `shapes` (one microbatch of `accum`) on `plan`'s mesh:
    the probe rows (a prime above every other dim, times the mesh size) and the sizes of the logical dims each
    non-batch axis splits."""
    mesh = shardings.mesh
    batch_axes = tuple(a for a in shardings.rules.batch_axes() if mesh.shape[a] > 1)
    dims = _logical_sizes(shardings)
    batch = next(iter(shapes.values())).shape[0] // accum
    probe = _prime_above(max([batch, *dims.values(), *(d for s in shapes.values() for d in s.shape)])) * mesh.size
    # The pipeline axis splits no traced dim: the trace is the whole model on one microbatch, and
    # `jaxtrain.planner.stages` takes the share of its layer stack one stage runs.
    split = {
        axis: frozenset(size for name, size in dims.items() if axis in shardings.rules.activations.get(name, ()))
        for axis in mesh.axis_names
        if mesh.shape[axis] > 1 and axis not in batch_axes and axis != "pipeline"
    }
    return Shares(probe, batch, batch_axes, split, dict(mesh.shape))


def _stacked_layers(shardings: Shardings) -> int | None:
    """The length of the model's stacked `layers` dim (that of its layer stack's loop), or None."""
    names = jax.tree.leaves(shardings.model.logical_names, is_leaf=is_logical_names)
    params = jax.tree.leaves(shardings.model.abstract_params)
    return next((p.shape[0] for ns, p in zip(names, params) if is_layer_stack(ns)), None)


def _is_matmul(eqn: Any) -> bool:
    return bool(eqn.outvars) and eqn.primitive.name in _MATMULS


def _flops(eqn: Any, shares: Shares, flow: Flow) -> float:
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


def _reshards(aval: Any, before: Spec | None, after: Spec | None, trips: int, shares: Shares) -> list[Transfer]:
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


def _logical_sizes(shardings: Shardings) -> dict[str, int]:
    """Size of each logical dim name, from the params that use it."""
    names = jax.tree.leaves(shardings.model.logical_names, is_leaf=is_logical_names)
    params = jax.tree.leaves(shardings.model.abstract_params)
    return {n: s for ns, p in zip(names, params) for n, s in zip(ns, p.shape) if n}


def _prime_above(n: int) -> int:
    n += 1
    while any(n % k == 0 for k in range(2, math.isqrt(n) + 1)):
        n += 1
    return n
