"""`jaxtrain.ops.cotangent.unfused_cotangent`: the same gradients, and in XLA:CPU's compiled program the activation's
backward no longer computed inside the loop that writes it transposed (the slow fusion of
`benchmarks/xla_cpu_transposed_fusion.py`); bfloat16 and other backends' programs left as they were."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.ops.cotangent import unfused_cotangent

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from xla_cpu_transposed_fusion import transposed_fusions  # noqa: E402

BATCH, SEQ, D_MODEL, D_FF = 12, 64, 128, 512


def mlp_gradient(barrier):
    def loss(weights, x):
        hidden = barrier(jnp.einsum("btd,df->btf", x, weights[0]))
        return jnp.sum(jnp.einsum("btf,fd->btd", jax.nn.gelu(hidden), weights[1]) ** 2)

    return jax.jit(jax.grad(loss))


def inputs(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((D_MODEL, D_FF)) * 0.05, rng.standard_normal((D_FF, D_MODEL)) * 0.05)
    x = rng.standard_normal((BATCH, SEQ, D_MODEL))
    return tuple(jnp.asarray(w, dtype) for w in weights), jnp.asarray(x, dtype)


def test_cpu_keeps_the_activation_backward_out_of_the_transposing_fusion():
    weights, x = inputs()
    fused, apart = mlp_gradient(lambda h: h), mlp_gradient(unfused_cotangent)
    counts = {
        name: transposed_fusions(f.lower(weights, x).compile().as_text(), BATCH * SEQ, (D_MODEL, D_FF))
        for name, f in (("fused", fused), ("apart", apart))
    }
    # Without it XLA:CPU writes two (width, B*T) transposes with math inside: GELU's backward (the slow one) and GELU
    # itself, for w2's gradient. With it, the backward's transpose is a plain one and its math a fusion of its own.
    assert counts["fused"] == {"transpose_only": 0, "with_math": 2}, counts
    assert counts["apart"] == {"transpose_only": 1, "with_math": 1}, counts
    for ours, plain in zip(apart(weights, x), fused(weights, x)):
        np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-6)


def test_bfloat16_and_other_backends_are_left_alone():
    weights, x = inputs(jnp.bfloat16)
    assert "custom_vjp" not in str(jax.make_jaxpr(mlp_gradient(unfused_cotangent))(weights, x))
    weights, x = inputs()
    for platform in ("tpu", "cuda"):
        lowered = mlp_gradient(unfused_cotangent).trace(weights, x).lower(lowering_platforms=(platform,))
        assert "optimization_barrier" not in lowered.as_text(), platform
    assert "optimization_barrier" in mlp_gradient(unfused_cotangent).lower(weights, x).as_text()
