"""How each parameter travels in a planned step: where it is used, what FSDP gathers before use, over which axes
its gradient is reduced, and the bytes of the weights gathered at once.

Per param, the axes splitting the rows of the activations it meets (the batch axes; all but the replicas for a
ResNet's convolutions; the lookups' own for a table). Its gradient is reduced over those it is not split over
(reduce-scatter where FSDP shards it, all-reduce where replicated). A dim split over one of those axes is gathered
before use (FSDP: once, and again in the backward pass for stacked layers, as XLA re-gathers each layer) unless the
activation rule of its name splits that axis too: expert weights are used where they are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping

import jax
import numpy as np

from jaxtrain.analysis.comm_report import SEND_SHARE
from jaxtrain.analysis.memory import device_bytes
from jaxtrain.placement.shardings import Shardings
from jaxtrain.planner.layouts import Spec, spec_entries
from jaxtrain.planner.transfers import Transfer
from jaxtrain.sharding.mesh import MESH_AXES
from jaxtrain.sharding.rules import is_layer_stack, is_logical_names, spec_axes


def params_in_use(shardings: Shardings) -> list[Spec]:
    """Each param's layout where it is used: split where the activation rule of a dim's name splits that dim too
    (tensor-parallel dims, experts), whole where its axes are gathered before use (FSDP) or indexed (tables)."""
    names = jax.tree.leaves(shardings.model.logical_names, is_leaf=is_logical_names)
    out = []
    for ns, p in zip(names, jax.tree.leaves(shardings.abstract_state["params"])):
        spec = spec_entries(p.sharding.spec, len(p.shape))
        out.append(
            tuple(tuple(a for a in d if n and a in shardings.rules.activations.get(n, ())) for n, d in zip(ns, spec))
        )
    return out


def _weight_axes(shardings: Shardings, used: Mapping[int, set[str]]) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """Per param: (axes its weights are gathered over before use, axes its gradient is all-reduced over).

    A param is used over the axes that split the rows of the activations it meets (`used`; the batch axes when it
    meets none). A dim split over one of those axes is gathered (FSDP), unless the activation rule of its logical
    name splits over that axis too: then each device uses its own slice where it is (an expert's weights, the
    experts' tokens travelling to them instead). A table's rows split over axes its lookups are not split over are
    never gathered either: each device looks up its own rows. The gradient is summed over the axes the param is
    used over but not split over."""
    mesh, default = shardings.mesh, set(shardings.rules.batch_axes())
    # A sequence split over devices (context parallelism) splits the rows every weight meets as the batch does.
    sequence = set(shardings.rules.activations.get("seq", ()))
    names = jax.tree.leaves(shardings.model.logical_names, is_leaf=is_logical_names)
    out = []
    for i, (ns, p) in enumerate(zip(names, jax.tree.leaves(shardings.abstract_state["params"]))):
        over = (used.get(i, default) | sequence) - {""}
        spec = spec_entries(p.sharding.spec, len(p.shape))
        in_place = {a for n, d in zip(ns, spec) for a in d if n and a in shardings.rules.activations.get(n, ())}
        live = [a for a in MESH_AXES if mesh.shape[a] > 1]
        gathered = tuple(a for a in live if a in spec_axes(p.sharding.spec) and a in over and a not in in_place)
        reduced = tuple(a for a in live if a in over and a not in spec_axes(p.sharding.spec))
        out.append((gathered, reduced))
    return out


@dataclasses.dataclass(frozen=True)
class Runs:
    """How often per step the weights travel, in multiples of one device's shard: FSDP gathers of the stacked
    layers and of the other params, reductions of their gradients, lookups into split tables (in multiples of one
    traced microbatch's rows) and reductions of the tables' gradients."""

    layer_gathers: float
    layer_reductions: float
    other_gathers: float
    other_reductions: float
    table_lookups: float
    table_reductions: float

    @classmethod
    def unpipelined(cls, accum: int) -> Runs:
        """Gathers every microbatch (the stacked layers' again in the backward pass, as XLA re-gathers each
        layer), gradients reduced once per step."""
        return cls(2 * accum, 1, accum, 1, accum, 1)


# Long: one pass over the params, each a table exchanged, a table gathered, a weight gathered or reduced as it is;
# split, each case would re-derive the same per-param sizes and axes.
def weight_transfers(
    shardings: Shardings,
    runs: Runs,
    used: Mapping[int, set[str]],
    use_itemsize: Mapping[int, int],
    tables: Mapping[int, tuple[float, float]],
    multiplied: Mapping[int, int] | None = None,
    whole_torus: Collection[str] = (),
    reduced_as: Mapping[int, tuple[str, int]] | None = None,
    compiler: str = "cpu",
    gathered_itemsize: Mapping[int, int] | None = None,
    reduced_itemsize: Mapping[int, int] | None = None,
) -> list[Transfer]:
    """FSDP gathers and the gradient reductions over the batch axes, as often as `runs` says, in the dtype each
    param is used in (`use_itemsize`, per param: TPU and GPU compilers cast a weight to the compute dtype before
    gathering it and reduce its gradient in that dtype; XLA:CPU, the `cpu` of each transfer, casts after).
    A table larger than the rows looked up in it whose lookups are split over axes that split its other dims (an
    embedding's `embed` over `fsdp`) is not gathered: each device looks up all the group's rows in its columns and
    an all-to-all hands them to their rows' devices, and their gradients back; no gradient is reduced over those
    axes (`tables`, per table: bytes of the rows one device looks up per microbatch and of their gradients;
    `exchanged_tables`). A table that is also a
    matmul's weight (`multiplied`, per param: the bytes per element it is multiplied in; a tied embedding used as
    the output head) is gathered for that use as well, and the head's part of its gradient reduced as a weight's.
    `used`: per param, the axes splitting the rows of the activations it meets (`StepTrace.used`). `whole_torus`:
    the axes that together span a whole TPU torus slice (`jaxtrain.planner.estimate`), over which XLA:TPU
    all-reduces a gradient and keeps each device's part instead of reduce-scattering it. `reduced_as`, per param:
    the collective and bytes per element of its gradient's reduction over the FSDP axes where the step's own code
    decides them (the chunked loss's head). `compiler`: whose habits the exchanged tables follow
    (`_exchanged_rows`). `gathered_itemsize`, `reduced_itemsize`: per param, other bytes per element (8-bit)."""
    mesh, out = shardings.mesh, []
    exchanged = set(exchanged_tables(shardings, used, {i: found for i, (found, _) in tables.items()}))
    multiplied, reduced_as, gathered_itemsize = multiplied or {}, reduced_as or {}, gathered_itemsize or {}
    names = jax.tree.leaves(shardings.model.logical_names, is_leaf=is_logical_names)
    params = jax.tree.leaves(shardings.abstract_state["params"])
    for i, (ns, p, (gathered, reduced)) in enumerate(zip(names, params, _weight_axes(shardings, used))):
        itemsize = np.dtype(p.dtype).itemsize
        shard, cast = device_bytes(p), use_itemsize.get(i, itemsize) / itemsize
        stacked = is_layer_stack(ns)
        gathers = runs.layer_gathers if stacked else runs.other_gathers
        reductions = (
            runs.table_reductions if i in tables else runs.layer_reductions if stacked else runs.other_reductions
        )
        if i in exchanged:
            # On TPU, a table whose looked-up rows are split over other axes too (the vocabulary over `tensor`) gets
            # its rows' gradients summed into a buffer of its size gathered over the exchange axes, all-reduced.
            summed = compiler == "tpu" and bool(set(spec_axes(p.sharding.spec)) - set(gathered))
            table = runs.table_reductions * shard * math.prod(mesh.shape[a] for a in gathered) if summed else None
            out += _exchanged_rows(gathered, tables[i], runs.table_lookups, mesh.shape, table)
            # The head's use: gathered once per microbatch, as the other params, in the dtype it is multiplied in.
            gathers, cast = runs.other_gathers, multiplied.get(i, itemsize) / itemsize
        usual = "all-reduce" if set(gathered) == set(whole_torus) else "reduce-scatter"
        if i in tables and i not in exchanged and gathered:
            # A table no larger than the rows looked up in it is gathered whole for its lookups, in the dtype they
            # read it in; its gradient, the rows' scattered into a table of its own dtype, is reduced in that
            # dtype. A matmul's use of it (a tied head) travels besides, below (compiled: bert-tiny's 4096-entry
            # table under 6144 tokens a device on h100:8 at context=2,fsdp=2,tensor=2).
            out += _gathered_weight(
                gathered, mesh.shape, runs.table_lookups * shard, reductions * shard, cast, (usual, itemsize), itemsize
            )
            cast = multiplied.get(i, itemsize) / itemsize
        if gathered and (i not in tables or i in multiplied):
            reduction = reduced_as.get(i, (usual, (reduced_itemsize or {}).get(i, cast * itemsize)))
            gather_cast = gathered_itemsize.get(i, cast * itemsize) / itemsize
            out += _gathered_weight(
                gathered, mesh.shape, gathers * shard, reductions * shard, gather_cast, reduction, itemsize
            )
        if reduced:
            n = math.prod(mesh.shape[a] for a in reduced)
            sent = reductions * SEND_SHARE["all-reduce"](n) * shard
            out.append(Transfer(reduced, "all-reduce", cast * sent, "gradients", ("all-reduce", sent)))
    return out


def _gathered_weight(
    axes: tuple[str, ...],
    mesh_shape: Mapping[str, int],
    gathered: float,
    reduced: float,
    cast: float,
    reduction: tuple[str, int],
    itemsize: int,
) -> list[Transfer]:
    """An FSDP weight's gathers over `axes` and its gradient's reduction: `gathered` and `reduced`, bytes of a
    device's shard (in the param's dtype, `itemsize` bytes an element) times the times per step; `cast`: the
    gathered dtype's bytes over the param's; `reduction`: the gradient's collective and bytes per element."""
    n = math.prod(mesh_shape[a] for a in axes)
    sent = (n - 1) * gathered
    gather = Transfer(axes, "all-gather", cast * sent, "weights (FSDP)", ("all-gather", sent))
    kind, size = reduction
    sent = (n - 1) * reduced
    # An all-reduce sends 2(N-1)/N of the whole gradient: twice a reduce-scatter's (N-1)/N.
    share = size / itemsize * (2 if kind == "all-reduce" else 1)
    return [gather, Transfer(axes, kind, share * sent, "gradients", ("all-reduce", 2 * sent))]


def exchanged_tables(shardings: Shardings, used: Mapping[int, set[str]], rows: Mapping[int, float]) -> list[int]:
    """The tables (param indices: those of `rows`, with the bytes of the rows one device looks up in each per
    microbatch) whose looked-up rows are exchanged by all-to-all rather than the table gathered (see
    `weight_transfers`). The compilers do so for a table larger, gathered, than the rows looked up in it, as an
    embedding is; a smaller one (BERT's two token types) is gathered like a weight (compiled: bert-tiny's
    type table on h100:8 and v5p:2x2x2 sends no rows)."""
    params = jax.tree.leaves(shardings.abstract_state["params"])
    return [
        i
        for i, (gathered, _) in enumerate(_weight_axes(shardings, used))
        if gathered and i in rows and _gathered_bytes(params[i], gathered, shardings.mesh.shape) > rows[i]
    ]


def _gathered_bytes(param: jax.ShapeDtypeStruct, axes: Collection[str], mesh_shape: Mapping[str, int]) -> float:
    """Bytes of a device's shard of `param` gathered over `axes`, in its own dtype."""
    return device_bytes(param) * math.prod(mesh_shape[a] for a in axes)


def _exchanged_rows(
    axes: tuple[str, ...],
    rows: tuple[float, float],
    lookups: float,
    mesh_shape: Mapping[str, int],
    summed_table: float | None = None,
) -> list[Transfer]:
    """A table split over `axes` along dims its lookups do not index: the rows each device finds in its share of
    the table go to their rows' devices by all-to-all, and their gradients come back the same way; `rows`: bytes
    of the rows one device looks up per microbatch and of their gradients, `lookups` times per step.
    `summed_table`: bytes per step of the table gathered over `axes`, where the compiler sums the rows' gradients
    into a buffer that size and all-reduces it over `axes` instead (XLA:TPU, for llama-8b's embedding at
    fsdp=32,tensor=4, vocabulary over `tensor`: 970 MiB of float32 a device, where llama-1b's table, split over
    `fsdp` alone, sends its rows' gradients back by all-to-all)."""
    n = math.prod(mesh_shape[a] for a in axes)
    share = SEND_SHARE["all-to-all"](n) * lookups
    found, gradients = rows
    back = (
        Transfer(axes, "all-to-all", share * gradients, "looked-up rows' gradients")
        if summed_table is None
        else Transfer(axes, "all-reduce", SEND_SHARE["all-reduce"](n) * summed_table, "looked-up rows' gradients")
    )
    return [Transfer(axes, "all-to-all", share * found, "looked-up rows (split table)"), back]


def gathered_layer_bytes(
    shardings: Shardings, used: Mapping[int, set[str]], use_itemsize: Mapping[int, int] | None = None
) -> float:
    """Bytes of the weights FSDP gathers at once, in the dtype they are used in (`use_itemsize`, per param: the
    compilers gather a weight after casting it): one layer of each stacked param, or the other params."""
    names = jax.tree.leaves(shardings.model.logical_names, is_leaf=is_logical_names)
    params = jax.tree.leaves(shardings.abstract_state["params"])
    stacked = other = 0.0
    for i, (ns, p, (gathered, _)) in enumerate(zip(names, params, _weight_axes(shardings, used))):
        ways = math.prod(shardings.mesh.shape[a] for a in gathered)
        if ways == 1:
            continue
        itemsize = np.dtype(p.dtype).itemsize
        whole = device_bytes(p) * ways * (use_itemsize or {}).get(i, itemsize) / itemsize
        if is_layer_stack(ns):
            stacked += whole / p.sharding.shard_shape(p.shape)[0]
        else:
            other += whole
    return max(stacked, other)
