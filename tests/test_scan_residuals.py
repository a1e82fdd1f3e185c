"""scripts/xla_cpu_scan_residuals.py's reproduction, compiled only: XLA:CPU zero-fills a scanned layer stack's
residual stacks before the loop writes them, and the same layers unrolled have none. When this fails, JAX or XLA has
changed it: the notes on the layer scan's saved activations in docs/benchmarks.md are then out of date."""

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from xla_cpu_scan_residuals import gradient, zero_filled_stacks  # noqa: E402

LAYERS, BATCH, SEQ, D_MODEL, D_FF = 3, 2, 16, 32, 64


def test_the_scanned_stack_zero_fills_its_residuals_and_the_unrolled_one_does_not():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, SEQ, D_MODEL)), jnp.float32)
    weights = tuple(
        jnp.asarray(rng.standard_normal((LAYERS, *shape)) * 0.05, jnp.float32)
        for shape in ((D_MODEL, D_FF), (D_FF, D_MODEL))
    )
    stacks = {
        form: zero_filled_stacks(gradient(form, LAYERS).lower(weights, x).compile().as_text(), LAYERS)
        for form in ("scan", "python_loop")
    }
    # The GELU's input, saved for the backward: one (B, T, d_ff) slice a layer, in a stack filled with zeros first.
    assert f"f32[{LAYERS},{BATCH},{SEQ},{D_FF}]" in stacks["scan"], stacks
    assert stacks["python_loop"] == [], stacks
    for a, b in zip(gradient("scan", LAYERS)(weights, x), gradient("python_loop", LAYERS)(weights, x)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
