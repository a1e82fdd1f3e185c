"""The kernels a model computes with, as a model setting (`kernels`): `fused` (attention in blocks and the loss in
chunks, with gradients of their own) or `plain` (the same numbers as plain array math with autodiff's gradients).

The planner reads a step's jaxpr for matmuls, softmaxes and their residuals; it has no model of a blockwise loop
under a custom VJP, so it places the model with `plain_kernels(config)`. Under `plain` the fused attention kernels
compute as plain math under `jax.checkpoint`: the backward pass keeps their inputs, as the kernels do, and computes
the scores again, as they do; one layer's scores count in the working set (the kernels hold a block at a time: an
upper bound there). The chunked loss computes as whole logits: an upper bound on its memory. A model without the
setting has no such kernels and is read as it is.

>>> import dataclasses
>>> @dataclasses.dataclass(frozen=True)
... class Config:
...     kernels: str = "fused"
>>> plain_kernels(Config())
Config(kernels='plain')
"""

from __future__ import annotations

import dataclasses
from typing import Any

KERNELS = ("fused", "plain")
KERNELS_HELP = "fused: attention in blocks, the loss in chunks; plain: the same numbers as plain math (the planner's)"


def plain_kernels(model_config: Any) -> Any:
    """`model_config` with `kernels="plain"` where it has that setting; else unchanged."""
    names = {field.name for field in dataclasses.fields(model_config)}
    return dataclasses.replace(model_config, kernels="plain") if "kernels" in names else model_config
