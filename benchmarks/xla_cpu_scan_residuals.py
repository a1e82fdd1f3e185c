"""A minimal reproduction of an XLA:CPU slowdown: the gradient of a layer stack run by `lax.scan` keeps each layer's
residuals (the activations its backward reads) in stacks that the compiled program first fills with zeros, writes a
layer at a time inside the forward loop (dynamic-update-slice) and copies out in the backward loop. The same layers
unrolled (a Python loop, or `lax.scan(..., unroll=True)`) keep the same residuals as separate arrays and run faster.

JAX starts every stacked scan output from `lax.empty2` broadcast to the stack's shape (`jax/_src/lax/control_flow/
loops.py`, `_empty_array`: "Replace `lax.empty2` with `lax.empty` once AllocateBuffer issues are fixed"), and XLA:CPU
keeps that broadcast although the loop overwrites every element of it.

The layer is a GELU MLP whose activation's cotangent passes an optimization barrier, so that XLA:CPU's slow
transposing fusion (`xla_cpu_transposed_fusion.py`, the other reproduction here) does not cloud the comparison.

Prints JSON: the gradient of the stack's loss scanned (`scan`), unrolled by the scan (`scan_unrolled`) and as a Python
loop (`python_loop`), alternated in one process: median and best seconds; for each program the stacks of `layers` rows
that it fills with zeros (shape and MB) and how many dynamic-update-slice fusions it runs; and that all three gradients
are equal.

    python benchmarks/xla_cpu_scan_residuals.py [--layers 4] [--batch 8] [--seq 256] [--d-model 256] [--d-ff 1024]
"""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from xla_cpu_common import alternated_seconds, mlp_arguments, mlp_inputs
from xla_cpu_transposed_fusion import barrier_cotangent


def layer(x: jax.Array, weights: tuple[jax.Array, jax.Array]) -> jax.Array:
    hidden = barrier_cotangent(jnp.einsum("btd,df->btf", x, weights[0]))
    return x + jnp.einsum("btf,fd->btd", jax.nn.gelu(hidden), weights[1])


def gradient(form: str, layers: int):
    def loss(weights, x):
        if form == "python_loop":
            for i in range(layers):
                x = layer(x, (weights[0][i], weights[1][i]))
        else:
            step = lambda h, w: (layer(h, w), None)  # noqa: E731
            x = jax.lax.scan(step, x, weights, unroll=form == "scan_unrolled")[0]
        return jnp.sum(x * x)

    return jax.jit(jax.grad(loss))


def zero_filled_stacks(hlo: str, layers: int) -> list[str]:
    """Arrays with a leading dim of `layers` that the compiled program fills with a broadcast constant (zeros)."""
    pattern = rf"= (f32\[{layers},[\d,]+\])\S* (?:broadcast|fusion)\(%constant[\w.]*\)"
    return re.findall(pattern, hlo)


def megabytes(shape: str) -> float:
    dims = [int(d) for d in shape[shape.index("[") + 1 : -1].split(",")]
    return round(4 * math.prod(dims) / 1e6, 1)


def main() -> None:
    args = mlp_arguments(__doc__, batch=8, seq=256, d_model=256, d_ff=1024, rounds=10)
    weights, x = mlp_inputs(args)
    forms = ("scan", "scan_unrolled", "python_loop")
    programs = {form: gradient(form, args.layers).lower(weights, x).compile() for form in forms}  # timed, then read
    results = {form: jax.block_until_ready(f(weights, x)) for form, f in programs.items()}
    equal = all(
        np.allclose(a, b, rtol=1e-4, atol=1e-5)
        for other in ("scan_unrolled", "python_loop")
        for a, b in zip(results["scan"], results[other])
    )
    times = alternated_seconds(programs, (weights, x), args.rounds)
    report = {"jax": jax.__version__, "shape": vars(args), "gradients_equal": equal}
    for form, f in programs.items():
        hlo = f.as_text()
        report[form] = {
            "median_s": float(np.median(times[form])),
            "best_s": min(times[form]),
            "zero_filled_stacks": {shape: megabytes(shape) for shape in zero_filled_stacks(hlo, args.layers)},
            "dynamic_update_slice_fusions": len(re.findall(r"%\S*dynamic-update-slice\S* = \S+ fusion\(", hlo)),
        }
    report["scan_over_python_loop"] = report["scan"]["median_s"] / report["python_loop"]["median_s"]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
