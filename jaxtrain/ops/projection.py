"""`project`: the one helper a model calls for its weight matmuls, `jnp.einsum` of activations and a weight, with a
gradient written for the compilers; and `REMAT_POLICIES`, the remat policies that know its output's name.

What `project` does differently from autodiff's einsum, and why (docs/benchmarks.md, "Small models on CPU", has the
measurements):
- The weight gradient is `dot_general(x, dy)`, activations first. Autodiff writes `dot_general(dy, x)`, contracting
  the batch and sequence dims, the major dims of both; XLA:CPU then leaves `dy` contracted along its major dim, a dot
  its YNNPACK kernels do not take (`benchmarks/xla_cpu_weight_gradient.py` reproduces it). On GPU and TPU it is the
  same contraction with its operands in the other order.
- It saves the weight cast to the compute dtype for the input gradient, not the float32 weight: XLA then reuses the
  weight FSDP gathered for the forward pass instead of gathering it a second time in the backward pass.
- On XLA:CPU, float32 arrays a weight gradient reads are written out before their transpose (`unfused_on_cpu`): the
  output's cotangent (an activation's backward, GELU's or SiLU's, times the gradient) and, under remat, the
  recomputed activations. Fused into the transposing copy the dot asks for, their math runs several times slower
  (`benchmarks/xla_cpu_transposed_fusion.py`). The choice is made per backend when the program is lowered
  (`jax.lax.platform_dependent`): other backends' programs are untouched.
- The gradient keeps the compute dtype, so FSDP reduces bfloat16 gradients in bfloat16 (tests/test_hlo_tpu.py).

A weight that is not an array computes its own projection: `project` hands `x` to its `projected(spec, x)`. That is
how a frozen weight with a low-rank adapter (LoRA, `jaxtrain.posttrain.adapters.Adapted`) changes what every model
computes without the model changing; its pieces are `weight_matmul` (a trained weight's matmul, unnamed) and
`frozen_matmul` (a weight that forms no gradient: a float array, or a qwix `QArray` of a quantized base, QLoRA's,
dequantized in the matmul by `qwix.einsum`).

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
import qwix
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.ops.cotangent import unfused_on_cpu

SAVEABLE = "projection"  # the name `project` gives its output, for `jax.checkpoint_policies.save_only_these_names`

# What the backward pass of a block recomputes (`jax.checkpoint`'s policies), by name: none (keep every residual),
# full (recompute the block), save_dots (keep matmul outputs: a policy of dots alone sees `project`'s custom VJP call,
# not the dot inside it, so `project`'s named output is kept too), offload (keep `project`'s outputs in host memory,
# copied out in the forward pass and back in the backward: save_dots's recompute, with their device memory freed).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(SAVEABLE),
    ),
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[SAVEABLE],
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


def project(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w.astype(x.dtype))`: `x` activations (batch dims first), `w` a float32 parameter, or a
    weight that computes its own projection (`w.projected(spec, x)`, e.g. an adapted one).

    The value and gradients are autodiff's, up to summation order; the backward pass is written for the compilers
    (the module's docstring says how).
    """
    if hasattr(w, "projected"):
        return checkpoint_name(w.projected(spec, x), SAVEABLE)
    return checkpoint_name(weight_matmul(spec, x, w), SAVEABLE)


def weight_matmul(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`project` of an array weight without naming its output for the remat policies: for a weight's parts (an
    adapter's factors), whose product `project` names as a whole."""
    return _project(spec, w.dtype, x, w)


def frozen_matmul(spec: str, x: jax.Array, w: jax.Array | qwix.QArray) -> jax.Array:
    """`jnp.einsum(spec, x, w.astype(x.dtype))` differentiated in `x` only: `w` is frozen, and its gradient is never
    formed, not even as dead code for XLA to drop (an adapted weight's base, `jaxtrain.posttrain.adapters`). `w` may
    be a qwix `QArray` (a quantized base, `jaxtrain.posttrain.quantized`): it is dequantized in the matmul."""
    if isinstance(w, qwix.QArray):
        return _frozen_quantized(spec, x, w)
    return _frozen(spec, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _project(spec: str, w_dtype: jnp.dtype, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w.astype(x.dtype))


def _forward(
    spec: str, w_dtype: jnp.dtype, x: jax.Array, w: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    cast = w.astype(x.dtype)
    return jnp.einsum(spec, x, cast), (x, cast)


def _backward(
    spec: str, w_dtype: jnp.dtype, saved: tuple[jax.Array, jax.Array], dy: jax.Array
) -> tuple[jax.Array, jax.Array]:
    x, cast = saved
    inputs, out = spec.split("->")
    x_dims, w_dims = inputs.split(",")
    dy = unfused_on_cpu(dy)
    dx = jnp.einsum(f"{out},{w_dims}->{x_dims}", dy, cast.astype(dy.dtype))
    dw = jnp.einsum(f"{x_dims},{out}->{w_dims}", unfused_on_cpu(x), dy)
    return dx.astype(x.dtype), dw.astype(w_dtype)


_project.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _frozen(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w.astype(x.dtype))


def _frozen_forward(spec: str, x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    cast = w.astype(x.dtype)  # kept for the input gradient, as `_forward` keeps it
    return jnp.einsum(spec, x, cast), cast


def _frozen_backward(spec: str, cast: jax.Array, dy: jax.Array) -> tuple[jax.Array, None]:
    inputs, out = spec.split("->")
    x_dims, w_dims = inputs.split(",")
    dx = jnp.einsum(f"{out},{w_dims}->{x_dims}", unfused_on_cpu(dy), cast.astype(dy.dtype))
    return dx.astype(cast.dtype), None  # None: a zero cotangent for `w`, which JAX never materialises as a dot


_frozen.defvjp(_frozen_forward, _frozen_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _frozen_quantized(spec: str, x: jax.Array, w: qwix.QArray) -> jax.Array:
    return qwix.einsum(spec, x, w.astype(x.dtype))  # qwix dequantizes `w` in front of the dot, for XLA to fuse


def _frozen_quantized_forward(spec: str, x: jax.Array, w: qwix.QArray) -> tuple[jax.Array, qwix.QArray]:
    # Kept for the input gradient: the codes and scales, dequantized again there, not a float copy of the weight
    # (QLoRA's saving would otherwise be lost between the passes).
    return _frozen_quantized(spec, x, w), w


def _frozen_quantized_backward(spec: str, w: qwix.QArray, dy: jax.Array) -> tuple[jax.Array, None]:
    inputs, out = spec.split("->")
    x_dims, w_dims = inputs.split(",")
    dx = qwix.einsum(f"{out},{w_dims}->{x_dims}", unfused_on_cpu(dy), w.astype(dy.dtype))
    return dx.astype(dy.dtype), None  # the output has x's dtype, so dy does too; no cotangent for the codes


_frozen_quantized.defvjp(_frozen_quantized_forward, _frozen_quantized_backward)
