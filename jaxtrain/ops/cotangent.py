"""`unfused_on_cpu`: an array XLA:CPU must write out before it uses it.

XLA:CPU fuses elementwise math into the transpose that a weight gradient's dot asks of its operand, into one loop
fusion that writes a (width, B*T) array transposed while it computes: several times slower than the same math
followed by a plain transpose (`benchmarks/xla_cpu_transposed_fusion.py` reproduces it; docs/benchmarks.md has the
measurements). An optimization barrier keeps the math and the transpose apart. It helped float32 programs only, so
bfloat16 arrays pass unchanged. On GPU and TPU the function is the identity and their fusions are untouched
(`lax.platform_dependent`: the branch is chosen when the program is lowered, so a program compiled ahead of time
for another backend gets that backend's branch).

>>> import jax.numpy as jnp
>>> from jaxtrain.ops.cotangent import unfused_on_cpu
>>> unfused_on_cpu(jnp.ones(3)).shape
(3,)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def unfused_on_cpu(x: jax.Array) -> jax.Array:
    """`x`, written out before use by XLA:CPU where it is float32 (an optimization barrier there); unchanged on
    other backends and in other dtypes."""
    if x.dtype != jnp.float32:
        return x
    return jax.lax.platform_dependent(x, cpu=jax.lax.optimization_barrier, default=lambda y: y)
