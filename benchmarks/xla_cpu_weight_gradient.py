"""A minimal reproduction of an XLA:CPU slowdown: the weight gradient of `einsum("btd,df->btf", x, w)` as autodiff
writes it, `dot_general(dy, x)` contracting the batch and sequence dims, compiles on one CPU device to a plain `dot`
whose left operand is contracted along its major dim, which XLA:CPU's YNNPACK fusions do not take; the fallback is
several times slower. The same contraction written `dot_general(x, dy)` compiles to YNNPACK fusions.

Prints JSON: the gradient of a GELU MLP's loss as autodiff writes it (`autodiff`) and with the weight gradients
written with the activations first (`activations_first`, `jaxtrain.ops.projection`'s form), alternated in one
process: median and best seconds, how many top-level dots the compiled program runs outside YNNPACK with the left
operand contracted along its major dim, and the largest difference between their gradients relative to the largest
gradient (float32: summation order only).

    python benchmarks/xla_cpu_weight_gradient.py [--dtype bfloat16] [--layers 4] [--batch 8] [--seq 256]
        [--d-model 256] [--d-ff 1024]
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from xla_cpu_common import alternated_seconds, mlp_arguments, mlp_inputs


def activations_first(spec: str):
    """`einsum(spec, x, w)` whose weight gradient is `einsum(x, dy)`."""

    @jax.custom_vjp
    def product(x, w):
        return jnp.einsum(spec, x, w)

    def backward(saved, dy):
        x, w = saved
        (x_dims, w_dims), out = spec.split("->")[0].split(","), spec.split("->")[1]
        return jnp.einsum(f"{out},{w_dims}->{x_dims}", dy, w), jnp.einsum(f"{x_dims},{out}->{w_dims}", x, dy)

    product.defvjp(lambda x, w: (product(x, w), (x, w)), backward)
    return product


def gradient(layers: int, dtype, first: bool):
    up = activations_first("btd,df->btf") if first else lambda x, w: jnp.einsum("btd,df->btf", x, w)
    down = activations_first("btf,fd->btd") if first else lambda x, w: jnp.einsum("btf,fd->btd", x, w)

    def loss(weights, x):
        for i in range(layers):
            x = x + down(jax.nn.gelu(up(x, weights[0][i].astype(dtype))), weights[1][i].astype(dtype))
        return jnp.sum(x.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss))


def major_contracting_dots(hlo: str) -> int:
    """Top-level `dot`s (not inside a YNNPACK fusion) whose left operand is contracted along its dim 0 of 2: the
    transposed-left form XLA:CPU runs in its slow fallback."""
    return len(re.findall(r"^\s+%\S+ = \S+ dot\(.*lhs_contracting_dims=\{0\}", hlo, re.MULTILINE))


def main() -> None:
    args = mlp_arguments(__doc__, batch=8, seq=256, d_model=256, d_ff=1024, rounds=10, dtype="bfloat16")
    jax.config.update("jax_platforms", "cpu")
    dtype = jnp.dtype(args.dtype)
    weights, x = mlp_inputs(args, dtype)
    programs = {  # compiled once: timed, then read
        name: gradient(args.layers, dtype, name == "activations_first").lower(weights, x).compile()
        for name in ("autodiff", "activations_first")
    }
    results = {name: jax.block_until_ready(f(weights, x)) for name, f in programs.items()}
    times = alternated_seconds(programs, (weights, x), args.rounds)
    difference = max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
        for a, b in zip(results["autodiff"], results["activations_first"])
    )
    report = {
        "jax": jax.__version__,
        "shape": vars(args),
        "relative_difference": difference,
        **{
            name: {
                "median_s": float(np.median(t)),
                "best_s": min(t),
                "major_contracting_dots": major_contracting_dots(programs[name].as_text()),
            }
            for name, t in times.items()
        },
    }
    report["autodiff_over_activations_first"] = report["autodiff"]["median_s"] / report["activations_first"]["median_s"]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
