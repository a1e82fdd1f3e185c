"""`project`: activations times a weight, as `jnp.einsum`, with a weight gradient that XLA:CPU runs at matmul speed.

Autodiff's transpose of `einsum(x, w)` computes the weight gradient as `dot_general(dy, x)`, contracting the batch
and sequence dims, which are the major dims of both. XLA:CPU copies `x` into a transposed layout and leaves `dy`
contracted along its major dim: a dot its YNNPACK kernels do not take, which falls back to a loop several times
slower (`benchmarks/xla_cpu_weight_gradient.py` reproduces it). Written as `dot_general(x, dy)`, the same contraction
gets `x` transposed into the left operand's canonical layout and runs in YNNPACK. The gradient keeps autodiff's
dtype (the compute dtype): accumulated in float32 it was more accurate in bfloat16, but the TPU compiler then
all-reduced FSDP's gradients in float32, 1.7x the bytes of gpt-small's bfloat16 ones (tests/test_hlo_tpu.py).

Measured on the 2-core CPU machine, alternated in one process, 2026-12-03:
- `python benchmarks/xla_cpu_weight_gradient.py` (a 4-layer GELU MLP, d_model 256 x 1024, 8 x 256 tokens, one device):
  the gradient 0.583 s as autodiff writes it, 0.164 s activations first (3.5x) in bfloat16; 0.393 s and 0.293 s
  (1.34x) in float32.
- A 4-layer GPT's training step on one device, autodiff's einsum against `project` (`models.gpt.project` patched):
  1.90x (d_model 128, 12 x 64 tokens) and 2.07x (d_model 256, 8 x 256) faster in bfloat16; in float32 0.97-0.98x
  (0.91-1.16x in earlier runs: no clear effect). On 8 devices (`fsdp=8`, `data=8`, `data=2,fsdp=2,tensor=2`)
  0.94-1.07x (with a float32-accumulating first version): the SPMD partitioner's per-device program already leaves
  autodiff's dot in a form YNNPACK takes.
- MoE's expert MLPs (moe-cpu, one device): 1.44x in bfloat16, 1.10x in float32; 1.07x on `data=2,expert=4`.
On GPU and TPU the dot is the same contraction with its operands in the other order (not measured: none here).

>>> import jax, jax.numpy as jnp
>>> from jaxtrain.ops.projection import project
>>> x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
>>> project("btd,df->btf", x, w).shape
(2, 3, 5)
>>> jax.grad(lambda w: project("btd,df->btf", x, w).sum())(w)[0, 0]
Array(6., dtype=float32)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.ops.cotangent import unfused_on_cpu
from jaxtrain.ops.plain import is_plain

SAVEABLE = "projection"  # the name `project` gives its output, for `jax.checkpoint_policies.save_only_these_names`


def project(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w.astype(x.dtype))`: `x` activations (batch dims first), `w` a float32 parameter.

    The gradient is autodiff's, up to summation order; under the planner's plain math
    (`jaxtrain.ops.plain`) this is the plain einsum, whose matmuls the planner reads.
    """
    if is_plain():
        return jnp.einsum(spec, x, w.astype(x.dtype))
    # Named, so that remat policies that keep matmul outputs can keep this one (`SAVEABLE`): a policy of
    # dots sees the custom VJP's call, not the dot inside it.
    return checkpoint_name(_project(spec, w.dtype, x, w), SAVEABLE)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _project(spec: str, w_dtype: jnp.dtype, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w.astype(x.dtype))


def _forward(
    spec: str, w_dtype: jnp.dtype, x: jax.Array, w: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    cast = w.astype(x.dtype)
    # The cast weight is what the input gradient needs. Saving it, not `w`, lets XLA reuse the weight FSDP gathered
    # for the forward; saving `w` made it gather every weight a second time in the backward.
    return jnp.einsum(spec, x, cast), (x, cast)


def _backward(
    spec: str, w_dtype: jnp.dtype, saved: tuple[jax.Array, jax.Array], dy: jax.Array
) -> tuple[jax.Array, jax.Array]:
    x, cast = saved
    inputs, out = spec.split("->")
    x_dims, w_dims = inputs.split(",")
    dx = jnp.einsum(f"{out},{w_dims}->{x_dims}", dy, cast.astype(dy.dtype))
    # The activations are the dot's left operand: see the module's docstring. Written out first: recomputed under
    # remat, their math would otherwise be fused into the slow transposing copy the dot asks for (`unfused_on_cpu`).
    dw = jnp.einsum(f"{x_dims},{out}->{w_dims}", unfused_on_cpu(x), dy)
    return dx.astype(x.dtype), dw.astype(w_dtype)


_project.defvjp(_forward, _backward)
