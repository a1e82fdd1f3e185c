"""Which of the residuals autodiff keeps for the backward pass a compiler actually holds in memory.

`jax.vjp` keeps every intermediate its linearisation needs. Inside a loop (a scanned layer stack) the compiler holds
them all: they are the forward loop's stacked outputs, which the backward loop reads, and no compiler pass moves work
from one loop to the other (seen in the GPU compiler's while loops). A weight cast inside the loop is held as the
cast of this device's shard: FSDP gathers it again in the backward pass. Outside loops XLA fuses elementwise work and
recomputes it inside the backward pass's fusions, so a residual there is not held when it is
- a parameter, or a cast of one (cast again, and gathered again under FSDP, where it is used);
- computed from constants alone (a causal mask broadcast to the scores' shape): it is made where it is used;
- the result of an elementwise op that no matmul, convolution or reduction reads in the forward pass, whose operands
  are held or recomputed themselves (a one-hot of the targets).
A sharding constraint or a copy is the buffer it constrains. Residuals a loop stacks are judged inside its body,
those of a nested call inside that call.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from jax.extend.core import Jaxpr, Literal, jaxprs_in_params

from jaxtrain.planner.layouts import Flow, scan_parts

_ELEMENTWISE = frozenset(
    """abs add and atan2 broadcast_in_dim clamp convert_element_type cos div eq erf erf_inv exp exp2 expm1 ge gt
    integer_pow is_finite le log log1p logistic lt max min mul ne neg not one_minus_square or pow rem round rsqrt
    select_n sign sin sqrt square sub tan tanh xor""".split()
)
_ALIASES = frozenset({"sharding_constraint", "copy", "copy_p", "reshard", "optimization_barrier"})


class _Scope:
    """One jaxpr's producers and consumers, which of its values depend on its inputs, and which inputs the backward
    pass can read again (all but a loop's carry, which changes from one iteration to the next)."""

    def __init__(self, jaxpr: Jaxpr, unavailable: Iterable[Any] = ()):
        self.producer: dict[Any, Any] = {}
        self.consumers: dict[Any, list] = {}
        self.available = set(jaxpr.invars) - set(unavailable)
        varying = set(jaxpr.invars)
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if not isinstance(v, Literal):
                    self.consumers.setdefault(v, []).append(eqn)
            if any(not isinstance(v, Literal) and v in varying for v in eqn.invars):
                varying.update(eqn.outvars)
            for o in eqn.outvars:
                self.producer[o] = eqn
        self.varying = varying

    def buffer(self, v: Any) -> Any:
        """The value `v` is an alias of (through sharding constraints and copies)."""
        while (
            not isinstance(v, Literal) and (eqn := self.producer.get(v)) is not None and eqn.primitive.name in _ALIASES
        ):
            v = eqn.invars[0]
        return v

    def readers(self, v: Any) -> list:
        """The ops reading `v` or an alias of it."""
        out = []
        for eqn in self.consumers.get(v, []):
            out += self.readers(eqn.outvars[0]) if eqn.primitive.name in _ALIASES else [eqn]
        return out


def held_residuals(jaxpr: Jaxpr, residuals: Iterable[Any], flow: Flow) -> list[tuple[Any, int | None, bool]]:
    """The residuals of `jaxpr` (a vjp's forward pass, whose outputs they are) a compiler holds, one per buffer,
    each with the index of the parameter it is a cast of (held as this device's shard) or None, and whether a loop
    stacks it; `flow` has walked `jaxpr` (it knows which values are parameters)."""
    scopes: dict[int, _Scope] = {}
    found = {v: _defining_scope(jaxpr, v, scopes) for v in residuals}  # residual -> (scope, buffer, in a loop)
    stored = {(id(scope), inner) for scope, inner, _ in found.values()}
    held, seen = [], set()
    for v, (scope, inner, looped) in found.items():
        key = (id(scope), inner)
        if key in seen or isinstance(inner, Literal):
            continue
        seen.add(key)
        if looped:
            held.append((v, flow.param.get(inner), True))
        elif not _recomputed(scope, inner, flow, stored):
            held.append((v, None, False))
    return held


def _defining_scope(jaxpr: Jaxpr, v: Any, scopes: dict[int, _Scope]) -> tuple[_Scope, Any, bool]:
    """The innermost jaxpr that computes `v` (through loops and calls that return it as one of their outputs), the
    buffer `v` is there, and whether that jaxpr runs inside a loop."""
    scope, looped = scopes.setdefault(id(jaxpr), _Scope(jaxpr)), False
    while True:
        v = scope.buffer(v)
        eqn = None if isinstance(v, Literal) else scope.producer.get(v)
        subs = list(jaxprs_in_params(eqn.params)) if eqn is not None else []
        if len(subs) != 1 or len(subs[0].outvars) != len(eqn.outvars):
            return scope, v, looped
        sub = subs[0]
        inner = sub.outvars[list(eqn.outvars).index(v)]
        if isinstance(inner, Literal):
            return scope, v, looped
        carry = scan_parts(eqn).carry if eqn.primitive.name == "scan" else ()
        start = len(eqn.invars) - len(sub.invars)
        unavailable = [i for o, i in zip(eqn.invars[start:], sub.invars) if o in carry]
        scope, v = scopes.setdefault(id(sub), _Scope(sub, unavailable)), inner
        looped = looped or eqn.primitive.name == "scan"


def _recomputed(scope: _Scope, v: Any, flow: Flow, stored: set, depth: int = 0) -> bool:
    """Whether the backward pass computes `v` again rather than reading it: a parameter (gathered again), a
    constant, or an elementwise result no matmul or reduction reads whose operands are held or recomputed."""
    if isinstance(v, Literal) or v in flow.param or v not in scope.varying:
        return True
    eqn = scope.producer.get(v)
    if eqn is None or eqn.primitive.name not in _ELEMENTWISE or depth > _DEPTH:
        return False
    if any(reader.primitive.name not in _ELEMENTWISE for reader in scope.readers(v)):
        return False
    operands = [scope.buffer(u) for u in eqn.invars if not isinstance(u, Literal)]
    return all(_readable(scope, u, v, flow, stored, depth) for u in operands)


def _readable(scope: _Scope, u: Any, of: Any, flow: Flow, stored: set, depth: int) -> bool:
    """Whether the backward pass has operand `u` of `of`: an input it can read, a residual, a value much smaller
    than `of` (held at negligible cost), or one it computes again."""
    if isinstance(u, Literal):  # a buffer followed out of a sub-jaxpr can be a constant there
        return True
    if u in scope.available or (id(scope), u) in stored:
        return True
    if _size(u) * _SMALL <= _size(of):
        return True
    return _recomputed(scope, u, flow, stored, depth + 1)


def _size(v: Any) -> int:
    return math.prod(getattr(v.aval, "shape", ()))


# Operands this many times smaller than a recomputed value are taken as held (a norm's statistics, a softmax's sums).
_SMALL = 16
_DEPTH = 16  # elementwise ops followed back from a residual before it is taken as held
