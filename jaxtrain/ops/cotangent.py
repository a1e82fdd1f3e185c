"""Arrays that XLA:CPU must write out before it uses them: `unfused_cotangent` (an activation's cotangent) and
`unfused_on_cpu` (any float32 array, e.g. the activations a weight gradient reads).

XLA:CPU fuses elementwise math into the transpose that a weight gradient's dot asks of its operand, into one loop
fusion that writes a (width, B*T) array transposed while it computes: several times slower than the same math
followed by a plain transpose (`benchmarks/xla_cpu_transposed_fusion.py` reproduces it). It happens to an activation's
backward (GELU's, SiLU's), and, under `remat`, to the recomputed activations a projection's weight gradient reads
(GELU's output times its input, a norm's scaling). An optimization barrier keeps the math and the transpose apart.
Measured by alternating both programs in one process (a 4-layer GPT, one CPU device unless named; the other program
with the barrier patched out, 2026-12-03):
- on the activation's input cotangent (`unfused_cotangent`): float32 steps 1.31x faster at d_model 128 (GELU), 1.21x
  (SwiGLU), 1.05x at d_model 256 on `fsdp=8`; bfloat16 0.97x at d_model 128 and 0.94x for SwiGLU at d_model 256 on
  `fsdp=8`;
- on the activations `jaxtrain.ops.projection.project`'s weight gradient reads, with `remat=full`, in float32:
  1.20x at d_model 256, 1.11x at d_model 128, 1.22x for llama-cpu (SwiGLU); with the same barrier patched into
  `project` from outside: 1.03x, 1.13x, 1.09x at d_model 256, 1.05x on `fsdp=8`, 1.02x with `remat=none` (the
  activations already written out), 0.99x in bfloat16.
So the barrier is for float32 on CPU only. On GPU and TPU (not measured: none here) these functions are the
plain identity, their fusions untouched (`lax.platform_dependent`: the branch is chosen when the program is lowered).

>>> import jax, jax.numpy as jnp
>>> from jaxtrain.ops.cotangent import unfused_cotangent
>>> float(jax.grad(lambda x: jnp.sum(jax.nn.gelu(unfused_cotangent(x))))(jnp.zeros(3))[0])
0.5
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.ops.plain import is_plain


def unfused_on_cpu(x: jax.Array) -> jax.Array:
    """`x`, written out before use by XLA:CPU where it is float32 (an optimization barrier there); unchanged on
    other backends, in other dtypes and in the planner's plain math, which reads the program rather than runs it."""
    if x.dtype != jnp.float32 or is_plain():
        return x
    return jax.lax.platform_dependent(x, cpu=jax.lax.optimization_barrier, default=lambda y: y)


@jax.custom_vjp
def _barrier_on_cotangent(x: jax.Array) -> jax.Array:
    return x


_barrier_on_cotangent.defvjp(lambda x: (x, None), lambda _, cotangent: (unfused_on_cpu(cotangent),))


def unfused_cotangent(x: jax.Array) -> jax.Array:
    """`x`, unchanged; a float32 `x`'s cotangent passes `unfused_on_cpu`."""
    return _barrier_on_cotangent(x) if x.dtype == jnp.float32 and not is_plain() else x
