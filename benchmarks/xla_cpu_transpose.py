"""A minimal reproduction of an XLA:CPU slowdown: a transpose whose dims are powers of two runs several times slower
than the same transpose a little off them, though both move the same bytes.

XLA:CPU emits a transpose as one loop over the output in row-major order, each element read from the input a row's
stride away. Where that stride is a power of two (2 KiB for a (2048, 1024) bfloat16 array) those reads likely fall in
a few cache sets and evict each other. Model dims are powers of two by habit, and a training step transposes its
activations for every weight gradient (the dot's left operand is the activations, tokens contracted:
`jaxtrain.ops.projection`).

The same transpose written over a 4-D view of (8, 32) tiles, an optimization barrier keeping XLA from folding it back
into the 2-D one, compiles to a copy and a 4-D transpose loop, and runs several times faster on the power-of-two
shapes, the copy included: the 2-D loop XLA:CPU emits, not the bytes, is what costs.

Prints JSON: for each shape and dtype, the median microseconds of a copy (`x * 2`), of XLA's transpose (`x.T * 2`)
and of the tiled one, alternated in one process, and the ratios to the copy; the shapes pair each power-of-two one
with a neighbour a little smaller.

    python benchmarks/xla_cpu_transpose.py [--rounds 9] [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from xla_cpu_common import alternated_seconds

# (tokens, width): a GPT's MLP activations at 8 x 256 tokens (d_ff 1024), its residual stream (d_model 256), the MLP
# activations of one device's 256 tokens under fsdp=8; each beside a shape off the powers of two (multiples of TILE).
SHAPES = ((2048, 1024), (2048, 992), (2048, 256), (2048, 224), (256, 1024), (256, 992))


TILE = (8, 32)  # rows, columns of the input read per tile: 32 bfloat16 columns are one 64-byte cache line


def tiled_transpose(x: jax.Array) -> jax.Array:
    """x (rows, cols).T, written over a 4-D view of TILE-sized tiles (rows and cols multiples of TILE)."""
    rows, cols = x.shape
    tile_rows, tile_cols = TILE
    tiles = x.reshape(rows // tile_rows, tile_rows, cols // tile_cols, tile_cols).transpose(2, 0, 3, 1)
    return jax.lax.optimization_barrier(tiles).transpose(0, 2, 1, 3).reshape(cols, rows)


def repeated(fn, calls: int):
    """`fn` called `calls` times on the same input (dispatched in order, so waiting on the last waits on all)."""

    def run(x):
        for _ in range(calls):
            out = fn(x)
        return out

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")
    rng = np.random.default_rng(0)
    results = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        for shape in SHAPES:
            x = jnp.asarray(rng.standard_normal(shape), dtype)
            programs = {
                "copy": jax.jit(lambda a: a * 2),
                "transpose": jax.jit(lambda a: a.T * 2),
                "tiled": jax.jit(lambda a: tiled_transpose(a * 2)),
            }
            for program in programs.values():
                jax.block_until_ready(program(x))  # compiled before the clock starts
            timed = {name: repeated(program, args.calls) for name, program in programs.items()}
            seconds = alternated_seconds(timed, (x,), args.rounds)
            us = {name: statistics.median(seconds[name]) / args.calls * 1e6 for name in programs}
            results[f"{jnp.dtype(dtype).name} {shape[0]}x{shape[1]}"] = {
                **{f"{name}_us": round(value, 1) for name, value in us.items()},
                "transpose_over_copy": round(us["transpose"] / us["copy"], 2),
                "tiled_over_copy": round(us["tiled"] / us["copy"], 2),
            }
            tiled, plain = (np.asarray(programs[name](x), np.float32) for name in ("tiled", "transpose"))
            assert np.array_equal(tiled, plain), f"the tiled transpose of {shape} differs from x.T"
    print(json.dumps({"jax": jax.__version__, "results": results}, indent=1))


if __name__ == "__main__":
    main()
