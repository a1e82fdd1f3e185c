"""Read the matmuls out of a compiled program's HLO text: each `dot` as a batched (m x k) @ (k x n), with how often
it runs per call of the program.

What the compiler kept, not what the model asked for: rematerialized forward matmuls appear twice, the SPMD
partitioner's per-device shapes replace the global ones, and a dot in a scanned layer stack counts once per layer
(its loop's trip count, as `jaxtrain.analysis.hlo` reads it). A dot in a branch of a `conditional` counts as if
its branch ran every time, since which branch runs is known only at run time (`Matmul.exact` is then False).
`scripts/matmul_floor.py` runs a program of these matmuls alone to time what a step's matmuls cost on their own.

    >>> import jax, jax.numpy as jnp
    >>> from jaxtrain.analysis.matmuls import matmuls
    >>> def f(w, x):
    ...     return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0].sum()
    >>> w, x = jnp.ones((3, 16, 32)), jnp.ones((8, 16))
    >>> sorted({(m.m, m.k, m.n, m.executions) for m in matmuls(jax.jit(f).lower(w[:, :, :16], x).compile().as_text())})
    [(8, 16, 16, 3)]
"""

from __future__ import annotations

import dataclasses
import math
import re

from jaxtrain.analysis.hlo import Module, arrays, loop_multiplicity, parse_module


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One `dot` of the program as `batch` independent (m x k) @ (k x n) products."""

    batch: int
    m: int
    k: int
    n: int
    lhs_dtype: str
    rhs_dtype: str
    out_dtype: str
    executions: int  # times it runs per call of the program
    op_name: str  # the JAX operation it came from (metadata), or ''
    # False where `executions` is not known before running: in a branch of a `conditional` (a pipeline tick's),
    # counted as if its branch ran every time, or in a loop whose trip count could not be read, counted once.
    exact: bool = True

    @property
    def flops(self) -> int:
        """Floating-point operations of one execution (a multiply and an add per term)."""
        return 2 * self.batch * self.m * self.k * self.n


def matmuls(hlo_text: str) -> list[Matmul]:
    """Every `dot` instruction of an optimized HLO module (`compiled.as_text()`), fused or not.

    Raises ValueError for a dot whose operand shapes cannot be read, rather than leaving it out of a total.
    """
    module = parse_module(hlo_text)
    executions, uncounted = loop_multiplicity(module)
    inexact = uncounted | under_branches(module)
    found = []
    for computation, body in module.computations.items():
        for instruction in body.values():
            if instruction.opcode != "dot" or not executions.get(computation):
                continue
            try:
                lhs, rhs = (_array(body[operand].type) for operand in instruction.operands)
            except (KeyError, ValueError) as error:
                raise ValueError(f"cannot read the operands of {instruction.line.strip()[:200]!r}: {error}") from error
            out_dtype = _array(instruction.type)[0]
            batch = _dims(instruction.line, "lhs_batch_dims")
            contracting = _dims(instruction.line, "lhs_contracting_dims")
            lhs_dims = lhs[1]
            shared = math.prod(lhs_dims[i] for i in (*batch, *contracting))  # the rhs's batch and contracting dims
            found.append(
                Matmul(
                    batch=math.prod(lhs_dims[i] for i in batch),
                    m=math.prod(d for i, d in enumerate(lhs_dims) if i not in batch and i not in contracting),
                    k=math.prod(lhs_dims[i] for i in contracting),
                    n=math.prod(rhs[1]) // shared,
                    lhs_dtype=lhs[0],
                    rhs_dtype=rhs[0],
                    out_dtype=out_dtype,
                    executions=executions[computation],
                    op_name=instruction.op_name,
                    exact=computation not in inexact,
                )
            )
    return found


def under_branches(module: Module) -> set[str]:
    """The computations a `conditional`'s branches run, directly or through further calls. Which branch runs is known
    only when the program runs (a pipeline tick's work), so what they hold counts as if every branch ran: inexact."""
    found: set[str] = set()
    pending = [
        branch
        for body in module.computations.values()
        for instruction in body.values()
        if instruction.opcode == "conditional"
        for branch in instruction.called()
    ]
    while pending:
        name = pending.pop()
        if name not in found:
            found.add(name)
            pending += [callee for i in module.computations.get(name, {}).values() for callee in i.called()]
    return found


def _array(type_text: str) -> tuple[str, tuple[int, ...]]:
    found = arrays(type_text)
    if not found:
        raise ValueError(f"not an array type: {type_text!r}")
    return found[0]


def _dims(line: str, key: str) -> tuple[int, ...]:
    found = re.search(rf"\b{key}=\{{([\d,]*)\}}", line)
    return tuple(int(d) for d in found.group(1).split(",") if d) if found else ()
