"""jaxtrain.analysis.matmuls reads the matmuls a compiled program runs, and benchmarks/matmul_floor.py's program of
those matmuls alone runs exactly them: counted against the FLOPs worked out by hand, not against our own parser."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain.analysis.matmuls import Matmul, matmuls

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from matmul_floor import floor_program  # noqa: E402

LAYERS, TOKENS, D_MODEL, D_FF = 3, 64, 32, 128


def mlp_loss(weights, x, remat: bool):
    def layer(h, w):
        w_in, w_out = w
        return h + jnp.tanh(h @ w_in) @ w_out

    if remat:
        layer = jax.checkpoint(layer)
    return jax.lax.scan(lambda h, w: (layer(h, w), None), x, weights)[0].sum()


def mlp_inputs():
    rng = np.random.default_rng(0)
    weights = (
        jnp.asarray(rng.standard_normal((LAYERS, D_MODEL, D_FF)), jnp.float32),
        jnp.asarray(rng.standard_normal((LAYERS, D_FF, D_MODEL)), jnp.float32),
    )
    return weights, jnp.asarray(rng.standard_normal((TOKENS, D_MODEL)), jnp.float32)


def dot_flops(found: list[Matmul]) -> int:
    return sum(m.flops * m.executions for m in found)


@pytest.mark.parametrize("remat", [False, True])
def test_a_scanned_stacks_gradient_runs_the_matmuls_autodiff_and_remat_make(remat):
    weights, x = mlp_inputs()
    text = jax.jit(jax.grad(mlp_loss), static_argnums=2).lower(weights, x, remat).compile().as_text()
    found = matmuls(text)
    per_product = 2 * TOKENS * D_MODEL * D_FF
    # Per layer: 2 forward products, 4 in the backward (each weight's and each input's gradient; the first layer's
    # input gradient too, since the scan does not know it is unused), and under remat the first forward product
    # again (the backward needs tanh's input; the second product's output it does not need, so XLA drops that one).
    assert dot_flops(found) == LAYERS * per_product * (7 if remat else 6)
    assert {m.executions for m in found} == {LAYERS}  # all inside the layer loops


def test_the_partitioners_per_device_shapes_are_read():
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    weights, x = mlp_inputs()
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
    text = jax.jit(jax.grad(mlp_loss), static_argnums=2).lower(weights, x, False).compile().as_text()
    found = matmuls(text)
    assert dot_flops(found) == LAYERS * 6 * 2 * (TOKENS // 4) * D_MODEL * D_FF
    assert all(TOKENS // 4 in (m.m, m.k) for m in found), found


def test_batch_dims_and_dtypes():
    q = jnp.ones((2, 3, 5, 8), jnp.bfloat16)  # (batch, heads, queries, channels)
    k = jnp.ones((2, 3, 7, 8), jnp.bfloat16)
    scores = jax.jit(lambda q, k: jnp.einsum("bhqc,bhkc->bhqk", q, k, preferred_element_type=jnp.float32))
    (found,) = matmuls(scores.lower(q, k).compile().as_text())
    assert (found.batch, found.m, found.k, found.n) == (6, 5, 8, 7)
    assert (found.lhs_dtype, found.rhs_dtype, found.out_dtype, found.executions) == ("bf16", "bf16", "f32", 1)


def test_an_unreadable_dot_is_an_error_not_a_smaller_total():
    text = """HloModule m, entry_computation_layout={()->f32[2,2]{1,0}}

ENTRY %main () -> f32[2,2] {
  ROOT %dot.1 = f32[2,2]{1,0} dot(%missing.0, %missing.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    with pytest.raises(ValueError, match="cannot read the operands of .*dot.1"):
        matmuls(text)


def test_the_floor_program_runs_the_same_matmuls_on_every_device():
    weights, x = mlp_inputs()
    found = matmuls(jax.jit(jax.grad(mlp_loss), static_argnums=2).lower(weights, x, True).compile().as_text())
    devices = jax.devices()[:2]
    program, operands = floor_program(found, devices)
    compiled = program.lower(operands).compile()
    floor = matmuls(compiled.as_text())
    assert dot_flops(floor) == dot_flops(found)
    assert sorted((m.batch, m.m, m.k, m.n) for m in floor for _ in range(m.executions)) == sorted(
        (m.batch, m.m, m.k, m.n) for m in found for _ in range(m.executions)
    )
    assert compiled(operands).shape == (len(devices),)


def test_a_dot_in_a_conditional_branch_is_marked_inexact():
    def f(flag, a, b):
        return jax.lax.cond(flag, lambda: a @ b, lambda: a[:, :3] @ b[:3]) + (a[:, :5] @ b[:5]).sum()

    a, b = jnp.ones((4, 8)), jnp.ones((8, 5))
    found = matmuls(jax.jit(f).lower(True, a, b).compile().as_text())
    assert sorted((m.k, m.exact) for m in found) == [(3, False), (5, True), (8, False)]
