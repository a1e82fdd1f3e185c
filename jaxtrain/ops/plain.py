"""Plain math for programs that are read rather than run: inside `plain_math()`, the kernels with loops and custom
gradients (chunked attention, the chunked loss) compute the same numbers the plain way, with autodiff's own gradient.

The planner reads a step's jaxpr for matmuls, softmaxes and their residuals; it has no model of a blockwise loop
under a custom VJP. So the fused attention kernels compute as plain math under `jax.checkpoint`: the backward pass
keeps their inputs, as the kernels do, and computes the scores again, as they do; one layer's scores count in the
working set (the kernels hold a block at a time: an upper bound there). The chunked loss computes as whole logits
with autodiff's gradient: an upper bound on its memory.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_PLAIN: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxtrain_plain_math", default=False)


@contextlib.contextmanager
def plain_math() -> Iterator[None]:
    """While tracing inside, `jaxtrain.ops` computes attention and the loss head without blocks or chunks."""
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


def is_plain() -> bool:
    return _PLAIN.get()
