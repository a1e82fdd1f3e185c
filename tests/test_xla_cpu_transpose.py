"""benchmarks/xla_cpu_transpose.py's reproduction, compiled only: its tiled transpose is `x.T`, and XLA:CPU compiles it
to two loops (a copy and a 4-D transpose) where it compiles `x.T` to one. When the second check fails, XLA folds the
tiled form back into the plain transpose, and the script then times the same program twice."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.analysis.hlo import parse_module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from xla_cpu_transpose import tiled_transpose  # noqa: E402


def loop_fusions(fn, x) -> int:
    """Loop fusions in the compiled program's entry computation."""
    module = parse_module(jax.jit(fn).lower(x).compile().as_text())
    entry = module.computations[module.entry].values()
    return sum(i.opcode == "fusion" and i.attribute("kind") == "kLoop" for i in entry)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_tiled_transpose_is_the_transpose_compiled_as_a_copy_and_a_4d_loop(dtype):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 96)), dtype)
    np.testing.assert_array_equal(np.asarray(jax.jit(tiled_transpose)(x)), np.asarray(x.T))
    assert loop_fusions(lambda a: a.T * 2, x) == 1
    assert loop_fusions(lambda a: tiled_transpose(a * 2), x) == 2
