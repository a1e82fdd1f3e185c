"""benchmarks/xla_cpu_scan_residuals.py's reproduction, compiled only: XLA:CPU zero-fills a scanned layer stack's
residual stacks before the loop writes them, and the same layers unrolled have none. When this fails, JAX or XLA has
changed it: the notes on the layer scan's saved activations in docs/benchmarks.md are then out of date."""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from xla_cpu_common import mlp_inputs  # noqa: E402
from xla_cpu_scan_residuals import gradient, zero_filled_stacks  # noqa: E402

LAYERS, BATCH, SEQ, D_MODEL, D_FF = 3, 2, 16, 32, 64


def test_the_scanned_stack_zero_fills_its_residuals_and_the_unrolled_one_does_not():
    shape = argparse.Namespace(layers=LAYERS, batch=BATCH, seq=SEQ, d_model=D_MODEL, d_ff=D_FF)
    weights, x = mlp_inputs(shape)
    programs = {form: gradient(form, LAYERS).lower(weights, x).compile() for form in ("scan", "python_loop")}
    stacks = {form: zero_filled_stacks(program.as_text(), LAYERS) for form, program in programs.items()}
    # The GELU's input, saved for the backward: one (B, T, d_ff) slice a layer, in a stack filled with zeros first.
    assert f"f32[{LAYERS},{BATCH},{SEQ},{D_FF}]" in stacks["scan"], stacks
    assert stacks["python_loop"] == [], stacks
    for a, b in zip(programs["scan"](weights, x), programs["python_loop"](weights, x)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
