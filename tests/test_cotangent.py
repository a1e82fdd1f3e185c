"""`jaxtrain.ops.projection.project` writes an activation's cotangent out before its weight gradient transposes it
(`jaxtrain.ops.cotangent.unfused_on_cpu`): the same gradients, and in XLA:CPU's compiled program the activation's
backward no longer computed inside the loop that writes it transposed (the slow fusion of
`benchmarks/xla_cpu_transposed_fusion.py`); bfloat16 and other backends' programs left as they were."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.ops import projection
from jaxtrain.ops.projection import project

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from xla_cpu_transposed_fusion import transposed_fusions  # noqa: E402

BATCH, SEQ, D_MODEL, D_FF = 12, 64, 128, 512


def mlp_gradient():
    def loss(weights, x):
        hidden = project("btd,df->btf", x, weights[0])
        return jnp.sum(project("btf,fd->btd", jax.nn.gelu(hidden), weights[1]) ** 2)

    return jax.jit(jax.grad(loss))


def inputs(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((D_MODEL, D_FF)) * 0.05, rng.standard_normal((D_FF, D_MODEL)) * 0.05)
    x = rng.standard_normal((BATCH, SEQ, D_MODEL))
    return tuple(jnp.asarray(w, jnp.float32) for w in weights), jnp.asarray(x, dtype)


def compiled_counts_and_gradients():
    weights, x = inputs()
    compiled = mlp_gradient().lower(weights, x).compile()
    return transposed_fusions(compiled.as_text(), BATCH * SEQ, (D_MODEL, D_FF)), compiled(weights, x)


def test_cpu_keeps_the_activation_backward_out_of_the_transposing_fusion(monkeypatch):
    ours, our_gradients = compiled_counts_and_gradients()
    monkeypatch.setattr(projection, "unfused_on_cpu", lambda x: x)
    fused, fused_gradients = compiled_counts_and_gradients()
    # Without the barrier XLA:CPU writes GELU's backward inside the transpose w1's gradient reads (the slow fusion);
    # with it, that transpose is a plain one and the math a fusion of its own.
    assert fused == {"transpose_only": 1, "with_math": 1}, fused
    assert ours == {"transpose_only": 2, "with_math": 0}, ours
    for a, b in zip(our_gradients, fused_gradients):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bfloat16_and_other_backends_are_left_alone(monkeypatch):
    def barriers(dtype, platform="cpu"):
        weights, x = inputs(dtype)
        lowered = mlp_gradient().trace(weights, x).lower(lowering_platforms=(platform,))
        return lowered.as_text().count("optimization_barrier")

    cases = ((jnp.float32,), (jnp.bfloat16,), (jnp.float32, "tpu"), (jnp.float32, "cuda"))
    ours = {case: barriers(*case) for case in cases}
    monkeypatch.setattr(projection, "unfused_on_cpu", lambda x: x)
    without = {case: barriers(*case) for case in cases}
    # One barrier on each weight gradient's two operands (the cotangent and the activations), float32 on CPU only.
    assert ours[(jnp.float32,)] == without[(jnp.float32,)] + 4
    assert all(ours[case] == without[case] for case in cases[1:]), (ours, without)
