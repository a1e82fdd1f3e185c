"""Which part of each value of a traced step one device holds, read from the jaxpr alone (nothing is compiled).

The step is traced under the activation constraints, with a batch of a prime number of rows (larger than any other
dim) times the mesh size, so dims carrying the batch are recognisable and the constraints divide. Each value's layout
is followed from the batch's sharding and the constraints through elementwise ops, broadcasts, reductions,
transposes, matmuls and convolutions (batch dims take the axes of the op's first input that has them); a dim nothing
speaks for is split over a mesh axis when its size is that of a logical dim the activation rules split over that axis
(`mlp` over `tensor`). Two logical dims of equal size split differently can be confused there: a known limit of
reading shapes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from jax.extend.core import Jaxpr, Literal, jaxprs_in_params
from jax.sharding import PartitionSpec

from jaxtrain.planner.tiling import held_bytes

# What is known of a traced value's layout: per dim, the mesh axes splitting it, or None where unknown.
Spec = tuple[tuple[str, ...] | None, ...]


def spec_entries(spec: PartitionSpec, ndim: int) -> Spec:
    """`spec` as a `Spec` of `ndim` dims: the mesh axes of each dim, () where it is whole."""
    entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    return tuple(entries + [()] * (ndim - len(entries)))


@dataclasses.dataclass(frozen=True)
class Shares:
    """Which part of a traced array one device holds (see the module docstring): from its `Spec` where known, else
    read from its shape."""

    probe: int  # rows the batch was traced with: a multiple of the mesh size by a prime larger than any other dim
    batch: int  # real rows of one microbatch, all devices together
    batch_axes: tuple[str, ...]  # the axes splitting batch dims where nothing else is known
    split: Mapping[str, frozenset[int]]  # mesh axis -> sizes of the logical dims split over it
    mesh_shape: Mapping[str, int]
    tiled: bool = False  # memory is counted as XLA:TPU stores arrays (`jaxtrain.planner.tiling`)

    def is_batch(self, size: int) -> bool:
        """Whether a dim of `size` carries the batch (a multiple of the probe's rows)."""
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
        """Per-device bytes of a value of abstract value `aval` (0 for tokens and other shapeless values)."""
        if not hasattr(aval, "shape"):
            return 0.0
        return math.prod(self.sizes(aval.shape, spec)) * np.dtype(aval.dtype).itemsize

    def held(self, aval: Any, spec: Spec | None = None) -> float:
        """Per-device bytes a value of abstract value `aval` takes in memory (`bytes`, padded where `tiled`)."""
        if not hasattr(aval, "shape"):
            return 0.0
        return held_bytes(self.sizes(aval.shape, spec), np.dtype(aval.dtype).itemsize, self.tiled)


class Flow:
    """What is known of each value of a traced step while walking it in order: its layout (`Spec`: from the batch's
    sharding and the activation constraints, carried through elementwise ops, broadcasts, reductions and transposes;
    elsewhere the batch dims take the axes of the op's first input that has them) and which parameter it is (a cast
    of one, or a layer's slice in a scan)."""

    # Ops whose output is still the parameter they take (cast, copied, broadcast for a bias, reshaped).
    VIEWS = frozenset({"convert_element_type", "copy", "copy_p", "reshard", "broadcast_in_dim", "reshape", "squeeze"})

    def __init__(self, shares: Shares, jaxpr: Jaxpr | None = None, param_specs: Sequence[Spec] = ()):
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
        """The layout known of value `v`, or None."""
        return None if isinstance(v, Literal) else self.spec.get(v)

    def infer(self, eqn: Any) -> None:
        """Set what is known of the outputs of `eqn`, an op without nested jaxprs."""
        if eqn.primitive.name in self.VIEWS and not isinstance(eqn.invars[0], Literal) and eqn.invars[0] in self.param:
            self.param[eqn.outvars[0]] = self.param[eqn.invars[0]]
        for out in eqn.outvars:
            ndim = len(out.aval.shape) if hasattr(out.aval, "shape") else 0
            spec = self._output_spec(eqn, out, ndim)
            if spec is not None and len(spec) == ndim:
                self.spec[out] = tuple(spec)

    def _output_spec(self, eqn: Any, out: Any, ndim: int) -> Sequence | None:
        name, p = eqn.primitive.name, eqn.params
        src = self.of(eqn.invars[0]) if eqn.invars else None
        if name == "sharding_constraint":
            return spec_entries(p["sharding"].spec, ndim)
        if src is not None and name == "broadcast_in_dim":
            spec = [None] * ndim  # new dims are free to take any layout
            for i, d in enumerate(p["broadcast_dimensions"]):
                spec[d] = src[i]
            return spec
        if src is not None and "axes" in p and (name.startswith("reduce_") or name in ("argmax", "argmin")):
            return [s for i, s in enumerate(src) if i not in p["axes"]]
        if src is not None and name == "transpose":
            return [src[i] for i in p["permutation"]]
        if name == "dot_general":
            return self._contraction(eqn)
        if name == "conv_general_dilated":
            return self._convolution(eqn)
        return self._elementwise(eqn, out) or self._batch_only(eqn, out)

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


class TraceError(RuntimeError):
    """A traced equation the planner cannot read: its form is not what this version of the planner expects (a JAX
    upgrade may have changed it). The message names the equation and what was expected."""


def walk(jaxpr: Jaxpr, trips: int = 1, flow: Flow | None = None) -> Iterator[tuple[Any, int]]:
    """Every equation, nested ones included, with how often it runs (loop trip counts multiplied); with `flow`,
    what is known of each value is updated as the walk goes."""
    for eqn in jaxpr.eqns:
        subs = list(jaxprs_in_params(eqn.params))
        if flow is not None and not subs:
            flow.infer(eqn)
        yield eqn, trips
        inner = trips * scan_length(eqn) if eqn.primitive.name == "scan" else trips
        for sub in subs:
            if flow is not None:
                flow.enter(eqn, sub)
            yield from walk(sub, inner, flow)
            if flow is not None:
                flow.leave(eqn, sub)


def body_of(eqn: Any) -> Jaxpr:
    """The one jaxpr a loop or remat equation runs."""
    subs = list(jaxprs_in_params(eqn.params))
    if len(subs) != 1:
        raise TraceError(f"expected one nested jaxpr in the '{eqn.primitive.name}' equation, found {len(subs)}: {eqn}")
    return subs[0]


@dataclasses.dataclass(frozen=True)
class ScanParts:
    """A scan equation's operands read from its shapes alone (no version-specific params): the loop-invariant
    `consts`, the `carry` passed from one iteration to the next and the `xs` sliced along their leading dim."""

    consts: tuple
    carry: tuple
    xs: tuple
    length: int


def scan_parts(eqn: Any) -> ScanParts:
    """Split a scan's inputs into (consts, carry, xs) the way every JAX version lays them out: an xs operand is its
    body's input with one more, leading, dim; a carry is one of the leading outputs shaped as its body's output
    (the stacked ys gain a leading dim), and the carries are the inputs just before the xs."""
    body = body_of(eqn)
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
        raise TraceError(f"a scan whose body takes {len(body.invars)} inputs for {len(eqn.invars)} operands: {eqn}")
    stacked = [
        _shape(o)[1:] == _shape(i) and len(_shape(o)) == len(_shape(i)) + 1 for o, i in zip(eqn.invars, body.invars)
    ]
    n_xs = next((k for k, s in enumerate(reversed(stacked)) if not s), len(stacked))
    pairs = zip(eqn.outvars, body.outvars)
    n_carry = next((k for k, (o, i) in enumerate(pairs) if _shape(o) != _shape(i)), len(eqn.outvars))
    start = len(eqn.invars) - n_xs - n_carry
    carried = [_shape(v) for v in body.invars[max(start, 0) : start + n_carry]]
    if start < 0 or carried != [_shape(v) for v in body.outvars[:n_carry]]:
        raise TraceError(
            f"cannot tell a scan's carry from its other operands by their shapes ({n_carry} carried outputs, "
            f"{n_xs} stacked inputs of {len(eqn.invars)}): {eqn}"
        )
    invars = tuple(eqn.invars)
    xs = invars[start + n_carry :]
    lengths = {_shape(v)[0] for v in (*xs, *eqn.outvars[n_carry:])}
    length = lengths.pop() if len(lengths) == 1 else eqn.params.get("length")
    if not isinstance(length, int) or lengths:
        raise TraceError(f"cannot read how many times a scan runs (stacked dims {sorted(lengths)}): {eqn}")
    return ScanParts(invars[:start], invars[start : start + n_carry], xs, length)


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def scan_length(eqn: Any) -> int:
    """How many times a scan runs its body."""
    return scan_parts(eqn).length
