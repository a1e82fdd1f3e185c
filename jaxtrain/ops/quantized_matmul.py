"""A weight's matmul in 8 bits for training (int8, or FP8: e4m3 forward, e5m2 gradients), and FSDP's weight
all-gather in 8 bits: `Recipe.einsum`, what a low-precision weight computes where the model projects it
(`jaxtrain.placement.precision`).

    matmuls=int8|fp8:  x (per-token scales) · W (per-output-channel scales), both quantized, the dot in 8 bits with a
                       wide accumulator, the scales applied to its output; in the backward pass the incoming gradient
                       is quantized too (int8, or e5m2), and the forward's quantized operands are reused.
    gather=8bit:       W's codes and scales are all-gathered where FSDP gathers W, and dequantized after the gather:
                       half the bytes of a bfloat16 gather.

The quantized matmul is qwix's quantized training (`dot_general_qt`, the function behind qwix's `QtProvider`), called
directly rather than through `qwix.quantize_model`: the provider intercepts every einsum of a Flax module and tells
weights from activations by finding `nnx.Param`s, which jaxtrain's functional step does not pass to the model; here
the weight is known, since the model hands it to `jaxtrain.ops.projection.project`. Scales are absmax of the current
values ("current scaling"): per channel (per token and per output channel) or per tensor.

The gather is our own: no library quantizes a weight before an SPMD all-gather. The weight is quantized where it
lies (its shard), its codes are laid out as the parameter, then as the matmul reads it (the activation rules for the
weight's dims), so the reshard between the two is an all-gather of 8-bit codes; the backward pass is the straight-
through estimator, the gradient of the dequantized weight, returned in the parameter's layout in the compute dtype
(so FSDP still reduce-scatters it in bfloat16).

>>> import jax, jax.numpy as jnp
>>> x, w = jnp.ones((2, 3, 4), jnp.bfloat16), jnp.full((4, 5), 0.5)
>>> Recipe("int8").einsum("btd,df->btf", x, w, ("embed", "mlp"))[0, 0, 0]
Array(2, dtype=bfloat16)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import qwix
from qwix._src.core import dot_general_qt

from jaxtrain.ops.projection import frozen_matmul, weight_matmul
from jaxtrain.sharding.constraints import constrain

# precision.matmuls: the forward operands' type and the backward gradient's
QTYPES = {"int8": (jnp.int8, jnp.int8), "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2)}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a chosen weight is multiplied: `matmuls` none/int8/fp8, `scales` channel/tensor, `backward`
    quantized/high (the gradient matmuls in 8 bits or in the compute dtype), `gather` none/8bit."""

    matmuls: str = "none"
    scales: str = "channel"
    backward: str = "quantized"
    gather: str = "none"

    def einsum(self, spec: str, x: jax.Array, w: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """`jnp.einsum(spec, x, w.astype(x.dtype))` as the recipe computes it, differentiated in `x` and `w`; `names`:
        the logical names of `w`'s dims (for the gather's layouts)."""
        w = self._gathered(w, spec, names, x.dtype)
        if self.matmuls == "none":
            return weight_matmul(spec, x, w)
        return self._quantized_einsum(spec, x, w.astype(x.dtype))

    def frozen_einsum(self, spec: str, x: jax.Array, w: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """`einsum` of a frozen weight (an adapter's base): differentiated in `x` only."""
        w = self._gathered(jax.lax.stop_gradient(w), spec, names, x.dtype)
        if self.matmuls == "none":
            return frozen_matmul(spec, x, w)
        return self._quantized_einsum(spec, x, w.astype(x.dtype))

    @property
    def gather_qtype(self) -> jnp.dtype:
        return QTYPES["fp8" if self.matmuls == "fp8" else "int8"][0]

    def _gathered(self, w: jax.Array, spec: str, names: Sequence[str | None], dtype: jnp.dtype) -> jax.Array:
        if self.gather == "none":
            return w
        kept = () if self.scales == "tensor" else output_dims(spec)
        return gathered_in_8_bits(w, tuple(names[-w.ndim :]), kept, self.gather_qtype, jnp.dtype(dtype))

    def _quantized_einsum(self, spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
        forward, gradient = QTYPES[self.matmuls]
        per_tensor = self.scales == "tensor"
        backward = gradient if self.backward == "quantized" else None
        config = dot_general_qt.DotGeneralQtConfig(
            lhs_qtype=forward,
            rhs_qtype=forward,
            lhs_disable_channelwise_axes=per_tensor,
            rhs_disable_channelwise_axes=per_tensor,
            dlhs_grad_qtype=backward,
            drhs_grad_qtype=backward,
            dlhs_grad_disable_channelwise_axes=per_tensor,
            drhs_grad_disable_channelwise_axes=per_tensor,
            # With the backward in the compute dtype, it multiplies the operands as they were, not their codes.
            use_original_residuals=backward is None,
        )

        def quantized_dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
            # jnp.einsum may swap the operands; the config treats both alike, so the order does not matter.
            return dot_general_qt.dot_general_qt(lhs, rhs, dimension_numbers, config).astype(x.dtype)

        # jnp.einsum is jitted with `_dot_general` static; traced inline, it calls ours (as qwix's provider does).
        with jax.disable_jit():
            return jnp.einsum(spec, x, w, _dot_general=quantized_dot)


def output_dims(spec: str) -> tuple[int, ...]:
    """The dims of einsum `spec`'s weight (its second operand) that are not contracted: each gets its own scale."""
    inputs, out = spec.replace(" ", "").split("->")
    w = inputs.split(",")[1]
    return tuple(i for i, c in enumerate(w) if c in out)


def gathered_in_8_bits(
    w: jax.Array, names: tuple, kept: tuple[int, ...], qtype: jnp.dtype, dtype: jnp.dtype
) -> jax.Array:
    """`w` quantized to `qtype` with a scale per index of its dims `kept` (none: one scale), moved from the
    parameter's layout to the matmul's in that type, and dequantized to `dtype`; the gradient passes straight
    through. `names`: the logical names of `w`'s dims."""
    return _gathered(w, names, kept, qtype, dtype, w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _gathered(w, names, kept, qtype, dtype, param_dtype):
    q = qwix.quantize(w, qtype, channelwise_axes=kept)
    scale_names = tuple(name if i in kept else None for i, name in enumerate(names))
    codes = constrain(constrain(q.qvalue, names, like_params=True), names)
    scale = constrain(constrain(q.scale, scale_names, like_params=True), scale_names)
    return codes.astype(dtype) * scale.astype(dtype)


def _gathered_fwd(w, names, kept, qtype, dtype, param_dtype):
    return _gathered(w, names, kept, qtype, dtype, param_dtype), None


def _gathered_bwd(names, kept, qtype, dtype, param_dtype, _, g):
    # Laid out as the parameter in the compute dtype first: FSDP's reduce-scatter moves bfloat16, not float32.
    return (constrain(g, names, like_params=True).astype(param_dtype),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)
