"""`unfused_cotangent`: the identity, whose float32 cotangent XLA:CPU must write out before it uses it.

XLA:CPU fuses an activation's backward (GELU's, SiLU's) with the transpose that the weight gradient's dot asks of its
result, into one loop fusion that writes a (d_ff, B*T) array transposed while it computes: several times slower than
the same math followed by a plain transpose (`scripts/xla_cpu_transposed_fusion.py` reproduces it). An optimization
barrier on the cotangent of the activation's input keeps the two apart. Measured by alternating both programs in one
process (a 4-layer GPT, one CPU device unless named; the other program with `models.gpt.unfused_cotangent` patched
to the identity, 2026-12-03): float32 steps 1.31x faster at d_model 128 (GELU), 1.21x
(SwiGLU), 1.05x at d_model 256 on `fsdp=8`; bfloat16 0.97x at d_model 128 and 0.94x for SwiGLU at d_model 256 on
`fsdp=8`. So the barrier is for float32 cotangents on CPU only. On GPU and TPU (not measured: none here) the function is
the plain identity, their fusions untouched (`lax.platform_dependent`: the branch is chosen when the program is
lowered).

>>> import jax, jax.numpy as jnp
>>> from jaxtrain.ops.cotangent import unfused_cotangent
>>> float(jax.grad(lambda x: jnp.sum(jax.nn.gelu(unfused_cotangent(x))))(jnp.zeros(3))[0])
0.5
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.ops.plain import is_plain


@jax.custom_vjp
def _barrier_on_cpu(x: jax.Array) -> jax.Array:
    return x


def _keep_apart(_, cotangent: jax.Array) -> tuple[jax.Array]:
    return (jax.lax.platform_dependent(cotangent, cpu=jax.lax.optimization_barrier, default=lambda g: g),)


_barrier_on_cpu.defvjp(lambda x: (x, None), _keep_apart)


def unfused_cotangent(x: jax.Array) -> jax.Array:
    """`x`, unchanged; a float32 `x`'s cotangent passes an optimization barrier on CPU (none in the planner's plain
    math, which reads the program rather than runs it)."""
    return _barrier_on_cpu(x) if x.dtype == jnp.float32 and not is_plain() else x
