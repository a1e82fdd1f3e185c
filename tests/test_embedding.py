"""`jaxtrain.ops.embedding.lookup` (GPT/Llama's token embedding): the rows in the compute dtype, and the table's
gradient autodiff's, summed in float32 where tokens repeat. What it changes in compiled programs (the rows and their
cotangents move in bfloat16): tests/test_hlo_tpu.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.ops.embedding import lookup


def reference(table, tokens, dtype):
    return jnp.take(table, tokens, axis=0).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_and_table_gradient_equal_autodiffs(dtype):
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((11, 6)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 11, (3, 17)))  # 51 lookups of 11 rows: most rows repeat
    weights = jnp.asarray(rng.standard_normal((3, 17, 6)), jnp.float32)

    def loss(fn):
        return lambda t: jnp.sum(weights * fn(t, tokens, dtype).astype(jnp.float32))

    np.testing.assert_array_equal(lookup(table, tokens, dtype), reference(table, tokens, dtype))
    assert lookup(table, tokens, dtype).dtype == dtype
    ours, theirs = jax.grad(loss(lookup))(table), jax.grad(loss(reference))(table)
    assert ours.dtype == theirs.dtype == jnp.float32
    # Each row's cotangents are summed in float32 by both (bfloat16's are exact in float32); only the order differs.
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
