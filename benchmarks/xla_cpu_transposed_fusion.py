"""A minimal reproduction of an XLA:CPU slowdown: the backward pass of `gelu(x @ w1) @ w2` fuses the activation's
backward with the transpose the weight gradient's dot asks for, and that fused loop is several times slower than the
same math followed by a separate transpose.

Prints JSON: the gradient's median and best seconds as JAX compiles it (`fused`) and with an optimization barrier on
the activation's input cotangent (`barrier`, the workaround), alternated in one process; their ratio; how many loop
fusions write a (width, B*T) transpose, with and without elementwise math in them; and that both gradients are equal.

    python benchmarks/xla_cpu_transposed_fusion.py [--layers 4] [--batch 12] [--seq 64] [--d-model 128] [--d-ff 512]
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from xla_cpu_common import alternated_seconds, mlp_arguments, mlp_inputs


@jax.custom_vjp
def barrier_cotangent(x):
    return x


barrier_cotangent.defvjp(lambda x: (x, None), lambda _, g: (jax.lax.optimization_barrier(g),))


def gradient(layers: int, barrier: bool):
    def loss(weights, x):
        for i in range(layers):
            hidden = jnp.einsum("btd,df->btf", x, weights[0][i])
            hidden = barrier_cotangent(hidden) if barrier else hidden
            x = x + jnp.einsum("btf,fd->btd", jax.nn.gelu(hidden), weights[1][i])
        return jnp.sum(x * x)

    return jax.jit(jax.grad(loss))


def transposed_fusions(hlo: str, rows: int, widths: tuple[int, ...]) -> dict[str, int]:
    """Loop fusions that write an activation or its cotangent transposed, output (width, rows) for rows = B*T:
    how many only move data (a transpose) and how many also compute (elementwise math fused into the transpose)."""
    shapes = "|".join(rf"f32\[{w},{rows}\]" for w in widths)
    counts = {"transpose_only": 0, "with_math": 0}
    for match in re.finditer(rf"%\S+ = (?:{shapes})\{{1,0\}} fusion\(.*kind=kLoop, calls=%(\S+?),", hlo):
        body = hlo[hlo.index(f"%{match.group(1)} (") :].split("\n}\n", 1)[0]
        computes = any(f" {op}(" in body for op in ("multiply", "add", "tanh", "subtract"))
        counts["with_math" if computes else "transpose_only"] += 1
    return counts


def main() -> None:
    args = mlp_arguments(__doc__, batch=12, seq=64, d_model=128, d_ff=512, rounds=20)
    weights, x = mlp_inputs(args)
    programs = {  # compiled once: timed, then read
        name: gradient(args.layers, name == "barrier").lower(weights, x).compile() for name in ("fused", "barrier")
    }
    results = {name: jax.block_until_ready(f(weights, x)) for name, f in programs.items()}
    equal = all(bool(jnp.array_equal(a, b)) for a, b in zip(results["fused"], results["barrier"]))
    times = alternated_seconds(programs, (weights, x), args.rounds)
    flops = 3 * 2 * 2 * args.batch * args.seq * args.d_model * args.d_ff * args.layers
    report = {
        "jax": jax.__version__,
        "shape": vars(args),
        "gradients_equal": equal,
        **{
            name: {
                "median_s": float(np.median(t)),
                "best_s": min(t),
                "gflop_s": flops / float(np.median(t)) / 1e9,
                "transposed_fusions": transposed_fusions(
                    programs[name].as_text(),
                    args.batch * args.seq,
                    (args.d_model, args.d_ff),
                ),
            }
            for name, t in times.items()
        },
    }
    report["fused_over_barrier"] = report["fused"]["median_s"] / report["barrier"]["median_s"]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
